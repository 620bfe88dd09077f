//! The RAM tier: per shard, an arena of `block_bytes` slots mapped once at
//! open (2 MiB huge pages where the kernel has them), with the map and LRU
//! order of [`crate::lru::SlotLru`]. Nothing is allocated per request.
//!
//! **Zero-copy reads.** A GET served from RAM is a `Bytes` over the slot
//! itself ([`Bytes::from_owner`]); the slot's pin count is raised while any
//! such `Bytes` lives, on whichever thread it ends (forwarded GETs end on
//! another shard). A pinned slot is never written: eviction takes it out of
//! the map and LRU at once, but it is reused only once its pins drop to 0.
//!
//! **Safety argument.** Only the owning shard's thread writes slot memory,
//! and only into a slot that is in neither the map nor the LRU and has no
//! pins; readers only ever see slots through a pin taken on that thread
//! after the write completed. The pin count's release (drop) / acquire
//! (reuse check) pair orders a reader's last access before the next write.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::key::{BlockHash, StoredKey};
use crate::lru::SlotLru;
use crate::tenant::OwnerId;

/// Huge page size the arena asks for: 2 MiB (x86-64 and arm64 default).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// How the arena's memory is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HugePages {
    /// `MAP_HUGETLB`: reserved 2 MiB pages (`vm.nr_hugepages`).
    Reserved,
    /// Transparent huge pages, asked for with `madvise(MADV_HUGEPAGE)`.
    Transparent,
    /// 4 KiB pages (the madvise was refused).
    None,
}

/// Slot memory, shared with the `Bytes` that pin its slots.
pub struct Arena {
    base: NonNull<u8>,
    map_bytes: usize,
    slot_bytes: usize,
    pins: Box<[AtomicU32]>,
    huge_pages: HugePages,
    /// [`Arena::prefault_in_background`] ran (or nothing to fault in).
    prefault_started: AtomicBool,
}

// SAFETY: the arena is plain memory; who may write which slot and when is
// the pin protocol in the module docs, kept by `RamTier` (single-threaded)
// and `SlotRef` (atomics).
unsafe impl Send for Arena {}
// SAFETY: as above; shared access is reads of pinned slots and atomic pins.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `slots` slots of `slot_bytes`: reserved huge pages are faulted
    /// in at once; other memory on a helper thread once
    /// [`Arena::prefault_in_background`] is called (after start-up).
    ///
    /// # Errors
    /// [`Error::Config`] when the mapping fails (too large for memory or
    /// `vm.max_map_count`).
    pub fn new(slots: u32, slot_bytes: usize) -> Result<Arc<Arena>> {
        let bytes = slots as usize * slot_bytes;
        let map_bytes = bytes.div_ceil(HUGE_PAGE_BYTES).max(1) * HUGE_PAGE_BYTES;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: an anonymous private mapping; the result is checked.
        let mut ptr = unsafe { libc::mmap(std::ptr::null_mut(), map_bytes, prot, flags | libc::MAP_HUGETLB | libc::MAP_POPULATE, -1, 0) };
        let mut huge_pages = HugePages::Reserved;
        if ptr == libc::MAP_FAILED {
            // SAFETY: as above.
            ptr = unsafe { libc::mmap(std::ptr::null_mut(), map_bytes, prot, flags, -1, 0) };
            if ptr == libc::MAP_FAILED {
                let e = std::io::Error::last_os_error();
                return Err(Error::Config(format!("cannot map a RAM tier of {map_bytes} bytes: {e}; lower --ram-gb")));
            }
            // SAFETY: advice on the mapping just made.
            huge_pages =
                if unsafe { libc::madvise(ptr, map_bytes, libc::MADV_HUGEPAGE) } == 0 { HugePages::Transparent } else { HugePages::None };
        }
        let arena = Arc::new(Arena {
            base: NonNull::new(ptr.cast()).expect("mmap returned a non-null address"),
            map_bytes,
            slot_bytes,
            pins: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            huge_pages,
            prefault_started: AtomicBool::new(huge_pages == HugePages::Reserved),
        });
        Ok(arena)
    }

    /// Faults every page in on a helper thread
    /// ([`crate::populate::populate`]: `MADV_POPULATE_WRITE`, Linux 5.14+, a
    /// huge page per call), so steady-state PUTs take no page faults; once
    /// per arena (reserved huge pages are in already). Called after the
    /// shard serves, not at start-up: populating 1 GiB took ~1 s here (page
    /// by page from user space 3.8 s), and up to 2.6 s on a VM whose freed
    /// memory had gone back to the host. The advice only maps pages not yet
    /// present and never changes data, so it may run while slots are being
    /// filled. Older kernels refuse it and pages fault on first use instead.
    pub fn prefault_in_background(self: &Arc<Self>) {
        if self.prefault_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let arena = self.clone();
        let spawned = std::thread::Builder::new().name("kvtier-ram-prefault".into()).spawn(move || {
            crate::populate::run_in_background();
            // `arena` keeps the mapping alive until this returns.
            let stop = AtomicBool::new(false);
            if let Err(e) = crate::populate::populate(arena.base.as_ptr() as usize, arena.map_bytes, &stop) {
                tracing::debug!("RAM tier prefault not available: {e}");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("RAM tier prefault thread not started ({e}); pages fault on first use");
        }
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize) < self.pins.len());
        // SAFETY: slot < slots, so the offset lies inside the mapping.
        unsafe { self.base.as_ptr().add(slot as usize * self.slot_bytes) }
    }

    fn pinned(&self, slot: u32) -> bool {
        self.pins[slot as usize].load(Ordering::Acquire) > 0
    }

    /// A `Bytes` over `slot`, pinning it until the last clone drops.
    fn pin(self: &Arc<Self>, slot: u32) -> Bytes {
        self.pin_range(slot, 0, self.slot_bytes)
    }

    /// A `Bytes` over `len` bytes of `slot` from `offset`, pinning the slot
    /// until the last clone drops. A slot being filled chunk by chunk hands
    /// out each filled range while later ranges are still written: the
    /// ranges never overlap, so no byte a reader holds is written.
    fn pin_range(self: &Arc<Self>, slot: u32, offset: usize, len: usize) -> Bytes {
        assert!(offset + len <= self.slot_bytes, "range within the slot");
        self.pins[slot as usize].fetch_add(1, Ordering::AcqRel);
        Bytes::from_owner(SlotRef { arena: self.clone(), slot, offset, len })
    }

    /// Copies `bytes` to `offset` in `slot`, handing each 256 KiB step to
    /// `inspect` just before it is copied (a CRC reads it while hot). The
    /// range must not have been handed out ([`Arena::pin_range`]) and the
    /// slot must be unreachable by lookups (reserved, not mapped).
    fn fill_range(&self, slot: u32, offset: usize, bytes: &[u8], mut inspect: impl FnMut(&[u8])) {
        const STEP_BYTES: usize = 256 << 10;
        assert!(offset + bytes.len() <= self.slot_bytes, "block larger than a RAM slot");
        let mut at = offset;
        for step in bytes.chunks(STEP_BYTES) {
            inspect(step);
            // SAFETY: in bounds (checked above); no reader holds this range
            // (the caller's protocol, above).
            unsafe { std::ptr::copy_nonoverlapping(step.as_ptr(), self.slot_ptr(slot).add(at), step.len()) };
            at += step.len();
        }
    }

    /// Copies `parts` (together `slot_bytes`) into an unpinned slot that no
    /// reader can reach.
    fn fill(&self, slot: u32, parts: &[&[u8]]) {
        assert!(!self.pinned(slot), "a pinned RAM slot is never written");
        let mut at = 0;
        for p in parts {
            self.fill_range(slot, at, p, |_| {});
            at += p.len();
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; no `SlotRef` outlives the
        // arena (each holds an `Arc` of it).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.map_bytes) };
    }
}

/// Owner of a RAM-served `Bytes`: keeps the slot pinned.
struct SlotRef {
    arena: Arc<Arena>,
    slot: u32,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for SlotRef {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot is pinned while this exists, so nothing writes
        // this range (`pin_range` checked it lies inside the slot).
        unsafe { std::slice::from_raw_parts(self.arena.slot_ptr(self.slot).add(self.offset), self.len) }
    }
}

impl Drop for SlotRef {
    fn drop(&mut self) {
        self.arena.pins[self.slot as usize].fetch_sub(1, Ordering::Release);
    }
}

pub use crate::lru::Victim;

/// One shard's RAM tier: the arena and its [`SlotLru`]. Single-threaded
/// (lives in the shard).
pub struct RamTier {
    arena: Arc<Arena>,
    lru: SlotLru,
    /// Fired when a demotion to the log ends: what a DELETE of the block
    /// waits for (shared, so it is awaited outside the tier's `RefCell`).
    pub(crate) demotion_ended: Arc<crate::signal::Signal>,
}

impl RamTier {
    /// A tier of `capacity_blocks` slots of `block_bytes`.
    ///
    /// # Errors
    /// As [`Arena::new`].
    pub fn new(capacity_blocks: u32, block_bytes: u64) -> Result<RamTier> {
        let arena = Arena::new(capacity_blocks, block_bytes as usize)?;
        Ok(RamTier {
            arena,
            lru: SlotLru::new(capacity_blocks, capacity_blocks),
            demotion_ended: Arc::new(crate::signal::Signal::new("a block's demotion from RAM to the log ended")),
        })
    }

    /// Slots in the tier.
    pub fn capacity_blocks(&self) -> u64 {
        self.lru.capacity_blocks()
    }

    /// Reports the blocks this tier starts and stops holding (KV events).
    pub fn set_journal(&mut self, journal: crate::events::Journal) {
        self.lru.set_journal(journal);
    }

    /// Blocks held now.
    pub fn used_blocks(&self) -> u64 {
        self.lru.used_blocks()
    }

    /// Slots out of the map but still pinned by responses in flight.
    pub fn retired_blocks(&self) -> u64 {
        self.lru.retired_blocks()
    }

    /// Faults the tier's memory in on a helper thread, once
    /// ([`Arena::prefault_in_background`]).
    pub fn prefault_in_background(&self) {
        self.arena.prefault_in_background();
    }

    /// How the arena is backed.
    pub fn huge_pages(&self) -> HugePages {
        self.arena.huge_pages
    }

    /// Whether `hash` is held (no LRU change).
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.lru.contains(hash)
    }

    /// Whether `hash` is held and still has to reach NVMe.
    pub fn is_dirty(&self, hash: &BlockHash) -> bool {
        self.lru.is_dirty(hash)
    }

    /// Whether a block of `hash` is being written to NVMe now.
    pub fn is_demoting(&self, hash: &BlockHash) -> bool {
        self.lru.is_demoting(hash)
    }

    /// The block of `key`, made most recently used, as a zero-copy `Bytes`
    /// pinning its slot. `None` when not held (or held under another key
    /// with the same hash).
    pub fn get(&mut self, key: &StoredKey, hash: &BlockHash) -> Option<Bytes> {
        let slot = self.lru.touch(key, hash)?;
        Some(self.arena.pin(slot))
    }

    /// A slot that a block of `owner` can fill now: a free one, or a
    /// retired one whose pins have dropped. `None` when every slot is live
    /// or pinned, or `owner` is at its limit here.
    pub fn take_free(&mut self, owner: OwnerId) -> Option<u32> {
        if !self.lru.under_limit(owner) {
            return None;
        }
        let arena = &self.arena;
        self.lru.take_free(|s| arena.pinned(s))
    }

    /// The block to move out to make room for a block of `owner`
    /// ([`SlotLru::victim_for`]).
    pub fn victim_for(&self, owner: OwnerId) -> Option<Victim> {
        self.lru.victim_for(owner)
    }

    /// The owners' slots: quotas, counts, their oldest blocks.
    pub fn lru(&self) -> &SlotLru {
        &self.lru
    }

    /// Sets each owner's `(reserved, limit)` in blocks ([`SlotLru::set_quotas`]).
    pub fn set_quotas(&mut self, quotas: &[(u64, u64)]) {
        self.lru.set_quotas(quotas);
    }

    /// A `Bytes` over a live slot (for writing it to NVMe), marking it as
    /// being demoted.
    pub fn begin_demotion(&mut self, slot: u32) -> Bytes {
        self.lru.begin_demotion(slot);
        self.arena.pin(slot)
    }

    /// Ends a demotion. If the slot still holds the block (not replaced or
    /// deleted meanwhile) and `written` is true, it leaves the tier.
    pub fn end_demotion(&mut self, slot: u32, written: bool) {
        self.lru.end_demotion(slot, written, self.arena.pinned(slot));
        self.demotion_ended.notify();
    }

    /// Ends a write of a dirty block to the log at a flush: the block stays
    /// in RAM, clean if `written`.
    pub fn end_flush(&mut self, slot: u32, written: bool) {
        self.lru.end_flush(slot, written);
    }

    /// Takes a live slot out of the map and the LRU; it becomes free now or
    /// once unpinned.
    pub fn evict(&mut self, slot: u32) {
        self.lru.evict(slot, self.arena.pinned(slot));
    }

    /// Frees the slot of `hash` for a new copy of the same block when no
    /// response holds it and it is not being demoted, so a PUT of a held key
    /// reuses its slot instead of pushing another block out. Returns whether
    /// it did.
    pub fn release_if_idle(&mut self, hash: &BlockHash) -> bool {
        let arena = &self.arena;
        self.lru.release_if_idle(hash, |s| arena.pinned(s))
    }

    /// Drops the block of `hash`, if held. Returns whether it was.
    pub fn remove(&mut self, hash: &BlockHash) -> bool {
        let arena = &self.arena;
        self.lru.remove(hash, |s| arena.pinned(s))
    }

    /// Fills `slot` (from [`RamTier::take_free`]) with `parts` and makes it
    /// the most recently used block of `hash`, replacing an older copy.
    pub fn install(&mut self, slot: u32, key: &StoredKey, hash: BlockHash, owner: OwnerId, parts: &[&[u8]], dirty: bool) {
        self.arena.fill(slot, parts);
        let arena = &self.arena;
        self.lru.install(slot, key, hash, owner, dirty, |s| arena.pinned(s));
    }

    /// Copies the next verified chunk of a block being promoted into
    /// `slot` (from [`RamTier::take_free`], not yet installed) at `offset`,
    /// and returns it as a `Bytes` over the slot: the response sends the
    /// RAM copy, so promotion costs no second copy. `inspect` sees each
    /// 256 KiB step just before it is copied.
    pub fn fill_chunk(&mut self, slot: u32, offset: usize, bytes: &[u8], inspect: impl FnMut(&[u8])) -> Bytes {
        self.arena.fill_range(slot, offset, bytes, inspect);
        self.arena.pin_range(slot, offset, bytes.len())
    }

    /// The first `len` bytes of `slot`, filled with [`RamTier::fill_chunk`],
    /// as one zero-copy `Bytes` pinning the slot.
    pub fn filled(&self, slot: u32, len: usize) -> Bytes {
        self.arena.pin_range(slot, 0, len)
    }

    /// Makes `slot`, filled with [`RamTier::fill_chunk`], the most recently
    /// used (clean) block of `hash`. The caller checked no copy of `hash` is
    /// held (a newer one may have been stored while the chunks were read).
    pub fn install_filled(&mut self, slot: u32, key: &StoredKey, hash: BlockHash, owner: OwnerId) {
        debug_assert!(!self.lru.contains(&hash));
        let arena = &self.arena;
        self.lru.install(slot, key, hash, owner, false, |s| arena.pinned(s));
    }

    /// Gives back a slot from [`RamTier::take_free`] that will not be
    /// installed: free now, or once responses holding its chunks drop them.
    pub fn abandon(&mut self, slot: u32) {
        self.lru.abandon(slot, self.arena.pinned(slot));
    }

    /// Dirty blocks (write-back), least recently used first, for a clean
    /// close that writes them all to NVMe.
    pub fn dirty_blocks(&self) -> Vec<Victim> {
        self.lru.dirty_blocks()
    }

    /// Keys held, most recently used first (tests and the policy oracle).
    pub fn lru_keys(&self) -> Vec<String> {
        self.lru.lru_keys()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::testing::sk;

    fn h(i: u128) -> BlockHash {
        BlockHash(i)
    }

    fn put(t: &mut RamTier, key: &StoredKey, hash: BlockHash, fill: u8) -> bool {
        let data = vec![fill; 4096];
        loop {
            if let Some(slot) = t.take_free(0) {
                t.install(slot, key, hash, 0, &[&data], false);
                return true;
            }
            match t.victim_for(0) {
                Some(v) => t.evict(v.slot),
                None => return false,
            }
        }
    }

    #[test]
    fn lru_order_and_eviction() {
        let mut t = RamTier::new(3, 4096).unwrap();
        for (i, k) in ["a", "b", "c"].iter().enumerate() {
            assert!(put(&mut t, &sk(k), h(i as u128), i as u8));
        }
        assert_eq!(t.lru_keys(), ["c", "b", "a"]);
        assert!(t.get(&sk("a"), &h(0)).is_some());
        assert_eq!(t.lru_keys(), ["a", "c", "b"]);
        put(&mut t, &sk("d"), h(3), 3);
        assert_eq!(t.lru_keys(), ["d", "a", "c"], "b was least recently used");
        assert!(!t.contains(&h(1)));
        assert!(t.get(&sk("x"), &h(0)).is_none(), "same hash, other key: not served");
        assert_eq!(t.used_blocks(), 3);
    }

    #[test]
    fn pinned_slot_is_never_rewritten() {
        let mut t = RamTier::new(2, 4096).unwrap();
        put(&mut t, &sk("a"), h(1), 0xAA);
        let held = t.get(&sk("a"), &h(1)).unwrap();
        put(&mut t, &sk("b"), h(2), 0xBB);
        // "a" is evicted while a response still holds it...
        put(&mut t, &sk("c"), h(3), 0xCC);
        assert!(!t.contains(&h(1)));
        assert_eq!(t.retired_blocks(), 1);
        // ... and the tier is full of pinned or live slots: "d" evicts "b",
        // not "a"'s memory.
        put(&mut t, &sk("d"), h(4), 0xDD);
        assert!(held.iter().all(|&b| b == 0xAA), "the response still sends a's bytes");
        // Sent on another thread, dropped there: the slot comes back.
        std::thread::spawn(move || drop(held)).join().unwrap();
        put(&mut t, &sk("e"), h(5), 0xEE);
        assert_eq!(t.retired_blocks(), 0);
        assert_eq!(t.lru_keys(), ["e", "d"]);
    }

    #[test]
    fn replacing_a_key_moves_it_to_a_new_slot() {
        let mut t = RamTier::new(2, 4096).unwrap();
        put(&mut t, &sk("a"), h(1), 1);
        let old = t.get(&sk("a"), &h(1)).unwrap();
        put(&mut t, &sk("a"), h(1), 2);
        assert_eq!(t.used_blocks(), 1);
        assert_eq!(old[0], 1);
        assert_eq!(t.get(&sk("a"), &h(1)).unwrap()[0], 2);
    }

    #[test]
    fn demotion_keeps_the_block_until_written() {
        let mut t = RamTier::new(1, 4096).unwrap();
        let data = vec![7u8; 4096];
        let s = t.take_free(0).unwrap();
        t.install(s, &sk("a"), h(1), 0, &[&data], true);
        assert!(t.is_dirty(&h(1)));
        let v = t.victim_for(0).unwrap();
        assert!(v.dirty);
        let bytes = t.begin_demotion(v.slot);
        assert!(t.is_demoting(&h(1)) && t.contains(&h(1)), "readable while it is written to NVMe");
        assert!(t.victim_for(0).is_none(), "not chosen twice");
        drop(bytes);
        t.end_demotion(v.slot, true);
        assert!(!t.contains(&h(1)));
        assert!(t.take_free(0).is_some());
    }
}
