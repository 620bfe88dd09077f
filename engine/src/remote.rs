//! The remote tier: shared storage below the NVMe log (S3-compatible object
//! storage in `kvtier-s3`), reached by the shard that owns a key and by no
//! other.
//!
//! The engine defines what it needs of such a tier and nothing else: fetch a
//! block, upload one, ask whether many exist, delete one. The waterfall on
//! the owning shard (`shard/remote.rs`) decides when: a local miss is read
//! through (one fetch per key at a time on its shard, however many GETs wait
//! for it) and installed in the local tiers unless a newer PUT or DELETE of
//! the key came meanwhile; a PUT is uploaded after it is stored locally; a
//! DELETE deletes the remote copy too; a lookup counts the remote tail of a
//! prefix chain. Because every operation on a key runs on its owning shard,
//! an implementation's per-shard caches (what it knows is present or absent)
//! see every write of the keys they hold.
//!
//! Threads: [`Remote`] is the process's handle (`Send + Sync`), built once
//! and passed in [`crate::StoreConfig::remote`]; each shard asks it for its
//! own [`RemoteShard`] on its executor, which is `!Send` and runs its futures
//! there. An implementation that needs another runtime (tokio, for
//! `object_store`) spawns onto it and awaits the answer.
//!
//! A remote tier never fails a local operation: its errors and timeouts are
//! misses, failed uploads or unknown existence, counted by the
//! implementation, and reported through [`Remote::health`].

use std::rc::Rc;

use bytes::Bytes;
use futures::future::LocalBoxFuture;

use crate::health::TierHealth;
use crate::key::StoredKey;

/// What a remote read found.
#[derive(Debug, Clone)]
pub enum Fetched {
    /// The block, checked by the implementation (its own checksum and the
    /// key it was stored under).
    Block {
        /// The payload, `block_bytes` long.
        payload: Bytes,
        /// The tag it was uploaded with ([`crate::events::BlockTag`],
        /// encoded), if any.
        tag: Option<Bytes>,
    },
    /// No such block.
    Absent,
    /// An error, a timeout or an object that failed its checks: a miss,
    /// already counted and logged by the implementation.
    Failed,
}

/// What became of an upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadOutcome {
    /// Written now.
    Uploaded,
    /// The object was already there (uploads are create-only; blocks are
    /// immutable): success.
    Present,
    /// Queued for a write-behind upload.
    Queued,
    /// The write-behind queue was full: not uploaded.
    Dropped,
    /// The upload failed or timed out (counted, logged).
    Failed,
}

impl UploadOutcome {
    /// Name in a PUT's answer: `uploaded`, `present`, `queued`, `dropped`,
    /// `failed`.
    pub fn as_str(&self) -> &'static str {
        match self {
            UploadOutcome::Uploaded => "uploaded",
            UploadOutcome::Present => "present",
            UploadOutcome::Queued => "queued",
            UploadOutcome::Dropped => "dropped",
            UploadOutcome::Failed => "failed",
        }
    }
}

/// What the waterfall did with the remote tier's blocks, for the
/// implementation's counters (so that the tier's statistics stay in one
/// object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteEvent {
    /// A local miss joined a read of the same key already in flight on its
    /// shard.
    ReadJoined,
    /// A block read from the remote tier was stored in the local tiers.
    Installed,
    /// The local tiers refused a block read from the remote tier (it was
    /// served anyway), with the key and the error, for a rate-limited
    /// warning.
    InstallFailed(String),
    /// A block read from the remote tier was not stored locally because a
    /// newer PUT or DELETE of its key came while it was read.
    InstallSuperseded,
    /// A prefetch copied this many blocks from the remote tier into the
    /// local tiers.
    Prefetched(u64),
}

/// One shard's handle on the remote tier. Lives on the shard's executor;
/// futures run there.
pub trait RemoteShard {
    /// Reads `key`'s block. Never an error: failures are [`Fetched::Failed`].
    fn fetch<'a>(&'a self, key: &'a StoredKey) -> LocalBoxFuture<'a, Fetched>;

    /// Uploads `key`'s block (its payload as `chunks`, `block_bytes` in all,
    /// reference-counted: no copy) with its encoded tag, if any, as the
    /// implementation's write policy says; `None` when it uploads nothing
    /// (policy off).
    fn upload<'a>(&'a self, key: &'a StoredKey, chunks: Vec<Bytes>, tag: Option<Bytes>) -> LocalBoxFuture<'a, Option<UploadOutcome>>;

    /// Whether each of `keys` exists remotely (`None`: unknown after an
    /// error or timeout). The caller bounds the batch
    /// ([`Remote::parallelism`]).
    fn exists_many<'a>(&'a self, keys: &'a [&'a StoredKey]) -> LocalBoxFuture<'a, Vec<Option<bool>>>;

    /// Deletes `key`'s remote copy (best effort); whether the delete was
    /// accepted.
    fn delete<'a>(&'a self, key: &'a StoredKey) -> LocalBoxFuture<'a, bool>;

    /// Counts what the waterfall did with a remote block.
    fn count(&self, event: RemoteEvent);
}

/// The process's remote tier: builds each shard's handle and reports on
/// the whole tier.
pub trait Remote: Send + Sync {
    /// Tier name in `x-kvtier-tier`, lookup answers, a PUT's answer and the
    /// stats object: `s3`.
    fn name(&self) -> &'static str;

    /// A one-line description for logs: where the tier is and its policy.
    fn describe(&self) -> String;

    /// Shard `shard`'s handle, called once on that shard's executor.
    fn for_shard(&self, shard: usize) -> Rc<dyn RemoteShard>;

    /// Keys checked or fetched at once for one lookup tail or prefetch.
    fn parallelism(&self) -> usize;

    /// The tier's settings and counters, for `/v1/stats`.
    fn stats_json(&self) -> serde_json::Value;

    /// Writes the tier's metrics (`kvtier_<name>_*`) into a scrape.
    fn register_metrics(&self, registry: &mut crate::latency::Scrape<'_>);

    /// The tier's health now (see [`crate::health`]).
    fn health(&self) -> TierHealth;
}

impl std::fmt::Debug for dyn Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Remote({})", self.describe())
    }
}
