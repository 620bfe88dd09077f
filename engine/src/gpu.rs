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

use std::cell::{Cell, RefCell};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use glommio::sync::Semaphore;
use serde::Serialize;

use crate::key::BlockHash;
use crate::lru::{SlotLru, Victim};
use crate::pool::BufferPool;
use crate::tenant::OwnerId;

/// Largest device allocation the tier makes: 1 GiB. A shard's share is cut
/// into at most [`GPU_SLABS_MAX`] slabs of equal size up to this.
pub const GPU_SLAB_BYTES_MAX: u64 = 1 << 30;

/// A shard's GPU share is split into at least this many slabs (fewer when
/// it holds fewer blocks), so memory is taken as the tier fills.
pub const GPU_SLABS_MAX: u64 = 4;

/// Pinned staging buffers (one block each) per shard: copies in flight at
/// once on the shard's stream.
pub const GPU_STAGING_BUFFERS: usize = 2;

/// How often a shard polls a copy's event. A 16 MiB block crosses PCIe 4.0
/// x16 (~25 GB/s) in ~0.7 ms, so polling every 50 µs adds at most ~7%.
pub const GPU_POLL_INTERVAL: Duration = Duration::from_micros(50);

/// After a slab allocation fails, the tier tries again after this long.
pub const GPU_SLAB_RETRY: Duration = Duration::from_secs(1);

/// `CUDA_ERROR_NOT_READY`: an event's work is still running.
const NOT_READY: sys::CUresult = sys::CUresult::CUDA_ERROR_NOT_READY;

/// Why no GPU tier could be opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuUnavailableKind {
    /// No `libcuda.so` the dynamic loader can find.
    NoDriver,
    /// The driver loaded but has no such device (`cuInit` or `cuDeviceGet`
    /// failed with "no device" or "invalid device").
    NoDevice,
    /// The device's memory could not hold the tier's first slab.
    OutOfMemory,
    /// Any other driver error.
    DriverError,
}

/// Why the GPU tier is absent, for the start-up refusal and `/v1/stats`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuUnavailable {
    /// The class of failure.
    pub kind: GpuUnavailableKind,
    /// What happened, in words.
    pub reason: String,
}

impl fmt::Display for GpuUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for GpuUnavailable {}

fn driver_error(what: &str, e: DriverError) -> GpuUnavailable {
    let kind = match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_DEVICE => GpuUnavailableKind::NoDevice,
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => GpuUnavailableKind::OutOfMemory,
        _ => GpuUnavailableKind::DriverError,
    };
    GpuUnavailable { kind, reason: format!("{what}: {}", describe(&e)) }
}

/// A driver error as `CUDA_ERROR_X (n): text`.
pub fn describe(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| "CUDA error".into());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name} ({}): {text}", e.0 as i32)
}

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

/// One CUDA device, opened once per process and shared by the shards.
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    /// Device ordinal (`--gpu-device`).
    pub ordinal: usize,
    /// `cuDeviceGetName`.
    pub name: String,
    /// Device memory in bytes (`cuDeviceTotalMem_v2`).
    pub total_bytes: u64,
    /// Free device memory in bytes when opened (`cuMemGetInfo_v2`).
    pub free_bytes_at_open: u64,
}

impl fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("total_bytes", &self.total_bytes)
            .finish()
    }
}

impl GpuDevice {
    /// Opens device `ordinal`: checks that a driver library can be loaded,
    /// then `cuInit`, the device, its primary context, name and memory.
    ///
    /// # Errors
    /// [`GpuUnavailableKind::NoDriver`] when no `libcuda.so` is found;
    /// [`GpuUnavailableKind::NoDevice`] when the driver has no such device;
    /// [`GpuUnavailableKind::DriverError`] for any other driver error.
    pub fn open(ordinal: usize) -> Result<Arc<GpuDevice>, GpuUnavailable> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuUnavailable {
                kind: GpuUnavailableKind::NoDriver,
                reason: "no CUDA driver: libcuda.so (or libcuda.so.1) is not on the library path".into(),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_INVALID_DEVICE => {
                let count = CudaContext::device_count().unwrap_or(0);
                GpuUnavailable {
                    kind: GpuUnavailableKind::NoDevice,
                    reason: format!("no CUDA device {ordinal}: the driver reports {count} device(s)"),
                }
            }
            _ => driver_error(&format!("opening CUDA device {ordinal}"), e),
        })?;
        let name = ctx.name().map_err(|e| driver_error("cuDeviceGetName", e))?;
        let total_bytes = ctx.total_mem().map_err(|e| driver_error("cuDeviceTotalMem", e))? as u64;
        let (free, _) = ctx.mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok(Arc::new(GpuDevice { ctx, ordinal, name, total_bytes, free_bytes_at_open: free as u64 }))
    }

    /// Makes the device's context current on this thread (a no-op when it
    /// is).
    fn bind(&self) -> Result<(), DriverError> {
        self.ctx.bind_to_thread()
    }

    /// Makes the device's context current on this thread, for callers that
    /// use cudarc's raw driver calls themselves (the GPU bench).
    ///
    /// # Errors
    /// The driver's.
    pub fn bind_to_thread(&self) -> Result<(), DriverError> {
        self.bind()
    }

    /// Free and total device memory now, in bytes.
    ///
    /// # Errors
    /// The driver's.
    pub fn mem_info(&self) -> Result<(u64, u64), DriverError> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok((free as u64, total as u64))
    }
}

/// A pinned host buffer of one block and the event of its last copy.
struct Staging {
    ptr: *mut u8,
    len: usize,
    event: sys::CUevent,
}

impl Staging {
    fn new(len: usize) -> Result<Staging, DriverError> {
        // SAFETY: a fresh allocation; freed in Drop.
        let ptr = unsafe { cu::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }?.cast::<u8>();
        let event = match cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: allocated just above, not shared.
                let _ = unsafe { cu::free_host(ptr.cast()) };
                return Err(e);
            }
        };
        Ok(Staging { ptr, len, event })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated in `new`; only read after the copy
        // into it completed (see `GpuTier::wait`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; written only when no copy from it is in flight.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: the event and buffer from `new`. Synchronizing first: a
        // copy may still use the buffer.
        unsafe {
            let _ = cu::event::synchronize(self.event);
            let _ = cu::event::destroy(self.event);
            let _ = cu::free_host(self.ptr.cast());
        }
    }
}

/// One slab of device memory.
struct Slab {
    ptr: sys::CUdeviceptr,
}

/// Counters of the tier's failures (the hit/miss counters are the shard's
/// `TierCounters`).
#[derive(Debug, Default)]
pub(crate) struct GpuFaults {
    pub copy_errors: Cell<u64>,
    pub alloc_errors: Cell<u64>,
    pub out_of_memory: Cell<u64>,
    pub corrupt_blocks: Cell<u64>,
    pub blocks_lost: Cell<u64>,
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

/// A block read back from the GPU: CRC-checked bytes.
pub enum GpuRead {
    /// Not held.
    Miss,
    /// Read and checked.
    Hit(Bytes),
    /// The copy failed or the CRC did not match; the block was dropped from
    /// the tier. `lost`: it was a write-back block held nowhere else (counted
    /// in `blocks_lost`).
    Failed {
        /// The block's bytes are gone.
        lost: bool,
    },
}

/// One shard's GPU tier. Single-threaded (lives in the shard); async
/// methods take `&self` and never hold a borrow across an await.
pub struct GpuTier {
    device: Arc<GpuDevice>,
    stream: sys::CUstream,
    block_bytes: u64,
    slab_blocks: u32,
    slabs: RefCell<Vec<Slab>>,
    /// Bytes of device memory in `slabs`.
    allocated_bytes: Cell<u64>,
    lru: RefCell<SlotLru>,
    /// Per slot: the CRC-32 of the block it holds.
    crc: RefCell<Vec<u32>>,
    /// Per slot: bumped at each install, so a late check acts only on the
    /// block it read.
    generation: RefCell<Vec<u64>>,
    staging: RefCell<Vec<Staging>>,
    staging_free: Semaphore,
    /// Held while a slab is being allocated.
    growing: Semaphore,
    next_slab_try: Cell<Option<Instant>>,
    pub(crate) faults: GpuFaults,
}

impl GpuTier {
    /// A tier of `capacity_blocks` slots of `block_bytes` on `device`, on
    /// this thread: one copy stream, the staging buffers and the first slab.
    ///
    /// # Errors
    /// [`GpuUnavailable`] when a driver call fails (out of memory for the
    /// first slab included).
    pub fn new(device: Arc<GpuDevice>, capacity_blocks: u32, block_bytes: u64) -> Result<GpuTier, GpuUnavailable> {
        device.bind().map_err(|e| driver_error("making the CUDA context current", e))?;
        let slab_blocks = slab_blocks(capacity_blocks, block_bytes);
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| driver_error("cuStreamCreate", e))?;
        let mut tier = GpuTier {
            device,
            stream,
            block_bytes,
            slab_blocks,
            slabs: RefCell::new(Vec::new()),
            allocated_bytes: Cell::new(0),
            lru: RefCell::new(SlotLru::new(capacity_blocks, 0)),
            crc: RefCell::new(vec![0; capacity_blocks as usize]),
            generation: RefCell::new(vec![0; capacity_blocks as usize]),
            staging: RefCell::new(Vec::new()),
            staging_free: Semaphore::new(GPU_STAGING_BUFFERS as u64),
            growing: Semaphore::new(1),
            next_slab_try: Cell::new(None),
            faults: GpuFaults::default(),
        };
        for _ in 0..GPU_STAGING_BUFFERS {
            let s = Staging::new(block_bytes as usize)
                .map_err(|e| driver_error(&format!("cuMemHostAlloc of a {block_bytes}-byte pinned staging buffer"), e))?;
            tier.staging.get_mut().push(s);
        }
        tier.grow().map_err(|e| {
            driver_error(
                &format!(
                    "allocating the GPU tier's first slab of {} bytes on device {} ({}, {} bytes free)",
                    slab_blocks as u64 * block_bytes,
                    tier.device.ordinal,
                    tier.device.name,
                    tier.device.mem_info().map(|(f, _)| f).unwrap_or(0)
                ),
                e,
            )
        })?;
        Ok(tier)
    }

    /// The device.
    pub fn device(&self) -> &GpuDevice {
        &self.device
    }

    /// Slots in the tier (allocated or not yet).
    pub fn capacity_blocks(&self) -> u64 {
        self.lru.borrow().capacity_blocks()
    }

    /// Blocks held now.
    pub fn used_blocks(&self) -> u64 {
        self.lru.borrow().used_blocks()
    }

    /// Whether `hash` is held.
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.lru.borrow().contains(hash)
    }

    /// Whether `hash` is held and must still reach NVMe.
    pub fn is_dirty(&self, hash: &BlockHash) -> bool {
        self.lru.borrow().is_dirty(hash)
    }

    /// Whether a block of `hash` is being moved down now.
    pub fn is_demoting(&self, hash: &BlockHash) -> bool {
        self.lru.borrow().is_demoting(hash)
    }

    /// Whether `slot` still holds the block of `hash` (not replaced or
    /// deleted since it was chosen).
    pub fn holds(&self, slot: u32, hash: &BlockHash) -> bool {
        self.lru.borrow().slot_of(hash) == Some(slot)
    }

    /// Makes the block of `key` most recently used; false when not held.
    pub fn touch(&self, key: &str, hash: &BlockHash) -> bool {
        self.lru.borrow_mut().touch(key, hash).is_some()
    }

    /// Keys held, most recently used first.
    pub fn lru_keys(&self) -> Vec<String> {
        self.lru.borrow().lru_keys()
    }

    /// Stats of this shard's tier.
    pub fn info(&self) -> GpuInfo {
        let slabs = self.slabs.borrow().len() as u64;
        let f = &self.faults;
        GpuInfo {
            device: self.device.name.clone(),
            ordinal: self.device.ordinal,
            unavailable: None,
            allocated_bytes: self.allocated_bytes.get(),
            slabs,
            copy_errors: f.copy_errors.get(),
            out_of_memory: f.out_of_memory.get(),
            alloc_errors: f.alloc_errors.get(),
            corrupt_blocks: f.corrupt_blocks.get(),
            blocks_lost: f.blocks_lost.get(),
        }
    }

    /// Allocates the next slab and frees its slots.
    fn grow(&self) -> Result<(), DriverError> {
        let (first, blocks) = self.next_slab();
        self.device.bind()?;
        // SAFETY: a plain device allocation, freed in Drop.
        let ptr = unsafe { cu::malloc_sync(blocks as usize * self.block_bytes as usize) }?;
        self.add_slab(ptr, first, blocks);
        Ok(())
    }

    /// The first slot and the block count of the next slab.
    fn next_slab(&self) -> (u32, u32) {
        let first = self.slabs.borrow().len() as u32 * self.slab_blocks;
        (first, self.slab_blocks.min(self.capacity_blocks() as u32 - first))
    }

    fn add_slab(&self, ptr: sys::CUdeviceptr, first: u32, blocks: u32) {
        let n = self.slabs.borrow().len();
        self.slabs.borrow_mut().push(Slab { ptr });
        self.allocated_bytes.set(self.allocated_bytes.get() + blocks as u64 * self.block_bytes);
        self.lru.borrow_mut().add_free(first..first + blocks);
        tracing::debug!(device = self.device.ordinal, slab = n, blocks, "GPU slab allocated");
    }

    /// Allocates the next slab on glommio's blocking thread pool
    /// (`cuMemAlloc_v2` of up to 1 GiB may take milliseconds; the reactor
    /// does not wait in it).
    async fn grow_off_reactor(&self) -> Result<(), DriverError> {
        let (first, blocks) = self.next_slab();
        let bytes = blocks as usize * self.block_bytes as usize;
        let device = self.device.clone();
        let ptr = glommio::executor()
            .spawn_blocking(move || -> Result<sys::CUdeviceptr, DriverError> {
                device.bind()?;
                // SAFETY: a plain device allocation, freed in Drop.
                unsafe { cu::malloc_sync(bytes) }
            })
            .await?;
        self.add_slab(ptr, first, blocks);
        Ok(())
    }

    fn slot_ptr(&self, slot: u32) -> sys::CUdeviceptr {
        let slabs = self.slabs.borrow();
        let slab = &slabs[(slot / self.slab_blocks) as usize];
        slab.ptr + (slot % self.slab_blocks) as u64 * self.block_bytes
    }

    /// A free slot for a block of `owner`: a free one, else a new slab's
    /// (when the tier is not at its size and the last refusal is older than
    /// [`GPU_SLAB_RETRY`]). `None` also when `owner` is at its limit here.
    pub async fn take_free(&self, owner: OwnerId) -> Option<u32> {
        if !self.lru.borrow().under_limit(owner) {
            return None;
        }
        if let Some(s) = self.lru.borrow_mut().take_free(|_| false) {
            return Some(s);
        }
        // One allocation at a time; whoever waited looks at the free list
        // again.
        let _growing = self.growing.acquire_permit(1).await.expect("the growth semaphore is never closed");
        if let Some(s) = self.lru.borrow_mut().take_free(|_| false) {
            return Some(s);
        }
        let allocated = self.allocated_bytes.get() / self.block_bytes;
        if allocated >= self.capacity_blocks() || self.next_slab_try.get().is_some_and(|t| Instant::now() < t) {
            return None;
        }
        match self.grow_off_reactor().await {
            Ok(()) => {
                self.next_slab_try.set(None);
                self.lru.borrow_mut().take_free(|_| false)
            }
            Err(e) => {
                if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    crate::counter::bump(&self.faults.out_of_memory, 1);
                } else {
                    crate::counter::bump(&self.faults.alloc_errors, 1);
                }
                self.next_slab_try.set(Some(Instant::now() + GPU_SLAB_RETRY));
                tracing::warn!(
                    device = self.device.ordinal,
                    "GPU slab of {} bytes not allocated ({}); the GPU tier stays at {allocated} blocks for now",
                    self.slab_blocks as u64 * self.block_bytes,
                    describe(&e)
                );
                None
            }
        }
    }

    /// Returns a slot taken with [`GpuTier::take_free`] but not filled.
    pub fn give_back(&self, slot: u32) {
        self.lru.borrow_mut().add_free(slot..slot + 1);
    }

    /// The block to move down to make room for a block of `owner`
    /// ([`SlotLru::victim_for`]).
    pub fn victim_for(&self, owner: OwnerId) -> Option<Victim> {
        self.lru.borrow().victim_for(owner)
    }

    /// The owners' slots: quotas, counts, their oldest blocks.
    pub fn lru(&self) -> std::cell::Ref<'_, SlotLru> {
        self.lru.borrow()
    }

    /// Sets each owner's `(reserved, limit)` in blocks ([`SlotLru::set_quotas`]).
    pub fn set_quotas(&self, quotas: &[(u64, u64)]) {
        self.lru.borrow_mut().set_quotas(quotas);
    }

    /// Drops a victim that needs no copy (its bytes are elsewhere).
    pub fn evict(&self, slot: u32) {
        self.lru.borrow_mut().evict(slot, false);
    }

    /// Drops the block of `hash`, if held.
    pub fn remove(&self, hash: &BlockHash) -> bool {
        self.lru.borrow_mut().remove(hash, |_| false)
    }

    /// Frees the slot of `hash` for a new copy when it is not being moved.
    pub fn release_if_idle(&self, hash: &BlockHash) -> bool {
        self.lru.borrow_mut().release_if_idle(hash, |_| false)
    }

    /// Dirty blocks, least recently used first.
    pub fn dirty_blocks(&self) -> Vec<Victim> {
        self.lru.borrow().dirty_blocks()
    }

    /// Takes a staging buffer once its last copy has completed.
    async fn staging(&self) -> Result<StagingGuard<'_>, DriverError> {
        let permit = self.staging_free.acquire_permit(1).await.expect("the staging semaphore is never closed");
        let buf = self.staging.borrow_mut().pop().expect("a permit means a buffer");
        let guard = StagingGuard { tier: self, buf: Some(buf), _permit: permit };
        self.wait(guard.buf().event).await?;
        Ok(guard)
    }

    /// Polls `event` until its work completed, sleeping
    /// [`GPU_POLL_INTERVAL`] between queries.
    async fn wait(&self, event: sys::CUevent) -> Result<(), DriverError> {
        loop {
            self.device.bind()?;
            // SAFETY: a live event owned by a staging buffer.
            match unsafe { cu::event::query(event) } {
                Ok(()) => return Ok(()),
                Err(e) if e.0 == NOT_READY => glommio::timer::sleep(GPU_POLL_INTERVAL).await,
                Err(e) => return Err(e),
            }
        }
    }

    /// Copies `parts` (together `block_bytes`) into `slot` (from
    /// [`GpuTier::take_free`]) through a staging buffer, and makes it the
    /// most recently used block of `hash` once the copy completed, if
    /// `wanted()` then still holds (checked in the same step as the
    /// install). Returns whether it was installed; when not, the slot went
    /// back to the free list.
    ///
    /// # Errors
    /// The driver's; the slot goes back to the free list and the block is
    /// not placed.
    // The block (key, hash, owner), its bytes, and the caller's placement
    // state (slot, dirty, wanted): mirrors `SlotLru::install`'s arguments.
    #[allow(clippy::too_many_arguments)]
    pub async fn write(
        &self,
        slot: u32,
        key: &str,
        hash: BlockHash,
        owner: OwnerId,
        parts: &[&[u8]],
        dirty: bool,
        wanted: &dyn Fn() -> bool,
    ) -> Result<bool, DriverError> {
        let crc = match self.copy_in(slot, parts).await {
            Ok(crc) => crc,
            Err(e) => {
                crate::counter::bump(&self.faults.copy_errors, 1);
                self.give_back(slot);
                tracing::warn!(device = self.device.ordinal, key, "copy to the GPU failed ({}); block not placed there", describe(&e));
                return Err(e);
            }
        };
        if !wanted() {
            self.give_back(slot);
            return Ok(false);
        }
        self.crc.borrow_mut()[slot as usize] = crc;
        self.generation.borrow_mut()[slot as usize] += 1;
        self.lru.borrow_mut().install(slot, key, hash, owner, dirty, |_| false);
        Ok(true)
    }

    /// Copies `parts` into `slot` through a staging buffer and waits for the
    /// copy to complete. Returns the block's CRC-32.
    async fn copy_in(&self, slot: u32, parts: &[&[u8]]) -> Result<u32, DriverError> {
        let mut staging = self.staging().await?;
        let mut crc = crc32fast::Hasher::new();
        let buf = staging.buf_mut();
        let mut at = 0;
        for p in parts {
            buf.bytes_mut()[at..at + p.len()].copy_from_slice(p);
            crc.update(p);
            at += p.len();
        }
        debug_assert_eq!(at as u64, self.block_bytes);
        self.device.bind()?;
        let dst = self.slot_ptr(slot);
        let (src, event) = (staging.buf().bytes(), staging.buf().event);
        // SAFETY: `dst` is a slot of a live slab, `block_bytes` long; the
        // staging buffer stays out of the pool (and so unwritten) until its
        // event, recorded after this copy, completes.
        unsafe {
            cu::memcpy_htod_async(dst, src, self.stream)?;
            cu::event::record(event, self.stream)?;
        }
        self.wait(event).await?;
        Ok(crc.finalize())
    }

    /// Reads the block of `key` (made most recently used): D2H into a
    /// staging buffer, wait for the copy's event, then one pass that
    /// copies the bytes into a response buffer from `pool` and checks them
    /// against the block's CRC-32. A failed copy or CRC drops the block.
    pub async fn read(&self, key: &str, hash: &BlockHash, pool: &Arc<BufferPool>) -> GpuRead {
        if !self.contains(hash) {
            return GpuRead::Miss;
        }
        let staging = match self.staging().await {
            Ok(s) => s,
            Err(e) => return self.read_failed(hash, None, &e),
        };
        // No await from the lookup to the copy being queued: the slot holds
        // this block when the copy is issued, and the stream keeps any later
        // write into it behind the copy.
        let Some(slot) = self.lru.borrow_mut().touch(key, hash) else { return GpuRead::Miss };
        let (expected, generation) = (self.crc.borrow()[slot as usize], self.generation.borrow()[slot as usize]);
        let event = staging.buf().event;
        let issued = self.device.bind().and_then(|()| {
            let dst = staging.buf().bytes();
            // SAFETY: the slot lies in a live slab; the staging buffer is
            // ours and is read only after the event completes.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_ptr() as *mut _, self.slot_ptr(slot), dst.len(), self.stream).result()?;
                cu::event::record(event, self.stream)
            }
        });
        if let Err(e) = issued {
            return self.read_failed(hash, Some((slot, generation)), &e);
        }
        if let Err(e) = self.wait(event).await {
            return self.read_failed(hash, Some((slot, generation)), &e);
        }
        let mut crc = crc32fast::Hasher::new();
        let bytes = pool.copy_parts(&[staging.buf().bytes()], |step| crc.update(step));
        if crc.finalize() != expected {
            crate::counter::bump(&self.faults.corrupt_blocks, 1);
            tracing::error!(
                device = self.device.ordinal,
                key,
                slot,
                "GPU block failed its CRC-32 after the copy back; dropped, not served"
            );
            return GpuRead::Failed { lost: self.drop_if_same(hash, slot, generation) };
        }
        GpuRead::Hit(bytes)
    }

    fn read_failed(&self, hash: &BlockHash, at: Option<(u32, u64)>, e: &DriverError) -> GpuRead {
        crate::counter::bump(&self.faults.copy_errors, 1);
        tracing::warn!(device = self.device.ordinal, "copy from the GPU failed ({}); block dropped from the GPU tier", describe(e));
        let slot = at.map(|a| a.0).or_else(|| self.lru.borrow().slot_of(hash));
        let lost = match (slot, at) {
            (Some(slot), Some((_, generation))) => self.drop_if_same(hash, slot, generation),
            (Some(slot), None) => {
                let g = self.generation.borrow()[slot as usize];
                self.drop_if_same(hash, slot, g)
            }
            _ => false,
        };
        GpuRead::Failed { lost }
    }

    /// Drops `hash` if `slot` still holds the block installed at
    /// `generation`; returns whether it was dirty (lost).
    fn drop_if_same(&self, hash: &BlockHash, slot: u32, generation: u64) -> bool {
        let mut lru = self.lru.borrow_mut();
        if lru.slot_of(hash) != Some(slot) || self.generation.borrow()[slot as usize] != generation {
            return false;
        }
        let dirty = lru.is_dirty(hash);
        if lru.is_demoting(hash) {
            // The demotion in flight finishes it.
            return false;
        }
        lru.evict(slot, false);
        if dirty {
            crate::counter::bump(&self.faults.blocks_lost, 1);
        }
        dirty
    }

    /// Copies a victim's block back (CRC checked) for moving it down,
    /// marking it as being moved; finish with [`GpuTier::end_demotion`].
    ///
    /// # Errors
    /// The copy failed or the CRC did not match (counted).
    pub(crate) async fn begin_demotion(&self, v: &Victim, pool: &Arc<BufferPool>) -> Result<Bytes, ()> {
        self.lru.borrow_mut().begin_demotion(v.slot);
        let staging = match self.staging().await {
            Ok(s) => s,
            Err(e) => {
                crate::counter::bump(&self.faults.copy_errors, 1);
                tracing::warn!("GPU demotion copy failed: {}", describe(&e));
                return Err(());
            }
        };
        let (expected, event) = (self.crc.borrow()[v.slot as usize], staging.buf().event);
        let issued = self.device.bind().and_then(|()| {
            let dst = staging.buf().bytes();
            // SAFETY: as in `read`; the slot is marked demoting, so it is not
            // refilled before `end_demotion`.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_ptr() as *mut _, self.slot_ptr(v.slot), dst.len(), self.stream).result()?;
                cu::event::record(event, self.stream)
            }
        });
        if let Err(e) = issued.and(self.wait(event).await) {
            crate::counter::bump(&self.faults.copy_errors, 1);
            tracing::warn!(key = &*v.key, "copy from the GPU to move a block down failed: {}", describe(&e));
            return Err(());
        }
        let mut crc = crc32fast::Hasher::new();
        let bytes = pool.copy_parts(&[staging.buf().bytes()], |step| crc.update(step));
        if crc.finalize() != expected {
            crate::counter::bump(&self.faults.corrupt_blocks, 1);
            tracing::error!(key = &*v.key, "GPU block failed its CRC-32 when moved down; dropped");
            return Err(());
        }
        Ok(bytes)
    }

    /// Ends a demotion: the block leaves the tier if `moved`, or (`drop`)
    /// when its copy back failed; otherwise it stays.
    pub(crate) fn end_demotion(&self, slot: u32, moved: bool) {
        self.lru.borrow_mut().end_demotion(slot, moved, false);
    }

    /// Ends a flush of a dirty block to the log: it stays, clean if
    /// `written`.
    pub(crate) fn end_flush(&self, slot: u32, written: bool) {
        self.lru.borrow_mut().end_flush(slot, written);
    }
}

impl Drop for GpuTier {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            return;
        }
        // SAFETY: the stream and slabs were created by this tier; every copy
        // is finished after the stream synchronize.
        unsafe {
            let _ = cu::stream::synchronize(self.stream);
            self.staging.get_mut().clear();
            for slab in self.slabs.get_mut().drain(..) {
                let _ = cu::free_sync(slab.ptr);
            }
            let _ = cu::stream::destroy(self.stream);
        }
    }
}

/// Slots per slab: the shard's share in [`GPU_SLABS_MAX`] parts, each at
/// most [`GPU_SLAB_BYTES_MAX`] (and at least one block).
pub fn slab_blocks(capacity_blocks: u32, block_bytes: u64) -> u32 {
    let per_slab = (capacity_blocks as u64).div_ceil(GPU_SLABS_MAX).max(1);
    let max_blocks = (GPU_SLAB_BYTES_MAX / block_bytes.max(1)).max(1);
    per_slab.min(max_blocks) as u32
}

/// A staging buffer out of the pool; goes back on drop.
struct StagingGuard<'a> {
    tier: &'a GpuTier,
    buf: Option<Staging>,
    _permit: glommio::sync::Permit<'a>,
}

impl StagingGuard<'_> {
    fn buf(&self) -> &Staging {
        self.buf.as_ref().expect("held until drop")
    }

    fn buf_mut(&mut self) -> &mut Staging {
        self.buf.as_mut().expect("held until drop")
    }
}

impl Drop for StagingGuard<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.tier.staging.borrow_mut().push(b);
        }
    }
}
