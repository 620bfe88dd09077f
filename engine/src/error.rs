//! Engine errors: one enum, each variant a condition a caller can act on.
//!
//! The HTTP layer maps every variant to exactly one status code (see
//! `server/src/routes.rs`), so a new variant is a new row in that table.

use std::path::PathBuf;

/// Everything an engine operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is empty, longer than [`crate::key::KEY_BYTES_MAX`], or holds a
    /// byte outside `[A-Za-z0-9._~-]`.
    #[error("invalid key: {reason}")]
    InvalidKey {
        /// Why the key was refused, naming the offending byte or length.
        reason: String,
    },
    /// A block body whose length is not the store's `block_bytes`.
    #[error("wrong block size: expected {expected} bytes, got {got}")]
    WrongSize {
        /// The store's `block_bytes`.
        expected: u64,
        /// The length the caller supplied.
        got: u64,
    },
    /// A block tag ([`crate::events::BlockTag`]) that breaks its rules or
    /// does not fit this store's slot header ([`crate::slot::tag_room`]).
    #[error("invalid block tag: {0}")]
    InvalidTag(String),
    /// No block is stored under the key (never written, deleted, or reclaimed).
    #[error("block not found")]
    NotFound,
    /// The stored bytes failed their CRC-32 check. The entry has been dropped
    /// from the index; callers treat this as a miss. Wrong bytes are never
    /// returned.
    #[error("block is corrupt on disk (CRC-32 mismatch in segment {segment}, slot {slot}); it was dropped")]
    Corrupt {
        /// Segment id that held the damaged slot.
        segment: u32,
        /// Slot index within the segment.
        slot: u32,
    },
    /// The log has no slot to give and none can be reclaimed, or the
    /// filesystem answered `ENOSPC`. Nothing already stored is affected.
    #[error("disk full: {0}")]
    DiskFull(String),
    /// The data directory was created with another geometry or shard count.
    #[error("data directory {dir} was created with {field} = {stored}, but {requested} was requested; use the stored value or another --data-dir")]
    GeometryMismatch {
        /// The data directory.
        dir: PathBuf,
        /// Which setting differs (`block_bytes`, `shards`, `segment_bytes`, ...).
        field: &'static str,
        /// The value in `store.json`.
        stored: String,
        /// The value this process asked for.
        requested: String,
    },
    /// The configuration cannot describe a working store (for example a
    /// segment too small to hold one slot). The message says which setting.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The device holding the owning shard's log failed: its last write
    /// met an I/O error. Writes are refused for [`crate::shard::LOG_PROBE_EVERY`]
    /// after each failure, then one is tried again (a success brings the
    /// log back); reads of that shard's log are misses meanwhile. Nothing
    /// on other devices is affected. The message names the error.
    #[error("device down: {0}")]
    DeviceDown(String),
    /// The owning shard already has as many block I/Os waiting as it
    /// admits (`io_queue_max`); nothing was done. Retry after a moment.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// This store cannot lease blocks to same-host clients (docs/LOCAL.md,
    /// "Leases"); the message says why (no RAM tier, or one not shared).
    #[error("no leases: {0}")]
    LeasesOff(String),
    /// The store is shutting down or a shard is gone; retry against a
    /// restarted process.
    #[error("store is shutting down")]
    ShuttingDown,
    /// A PUT of a same-host client's memory whose client gave up on it
    /// (closed its connection or unregistered the memory) before the block
    /// was stored ([`crate::PutSource::ClientMemory`]): nothing was stored,
    /// and a block already under the key stays.
    #[error("cancelled: the client gave up on the memory the block was read from; nothing was stored")]
    Cancelled,
    /// An operating-system I/O error, with what was being done and where.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What the engine was doing (e.g. "writing slot 3 of segment 7").
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with what was being done. An `ENOSPC` becomes
    /// [`Error::DiskFull`] so the server answers 507 rather than 500.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        let context = context.into();
        if source.raw_os_error() == Some(libc::ENOSPC) {
            return Error::DiskFull(format!("{context}: {source}"));
        }
        Error::Io { context, source }
    }

    /// Converts a glommio error (which wraps `std::io::Error` for file and
    /// socket operations) into an engine error.
    pub fn glommio<T: std::fmt::Debug>(context: impl Into<String>, source: glommio::GlommioError<T>) -> Self {
        Error::io(context, std::io::Error::from(source))
    }
}

/// Result alias for engine operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
