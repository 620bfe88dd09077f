//! # kvtier-engine
//!
//! The storage engine of kvtier, a KV-cache block store for LLM inference:
//! a shard-per-core log of fixed-size blocks on NVMe, written and read with
//! `O_DIRECT` through glommio (io_uring).
//!
//! - [`alloc`]: the global allocator of every kvtier binary (jemalloc,
//!   huge pages).
//! - [`geometry`]: block size from the model (`layers × vectors × kv_heads
//!   × head_dim × dtype_bytes × block_tokens`: 2 vectors, K and V; 1, MLA's
//!   latent) and `store.json`.
//! - [`key`]: key rules, the 128-bit [`key::BlockHash`], shard choice.
//! - [`slot`]: the slot header (on-disk format of one record).
//! - [`segment`]: preallocated segment files and their superblock.
//! - [`index`]: the per-shard hash index and its snapshot.
//! - [`pool`]: reusable buffers for GET responses.
//! - [`lru`]: slot map, LRU order and free list shared by the memory tiers.
//! - [`ram`]: the RAM tier: a slot arena with LRU order and zero-copy reads.
//! - [`gpu`]: the GPU tier above RAM: device slabs through cudarc, pinned
//!   staging, event-polled copies, CRC-checked reads.
//! - [`tier`]: tier names, write policy, per-tier counters.
//! - [`health`]: each tier's health (ok, degraded, down) and why.
//! - [`remote`]: the trait of the remote tier below the log (S3 in
//!   `kvtier-s3`).
//! - [`shard`]: one shard's write path, read path and reclaim.
//! - [`stream`]: a block on its way out, whole or as verified chunks.
//! - [`recover`]: rebuilding a shard's index from its snapshot and segments.
//! - [`fsck`]: offline check of every header and payload CRC-32.
//! - [`events`]: KV events: the block tags clients attach, which tiers hold
//!   each tagged block, the sink the server's publisher implements.
//! - [`store`]: one executor per shard, routing over the channel mesh.
//! - [`trace`]: block-operation traces (`--trace-dir`): format, reader,
//!   recorder.
//! - [`tenant`]: block owners (tenants, shared namespaces), scoped keys,
//!   per-tier quotas.
//! - [`populate`]: faulting memory in off the start-up path, 2 MiB at a
//!   time (the I/O memory and the RAM tier, once a shard serves).
//!
//! docs/ARCHITECTURE.md and docs/FORMAT.md describe the design and the
//! bytes on disk.
#![deny(missing_docs)]

pub mod alloc;
mod counter;
pub mod devices;
pub mod error;
pub mod events;
pub mod faults;
pub mod fsck;
pub mod geometry;
pub mod gpu;
pub mod health;
pub mod index;
pub mod key;
pub mod latency;
pub mod lru;
pub mod pool;
pub mod populate;
pub mod ram;
pub mod recover;
pub mod remote;
mod sealed;
pub mod segment;
pub mod shard;
pub mod shared_index;
mod signal;
pub mod slot;
pub mod stall;
mod startup;
pub mod store;
pub mod stream;
pub mod tenant;
pub mod tier;
pub mod trace;

pub use error::{Error, Result};
pub use geometry::{Geometry, StoreManifest};
pub use shard::{LeaseOutcome, PutOutcome, PutReport, PutSource, ShardStats, StillWanted};
pub use store::{run, Block, PrefetchReport, Store, StoreConfig};
pub use stream::{BlockBody, BlockSink, ChunkStream};
pub use tier::{Tier, TierStats, WritePolicy};
