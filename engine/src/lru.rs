//! Slot bookkeeping shared by the memory tiers (RAM and GPU): a fixed set of
//! `block_bytes` slots, a map from block hash to slot, an LRU list threaded
//! through the slots, a free list, and the write-back state of each block
//! (dirty, being demoted). It holds no block bytes: the tier that owns it
//! fills and reads the slots, and says through a `pinned` predicate which
//! slots readers still hold (such a slot is retired, not reused, until its
//! pins drop). Single-threaded; lives in the shard.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::rc::Rc;

use crate::index::BlockHashHasher;
use crate::key::BlockHash;

const NIL: u32 = u32::MAX;

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// On the free list, or not usable yet (no memory behind it).
    Free,
    /// Mapped and in the LRU.
    Live,
    /// Out of the map, waiting for its pins to drop.
    Retired,
}

struct Meta {
    hash: BlockHash,
    key: Option<Rc<str>>,
    prev: u32,
    next: u32,
    state: SlotState,
    /// Not on NVMe yet (write-back): must be written there before reuse.
    dirty: bool,
    /// Being moved to a slower tier now; not a victim again meanwhile.
    demoting: bool,
}

/// A least-recently-used block chosen to leave a tier.
#[derive(Debug, Clone)]
pub struct Victim {
    /// Its slot.
    pub slot: u32,
    /// Its hash.
    pub hash: BlockHash,
    /// Its key.
    pub key: Rc<str>,
    /// Whether it must be written to NVMe first (write-back).
    pub dirty: bool,
}

/// The slots of one tier of one shard: map, LRU order, free list.
pub struct SlotLru {
    map: HashMap<BlockHash, u32, BuildHasherDefault<BlockHashHasher>>,
    meta: Vec<Meta>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    free: Vec<u32>,
    retired: Vec<u32>,
}

impl SlotLru {
    /// `capacity_blocks` slots, of which `usable` (the first ones) are free
    /// now; the rest join with [`SlotLru::add_free`] once memory backs them.
    pub fn new(capacity_blocks: u32, usable: u32) -> SlotLru {
        let meta = (0..capacity_blocks)
            .map(|_| Meta { hash: BlockHash(0), key: None, prev: NIL, next: NIL, state: SlotState::Free, dirty: false, demoting: false })
            .collect();
        SlotLru {
            map: HashMap::with_capacity_and_hasher(capacity_blocks as usize, Default::default()),
            meta,
            head: NIL,
            tail: NIL,
            free: (0..usable.min(capacity_blocks)).rev().collect(),
            retired: Vec::new(),
        }
    }

    /// Makes `slots` usable (their memory now exists).
    pub fn add_free(&mut self, slots: std::ops::Range<u32>) {
        self.free.extend(slots.rev());
    }

    /// Slots in the tier.
    pub fn capacity_blocks(&self) -> u64 {
        self.meta.len() as u64
    }

    /// Blocks held now.
    pub fn used_blocks(&self) -> u64 {
        self.map.len() as u64
    }

    /// Slots out of the map but still pinned by readers.
    pub fn retired_blocks(&self) -> u64 {
        self.retired.len() as u64
    }

    /// Whether `hash` is held (no LRU change).
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.map.contains_key(hash)
    }

    /// Whether `hash` is held and still has to reach NVMe.
    pub fn is_dirty(&self, hash: &BlockHash) -> bool {
        self.map.get(hash).is_some_and(|&s| self.meta[s as usize].dirty)
    }

    /// Whether a block of `hash` is being demoted now.
    pub fn is_demoting(&self, hash: &BlockHash) -> bool {
        self.meta.iter().any(|m| m.demoting && m.hash == *hash && m.state != SlotState::Free)
    }

    /// The slot of `key`, made most recently used. `None` when not held (or
    /// held under another key with the same hash).
    pub fn touch(&mut self, key: &str, hash: &BlockHash) -> Option<u32> {
        let slot = *self.map.get(hash)?;
        if self.meta[slot as usize].key.as_deref() != Some(key) {
            return None;
        }
        self.unlink(slot);
        self.push_front(slot);
        Some(slot)
    }

    /// The slot holding `hash` now, if any (no LRU change).
    pub fn slot_of(&self, hash: &BlockHash) -> Option<u32> {
        self.map.get(hash).copied()
    }

    /// A slot that can be filled now: a free one, or a retired one that is
    /// no longer `pinned` nor being read for a demotion. `None` when every
    /// usable slot is live, pinned or being demoted.
    pub fn take_free(&mut self, pinned: impl Fn(u32) -> bool) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let i = self.retired.iter().position(|&s| !pinned(s) && !self.meta[s as usize].demoting)?;
        let s = self.retired.swap_remove(i);
        self.meta[s as usize].state = SlotState::Free;
        Some(s)
    }

    /// The least recently used block not being demoted already.
    pub fn victim(&self) -> Option<Victim> {
        let mut s = self.tail;
        while s != NIL {
            let m = &self.meta[s as usize];
            if !m.demoting {
                return Some(Victim { slot: s, hash: m.hash, key: m.key.clone().expect("live slots have keys"), dirty: m.dirty });
            }
            s = m.prev;
        }
        None
    }

    /// Marks a live slot as being demoted (it stays readable).
    pub fn begin_demotion(&mut self, slot: u32) {
        self.meta[slot as usize].demoting = true;
    }

    /// Ends a demotion. If the slot still holds the block (not replaced or
    /// deleted meanwhile) and `moved` is true, it leaves the tier.
    pub fn end_demotion(&mut self, slot: u32, moved: bool, pinned: bool) {
        let m = &mut self.meta[slot as usize];
        m.demoting = false;
        if moved && m.state == SlotState::Live {
            m.dirty = false;
            self.evict(slot, pinned);
        }
    }

    /// Ends a write of a dirty block to the log at a flush: the block stays,
    /// clean if `written`.
    pub fn end_flush(&mut self, slot: u32, written: bool) {
        let m = &mut self.meta[slot as usize];
        m.demoting = false;
        if written && m.state == SlotState::Live {
            m.dirty = false;
        }
    }

    /// Takes a live slot out of the map and the LRU; it becomes free now or,
    /// if `pinned` or being demoted, once released.
    pub fn evict(&mut self, slot: u32, pinned: bool) {
        let m = &self.meta[slot as usize];
        if m.state != SlotState::Live {
            return;
        }
        let hash = m.hash;
        if self.map.get(&hash) == Some(&slot) {
            self.map.remove(&hash);
        }
        self.unlink(slot);
        let m = &mut self.meta[slot as usize];
        m.key = None;
        m.dirty = false;
        if pinned || m.demoting {
            m.state = SlotState::Retired;
            self.retired.push(slot);
        } else {
            m.state = SlotState::Free;
            self.free.push(slot);
        }
    }

    /// Frees the slot of `hash` when `pinned` says no reader holds it and it
    /// is not being demoted. Returns whether it did.
    pub fn release_if_idle(&mut self, hash: &BlockHash, pinned: impl Fn(u32) -> bool) -> bool {
        match self.map.get(hash) {
            Some(&slot) if !pinned(slot) && !self.meta[slot as usize].demoting => {
                self.evict(slot, false);
                true
            }
            _ => false,
        }
    }

    /// Drops the block of `hash`, if held. Returns whether it was.
    pub fn remove(&mut self, hash: &BlockHash, pinned: impl Fn(u32) -> bool) -> bool {
        match self.map.get(hash) {
            Some(&slot) => {
                self.evict(slot, pinned(slot));
                true
            }
            None => false,
        }
    }

    /// Makes the filled `slot` (from [`SlotLru::take_free`]) the most
    /// recently used block of `hash`, replacing an older copy.
    pub fn install(&mut self, slot: u32, key: &str, hash: BlockHash, dirty: bool, pinned: impl Fn(u32) -> bool) {
        debug_assert_eq!(self.meta[slot as usize].state, SlotState::Free);
        if let Some(&old) = self.map.get(&hash) {
            self.evict(old, pinned(old));
        }
        let m = &mut self.meta[slot as usize];
        *m = Meta { hash, key: Some(Rc::from(key)), prev: NIL, next: NIL, state: SlotState::Live, dirty, demoting: false };
        self.map.insert(hash, slot);
        self.push_front(slot);
    }

    /// Gives back a slot from [`SlotLru::take_free`] that will not be
    /// installed: free now, or, if `pinned` (readers hold bytes of it),
    /// retired until they drop them.
    pub fn abandon(&mut self, slot: u32, pinned: bool) {
        debug_assert_eq!(self.meta[slot as usize].state, SlotState::Free);
        if pinned {
            self.meta[slot as usize].state = SlotState::Retired;
            self.retired.push(slot);
        } else {
            self.free.push(slot);
        }
    }

    /// Dirty blocks (write-back), least recently used first, for a clean
    /// close that writes them all to NVMe.
    pub fn dirty_blocks(&self) -> Vec<Victim> {
        let mut out = Vec::new();
        let mut s = self.tail;
        while s != NIL {
            let m = &self.meta[s as usize];
            if m.dirty && !m.demoting {
                out.push(Victim { slot: s, hash: m.hash, key: m.key.clone().expect("live slots have keys"), dirty: true });
            }
            s = m.prev;
        }
        out
    }

    /// Keys held, most recently used first (tests and the policy oracle).
    pub fn lru_keys(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut s = self.head;
        while s != NIL {
            out.push(self.meta[s as usize].key.as_deref().unwrap_or("").to_string());
            s = self.meta[s as usize].next;
        }
        out
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next) = (self.meta[slot as usize].prev, self.meta[slot as usize].next);
        if prev != NIL {
            self.meta[prev as usize].next = next;
        } else if self.head == slot {
            self.head = next;
        }
        if next != NIL {
            self.meta[next as usize].prev = prev;
        } else if self.tail == slot {
            self.tail = prev;
        }
        self.meta[slot as usize].prev = NIL;
        self.meta[slot as usize].next = NIL;
    }

    fn push_front(&mut self, slot: u32) {
        self.meta[slot as usize].prev = NIL;
        self.meta[slot as usize].next = self.head;
        if self.head != NIL {
            self.meta[self.head as usize].prev = slot;
        }
        self.head = slot;
        if self.tail == NIL {
            self.tail = slot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_join_as_memory_backs_them() {
        let mut l = SlotLru::new(4, 2);
        let (a, b) = (l.take_free(|_| false).unwrap(), l.take_free(|_| false).unwrap());
        assert_eq!((a, b), (0, 1));
        assert_eq!(l.take_free(|_| false), None, "slots 2 and 3 have no memory yet");
        l.install(a, "a", BlockHash(1), false, |_| false);
        l.install(b, "b", BlockHash(2), true, |_| false);
        l.add_free(2..4);
        assert_eq!(l.take_free(|_| false), Some(2));
        assert_eq!(l.take_free(|_| false), Some(3));
        assert_eq!(l.lru_keys(), ["b", "a"]);
        assert_eq!(l.capacity_blocks(), 4);
    }

    #[test]
    fn a_demoting_victim_is_skipped_and_freed_only_when_its_move_ends() {
        let mut l = SlotLru::new(2, 2);
        for (key, h) in [("a", 1), ("b", 2)] {
            let s = l.take_free(|_| false).unwrap();
            l.install(s, key, BlockHash(h), false, |_| false);
        }
        let v = l.victim().unwrap();
        assert_eq!(&*v.key, "a");
        l.begin_demotion(v.slot);
        assert_eq!(&*l.victim().unwrap().key, "b", "not chosen twice");
        // Replaced while it moves: the old slot is retired, not reused...
        let s = l.take_free(|_| false);
        assert_eq!(s, None);
        l.remove(&BlockHash(1), |_| false);
        assert!(!l.contains(&BlockHash(1)) && l.retired_blocks() == 1);
        assert_eq!(l.take_free(|_| false), None, "a slot being read for its move is not refilled");
        // ... until the move ends.
        l.end_demotion(v.slot, true, false);
        assert_eq!(l.take_free(|_| false), Some(v.slot));
    }
}
