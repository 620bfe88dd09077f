//! Blocks on their way into a memory tier.
//!
//! Placing a block on the GPU takes a copy that completes later (an event
//! the shard polls, [`crate::gpu`]), and making room first may move a victim
//! down, which takes copies and log writes of its own. For that time the
//! block is in no tier: the copies it replaces have left (a PUT's older
//! copy, or the RAM copy of a block moving up to the GPU) and in write-back
//! the log may hold nothing of it, or an older block. Without more, a GET
//! then misses a block that was acknowledged, or serves the older bytes; a
//! DELETE answers 404 and the move brings the block back afterwards; and a
//! move that completes after a newer PUT overwrites that PUT's bytes.
//!
//! A [`Ticket`] covers a block for that time: [`Transits`] keeps the
//! block's bytes, which GETs serve (`x-kvtier-tier: ram`, counted as
//! `transit_hits`) and lookups count. A newer PUT of the key takes the
//! place of the ticket; a DELETE waits until the transit it found has
//! ended, then deletes the block wherever it landed. A move lands only
//! while its ticket is current, checked in the same step as the install (no
//! await between), and removes older copies of the key only then; a
//! superseded move gives its slot back and changes nothing.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use bytes::Bytes;

use crate::key::{BlockHash, StoredKey};
use crate::tier::Tier;

/// What became of a block offered to a memory tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placed {
    /// Installed in this tier.
    In(Tier),
    /// A newer PUT of the key came first: nothing was changed.
    Superseded,
    /// No tier had a slot for it (or the copy failed).
    NoRoom,
}

/// A block in transit: its key (a hash collision must not be served) and
/// its payload, `block_bytes` in all.
struct InTransit {
    id: u64,
    key: StoredKey,
    parts: Vec<Bytes>,
}

/// The shard's blocks in transit, by block hash: at most one per hash, the
/// newest.
pub(super) struct Transits {
    blocks: RefCell<HashMap<BlockHash, InTransit>>,
    next_id: Cell<u64>,
    /// Fired when a transit ends: what a DELETE of the block waits for.
    pub(super) ended: crate::signal::Signal,
}

/// The right to land one block in a memory tier; dropping it ends the
/// transit (if it is still the block's newest).
pub(super) struct Ticket<'a> {
    transits: &'a Transits,
    hash: BlockHash,
    id: u64,
}

impl Default for Transits {
    fn default() -> Self {
        Transits {
            blocks: RefCell::default(),
            next_id: Cell::default(),
            ended: crate::signal::Signal::new("a block's transit into a memory tier ended"),
        }
    }
}

impl Transits {
    /// Starts the transit of `hash` with payload `parts`, superseding any
    /// earlier transit of it.
    pub(super) fn begin(&self, key: &StoredKey, hash: BlockHash, parts: Vec<Bytes>) -> Ticket<'_> {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        self.blocks.borrow_mut().insert(hash, InTransit { id, key: key.clone(), parts });
        Ticket { transits: self, hash, id }
    }

    /// The payload of `key` if it is in transit (cheap: reference-counted
    /// buffers).
    pub(super) fn get(&self, key: &StoredKey, hash: &BlockHash) -> Option<Vec<Bytes>> {
        self.blocks.borrow().get(hash).filter(|t| t.key == *key).map(|t| t.parts.clone())
    }

    /// Whether a block under `hash` is in transit.
    pub(super) fn contains(&self, hash: &BlockHash) -> bool {
        self.blocks.borrow().contains_key(hash)
    }

    /// The id of the transit of `hash` under way, if any (ids grow: a newer
    /// transit of the same block has a higher one).
    pub(super) fn id_of(&self, hash: &BlockHash) -> Option<u64> {
        self.blocks.borrow().get(hash).map(|t| t.id)
    }
}

impl Ticket<'_> {
    /// Whether this is still the newest transit of its block: no PUT of the
    /// key came since it began.
    pub(super) fn is_current(&self) -> bool {
        self.transits.blocks.borrow().get(&self.hash).is_some_and(|t| t.id == self.id)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.is_current() {
            self.transits.blocks.borrow_mut().remove(&self.hash);
            self.transits.ended.notify();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::testing::sk;

    #[test]
    fn the_newest_transit_wins_and_only_its_own_ticket_ends_it() {
        let t = Transits::default();
        let h = BlockHash(7);
        let first = t.begin(&sk("k"), h, vec![Bytes::from_static(b"old")]);
        assert!(first.is_current());
        assert_eq!(t.get(&sk("k"), &h), Some(vec![Bytes::from_static(b"old")]));
        assert_eq!(t.get(&sk("other-key-same-hash"), &h), None, "a collision is not served");
        let second = t.begin(&sk("k"), h, vec![Bytes::from_static(b"new")]);
        assert!(!first.is_current() && second.is_current());
        assert!(t.id_of(&h).is_some_and(|id| id > first.id));
        drop(first);
        assert_eq!(t.get(&sk("k"), &h), Some(vec![Bytes::from_static(b"new")]), "an old ticket's drop leaves the newer transit");
        drop(second);
        assert!(!t.contains(&h) && t.id_of(&h).is_none());
    }
}
