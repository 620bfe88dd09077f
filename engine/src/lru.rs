//! Slot bookkeeping shared by the memory tiers (RAM and GPU): a fixed set of
//! `block_bytes` slots, a map from block hash to slot, an LRU list threaded
//! through the slots, a free list, and the write-back state of each block
//! (dirty, being demoted). It holds no block bytes: the tier that owns it
//! fills and reads the slots, and says through a `pinned` predicate which
//! slots readers still hold (such a slot is retired, not reused, until its
//! pins drop). Single-threaded; lives in the shard.
//!
//! Blocks have owners (tenants, docs/OPERATIONS.md "Tenants"): each owner
//! has an LRU list of its own, and a global tick taken at every use orders
//! blocks across lists, so with one owner this is one LRU list. Room for an
//! owner's block is made by [`SlotLru::victim_for`]: at its limit, from its
//! own least recently used block; below it, from the least recently used
//! block of any owner above its reservation (itself included). Finding it
//! looks at one list end per owner, O(owners), where one shared list with
//! per-owner counts would walk past every protected block.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::events::Journal;
use crate::index::BlockHashHasher;
use crate::key::{BlockHash, StoredKey};
use crate::tenant::OwnerId;

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
    key: Option<StoredKey>,
    prev: u32,
    next: u32,
    state: SlotState,
    /// Not on NVMe yet (write-back): must be written there before reuse.
    dirty: bool,
    /// Being moved to a slower tier now; not a victim again meanwhile.
    demoting: bool,
    /// Whose block it is.
    owner: OwnerId,
    /// The tick of its last use (orders blocks of different owners).
    tick: u64,
}

/// One owner's LRU list, block count and quota in this tier of one shard.
#[derive(Debug, Clone)]
struct OwnerList {
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    /// Live blocks.
    used: u64,
    /// Blocks no other owner can move out.
    reserved: u64,
    /// Most blocks it may hold.
    limit: u64,
}

/// A least-recently-used block chosen to leave a tier.
#[derive(Debug, Clone)]
pub struct Victim {
    /// Its slot.
    pub slot: u32,
    /// Its hash.
    pub hash: BlockHash,
    /// Its key.
    pub key: StoredKey,
    /// Whether it must be written to NVMe first (write-back).
    pub dirty: bool,
    /// Whose block it is.
    pub owner: OwnerId,
}

/// The slots of one tier of one shard: map, LRU order, free list.
pub struct SlotLru {
    map: HashMap<BlockHash, u32, BuildHasherDefault<BlockHashHasher>>,
    meta: Vec<Meta>,
    /// By owner id; grown on first use of an id.
    owners: Vec<OwnerList>,
    /// Taken at every use.
    tick: u64,
    free: Vec<u32>,
    retired: Vec<u32>,
    /// Where arrivals and departures are reported (KV events).
    journal: Option<Journal>,
}

impl SlotLru {
    /// `capacity_blocks` slots, of which `usable` (the first ones) are free
    /// now; the rest join with [`SlotLru::add_free`] once memory backs them.
    pub fn new(capacity_blocks: u32, usable: u32) -> SlotLru {
        let meta = (0..capacity_blocks)
            .map(|_| Meta {
                hash: BlockHash(0),
                key: None,
                prev: NIL,
                next: NIL,
                state: SlotState::Free,
                dirty: false,
                demoting: false,
                owner: 0,
                tick: 0,
            })
            .collect();
        SlotLru {
            map: HashMap::with_capacity_and_hasher(capacity_blocks as usize, Default::default()),
            meta,
            owners: Vec::new(),
            tick: 0,
            free: (0..usable.min(capacity_blocks)).rev().collect(),
            retired: Vec::new(),
            journal: None,
        }
    }

    /// Reports every block this tier starts or stops holding to `journal`.
    pub fn set_journal(&mut self, journal: Journal) {
        self.journal = Some(journal);
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
    pub fn touch(&mut self, key: &StoredKey, hash: &BlockHash) -> Option<u32> {
        let slot = *self.map.get(hash)?;
        if self.meta[slot as usize].key.as_ref() != Some(key) {
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

    /// Sets each owner's `(reserved, limit)` in blocks, by owner id (owners
    /// not named get no reservation and no limit but the tier's size).
    pub fn set_quotas(&mut self, quotas: &[(u64, u64)]) {
        let capacity = self.capacity_blocks();
        self.list_mut(quotas.len().saturating_sub(1) as OwnerId);
        for (i, l) in self.owners.iter_mut().enumerate() {
            (l.reserved, l.limit) = quotas.get(i).copied().unwrap_or((0, capacity));
        }
    }

    /// Blocks `owner` holds here.
    pub fn owner_blocks(&self, owner: OwnerId) -> u64 {
        self.owners.get(owner as usize).map_or(0, |l| l.used)
    }

    /// `owner`'s `(reserved, limit)` in blocks.
    pub fn quota(&self, owner: OwnerId) -> (u64, u64) {
        self.owners.get(owner as usize).map_or((0, self.capacity_blocks()), |l| (l.reserved, l.limit))
    }

    /// Whether `owner` may take a free slot: it holds fewer blocks than its
    /// limit.
    pub fn under_limit(&self, owner: OwnerId) -> bool {
        self.owners.get(owner as usize).is_none_or(|l| l.used < l.limit)
    }

    /// Blocks `owner` holds over its limit (after the limit shrank).
    pub fn over_limit_by(&self, owner: OwnerId) -> u64 {
        self.owners.get(owner as usize).map_or(0, |l| l.used.saturating_sub(l.limit))
    }

    /// `owner`'s least recently used block not being demoted already.
    pub fn oldest_of(&self, owner: OwnerId) -> Option<Victim> {
        let mut s = self.owners.get(owner as usize)?.tail;
        while s != NIL {
            let m = &self.meta[s as usize];
            if !m.demoting {
                return Some(self.victim_at(s));
            }
            s = m.prev;
        }
        None
    }

    /// The block to move out to make room for a block of `owner`: at its
    /// limit, its own least recently used block; under its reservation,
    /// the least recently used block of the other owners holding more than
    /// theirs (its own only when there is none), so an owner can always
    /// fill its reservation; between the two, the least recently used
    /// block of those owners and its own. Blocks being demoted are
    /// skipped. `None` when no block may leave for it.
    pub fn victim_for(&self, owner: OwnerId) -> Option<Victim> {
        if !self.under_limit(owner) {
            return self.oldest_of(owner);
        }
        let (used, reserved) = self.owners.get(owner as usize).map_or((0, 0), |l| (l.used, l.reserved));
        let filling = used < reserved;
        let mut best: Option<Victim> = None;
        for (o, l) in self.owners.iter().enumerate() {
            let eligible = if o == owner as usize { !filling } else { l.used > l.reserved };
            if !eligible {
                continue;
            }
            if let Some(v) = self.oldest_of(o as OwnerId) {
                if best.as_ref().is_none_or(|b| self.meta[v.slot as usize].tick < self.meta[b.slot as usize].tick) {
                    best = Some(v);
                }
            }
        }
        best.or_else(|| if filling { self.oldest_of(owner) } else { None })
    }

    fn victim_at(&self, s: u32) -> Victim {
        let m = &self.meta[s as usize];
        Victim { slot: s, hash: m.hash, key: m.key.clone().expect("live slots have keys"), dirty: m.dirty, owner: m.owner }
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
            if let Some(j) = &self.journal {
                j.left(hash);
            }
        }
        self.unlink(slot);
        let owner = self.meta[slot as usize].owner;
        self.list_mut(owner).used -= 1;
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
    pub fn install(&mut self, slot: u32, key: &StoredKey, hash: BlockHash, owner: OwnerId, dirty: bool, pinned: impl Fn(u32) -> bool) {
        debug_assert_eq!(self.meta[slot as usize].state, SlotState::Free);
        if let Some(&old) = self.map.get(&hash) {
            self.evict(old, pinned(old));
        }
        let m = &mut self.meta[slot as usize];
        *m = Meta { hash, key: Some(key.clone()), prev: NIL, next: NIL, state: SlotState::Live, dirty, demoting: false, owner, tick: 0 };
        self.map.insert(hash, slot);
        if let Some(j) = &self.journal {
            j.arrived(hash);
        }
        self.list_mut(owner).used += 1;
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
        let mut out: Vec<Victim> = self
            .live_by_tick()
            .into_iter()
            .filter(|&s| self.meta[s as usize].dirty && !self.meta[s as usize].demoting)
            .map(|s| self.victim_at(s))
            .collect();
        out.reverse();
        out
    }

    /// Keys held, most recently used first (tests and the policy oracle).
    pub fn lru_keys(&self) -> Vec<String> {
        self.live_by_tick()
            .into_iter()
            .map(|s| self.meta[s as usize].key.as_ref().map_or(String::new(), |k| k.as_str().to_string()))
            .collect()
    }

    /// Live slots, most recently used first, across owners.
    fn live_by_tick(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.map.len());
        for l in &self.owners {
            let mut s = l.head;
            while s != NIL {
                out.push(s);
                s = self.meta[s as usize].next;
            }
        }
        out.sort_by_key(|&s| std::cmp::Reverse(self.meta[s as usize].tick));
        out
    }

    /// The list of `owner`, made on first use (no reservation, no limit but
    /// the tier's size).
    fn list_mut(&mut self, owner: OwnerId) -> &mut OwnerList {
        let capacity = self.capacity_blocks();
        while self.owners.len() <= owner as usize {
            self.owners.push(OwnerList { head: NIL, tail: NIL, used: 0, reserved: 0, limit: capacity });
        }
        &mut self.owners[owner as usize]
    }

    fn unlink(&mut self, slot: u32) {
        let (prev, next, owner) = {
            let m = &self.meta[slot as usize];
            (m.prev, m.next, m.owner)
        };
        if prev != NIL {
            self.meta[prev as usize].next = next;
        } else if self.list_mut(owner).head == slot {
            self.list_mut(owner).head = next;
        }
        if next != NIL {
            self.meta[next as usize].prev = prev;
        } else if self.list_mut(owner).tail == slot {
            self.list_mut(owner).tail = prev;
        }
        self.meta[slot as usize].prev = NIL;
        self.meta[slot as usize].next = NIL;
    }

    fn push_front(&mut self, slot: u32) {
        self.tick += 1;
        let (tick, owner) = (self.tick, self.meta[slot as usize].owner);
        let head = self.list_mut(owner).head;
        let m = &mut self.meta[slot as usize];
        m.tick = tick;
        m.prev = NIL;
        m.next = head;
        if head != NIL {
            self.meta[head as usize].prev = slot;
        }
        let l = self.list_mut(owner);
        l.head = slot;
        if l.tail == NIL {
            l.tail = slot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::testing::sk;

    #[test]
    fn slots_join_as_memory_backs_them() {
        let mut l = SlotLru::new(4, 2);
        let (a, b) = (l.take_free(|_| false).unwrap(), l.take_free(|_| false).unwrap());
        assert_eq!((a, b), (0, 1));
        assert_eq!(l.take_free(|_| false), None, "slots 2 and 3 have no memory yet");
        l.install(a, &sk("a"), BlockHash(1), 0, false, |_| false);
        l.install(b, &sk("b"), BlockHash(2), 0, true, |_| false);
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
            l.install(s, &sk(key), BlockHash(h), 0, false, |_| false);
        }
        let v = l.victim_for(0).unwrap();
        assert_eq!(v.key.as_str(), "a");
        l.begin_demotion(v.slot);
        assert_eq!(l.victim_for(0).unwrap().key.as_str(), "b", "not chosen twice");
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

    fn fill(l: &mut SlotLru, key: &StoredKey, h: u128, owner: OwnerId) {
        let s = l.take_free(|_| false).expect("a free slot");
        l.install(s, key, BlockHash(h), owner, false, |_| false);
    }

    #[test]
    fn one_owner_is_plain_lru() {
        let mut l = SlotLru::new(3, 3);
        for (k, h) in [("a", 1), ("b", 2), ("c", 3)] {
            fill(&mut l, &sk(k), h, 0);
        }
        l.touch(&sk("a"), &BlockHash(1));
        assert_eq!(l.lru_keys(), ["a", "c", "b"]);
        assert_eq!(l.victim_for(0).unwrap().key.as_str(), "b");
        assert_eq!(l.dirty_blocks().len(), 0);
    }

    #[test]
    fn a_reserved_owner_is_not_evicted_for_another() {
        let mut l = SlotLru::new(4, 4);
        // Owner 1 reserves 2 blocks; owner 2 has none.
        l.set_quotas(&[(0, 4), (2, 4), (0, 4)]);
        fill(&mut l, &sk("q1"), 1, 1);
        fill(&mut l, &sk("q2"), 2, 1);
        fill(&mut l, &sk("n1"), 3, 2);
        fill(&mut l, &sk("n2"), 4, 2);
        // Owner 1's blocks are the oldest, but within its reservation.
        let v = l.victim_for(2).unwrap();
        assert_eq!((v.key.as_str(), v.owner), ("n1", 2));
        // Owner 1 at its reservation competes with its own oldest.
        assert_eq!(l.victim_for(1).unwrap().key.as_str(), "q1");
        // Under its reservation, it takes from owners above theirs first,
        // though its own block is older.
        let q1 = l.slot_of(&BlockHash(1)).unwrap();
        l.evict(q1, false);
        fill(&mut l, &sk("n3"), 5, 2);
        assert_eq!((l.owner_blocks(1), l.owner_blocks(2)), (1, 3));
        assert_eq!(l.victim_for(1).unwrap().key.as_str(), "n1", "q2 is older, but owner 1 is filling its reservation");
    }

    #[test]
    fn at_its_limit_an_owner_evicts_only_its_own() {
        let mut l = SlotLru::new(4, 4);
        l.set_quotas(&[(0, 4), (0, 4), (0, 2)]);
        fill(&mut l, &sk("a"), 1, 1);
        fill(&mut l, &sk("n1"), 2, 2);
        fill(&mut l, &sk("n2"), 3, 2);
        assert!(!l.under_limit(2), "owner 2 is at its limit of 2");
        assert!(l.under_limit(1));
        assert_eq!(l.victim_for(2).unwrap().key.as_str(), "n1", "its own, though a free slot is left and a's block is older");
        assert_eq!(l.owner_blocks(2), 2);
        // Shrinking the limit leaves it over by one.
        l.set_quotas(&[(0, 4), (0, 4), (0, 1)]);
        assert_eq!(l.over_limit_by(2), 1);
        let v = l.oldest_of(2).unwrap();
        l.evict(v.slot, false);
        assert_eq!((l.over_limit_by(2), l.owner_blocks(2), l.used_blocks()), (0, 1, 2));
    }
}
