//! Device memory of one shard's GPU tier: slabs from `cuMemAlloc_v2`, each
//! cut into `block_bytes` slots. `cuMemAlloc_v2` memory can be exported
//! with `cuIpcGetMemHandle` (stream-ordered pool memory cannot), keeping a
//! later zero-copy path to an engine on the same GPU possible. The first
//! slab is allocated when the tier opens, on the shard's thread; later ones
//! on glommio's blocking thread pool. Which slots hold what is the tier's
//! map (`tier.rs`); this file only hands out slot ranges and addresses.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;

use super::driver::GpuDevice;

/// Largest device allocation the tier makes: 1 GiB. A shard's share is cut
/// into at most [`GPU_SLABS_MAX`] slabs of equal size up to this.
pub const GPU_SLAB_BYTES_MAX: u64 = 1 << 30;

/// A shard's GPU share is split into at least this many slabs (fewer when
/// it holds fewer blocks), so memory is taken as the tier fills.
pub const GPU_SLABS_MAX: u64 = 4;

/// After a slab allocation fails, the tier tries again after this long.
pub const GPU_SLAB_RETRY: Duration = Duration::from_secs(1);

/// One slab of device memory.
struct Slab {
    ptr: sys::CUdeviceptr,
}

/// Slots per slab: the shard's share in [`GPU_SLABS_MAX`] parts, each at
/// most [`GPU_SLAB_BYTES_MAX`] (and at least one block).
pub fn slab_blocks(capacity_blocks: u32, block_bytes: u64) -> u32 {
    let per_slab = (capacity_blocks as u64).div_ceil(GPU_SLABS_MAX).max(1);
    let max_blocks = (GPU_SLAB_BYTES_MAX / block_bytes.max(1)).max(1);
    per_slab.min(max_blocks) as u32
}

/// The slabs of one shard's tier, allocated in slot order: slab `n` holds
/// slots `n * slab_blocks ..`. Freed by [`Slabs::free_all`] (the tier's
/// drop, once its stream is idle).
pub(super) struct Slabs {
    device: Arc<GpuDevice>,
    block_bytes: u64,
    /// Slots per slab ([`slab_blocks`]).
    slab_blocks: u32,
    /// Slots of the tier once every slab is allocated.
    capacity_blocks: u32,
    slabs: RefCell<Vec<Slab>>,
    /// Bytes of device memory in `slabs`.
    allocated_bytes: Cell<u64>,
}

impl Slabs {
    /// No slabs yet, for a tier of `capacity_blocks` slots of `block_bytes`.
    pub fn new(device: Arc<GpuDevice>, capacity_blocks: u32, block_bytes: u64) -> Slabs {
        Slabs {
            device,
            block_bytes,
            slab_blocks: slab_blocks(capacity_blocks, block_bytes),
            capacity_blocks,
            slabs: RefCell::new(Vec::new()),
            allocated_bytes: Cell::new(0),
        }
    }

    /// Slots per slab.
    pub fn slab_blocks(&self) -> u32 {
        self.slab_blocks
    }

    /// Slabs allocated.
    pub fn count(&self) -> u64 {
        self.slabs.borrow().len() as u64
    }

    /// Bytes of device memory allocated.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes.get()
    }

    /// Allocates the next slab on this thread; returns its slots.
    pub fn grow(&self) -> Result<Range<u32>, DriverError> {
        let (first, blocks) = self.next_slab();
        self.device.bind()?;
        // SAFETY: a plain device allocation, freed in `free_all`.
        let ptr = unsafe { cu::malloc_sync(blocks as usize * self.block_bytes as usize) }?;
        Ok(self.add_slab(ptr, first, blocks))
    }

    /// The first slot and the block count of the next slab.
    fn next_slab(&self) -> (u32, u32) {
        let first = self.slabs.borrow().len() as u32 * self.slab_blocks;
        (first, self.slab_blocks.min(self.capacity_blocks - first))
    }

    fn add_slab(&self, ptr: sys::CUdeviceptr, first: u32, blocks: u32) -> Range<u32> {
        let n = self.slabs.borrow().len();
        self.slabs.borrow_mut().push(Slab { ptr });
        self.allocated_bytes.set(self.allocated_bytes.get() + blocks as u64 * self.block_bytes);
        tracing::debug!(device = self.device.ordinal, slab = n, blocks, "GPU slab allocated");
        first..first + blocks
    }

    /// Allocates the next slab on glommio's blocking thread pool
    /// (`cuMemAlloc_v2` of up to 1 GiB may take milliseconds; the reactor
    /// does not wait in it); returns its slots.
    pub async fn grow_off_reactor(&self) -> Result<Range<u32>, DriverError> {
        let (first, blocks) = self.next_slab();
        let bytes = blocks as usize * self.block_bytes as usize;
        let device = self.device.clone();
        let ptr = glommio::executor()
            .spawn_blocking(move || -> Result<sys::CUdeviceptr, DriverError> {
                device.bind()?;
                // SAFETY: a plain device allocation, freed in `free_all`.
                unsafe { cu::malloc_sync(bytes) }
            })
            .await?;
        Ok(self.add_slab(ptr, first, blocks))
    }

    /// The device address of `slot` (in an allocated slab).
    pub fn slot_ptr(&self, slot: u32) -> sys::CUdeviceptr {
        let slabs = self.slabs.borrow();
        let slab = &slabs[(slot / self.slab_blocks) as usize];
        slab.ptr + (slot % self.slab_blocks) as u64 * self.block_bytes
    }

    /// Frees every slab.
    ///
    /// # Safety
    /// No copy may use the slabs any more (the tier synchronized its
    /// stream), and the device's context is current on this thread.
    pub unsafe fn free_all(&mut self) {
        for slab in self.slabs.get_mut().drain(..) {
            // SAFETY: allocated by `grow`/`grow_off_reactor`, unused as the
            // caller promises.
            let _ = unsafe { cu::free_sync(slab.ptr) };
        }
    }
}
