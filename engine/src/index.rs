//! The per-shard hash index: block hash → where the newest record of that
//! key lives in the log.
//!
//! Memory: a table bucket is the 16-byte block hash, a 12-byte packed
//! location ([`Entry`] is 24 bytes unpacked: the segment and slot become
//! one 4-byte slot number `segment × slots_per_segment + slot`, the
//! sequence number keeps its low 48 bits, the owner takes 2 bytes) and
//! hashbrown's 1 control byte: 29 bytes, stored unaligned. hashbrown keeps
//! at most 7/8 of its power-of-two bucket count full and grows by doubling,
//! so in a full store (the shard pre-sizes the table for all its slots) or
//! a growing table a block costs between 29 × 8/7 = 33 and 29 × 16/7 = 66
//! bytes, whatever the capacity (`Index::heap_bytes`;
//! `index_memory_per_block` checks it). The index also counts each
//! owner's blocks (tenants, [`crate::tenant`]).
//! 48 bits of sequence number last 89 years at 100,000 writes a second.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use crate::events::Journal;
use crate::key::BlockHash;
pub use crate::key::BlockHashHasher;
use crate::tenant::OwnerId;

/// Where a block's newest record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Segment id.
    pub segment: u32,
    /// Slot index within the segment.
    pub slot: u32,
    /// Sequence number of the record; a read checks the header carries it.
    pub seq: u64,
    /// Whose block it is ([`crate::tenant::Owners::owner_of`] of its key).
    pub owner: OwnerId,
}

/// Highest sequence number an index entry holds (48 bits).
pub const SEQ_MAX: u64 = (1 << 48) - 1;

/// A block hash as the table stores it: 16 bytes, alignment 1, so a bucket
/// has no padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key([u8; 16]);

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The low 64 bits of xxh3-128: already uniformly mixed.
        state.write_u64(u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes")));
    }
}

impl From<BlockHash> for Key {
    fn from(h: BlockHash) -> Self {
        Key(h.0.to_le_bytes())
    }
}

impl From<Key> for BlockHash {
    fn from(k: Key) -> Self {
        BlockHash(u128::from_le_bytes(k.0))
    }
}

/// An [`Entry`] packed into 12 bytes: slot number (u32 LE), the low 48
/// bits of the sequence number (LE), the owner (u16 LE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed([u8; 12]);

/// The index of one shard.
pub struct Index {
    map: HashMap<Key, Packed, BuildHasherDefault<BlockHashHasher>>,
    slots_per_segment: u32,
    /// Blocks indexed, by owner id.
    owner_blocks: Vec<u64>,
    /// Blocks indexed by lane: a shard spanning several devices keeps
    /// segment `i` on lane `i mod lanes` ([`crate::devices`]); one lane
    /// otherwise.
    lane_blocks: Vec<u64>,
    /// Where arrivals and departures are reported (KV events).
    journal: Option<Journal>,
}

impl Index {
    /// An index of a shard whose segments hold `slots_per_segment` slots,
    /// with room for `capacity_blocks` entries without growing.
    pub fn new(capacity_blocks: usize, slots_per_segment: u32) -> Self {
        assert!(slots_per_segment > 0, "a segment holds at least one slot");
        Index {
            map: HashMap::with_capacity_and_hasher(capacity_blocks, Default::default()),
            slots_per_segment,
            owner_blocks: Vec::new(),
            lane_blocks: vec![0],
            journal: None,
        }
    }

    /// Counts blocks over `lanes` lanes from now on (set before any insert).
    pub fn set_lanes(&mut self, lanes: usize) {
        debug_assert!(self.map.is_empty(), "lanes are set on an empty index");
        self.lane_blocks = vec![0; lanes.max(1)];
    }

    /// Blocks indexed per lane ([`Index::set_lanes`]).
    pub fn lane_blocks(&self) -> &[u64] {
        &self.lane_blocks
    }

    /// Reports every block the log starts or stops holding to `journal`.
    pub fn set_journal(&mut self, journal: Journal) {
        self.journal = Some(journal);
    }

    fn arrived(&self, hash: BlockHash) {
        if let Some(j) = &self.journal {
            j.arrived(hash);
        }
    }

    fn left(&self, hash: BlockHash) {
        if let Some(j) = &self.journal {
            j.left(hash);
        }
    }

    /// Whether a shard with `segments` segments of `slots_per_segment`
    /// slots can be indexed: every slot number fits 32 bits.
    pub fn fits(segments: u64, slots_per_segment: u32) -> bool {
        segments.saturating_mul(slots_per_segment as u64) <= u32::MAX as u64
    }

    fn pack(&self, e: Entry) -> Packed {
        let slot = e.segment as u64 * self.slots_per_segment as u64 + e.slot as u64;
        assert!(
            slot <= u32::MAX as u64 && e.slot < self.slots_per_segment,
            "slot {} of segment {} beyond the index's reach",
            e.slot,
            e.segment
        );
        assert!(e.seq <= SEQ_MAX, "sequence number {} beyond 48 bits", e.seq);
        let mut p = [0u8; 12];
        p[..4].copy_from_slice(&(slot as u32).to_le_bytes());
        p[4..10].copy_from_slice(&e.seq.to_le_bytes()[..6]);
        p[10..].copy_from_slice(&e.owner.to_le_bytes());
        Packed(p)
    }

    fn unpack(&self, p: Packed) -> Entry {
        let slot = u32::from_le_bytes(p.0[..4].try_into().expect("4 bytes"));
        let mut seq = [0u8; 8];
        seq[..6].copy_from_slice(&p.0[4..10]);
        Entry {
            segment: slot / self.slots_per_segment,
            slot: slot % self.slots_per_segment,
            seq: u64::from_le_bytes(seq),
            owner: u16::from_le_bytes([p.0[10], p.0[11]]),
        }
    }

    /// The entry for `hash`, if stored.
    pub fn get(&self, hash: &BlockHash) -> Option<Entry> {
        self.map.get(&Key::from(*hash)).map(|p| self.unpack(*p))
    }

    /// Whether `hash` is stored.
    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.map.contains_key(&Key::from(*hash))
    }

    /// Records `entry` unless the index already holds a newer record of the
    /// key. Returns the entry it replaced (or the newer one it kept, with
    /// `false`).
    pub fn insert_if_newer(&mut self, hash: BlockHash, entry: Entry) -> (Option<Entry>, bool) {
        let packed = self.pack(entry);
        let old = self.get(&hash);
        match old {
            Some(old) if old.seq > entry.seq => (Some(old), false),
            _ => {
                self.map.insert(Key::from(hash), packed);
                if let Some(o) = old {
                    self.count(o, -1);
                }
                self.count(entry, 1);
                self.arrived(hash);
                (old, true)
            }
        }
    }

    /// Removes `hash` if its entry is not newer than `seq`; returns the
    /// removed entry.
    pub fn remove_if_not_newer(&mut self, hash: &BlockHash, seq: u64) -> Option<Entry> {
        match self.get(hash) {
            Some(e) if e.seq <= seq => {
                self.map.remove(&Key::from(*hash));
                self.count(e, -1);
                self.left(*hash);
                Some(e)
            }
            _ => None,
        }
    }

    /// Removes `hash` only if its entry is exactly `entry` (used when a read
    /// finds the record corrupt: a newer write must not be dropped).
    pub fn remove_exact(&mut self, hash: &BlockHash, entry: Entry) -> bool {
        if self.get(hash) == Some(entry) {
            self.map.remove(&Key::from(*hash));
            self.count(entry, -1);
            self.left(*hash);
            return true;
        }
        false
    }

    /// Drops every entry in `segment`; returns how many.
    pub fn remove_segment(&mut self, segment: u32) -> usize {
        let before = self.map.len();
        let sps = self.slots_per_segment;
        let lane = segment as usize % self.lane_blocks.len();
        let counts = &mut self.owner_blocks;
        let journal = &self.journal;
        self.map.retain(|k, p| {
            let keep = u32::from_le_bytes(p.0[..4].try_into().expect("4 bytes")) / sps != segment;
            if !keep {
                counts[u16::from_le_bytes([p.0[10], p.0[11]]) as usize] -= 1;
                if let Some(j) = journal {
                    j.left(BlockHash::from(*k));
                }
            }
            keep
        });
        let removed = before - self.map.len();
        self.lane_blocks[lane] -= removed as u64;
        removed
    }

    /// Blocks indexed of `owner`.
    pub fn owner_blocks(&self, owner: OwnerId) -> u64 {
        self.owner_blocks.get(owner as usize).copied().unwrap_or(0)
    }

    /// `owner`'s `n` oldest blocks (lowest sequence numbers), oldest first:
    /// one pass over the index.
    pub fn oldest_of(&self, owner: OwnerId, n: usize) -> Vec<(BlockHash, Entry)> {
        let mut mine: Vec<(BlockHash, Entry)> = self.iter().filter(|(_, e)| e.owner == owner).collect();
        if n < mine.len() {
            mine.select_nth_unstable_by_key(n, |(_, e)| e.seq);
            mine.truncate(n);
        }
        mine.sort_unstable_by_key(|(_, e)| e.seq);
        mine
    }

    fn count(&mut self, entry: Entry, delta: i64) {
        let i = entry.owner as usize;
        if self.owner_blocks.len() <= i {
            self.owner_blocks.resize(i + 1, 0);
        }
        self.owner_blocks[i] = self.owner_blocks[i].checked_add_signed(delta).expect("owner block count stays positive");
        let lane = entry.segment as usize % self.lane_blocks.len();
        self.lane_blocks[lane] = self.lane_blocks[lane].checked_add_signed(delta).expect("lane block count stays positive");
    }

    /// Number of blocks indexed.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Heap bytes held by the table: buckets × (key + packed entry + 1
    /// control byte), hashbrown's layout.
    pub fn heap_bytes(&self) -> usize {
        let capacity = self.map.capacity();
        let buckets = if capacity < 8 { (capacity + 1).next_power_of_two() } else { (capacity * 8 / 7).next_power_of_two() };
        buckets * (std::mem::size_of::<(Key, Packed)>() + 1)
    }

    /// Every entry, for a snapshot or a reclaim.
    pub fn iter(&self) -> impl Iterator<Item = (BlockHash, Entry)> + '_ {
        self.map.iter().map(|(k, p)| (BlockHash::from(*k), self.unpack(*p)))
    }
}

const _: () = assert!(std::mem::size_of::<(Key, Packed)>() == 28);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_record_wins_whatever_the_order() {
        let mut ix = Index::new(0, 64);
        let h = BlockHash::of(b"k");
        let e5 = Entry { segment: 0, slot: 1, seq: 5, owner: 0 };
        let e3 = Entry { segment: 0, slot: 0, seq: 3, owner: 0 };
        assert_eq!(ix.insert_if_newer(h, e5), (None, true));
        assert_eq!(ix.insert_if_newer(h, e3), (Some(e5), false));
        assert_eq!(ix.get(&h), Some(e5));
        assert_eq!(ix.remove_if_not_newer(&h, 4), None);
        assert!(!ix.remove_exact(&h, e3));
        assert_eq!(ix.remove_if_not_newer(&h, 6), Some(e5));
        assert!(ix.is_empty());
    }

    #[test]
    fn owners_are_counted_through_every_change() {
        let mut ix = Index::new(0, 64);
        let e = |slot: u32, seq: u64, owner: OwnerId| Entry { segment: slot / 8, slot: slot % 8, seq, owner };
        for i in 0..10u32 {
            ix.insert_if_newer(BlockHash(i as u128), e(i, i as u64 + 1, (i % 2) as OwnerId + 1));
        }
        assert_eq!((ix.owner_blocks(1), ix.owner_blocks(2), ix.owner_blocks(0)), (5, 5, 0));
        // Oldest of owner 2: blocks 1, 3 (seqs 2, 4).
        let oldest: Vec<u128> = ix.oldest_of(2, 2).into_iter().map(|(h, _)| h.0).collect();
        assert_eq!(oldest, [1, 3]);
        // Segment 0 holds blocks 0..8 (four of each owner).
        ix.remove_segment(0);
        assert_eq!((ix.owner_blocks(1), ix.owner_blocks(2)), (1, 1));
        assert!(ix.remove_exact(&BlockHash(9), e(9, 10, 2)));
        assert_eq!(ix.owner_blocks(2), 0);
        assert_eq!(ix.remove_if_not_newer(&BlockHash(8), 100).map(|e| e.owner), Some(1));
        assert_eq!(ix.owner_blocks(1), 0);
    }

    /// Index memory per block (the table's heap bytes over the blocks in
    /// it) of a full store is at most 67 bytes whatever the capacity: the
    /// shard pre-sizes its table for every slot it has (so filling it never
    /// reallocates), and hashbrown rounds buckets up to a power of two, so
    /// the figure swings with the capacity (33–66 bytes). A table that
    /// grows (a capacity above the 1 Mi pre-size) stays within the same
    /// bounds at every fill, measured after every insert (the worst case is
    /// just after a doubling). Prints the figures (`cargo test -p
    /// kvtier-engine index_memory -- --nocapture`).
    #[test]
    fn index_memory_per_block() {
        let entry = |i: usize| Entry { segment: (i / 1000) as u32, slot: (i % 1000) as u32, seq: i as u64 + (1 << 40), owner: 0 };
        let hash = |i: usize| BlockHash::of(&(i as u64).to_le_bytes());
        // The restart target in docs/BENCHMARKS.md (60,000 blocks) and
        // capacities either side of hashbrown's bucket steps (4,096 and 65,536 buckets hold 3,584
        // and 57,344 entries).
        for capacity in [1_000, 3_584, 3_585, 57_344, 57_345, 60_000, 100_000] {
            let mut ix = Index::new(capacity, 1000);
            let heap_at_open = ix.heap_bytes();
            for fill in [capacity / 2, capacity * 3 / 4, capacity] {
                for i in ix.len()..fill {
                    ix.insert_if_newer(hash(i), entry(i));
                }
                let per_block = ix.heap_bytes() as f64 / ix.len() as f64;
                println!("capacity {capacity}: {} blocks, {} heap bytes, {per_block:.1} bytes/block", ix.len(), ix.heap_bytes());
                // Pre-sized at open: filling it never reallocates.
                assert_eq!(ix.heap_bytes(), heap_at_open);
            }
            let full = ix.heap_bytes() as f64 / ix.len() as f64;
            assert!(full <= 67.0, "{full} bytes per block in a full store of {capacity} blocks");
        }
        let mut grown = Index::new(0, 1000);
        let mut worst: f64 = 0.0;
        for i in 0..200_000 {
            grown.insert_if_newer(hash(i), entry(i));
            if i >= 64 {
                worst = worst.max(grown.heap_bytes() as f64 / grown.len() as f64);
            }
        }
        println!("growing to {} blocks: at most {worst:.1} bytes/block", grown.len());
        assert!(worst <= 67.0, "{worst} bytes per block");
        // Every entry reads back as stored, through the packing.
        for i in (0..200_000).step_by(997) {
            assert_eq!(grown.get(&hash(i)), Some(entry(i)));
        }
        assert_eq!(grown.iter().count(), 200_000);
    }

    #[test]
    fn reach_of_a_packed_entry() {
        assert!(Index::fits(4_000_000, 1000));
        assert!(!Index::fits(5_000_000, 1000));
        let mut ix = Index::new(4, 1000);
        let far = Entry { segment: 4_294_966, slot: 295, seq: SEQ_MAX, owner: 0 };
        ix.insert_if_newer(BlockHash(7), far);
        assert_eq!(ix.get(&BlockHash(7)), Some(far));
        assert_eq!(ix.iter().next(), Some((BlockHash(7), far)));
    }

    #[test]
    fn remove_segment_drops_only_that_segment() {
        let mut ix = Index::new(0, 128);
        for i in 0..100u32 {
            ix.insert_if_newer(BlockHash::of(&i.to_le_bytes()), Entry { segment: i % 3, slot: i, seq: i as u64, owner: 0 });
        }
        assert_eq!(ix.remove_segment(1), 33);
        assert_eq!(ix.len(), 67);
    }
}

/// The index snapshot: a shard's index and segment states at one moment,
/// serialized with rkyv to `shard-NNN/index.snapshot`, so a restart reads one
/// file instead of every slot header.
///
/// File layout: `"KVIX"` (u32 LE), version (u32 LE), CRC-32 of the body
/// (u32 LE), body length (u32 LE), then the rkyv body. A file that fails any
/// check is ignored (and counted), and the shard falls back to a full scan.
pub mod snapshot {
    use rkyv::{Archive, Deserialize, Serialize};

    /// File name inside the shard directory.
    pub const FILE: &str = "index.snapshot";
    const MAGIC: u32 = u32::from_le_bytes(*b"KVIX");
    /// 3: entries name their owner, the snapshot the owners' names; 4: the
    /// blocks' tags. A snapshot of another version is not used (the shard
    /// reads every slot header instead, once).
    const VERSION: u32 = 4;
    const PREAMBLE_BYTES: usize = 16;

    /// One segment as the snapshot saw it.
    #[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
    pub struct SegmentState {
        /// Segment id.
        pub id: u32,
        /// Its `first_seq` then; a different one on disk means it was
        /// reclaimed since, and its entries here are stale.
        pub first_seq: u64,
        /// Slots handed out in its current life.
        pub slots_used: u32,
        /// Highest sequence number recorded in it (0 if none).
        pub max_seq: u64,
        /// Writes may have landed in it after the snapshot (it was the head,
        /// or had writes in flight): recovery reads its headers again.
        pub rescan: bool,
        /// With `rescan`: the first slot that can hold a record the snapshot
        /// does not cover; recovery reads headers from here on.
        pub scan_from_slot: u32,
    }

    /// One index entry.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Archive, Serialize, Deserialize)]
    pub struct EntryState {
        /// Block hash, low 64 bits.
        pub hash_lo: u64,
        /// Block hash, high 64 bits.
        pub hash_hi: u64,
        /// Segment id.
        pub segment: u32,
        /// Slot index.
        pub slot: u32,
        /// Sequence number.
        pub seq: u64,
        /// Owner, an index into [`IndexSnapshot::owners`].
        pub owner: u16,
    }

    /// The tag of one indexed block ([`crate::events::BlockTag`], encoded).
    #[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
    pub struct TagState {
        /// Block hash, low 64 bits.
        pub hash_lo: u64,
        /// Block hash, high 64 bits.
        pub hash_hi: u64,
        /// The encoded tag.
        pub tag: Vec<u8>,
    }

    /// A whole shard snapshot.
    #[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
    pub struct IndexSnapshot {
        /// Shard id.
        pub shard: u32,
        /// Every record with a lower sequence number is reflected here;
        /// records from here on must come from a header scan.
        pub covered_seq: u64,
        /// The shard's next sequence number then.
        pub next_seq: u64,
        /// Segments that existed.
        pub segments: Vec<SegmentState>,
        /// The index.
        pub entries: Vec<EntryState>,
        /// Owner names by the ids entries use (`""`: the default owner).
        pub owners: Vec<String>,
        /// The tags of the indexed blocks that have one.
        pub tags: Vec<TagState>,
    }

    /// Encodes a snapshot into the file layout above.
    pub fn encode(s: &IndexSnapshot) -> Vec<u8> {
        frame(&rkyv::to_bytes::<rkyv::rancor::Error>(s).expect("snapshot serializes"))
    }

    /// The file of an rkyv `body`: the preamble above, then the body. The
    /// fuzz target `index_snapshot` frames arbitrary bodies with it, so
    /// rkyv's validation is what [`decode`] then checks.
    pub fn frame(body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(PREAMBLE_BYTES + body.len());
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(body).to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(body);
        out
    }

    /// Decodes a snapshot file; `Err` says why it cannot be used.
    pub fn decode(bytes: &[u8]) -> Result<IndexSnapshot, String> {
        if bytes.len() < PREAMBLE_BYTES {
            return Err(format!("{} bytes is shorter than the preamble", bytes.len()));
        }
        let word = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        if word(0) != MAGIC || word(4) != VERSION {
            return Err("wrong magic or version".into());
        }
        let body = &bytes[PREAMBLE_BYTES..];
        if body.len() != word(12) as usize {
            return Err(format!("body is {} bytes, the preamble says {}", body.len(), word(12)));
        }
        if crc32fast::hash(body) != word(8) {
            return Err("CRC-32 mismatch".into());
        }
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(body.len());
        aligned.extend_from_slice(body);
        rkyv::from_bytes::<IndexSnapshot, rkyv::rancor::Error>(&aligned).map_err(|e| format!("rkyv: {e}"))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn round_trip_and_damage_detected() {
            let s = IndexSnapshot {
                shard: 1,
                covered_seq: 10,
                next_seq: 12,
                segments: vec![SegmentState { id: 0, first_seq: 1, slots_used: 3, max_seq: 11, rescan: true, scan_from_slot: 2 }],
                entries: vec![EntryState { hash_lo: 1, hash_hi: 2, segment: 0, slot: 2, seq: 11, owner: 1 }],
                owners: vec![String::new(), "acme".into()],
                tags: vec![TagState { hash_lo: 1, hash_hi: 2, tag: vec![1, 2, 3] }],
            };
            let bytes = encode(&s);
            assert_eq!(decode(&bytes), Ok(s));
            for i in [0, 9, 20, bytes.len() - 1] {
                let mut bad = bytes.clone();
                bad[i] ^= 0x40;
                assert!(decode(&bad).is_err(), "flip at {i} accepted");
            }
            assert!(decode(&bytes[..bytes.len() - 3]).is_err());
        }
    }
}
