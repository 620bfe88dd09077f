//! KV events: what each tier of a shard holds, published as blocks arrive
//! in and leave each tier, for KV-aware routers (docs/OPERATIONS.md, "KV
//! events for routers").
//!
//! - [`tag`]: the [`BlockTag`] a client attaches to a block at PUT (the
//!   inference engine's block hashes, parent hash, token ids), kept with the
//!   block in every tier, on disk and in the shared tier.
//! - [`residency`]: per shard, which tiers hold each tagged block; the
//!   tiers' own maps (the memory tiers' slot maps, the log's index, the
//!   shared tier's uploads and deletes) report every arrival and departure
//!   to it through a [`Journal`], and it hands the net changes of each
//!   short interval to the process's [`EventSink`].
//!
//! The engine decides what happened and in which order per block; the
//! sink (the server's publisher) numbers, encodes and sends batches.

pub mod residency;
pub mod tag;

use bytes::Bytes;

pub use residency::{Journal, Residency};
pub use tag::{BlockTag, TAG_BYTES_MAX};

/// How long a shard gathers tier changes before it hands them to the sink:
/// a block's moves within this interval publish only their net effect
/// ([`Residency::flush`]). Short beside a request's life, long beside the
/// microseconds a move takes.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(5);

/// A tier as KV events name it. The log's index and the memory tiers'
/// slot maps report through a [`Journal`] of their medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The GPU tier.
    Gpu,
    /// The RAM tier.
    Ram,
    /// The NVMe log.
    Nvme,
    /// The shared tier (S3-compatible object storage).
    S3,
}

impl Medium {
    /// Every medium, fastest first: the order in which a block's events of
    /// one kind are published.
    pub const ALL: [Medium; 4] = [Medium::Gpu, Medium::Ram, Medium::Nvme, Medium::S3];

    pub(crate) fn bit(self) -> u8 {
        1 << self as u8
    }

    /// Lower-case name, as in `/v1/stats`: `gpu`, `ram`, `nvme`, `s3`.
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "gpu",
            Medium::Ram => "ram",
            Medium::Nvme => "nvme",
            Medium::S3 => "s3",
        }
    }
}

/// What happened to a block in a tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierEvent {
    /// The block, named by its tag, now is in `medium` (vLLM's
    /// `BlockStored`).
    Stored {
        /// Where.
        medium: Medium,
        /// The block's encoded [`BlockTag`].
        tag: Bytes,
    },
    /// The block, named by its tag, left `medium` (vLLM's `BlockRemoved`).
    Removed {
        /// Where it was.
        medium: Medium,
        /// The block's encoded [`BlockTag`].
        tag: Bytes,
    },
}

/// Where a shard's events go: the server's publisher. Called on a shard's
/// thread once per interval with that interval's events in order; must not
/// block (a publisher that cannot keep up drops and counts, it never slows
/// a shard).
pub trait EventSink: Send + Sync + std::fmt::Debug {
    /// Takes shard `shard`'s events of one interval.
    fn submit(&self, shard: usize, events: Vec<TierEvent>);
}
