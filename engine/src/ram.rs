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
//!
//! **Leases.** A same-host client's lease (docs/LOCAL.md) is such a pin,
//! held by the client's connection instead of a response, over an arena
//! the client has mapped read-only (`arena.rs`): the same rule keeps the
//! slot unwritten until the lease ends, and the slot's generation tells
//! the client afterwards whether it did end before the client was done.

mod arena;

use std::sync::Arc;

use bytes::Bytes;

use crate::error::Result;
use crate::key::{BlockHash, StoredKey};
use crate::lru::SlotLru;
use crate::tenant::OwnerId;

pub use crate::lru::Victim;
pub use arena::{shared_arena, shared_arena_ids, Arena, ArenaLayout, HugePages, RamShared, HUGE_PAGE_BYTES};

/// A block of the RAM tier pinned for a client's lease: its bytes (the
/// pin: the slot is not written while this lives) and where a client that
/// mapped the arena finds them.
#[derive(Clone)]
pub struct LeasedSlot {
    /// The block, over its slot (dropping the last clone ends the pin).
    pub bytes: Bytes,
    /// The arena's number ([`Arena::id`]).
    pub arena: u32,
    /// Offset of the block in the arena's file.
    pub offset: u64,
    /// The slot's generation when leased.
    pub generation: u64,
}

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
    /// A tier of `capacity_blocks` slots of `block_bytes`, its memory shared
    /// as `shared` says.
    ///
    /// # Errors
    /// As [`Arena::new`].
    pub fn new(capacity_blocks: u32, block_bytes: u64, shared: RamShared) -> Result<RamTier> {
        let arena = Arena::new(capacity_blocks, block_bytes as usize, shared)?;
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
        self.arena.huge_pages()
    }

    /// The tier's memory.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The block of `key` pinned for a lease, made most recently used;
    /// `None` when not held (or held under another key with the same hash)
    /// or when the arena is not shared.
    pub fn lease(&mut self, key: &StoredKey, hash: &BlockHash) -> Option<LeasedSlot> {
        if !self.arena.is_shared() {
            return None;
        }
        let slot = self.lru.touch(key, hash)?;
        Some(LeasedSlot {
            bytes: self.arena.pin(slot),
            arena: self.arena.id(),
            offset: slot as u64 * self.arena.layout().slot_bytes,
            generation: self.arena.generation_of(slot),
        })
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
        let slot = self.lru.take_free(|s| arena.pinned(s))?;
        // Whoever takes it writes it: a lease that ended on it sees the
        // generation change first.
        self.arena.reuse(slot);
        Some(slot)
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
    /// 256 KiB step as the slot holds it, just after it is copied (the
    /// chunk's CRC then checks the bytes served).
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
        self.commit_filled(slot, key, hash, owner);
    }

    /// Copies `bytes` to `offset` in `slot` (from [`RamTier::take_free`],
    /// not yet installed), handing each 256 KiB step to `inspect` as the
    /// slot holds it once copied (the CRC of a block written to the log
    /// straight from its slot: `shard/append.rs`).
    pub fn fill_checked(&mut self, slot: u32, offset: usize, bytes: &[u8], inspect: impl FnMut(&[u8])) {
        self.arena.fill_range(slot, offset, bytes, inspect);
    }

    /// Makes `slot`, filled with [`RamTier::fill_checked`] and now in the
    /// log, the most recently used (clean) block of `hash`, replacing an
    /// older copy if one is held.
    pub fn commit_filled(&mut self, slot: u32, key: &StoredKey, hash: BlockHash, owner: OwnerId) {
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
        let mut t = RamTier::new(3, 4096, RamShared::Off).unwrap();
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
        let mut t = RamTier::new(2, 4096, RamShared::Off).unwrap();
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
        let mut t = RamTier::new(2, 4096, RamShared::Off).unwrap();
        put(&mut t, &sk("a"), h(1), 1);
        let old = t.get(&sk("a"), &h(1)).unwrap();
        put(&mut t, &sk("a"), h(1), 2);
        assert_eq!(t.used_blocks(), 1);
        assert_eq!(old[0], 1);
        assert_eq!(t.get(&sk("a"), &h(1)).unwrap()[0], 2);
    }

    #[test]
    fn demotion_keeps_the_block_until_written() {
        let mut t = RamTier::new(1, 4096, RamShared::Off).unwrap();
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

    #[test]
    fn a_leased_slot_is_never_reused_and_its_generation_changes_before_it_is() {
        let mut t = RamTier::new(2, 4096, RamShared::On).unwrap();
        assert!(t.arena().is_shared());
        put(&mut t, &sk("a"), h(1), 0xAA);
        let lease = t.lease(&sk("a"), &h(1)).unwrap();
        assert!(t.lease(&sk("x"), &h(1)).is_none(), "same hash, other key: not leased");
        let slot = (lease.offset / 4096) as u32;
        assert_eq!(t.arena().generation_of(slot), lease.generation);
        // "a" is deleted and the tier churned past its size: the leased
        // slot keeps a's bytes and generation.
        assert!(t.remove(&h(1)));
        for i in 2..10u8 {
            put(&mut t, &sk(&format!("k{i}")), h(i as u128), i);
        }
        assert!(lease.bytes.iter().all(|&b| b == 0xAA));
        assert_eq!(t.arena().generation_of(slot), lease.generation);
        // The lease ends: the slot is taken again, generation first.
        let generation = lease.generation;
        drop(lease);
        for i in 10..13u8 {
            put(&mut t, &sk(&format!("k{i}")), h(i as u128), i);
        }
        assert!(t.arena().generation_of(slot) > generation, "reused, so its generation moved on");
        // An arena that is not shared leases nothing.
        let mut private = RamTier::new(1, 4096, RamShared::Off).unwrap();
        put(&mut private, &sk("a"), h(1), 1);
        assert!(private.lease(&sk("a"), &h(1)).is_none());
    }

    #[test]
    fn a_client_descriptor_maps_only_to_read() {
        let t = RamTier::new(2, 4096, RamShared::On).unwrap();
        let fd = t.arena().read_only_fd().unwrap();
        let bytes = t.arena().layout().file_bytes as usize;
        let map =
            |prot| unsafe { libc::mmap(std::ptr::null_mut(), bytes, prot, libc::MAP_SHARED, std::os::fd::AsRawFd::as_raw_fd(&fd), 0) };
        assert_eq!(map(libc::PROT_READ | libc::PROT_WRITE), libc::MAP_FAILED, "a writable shared mapping");
        let read = map(libc::PROT_READ);
        assert_ne!(read, libc::MAP_FAILED);
        // SAFETY: the mapping just made.
        unsafe { libc::munmap(read, bytes) };
    }
}
