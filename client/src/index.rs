//! The shared index read in the client (docs/LOCAL.md, "The shared
//! index"): each shard's index table, mapped read-only from the
//! descriptor `MAP_INDEX` hands over, probed with the reader of
//! `kvtier_local_proto::shared_index` (acquire loads under each bucket's
//! seqlock, so the answers hold on arm64 as on x86-64). A key's block hash
//! is xxh3-128 of its bytes, its shard the hash mod the shard count, as the
//! server's (`engine/src/key.rs`).

use std::os::fd::{AsRawFd, BorrowedFd};

use kvtier_local_proto::shared_index::{fastest_tier, LayoutError, Probe, Reader};
use kvtier_local_proto::{key_is_valid, shard_of};

/// [`SharedIndex::tiers`]'s answer for a key the server would refuse
/// (`kvtier_local_proto::key_is_valid`): it is not probed.
pub const BAD_KEY: u8 = u8::MAX;

/// Why a table cannot be mapped or a set of tables used.
#[derive(Debug)]
pub enum IndexError {
    /// `fstat` or `mmap` of the descriptor failed.
    Map(std::io::Error),
    /// The file is shorter than `MAP_INDEX` said.
    Short {
        /// Bytes of the file.
        file_bytes: u64,
        /// Bytes `MAP_INDEX` said.
        told_bytes: u64,
    },
    /// The mapping is not an index table.
    Layout(LayoutError),
    /// Table `at` says it is shard `shard` of `shards`, not shard `at` of
    /// the tables given.
    Shard {
        /// Its place among the tables given.
        at: usize,
        /// The header's shard.
        shard: u32,
        /// The header's shard count.
        shards: u32,
        /// Tables given.
        tables: usize,
    },
}

impl std::fmt::Display for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IndexError::Map(e) => write!(f, "mapping an index table: {e}"),
            IndexError::Short { file_bytes, told_bytes } => {
                write!(f, "index table file of {file_bytes} bytes, MAP_INDEX said {told_bytes}")
            }
            IndexError::Layout(e) => e.fmt(f),
            IndexError::Shard { at, shard, shards, tables } => {
                write!(f, "table {at} of {tables} says it is shard {shard} of {shards}")
            }
        }
    }
}

impl std::error::Error for IndexError {}

/// One shard's table, mapped read-only; unmapped on drop.
pub struct Table {
    base: *mut libc::c_void,
    bytes: usize,
    reader: Reader,
}

// SAFETY: a read-only shared mapping owned by the value; it is only read,
// through atomics (`Reader`), from any thread.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl Table {
    /// Maps `file_bytes` bytes of the table behind `fd` (the descriptor may
    /// be closed afterwards) and checks its header.
    ///
    /// # Errors
    /// [`IndexError::Map`] when `fstat` or `mmap` fails,
    /// [`IndexError::Short`] when the file is shorter than `file_bytes`,
    /// [`IndexError::Layout`] when it is not a version-1 table that fits.
    pub fn map(fd: BorrowedFd<'_>, file_bytes: u64) -> Result<Table, IndexError> {
        // SAFETY: fstat of a descriptor the caller holds into a zeroed stat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(IndexError::Map(std::io::Error::last_os_error()));
        }
        if (st.st_size as u64) < file_bytes {
            return Err(IndexError::Short { file_bytes: st.st_size as u64, told_bytes: file_bytes });
        }
        let bytes = file_bytes as usize;
        // SAFETY: a new read-only shared mapping of `bytes` bytes the file
        // holds (checked above; the server's file is sealed against
        // shrinking, F_SEAL_SHRINK).
        let base = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if base == libc::MAP_FAILED {
            return Err(IndexError::Map(std::io::Error::last_os_error()));
        }
        // SAFETY: the page-aligned mapping above, alive until `drop`, written
        // only by the server's seqlock writer, through atomics.
        match unsafe { Reader::new(base as *const u8, bytes) } {
            Ok(reader) => Ok(Table { base, bytes, reader }),
            Err(e) => {
                // SAFETY: the mapping made above, not used after.
                unsafe { libc::munmap(base, bytes) };
                Err(IndexError::Layout(e))
            }
        }
    }

    /// The table's reader.
    pub fn reader(&self) -> &Reader {
        &self.reader
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; readers borrow `self`.
        unsafe { libc::munmap(self.base, self.bytes) };
    }
}

/// The tables of every shard of one server process, shard `i` at `i`.
pub struct SharedIndex {
    tables: Vec<Table>,
}

impl SharedIndex {
    /// The index over `tables`, each checked to be the shard of its place.
    ///
    /// # Errors
    /// [`IndexError::Shard`] when a header's shard or shard count disagrees.
    pub fn new(tables: Vec<Table>) -> Result<SharedIndex, IndexError> {
        for (at, t) in tables.iter().enumerate() {
            let (shard, shards) = t.reader.shard_of_shards();
            if shard as usize != at || shards as usize != tables.len() {
                return Err(IndexError::Shard { at, shard, shards, tables: tables.len() });
            }
        }
        Ok(SharedIndex { tables })
    }

    /// Shard `shard`'s table.
    ///
    /// # Panics
    /// `shard` is not below [`SharedIndex::shards`].
    pub fn table(&self, shard: usize) -> &Table {
        &self.tables[shard]
    }

    /// Shards (tables).
    pub fn shards(&self) -> usize {
        self.tables.len()
    }

    /// Whether any table overflowed (then it does not list everything).
    pub fn overflowed(&self) -> bool {
        self.tables.iter().any(|t| t.reader.overflowed())
    }

    /// Appends to `out`, per key, the wire number of the fastest local tier
    /// listed for it (1 gpu, 2 ram, 3 nvme; 0 none), or [`BAD_KEY`] for a
    /// key the server would refuse. `false` (and `out` cut back to its
    /// length before) when the index cannot answer for all of them: a table
    /// overflowed or a bucket stayed busy.
    pub fn tiers<'k>(&self, keys: impl IntoIterator<Item = &'k [u8]>, out: &mut Vec<u8>) -> bool {
        let before = out.len();
        if self.tables.is_empty() || self.overflowed() {
            return false;
        }
        let shards = self.tables.len();
        for key in keys {
            if !key_is_valid(key) {
                out.push(BAD_KEY);
                continue;
            }
            let hash = xxhash_rust::xxh3::xxh3_128(key);
            let table = &self.tables[shard_of(hash, shards)];
            match table.reader.probe(hash as u64, (hash >> 64) as u64) {
                Probe::Tiers(bits) => out.push(fastest_tier(bits)),
                Probe::Busy => {
                    out.truncate(before);
                    return false;
                }
            }
        }
        true
    }
}
