//! The per-shard hash index: block hash → where the newest record of that
//! key lives in the log.
//!
//! Memory: an [`Entry`] is 16 bytes and its [`BlockHash`] key 16, so a
//! hashbrown table slot is 32 bytes plus one control byte; at the table's
//! 7/8 maximum load and power-of-two growth, a block costs between 37 and 74
//! bytes (`Index::bytes_per_block` reports the live figure).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::key::BlockHash;

/// Where a block's newest record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Segment id.
    pub segment: u32,
    /// Slot index within the segment.
    pub slot: u32,
    /// Sequence number of the record; a read checks the header carries it.
    pub seq: u64,
}

/// Hashes a [`BlockHash`] by taking its low 64 bits: the key is already the
/// output of xxh3-128, so hashing it again would only cost time.
#[derive(Default)]
pub struct BlockHashHasher(u64);

impl Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached if something other than a u128 is hashed; fold it in.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0 ^ u64::from_le_bytes(word)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u128(&mut self, value: u128) {
        self.0 ^= value as u64;
    }
}

/// The index of one shard.
#[derive(Default)]
pub struct Index {
    map: HashMap<BlockHash, Entry, BuildHasherDefault<BlockHashHasher>>,
}

impl Index {
    /// An index with room for `capacity_blocks` entries without growing.
    pub fn with_capacity(capacity_blocks: usize) -> Self {
        Index {
            map: HashMap::with_capacity_and_hasher(capacity_blocks, Default::default()),
        }
    }

    /// The entry for `hash`, if stored.
    pub fn get(&self, hash: &BlockHash) -> Option<Entry> {
        self.map.get(hash).copied()
    }

    /// Whether `hash` is stored.
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.map.contains_key(hash)
    }

    /// Records `entry` unless the index already holds a newer record of the
    /// key. Returns the entry it replaced (or the newer one it kept, with
    /// `false`).
    pub fn insert_if_newer(&mut self, hash: BlockHash, entry: Entry) -> (Option<Entry>, bool) {
        match self.map.get_mut(&hash) {
            Some(old) if old.seq > entry.seq => (Some(*old), false),
            Some(old) => (Some(std::mem::replace(old, entry)), true),
            None => {
                self.map.insert(hash, entry);
                (None, true)
            }
        }
    }

    /// Removes `hash` if its entry is not newer than `seq`; returns the
    /// removed entry.
    pub fn remove_if_not_newer(&mut self, hash: &BlockHash, seq: u64) -> Option<Entry> {
        match self.map.get(hash) {
            Some(e) if e.seq <= seq => self.map.remove(hash),
            _ => None,
        }
    }

    /// Removes `hash` only if its entry is exactly `entry` (used when a read
    /// finds the record corrupt: a newer write must not be dropped).
    pub fn remove_exact(&mut self, hash: &BlockHash, entry: Entry) -> bool {
        if self.map.get(hash) == Some(&entry) {
            self.map.remove(hash);
            return true;
        }
        false
    }

    /// Drops every entry in `segment`; returns how many.
    pub fn remove_segment(&mut self, segment: u32) -> usize {
        let before = self.map.len();
        self.map.retain(|_, e| e.segment != segment);
        before - self.map.len()
    }

    /// Number of blocks indexed.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Heap bytes held by the table: buckets × (key + entry + 1 control
    /// byte), hashbrown's layout.
    pub fn heap_bytes(&self) -> usize {
        let capacity = self.map.capacity();
        let buckets = if capacity < 8 {
            (capacity + 1).next_power_of_two()
        } else {
            (capacity * 8 / 7).next_power_of_two()
        };
        buckets * (std::mem::size_of::<(BlockHash, Entry)>() + 1)
    }
}

const _: () = assert!(std::mem::size_of::<Entry>() == 16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_record_wins_whatever_the_order() {
        let mut ix = Index::default();
        let h = BlockHash::of(b"k");
        let e5 = Entry {
            segment: 0,
            slot: 1,
            seq: 5,
        };
        let e3 = Entry {
            segment: 0,
            slot: 0,
            seq: 3,
        };
        assert_eq!(ix.insert_if_newer(h, e5), (None, true));
        assert_eq!(ix.insert_if_newer(h, e3), (Some(e5), false));
        assert_eq!(ix.get(&h), Some(e5));
        assert_eq!(ix.remove_if_not_newer(&h, 4), None);
        assert!(!ix.remove_exact(&h, e3));
        assert_eq!(ix.remove_if_not_newer(&h, 6), Some(e5));
        assert!(ix.is_empty());
    }

    #[test]
    fn remove_segment_drops_only_that_segment() {
        let mut ix = Index::default();
        for i in 0..100u32 {
            ix.insert_if_newer(
                BlockHash::of(&i.to_le_bytes()),
                Entry {
                    segment: i % 3,
                    slot: i,
                    seq: i as u64,
                },
            );
        }
        assert_eq!(ix.remove_segment(1), 33);
        assert_eq!(ix.len(), 67);
    }
}
