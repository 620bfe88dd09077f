//! One shard's GPU tier: the map of its slots (which block each holds, with
//! the LRU order and owners of [`crate::lru::SlotLru`], each block's CRC-32
//! and install generation), the policy of growing it a slab at a time, and
//! the copies in and out of it on the shard's one stream, each waited for by
//! polling its staging buffer's event (the module docs of [`crate::gpu`]
//! say why).

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use glommio::sync::Semaphore;

use super::driver::{describe, driver_error, GpuDevice, GpuUnavailable};
use super::slabs::{Slabs, GPU_SLAB_RETRY};
use super::staging::{Staging, StagingGuard, StagingPool, GPU_STAGING_BUFFERS};
use super::GpuInfo;
use crate::key::{BlockHash, StoredKey};
use crate::lru::{SlotLru, Victim};
use crate::pool::BufferPool;
use crate::tenant::OwnerId;

/// How often a shard polls a copy's event. A 16 MiB block crosses PCIe 4.0
/// x16 (~25 GB/s) in ~0.7 ms, so polling every 50 µs adds at most ~7%.
pub const GPU_POLL_INTERVAL: Duration = Duration::from_micros(50);

/// `CUDA_ERROR_NOT_READY`: an event's work is still running.
const NOT_READY: sys::CUresult = sys::CUresult::CUDA_ERROR_NOT_READY;

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
    /// The device memory the slots live in.
    slabs: Slabs,
    lru: RefCell<SlotLru>,
    /// Per slot: the CRC-32 of the block it holds.
    crc: RefCell<Vec<u32>>,
    /// Per slot: bumped at each install, so a late check acts only on the
    /// block it read.
    generation: RefCell<Vec<u64>>,
    staging: StagingPool,
    /// Held while a slab is being allocated.
    growing: Semaphore,
    next_slab_try: Cell<Option<Instant>>,
    pub(crate) faults: GpuFaults,
    /// Fired when a move of a block down to RAM ends: what a DELETE of the
    /// block waits for.
    pub(crate) demotion_ended: crate::signal::Signal,
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
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| driver_error("cuStreamCreate", e))?;
        let mut tier = GpuTier {
            slabs: Slabs::new(device.clone(), capacity_blocks, block_bytes),
            device,
            stream,
            block_bytes,
            lru: RefCell::new(SlotLru::new(capacity_blocks, 0)),
            crc: RefCell::new(vec![0; capacity_blocks as usize]),
            generation: RefCell::new(vec![0; capacity_blocks as usize]),
            staging: StagingPool::new(),
            growing: Semaphore::new(1),
            next_slab_try: Cell::new(None),
            demotion_ended: crate::signal::Signal::new("a block's move from the GPU down to RAM ended"),
            faults: GpuFaults::default(),
        };
        for _ in 0..GPU_STAGING_BUFFERS {
            let s = Staging::new(block_bytes as usize)
                .map_err(|e| driver_error(&format!("cuMemHostAlloc of a {block_bytes}-byte pinned staging buffer"), e))?;
            tier.staging.add(s);
        }
        let first_slab = tier.slabs.grow().map_err(|e| {
            driver_error(
                &format!(
                    "allocating the GPU tier's first slab of {} bytes on device {} ({}, {} bytes free)",
                    tier.slabs.slab_blocks() as u64 * block_bytes,
                    tier.device.ordinal,
                    tier.device.name,
                    tier.device.mem_info().map(|(f, _)| f).unwrap_or(0)
                ),
                e,
            )
        })?;
        tier.lru.get_mut().add_free(first_slab);
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

    /// Reports the blocks this tier starts and stops holding (KV events).
    pub fn set_journal(&self, journal: crate::events::Journal) {
        self.lru.borrow_mut().set_journal(journal);
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
    pub fn touch(&self, key: &StoredKey, hash: &BlockHash) -> bool {
        self.lru.borrow_mut().touch(key, hash).is_some()
    }

    /// Keys held, most recently used first.
    pub fn lru_keys(&self) -> Vec<String> {
        self.lru.borrow().lru_keys()
    }

    /// Stats of this shard's tier.
    pub fn info(&self) -> GpuInfo {
        let slabs = self.slabs.count();
        let f = &self.faults;
        GpuInfo {
            device: self.device.name.clone(),
            ordinal: self.device.ordinal,
            unavailable: None,
            allocated_bytes: self.slabs.allocated_bytes(),
            slabs,
            copy_errors: f.copy_errors.get(),
            out_of_memory: f.out_of_memory.get(),
            alloc_errors: f.alloc_errors.get(),
            corrupt_blocks: f.corrupt_blocks.get(),
            blocks_lost: f.blocks_lost.get(),
        }
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
        let allocated = self.slabs.allocated_bytes() / self.block_bytes;
        if allocated >= self.capacity_blocks() || self.next_slab_try.get().is_some_and(|t| Instant::now() < t) {
            return None;
        }
        match self.slabs.grow_off_reactor().await {
            Ok(slots) => {
                self.lru.borrow_mut().add_free(slots);
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
                    self.slabs.slab_blocks() as u64 * self.block_bytes,
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
        let guard = self.staging.take().await;
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
        key: &StoredKey,
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
                tracing::warn!(
                    device = self.device.ordinal,
                    key = key.as_str(),
                    "copy to the GPU failed ({}); block not placed there",
                    describe(&e)
                );
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
        let dst = self.slabs.slot_ptr(slot);
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
    pub async fn read(&self, key: &StoredKey, hash: &BlockHash, pool: &Arc<BufferPool>) -> GpuRead {
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
                sys::cuMemcpyDtoHAsync_v2(dst.as_ptr() as *mut _, self.slabs.slot_ptr(slot), dst.len(), self.stream).result()?;
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
                key = key.as_str(),
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
                sys::cuMemcpyDtoHAsync_v2(dst.as_ptr() as *mut _, self.slabs.slot_ptr(v.slot), dst.len(), self.stream).result()?;
                cu::event::record(event, self.stream)
            }
        });
        if let Err(e) = issued.and(self.wait(event).await) {
            crate::counter::bump(&self.faults.copy_errors, 1);
            tracing::warn!(key = v.key.as_str(), "copy from the GPU to move a block down failed: {}", describe(&e));
            return Err(());
        }
        let mut crc = crc32fast::Hasher::new();
        let bytes = pool.copy_parts(&[staging.buf().bytes()], |step| crc.update(step));
        if crc.finalize() != expected {
            crate::counter::bump(&self.faults.corrupt_blocks, 1);
            tracing::error!(key = v.key.as_str(), "GPU block failed its CRC-32 when moved down; dropped");
            return Err(());
        }
        Ok(bytes)
    }

    /// Ends a demotion: the block leaves the tier if `moved`, or (`drop`)
    /// when its copy back failed; otherwise it stays.
    pub(crate) fn end_demotion(&self, slot: u32, moved: bool) {
        self.lru.borrow_mut().end_demotion(slot, moved, false);
        self.demotion_ended.notify();
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
            self.staging.clear();
            self.slabs.free_all();
            let _ = cu::stream::destroy(self.stream);
        }
    }
}
