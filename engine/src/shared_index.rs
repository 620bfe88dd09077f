//! A shard's index table: which of its blocks each local tier holds,
//! in a sealed memory file that same-host clients map read-only, so
//! `batch_is_exist` and `lookup` are answered in the client without a round
//! trip (docs/LOCAL.md, "The shared index"). Advisory: the GET or lease
//! that follows checks again.
//!
//! **Layout**: `kvtier_local_proto::shared_index` (header, 32-byte buckets,
//! open addressing with linear probing), written once for this writer and
//! the clients' reader.
//!
//! **Writers and readers.** Only the shard's thread writes, from its tiers'
//! journals (every arrival and departure of a block in the GPU, RAM and
//! NVMe tiers, [`crate::events::Journal`]), as a seqlock per bucket: `seq`
//! made odd, the fields written, `seq` made even again (release). A reader
//! reads `seq`, the fields, then `seq` again (after an acquire fence) and
//! believes the fields only when both reads are the same even number.
//! Deleting shifts later buckets of the probe run back (no tombstones), so
//! a reader racing a delete can miss an entry that is present (a false
//! "absent"); a "present" it believes was true when it read it.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::error::{Error, Result};
use crate::key::BlockHash;

use kvtier_local_proto::shared_index::{
    BUCKET_BYTES, FLAGS_OFFSET, FLAG_OVERFLOWED, HEADER_BYTES, MAGIC, TIER_GPU, TIER_NVME, TIER_RAM, VERSION,
};

/// A tier's bit in a bucket's `tiers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexTier {
    /// The GPU tier.
    Gpu = TIER_GPU as isize,
    /// The RAM tier.
    Ram = TIER_RAM as isize,
    /// The NVMe log.
    Nvme = TIER_NVME as isize,
}

/// One shard's index table (module docs). Written by its shard's thread
/// only.
pub struct IndexTable {
    base: NonNull<u8>,
    bytes: usize,
    buckets: u32,
    shard: u32,
    file: OwnedFd,
    /// Blocks listed.
    entries: std::cell::Cell<u64>,
}

// SAFETY: the memory is a shared mapping written only by the owning
// shard's thread (the `Cell` and the writes below are used from it alone);
// other threads only reopen the file (`read_only_fd`) or read the layout.
unsafe impl Send for IndexTable {}
// SAFETY: as above.
unsafe impl Sync for IndexTable {}

impl IndexTable {
    /// A table of at least `2 × capacity_blocks` buckets (a power of two)
    /// for shard `shard` of `shards`, in a new sealed memory file,
    /// registered for [`index_table`] under `dir` (the shard's
    /// directory).
    ///
    /// # Errors
    /// [`Error::Config`] when the memory file cannot be made or mapped.
    pub fn new(capacity_blocks: u64, shard: u32, shards: u32, dir: &std::path::Path) -> Result<Arc<IndexTable>> {
        let buckets = (capacity_blocks.max(1) * 2).next_power_of_two().min(1 << 31) as u32;
        let bytes = kvtier_local_proto::shared_index::table_bytes(buckets);
        let config = |e: std::io::Error| Error::Config(format!("index table of {bytes} bytes: {e}"));
        let (file, ptr) = crate::sealed::create(c"kvtier-shared-index", bytes, false).map_err(config)?;
        crate::sealed::seal(&file, ptr, bytes).map_err(config)?;
        let table = Arc::new(IndexTable {
            base: NonNull::new(ptr.cast()).expect("mmap returned a non-null address"),
            bytes,
            buckets,
            shard,
            file,
            entries: std::cell::Cell::new(0),
        });
        for (at, v) in [(0, MAGIC), (4, VERSION), (8, buckets), (12, shard), (16, shards)] {
            table.header(at).store(v, Ordering::Relaxed);
        }
        let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
        tables.retain(|(_, t)| t.strong_count() > 0);
        tables.push((dir.to_path_buf(), Arc::downgrade(&table)));
        Ok(table)
    }

    fn header(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is one of the 4-byte-aligned header fields, inside the
        // mapping; only atomics touch them.
        unsafe { &*(self.base.as_ptr().add(at) as *const AtomicU32) }
    }

    fn bucket(&self, i: u32) -> (&AtomicU32, &AtomicU8, &AtomicU64, &AtomicU64) {
        debug_assert!(i < self.buckets);
        let at = HEADER_BYTES + i as usize * BUCKET_BYTES;
        // SAFETY: bucket `i` lies inside the mapping (i < buckets), its
        // fields aligned (32-byte buckets after a 4 KiB header); only
        // atomics touch them.
        unsafe {
            let p = self.base.as_ptr().add(at);
            (
                &*(p as *const AtomicU32),
                &*(p.add(4) as *const AtomicU8),
                &*(p.add(8) as *const AtomicU64),
                &*(p.add(16) as *const AtomicU64),
            )
        }
    }

    fn read(&self, i: u32) -> (u8, u64, u64) {
        let (_, tiers, lo, hi) = self.bucket(i);
        (tiers.load(Ordering::Relaxed), lo.load(Ordering::Relaxed), hi.load(Ordering::Relaxed))
    }

    /// Writes bucket `i` under its seqlock.
    fn write(&self, i: u32, tiers: u8, lo: u64, hi: u64) {
        let (seq, t, l, h) = self.bucket(i);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        t.store(tiers, Ordering::Relaxed);
        l.store(lo, Ordering::Relaxed);
        h.store(hi, Ordering::Relaxed);
        seq.store(s.wrapping_add(2), Ordering::Release);
    }

    fn split(hash: &BlockHash) -> (u64, u64) {
        (hash.0 as u64, (hash.0 >> 64) as u64)
    }

    /// The bucket listing `hash`, or the empty bucket ending its probe run
    /// (`Err`), or `None` when the table is full.
    fn find(&self, lo: u64, hi: u64) -> Option<std::result::Result<u32, u32>> {
        let mask = self.buckets - 1;
        let mut i = lo as u32 & mask;
        for _ in 0..self.buckets {
            let (tiers, l, h) = self.read(i);
            if tiers == 0 && l == 0 && h == 0 {
                return Some(Err(i));
            }
            if l == lo && h == hi {
                return Some(Ok(i));
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Records that `tier` now holds (`held`) or no longer holds `hash`'s
    /// block. Called from the tiers' journals on the shard's thread.
    pub fn set(&self, hash: &BlockHash, tier: IndexTier, held: bool) {
        let (lo, hi) = Self::split(hash);
        match self.find(lo, hi) {
            Some(Ok(i)) => {
                let (tiers, ..) = self.read(i);
                let now = if held { tiers | tier as u8 } else { tiers & !(tier as u8) };
                match now {
                    _ if now == tiers => {}
                    0 => self.remove_at(i),
                    _ => self.write(i, now, lo, hi),
                }
            }
            Some(Err(empty)) if held => {
                self.write(empty, tier as u8, lo, hi);
                self.entries.set(self.entries.get() + 1);
            }
            Some(Err(_)) => {}
            None if held => {
                let flags = self.header(FLAGS_OFFSET);
                if flags.load(Ordering::Relaxed) & FLAG_OVERFLOWED == 0 {
                    tracing::warn!(shard = self.shard, buckets = self.buckets, "index table full; clients ask the server from now on");
                }
                flags.fetch_or(FLAG_OVERFLOWED, Ordering::Release);
            }
            None => {}
        }
    }

    /// Empties bucket `i` and shifts the rest of its probe run back, so no
    /// run has a hole (linear probing's deletion without tombstones).
    fn remove_at(&self, mut i: u32) {
        let mask = self.buckets - 1;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let (tiers, lo, hi) = self.read(j);
            if tiers == 0 && lo == 0 && hi == 0 {
                break;
            }
            let home = lo as u32 & mask;
            // j's entry may move to i when i lies on its probe path, that
            // is cyclically in [home, j).
            let on_path = if home <= j { home <= i && i < j } else { home <= i || i < j };
            if on_path {
                self.write(i, tiers, lo, hi);
                i = j;
            }
        }
        self.write(i, 0, 0, 0);
        self.entries.set(self.entries.get() - 1);
    }

    /// The tiers listed for `hash` (a bit per [`IndexTier`]; 0: none).
    pub fn tiers_of(&self, hash: &BlockHash) -> u8 {
        let (lo, hi) = Self::split(hash);
        match self.find(lo, hi) {
            Some(Ok(i)) => self.read(i).0,
            _ => 0,
        }
    }

    /// Blocks listed.
    pub fn entries(&self) -> u64 {
        self.entries.get()
    }

    /// Buckets in the table.
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// Bytes of the file (header and buckets).
    pub fn file_bytes(&self) -> u64 {
        self.bytes as u64
    }

    /// A new descriptor of the file, opened read-only, for a client to map.
    ///
    /// # Errors
    /// The reopen failed.
    pub fn read_only_fd(&self) -> std::io::Result<OwnedFd> {
        crate::sealed::reopen_read_only(&self.file)
    }
}

impl Drop for IndexTable {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

/// The tables alive in this process, by their shard's directory.
static TABLES: Mutex<Vec<(std::path::PathBuf, Weak<IndexTable>)>> = Mutex::new(Vec::new());

/// The index table of the shard whose directory is `dir`, if it is
/// open (`MAP_INDEX`).
pub fn index_table(dir: &std::path::Path) -> Option<Arc<IndexTable>> {
    TABLES.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(d, _)| d == dir).and_then(|(_, t)| t.upgrade())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_local_proto::shared_index::{Probe, Reader};

    fn h(lo: u64, hi: u64) -> BlockHash {
        BlockHash(((hi as u128) << 64) | lo as u128)
    }

    #[test]
    fn tiers_come_and_go_and_deletes_leave_no_holes() {
        let dir = tempfile::tempdir().unwrap();
        let t = IndexTable::new(4, 0, 1, dir.path()).unwrap();
        assert_eq!(t.buckets(), 8);
        // Three hashes with the same home bucket (lo & 7 == 3), one after.
        let (a, b, c, d) = (h(3, 1), h(11, 2), h(19, 3), h(4, 4));
        for x in [&a, &b, &c, &d] {
            t.set(x, IndexTier::Nvme, true);
        }
        t.set(&b, IndexTier::Ram, true);
        assert_eq!((t.tiers_of(&a), t.tiers_of(&b), t.tiers_of(&c), t.tiers_of(&d)), (4, 6, 4, 4));
        assert_eq!(t.entries(), 4);
        // Deleting the run's first entry shifts the others back: all found.
        t.set(&a, IndexTier::Nvme, false);
        assert_eq!((t.tiers_of(&a), t.tiers_of(&b), t.tiers_of(&c), t.tiers_of(&d)), (0, 6, 4, 4));
        t.set(&b, IndexTier::Nvme, false);
        assert_eq!(t.tiers_of(&b), 2, "still in RAM");
        t.set(&b, IndexTier::Ram, false);
        assert_eq!((t.tiers_of(&b), t.tiers_of(&c), t.tiers_of(&d)), (0, 4, 4));
        assert_eq!(t.entries(), 2);
        // A full table says so.
        for i in 0..20u64 {
            t.set(&h(100 + i, 9), IndexTier::Ram, true);
        }
        assert_eq!(t.header(FLAGS_OFFSET).load(Ordering::Relaxed) & FLAG_OVERFLOWED, FLAG_OVERFLOWED);
        assert!(index_table(dir.path()).is_some_and(|p| Arc::ptr_eq(&p, &t)));
    }

    proptest::proptest! {
        #[test]
        fn the_table_agrees_with_a_map_after_any_sequence(ops in proptest::collection::vec((0u64..24, 0u8..3, proptest::bool::ANY), 1..300)) {
            let dir = tempfile::tempdir().unwrap();
            let t = IndexTable::new(16, 0, 1, dir.path()).unwrap();
            let mut model = std::collections::HashMap::<u64, u8>::new();
            let tiers = [IndexTier::Gpu, IndexTier::Ram, IndexTier::Nvme];
            for (k, tier, held) in ops {
                // Few distinct homes, so runs are long and shifts frequent.
                let hash = h(k % 5 + 8 * k, k);
                t.set(&hash, tiers[tier as usize], held);
                let e = model.entry(k).or_default();
                if held { *e |= tiers[tier as usize] as u8 } else { *e &= !(tiers[tier as usize] as u8) }
            }
            // The clients' reader (local-proto) finds what the writer wrote.
            // SAFETY: the table's mapping, alive while `t` is.
            let reader = unsafe { Reader::new(t.base.as_ptr(), t.bytes as usize) }.unwrap();
            for (k, want) in model {
                proptest::prop_assert_eq!(t.tiers_of(&h(k % 5 + 8 * k, k)), want, "key {}", k);
                proptest::prop_assert_eq!(reader.probe(k % 5 + 8 * k, k), Probe::Tiers(want), "key {}", k);
            }
        }
    }
}
