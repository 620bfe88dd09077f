//! The GPU tier: per shard, device memory from `cuMemAlloc_v2` in a few
//! large slabs cut into `block_bytes` slots, with the map and LRU order of
//! [`crate::lru::SlotLru`], above the RAM tier (waterfall GPU → RAM → NVMe).
//!
//! Driver access is cudarc's driver API with `dynamic-loading`: libcuda is
//! opened at the first call and each symbol resolved by name. cudarc panics
//! when no library is found, so [`GpuDevice::open`] checks
//! [`cudarc::driver::sys::is_culib_present`] before any other call.
//!
//! - **Slabs, not the stream-ordered pool.** `cuMemAlloc_v2` memory can be
//!   exported with `cuIpcGetMemHandle` (pool memory cannot), keeping a later
//!   zero-copy path to an engine on the same GPU possible. The first slab is
//!   allocated when the shard opens (an out-of-memory there refuses the
//!   start); later ones when the free slots run out, on glommio's blocking
//!   thread pool, and a failure then leaves the tier at the size it has
//!   (counted, retried later).
//! - **Staging.** Copies go through pinned host buffers allocated with
//!   `CU_MEMHOSTALLOC_PORTABLE` (cudarc's default pinned allocation is
//!   write-combined, slow for the CPU to read), [`GPU_STAGING_BUFFERS`] per
//!   shard, each with its own event.
//! - **One copy stream per shard.** Copies run in issue order, so a slot
//!   evicted while a read of it is in flight can be refilled at once: the
//!   write is queued behind the read.
//! - **Never blocking the reactor.** After a copy the shard records the
//!   buffer's event and polls `cuEventQuery` from a glommio timer every
//!   [`GPU_POLL_INTERVAL`]; no call waits in the driver. A buffer is reused
//!   only after its event completed, so a read abandoned half way (the
//!   client went away) cannot have its buffer overwritten under the copy.
//! - **Integrity.** A block's CRC-32 is computed while it is staged for the
//!   write and kept per slot; a read checks the bytes copied back against
//!   it before a byte is served, and drops the block on a mismatch.
//!
//! | file | concern |
//! |---|---|
//! | `gpu/driver.rs` | loading the driver, opening the device, why it is unavailable |
//! | `gpu/staging.rs` | the pinned staging buffers and their pool |
//! | `gpu/slabs.rs` | the slab allocator: device memory cut into slots |
//! | `gpu/tier.rs` | the tier: its map of slots, growth, copies in and out, CRC checks |

use std::sync::Arc;

use serde::Serialize;

mod driver;
mod slabs;
mod staging;
mod tier;

pub use driver::{describe, GpuDevice, GpuUnavailable, GpuUnavailableKind};
pub use slabs::{slab_blocks, GPU_SLABS_MAX, GPU_SLAB_BYTES_MAX, GPU_SLAB_RETRY};
pub use staging::GPU_STAGING_BUFFERS;
pub use tier::{GpuRead, GpuTier, GPU_POLL_INTERVAL};

/// The GPU tier's settings, shared by the store and each shard.
#[derive(Debug, Clone, Default)]
pub struct GpuConfig {
    /// The device, opened once per process; `None`: no GPU tier.
    pub device: Option<Arc<GpuDevice>>,
    /// Slots each shard's GPU tier gets (`--gpu-mem-gb` / shards /
    /// `block_bytes`).
    pub blocks_per_shard: u32,
    /// A shard whose tier cannot open runs without it (`--gpu-optional`)
    /// instead of refusing to start.
    pub optional: bool,
    /// The tier was asked for but the device could not be opened, and
    /// `optional` let the store start without it: shown in the stats.
    pub unavailable: Option<GpuUnavailable>,
}

/// The GPU part of `/v1/stats` for one shard (or summed).
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuInfo {
    /// Device name (`cuDeviceGetName`); empty when the tier is absent.
    pub device: String,
    /// Device ordinal.
    pub ordinal: usize,
    /// Why the tier is absent (`None` when it is present).
    pub unavailable: Option<String>,
    /// Device memory the tier has allocated, in bytes.
    pub allocated_bytes: u64,
    /// Slabs allocated.
    pub slabs: u64,
    /// Copies (either way) the driver failed; the block was not placed or
    /// was read from a slower tier.
    pub copy_errors: u64,
    /// Slab allocations refused for lack of device memory.
    pub out_of_memory: u64,
    /// Slab allocations that failed for another reason.
    pub alloc_errors: u64,
    /// Blocks whose bytes copied back failed their CRC-32; dropped, never
    /// served.
    pub corrupt_blocks: u64,
    /// Write-back blocks held only on the GPU that were lost to a failed
    /// copy or CRC (none with write-through).
    pub blocks_lost: u64,
}

impl GpuInfo {
    /// Adds another shard's counters.
    pub fn add(&mut self, o: &GpuInfo) {
        if self.device.is_empty() {
            self.device = o.device.clone();
            self.ordinal = o.ordinal;
        }
        if self.unavailable.is_none() {
            self.unavailable = o.unavailable.clone();
        }
        self.allocated_bytes += o.allocated_bytes;
        self.slabs += o.slabs;
        self.copy_errors += o.copy_errors;
        self.out_of_memory += o.out_of_memory;
        self.alloc_errors += o.alloc_errors;
        self.corrupt_blocks += o.corrupt_blocks;
        self.blocks_lost += o.blocks_lost;
    }
}
