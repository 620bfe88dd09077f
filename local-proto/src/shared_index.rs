//! The shared index's table layout (docs/LOCAL.md, "The shared index"),
//! written once: the engine's shards write it (`engine/src/shared_index.rs`)
//! and same-host clients read it (`client/src/index.rs`) with the reader
//! here.
//!
//! **Layout** (little-endian): a [`HEADER_BYTES`] header, then `buckets` (a
//! power of two) buckets of [`BUCKET_BYTES`], open addressing with linear
//! probing from bucket `lo & (buckets - 1)`:
//!
//! | bytes | header field |
//! |---|---|
//! | 0–3 | magic `"KVPX"` ([`MAGIC`]) |
//! | 4–7 | version, 1 ([`VERSION`]) |
//! | 8–11 | buckets |
//! | 12–15 | shard |
//! | 16–19 | shards |
//! | 20–23 | flags: bit 0 ([`FLAG_OVERFLOWED`]), the table overflowed (ask the server) |
//!
//! | bytes | bucket field |
//! |---|---|
//! | 0–3 | `seq`: even while stable, odd while the shard writes the bucket |
//! | 4 | `tiers`: bit 0 GPU, bit 1 RAM, bit 2 NVMe; 0 with `lo` = `hi` = 0: empty |
//! | 8–15 | `lo`: the block hash's low 64 bits |
//! | 16–23 | `hi`: its high 64 bits |
//!
//! **Memory orderings.** The writer makes `seq` odd (relaxed), fences
//! (release), writes the fields (relaxed) and makes `seq` even with a
//! release store. The reader loads `seq` with acquire, the fields relaxed,
//! fences (acquire) and loads `seq` again: when both loads read the same
//! even number, no write of the bucket overlapped the field loads (the
//! seqlock of Boehm, "Can seqlocks get along with programming language
//! memory models?", MSPC 2012, fig. 6). Answers are advisory: a "present"
//! was true when it was read; a probe racing a delete's shift can read a
//! present block as absent.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// `"KVPX"`: the header's first four bytes.
pub const MAGIC: u32 = u32::from_le_bytes(*b"KVPX");
/// The layout's version.
pub const VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 4096;
/// Bytes of one bucket.
pub const BUCKET_BYTES: usize = 32;
/// Header offset of the flags word.
pub const FLAGS_OFFSET: usize = 20;
/// Header flag: a block found no free bucket; the table no longer lists
/// everything, so clients must ask the server.
pub const FLAG_OVERFLOWED: u32 = 1;
/// A bucket's `tiers` bit per tier.
pub const TIER_GPU: u8 = 1;
/// See [`TIER_GPU`].
pub const TIER_RAM: u8 = 2;
/// See [`TIER_GPU`].
pub const TIER_NVME: u8 = 4;
/// A probe gives up (its caller asks the server) after this many reads of
/// one bucket that found it being written.
pub const PROBE_RETRIES: u32 = 8;

/// The wire tier number (docs/LOCAL.md: 1 gpu, 2 ram, 3 nvme) of the fastest
/// tier in a bucket's `tiers` bits; 0 when none.
pub fn fastest_tier(tiers: u8) -> u8 {
    match tiers & tiers.wrapping_neg() {
        TIER_GPU => 1,
        TIER_RAM => 2,
        TIER_NVME => 3,
        _ => 0,
    }
}

/// The table's size in bytes for `buckets` buckets.
pub fn table_bytes(buckets: u32) -> usize {
    HEADER_BYTES + buckets as usize * BUCKET_BYTES
}

/// Why a mapping is not a table a reader may probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutError {
    /// Shorter than its header says.
    Short {
        /// Bytes mapped.
        bytes: usize,
        /// Bytes the header's `buckets` need.
        needed: usize,
    },
    /// Not `"KVPX"` version 1.
    NotATable {
        /// The header's magic.
        magic: u32,
        /// The header's version.
        version: u32,
    },
    /// `buckets` is zero or not a power of two.
    Buckets(u32),
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutError::Short { bytes, needed } => write!(f, "index table of {bytes} bytes, its header needs {needed}"),
            LayoutError::NotATable { magic, version } => {
                write!(f, "not a version-{VERSION} index table (magic {magic:#010x}, version {version})")
            }
            LayoutError::Buckets(b) => write!(f, "index table of {b} buckets (a power of two is needed)"),
        }
    }
}

impl std::error::Error for LayoutError {}

/// What one probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The `tiers` bits listed for the hash (0: not listed).
    Tiers(u8),
    /// A bucket on the probe's path was being written on every one of
    /// [`PROBE_RETRIES`] reads: unknown.
    Busy,
}

/// A table read through atomics at `base` (a mapping the caller keeps alive
/// for the reader's life).
#[derive(Debug, Clone, Copy)]
pub struct Reader {
    base: *const u8,
    buckets: u32,
}

// SAFETY: the reader only loads through atomics from memory its owner keeps
// mapped; nothing in it is tied to a thread.
unsafe impl Send for Reader {}
// SAFETY: as above.
unsafe impl Sync for Reader {}

impl Reader {
    /// A reader of the table in `bytes` bytes at `base`, its header checked.
    ///
    /// # Safety
    /// `base` is 8-byte aligned (a page-aligned mapping is), `bytes` bytes
    /// from it are readable, and stay so, unchanged in size, while the
    /// reader or a copy of it is used; the memory is only ever written
    /// through atomics (the shard's seqlock writer).
    ///
    /// # Errors
    /// [`LayoutError`] when the header is not a version-1 table or the
    /// mapping is shorter than its buckets.
    pub unsafe fn new(base: *const u8, bytes: usize) -> Result<Reader, LayoutError> {
        if bytes < HEADER_BYTES {
            return Err(LayoutError::Short { bytes, needed: HEADER_BYTES });
        }
        let word = |at: usize| (*(base.add(at) as *const AtomicU32)).load(Ordering::Relaxed);
        let (magic, version, buckets) = (word(0), word(4), word(8));
        if magic != MAGIC || version != VERSION {
            return Err(LayoutError::NotATable { magic, version });
        }
        if buckets == 0 || !buckets.is_power_of_two() {
            return Err(LayoutError::Buckets(buckets));
        }
        if bytes < table_bytes(buckets) {
            return Err(LayoutError::Short { bytes, needed: table_bytes(buckets) });
        }
        Ok(Reader { base, buckets })
    }

    /// Buckets in the table.
    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// The header's `shard` and `shards`.
    pub fn shard_of_shards(&self) -> (u32, u32) {
        (self.header(12).load(Ordering::Relaxed), self.header(16).load(Ordering::Relaxed))
    }

    fn header(&self, at: usize) -> &AtomicU32 {
        // SAFETY: a 4-byte-aligned header field inside the mapping (`new`).
        unsafe { &*(self.base.add(at) as *const AtomicU32) }
    }

    /// Whether the shard flagged the table as no longer listing everything.
    pub fn overflowed(&self) -> bool {
        self.header(FLAGS_OFFSET).load(Ordering::Acquire) & FLAG_OVERFLOWED != 0
    }

    /// Bucket `i`'s `tiers`, `lo`, `hi`, read under its seqlock; `None`
    /// when a write overlapped the read.
    fn read(&self, i: u32) -> Option<(u8, u64, u64)> {
        let at = HEADER_BYTES + i as usize * BUCKET_BYTES;
        // SAFETY: bucket `i < buckets` lies inside the mapping (`new`), its
        // fields aligned (32-byte buckets after a 4 KiB header).
        let (seq, tiers, lo, hi) = unsafe {
            let p = self.base.add(at);
            (
                &*(p as *const AtomicU32),
                &*(p.add(4) as *const AtomicU8),
                &*(p.add(8) as *const AtomicU64),
                &*(p.add(16) as *const AtomicU64),
            )
        };
        let before = seq.load(Ordering::Acquire);
        if before & 1 != 0 {
            return None;
        }
        let fields = (tiers.load(Ordering::Relaxed), lo.load(Ordering::Relaxed), hi.load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        (seq.load(Ordering::Relaxed) == before).then_some(fields)
    }

    /// The `tiers` bits listed for the block hash `(lo, hi)` (its low and
    /// high 64 bits).
    pub fn probe(&self, lo: u64, hi: u64) -> Probe {
        let mask = self.buckets - 1;
        let mut i = lo as u32 & mask;
        for _ in 0..self.buckets {
            let mut read = None;
            for _ in 0..PROBE_RETRIES {
                read = self.read(i);
                if read.is_some() {
                    break;
                }
                std::hint::spin_loop();
            }
            let Some((tiers, l, h)) = read else { return Probe::Busy };
            if l == lo && h == hi {
                return Probe::Tiers(tiers);
            }
            if tiers == 0 && l == 0 && h == 0 {
                return Probe::Tiers(0);
            }
            i = (i + 1) & mask;
        }
        Probe::Tiers(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of `buckets` buckets in 8-byte-aligned memory.
    fn table(buckets: u32) -> Vec<u64> {
        let mut words = vec![0u64; table_bytes(buckets) / 8];
        let header = words.as_mut_ptr() as *mut u32;
        // SAFETY: the header's first five words, inside `words`.
        unsafe {
            for (at, v) in [(0, MAGIC), (1, VERSION), (2, buckets), (3, 0), (4, 1)] {
                *header.add(at) = v;
            }
        }
        words
    }

    fn bucket(words: &mut [u64], i: u32, seq: u32, tiers: u8, lo: u64, hi: u64) {
        let at = (HEADER_BYTES + i as usize * BUCKET_BYTES) / 8;
        words[at] = seq as u64 | (tiers as u64) << 32;
        words[at + 1] = lo;
        words[at + 2] = hi;
    }

    #[test]
    fn a_probe_follows_the_run_and_believes_only_a_stable_bucket() {
        let mut words = table(8);
        // Two hashes at home bucket 3, the second one bucket on.
        bucket(&mut words, 3, 2, TIER_NVME, 11, 1);
        bucket(&mut words, 4, 4, TIER_RAM | TIER_NVME, 19, 2);
        // SAFETY: `words` outlives the reader and is not written while it reads.
        let r = unsafe { Reader::new(words.as_ptr() as *const u8, words.len() * 8) }.unwrap();
        assert_eq!(r.probe(11, 1), Probe::Tiers(TIER_NVME));
        assert_eq!(r.probe(19, 2), Probe::Tiers(TIER_RAM | TIER_NVME));
        assert_eq!(r.probe(27, 3), Probe::Tiers(0), "the run ends at an empty bucket");
        assert_eq!(fastest_tier(TIER_RAM | TIER_NVME), 2);
        // A bucket being written (odd seq) on the path is never believed.
        bucket(&mut words, 3, 5, TIER_GPU, 11, 1);
        let r = unsafe { Reader::new(words.as_ptr() as *const u8, words.len() * 8) }.unwrap();
        assert_eq!(r.probe(11, 1), Probe::Busy);
        assert_eq!(r.probe(19, 2), Probe::Busy, "bucket 3 lies on its path");
        assert_eq!(r.probe(5, 9), Probe::Tiers(0), "another run");
    }

    #[test]
    fn a_mapping_that_is_not_a_table_is_refused() {
        let mut words = table(8);
        let bytes = words.len() * 8;
        let p = words.as_ptr() as *const u8;
        // SAFETY (all below): `words` outlives each reader, unwritten meanwhile.
        assert_eq!(unsafe { Reader::new(p, bytes - 8) }.err(), Some(LayoutError::Short { bytes: bytes - 8, needed: bytes }));
        assert!(matches!(unsafe { Reader::new(p, 100) }, Err(LayoutError::Short { .. })));
        words[0] = MAGIC as u64; // version 0
        let p = words.as_ptr() as *const u8;
        assert!(matches!(unsafe { Reader::new(p, bytes) }, Err(LayoutError::NotATable { version: 0, .. })));
        words[0] = MAGIC as u64 | (VERSION as u64) << 32;
        words[1] = 6; // buckets 6, shard 0
        let p = words.as_ptr() as *const u8;
        assert_eq!(unsafe { Reader::new(p, bytes) }.err(), Some(LayoutError::Buckets(6)));
    }
}
