//! Segment files: the preallocated, fixed-size files that make up a shard's
//! log. Written and read with `O_DIRECT` through glommio's [`DmaFile`].
//!
//! Layout of `shard-NNN/seg-NNNNNN.kvt` (byte offsets in docs/FORMAT.md):
//! a 4 KiB superblock at offset 0, then `slots_per_segment` slots of
//! `slot_bytes` each. A segment is created whole: a temporary file is
//! `fallocate`d to `segment_bytes`, its superblock written and fsynced with
//! std I/O, then renamed into place. Writing a real superblock before the
//! first `dma_open` matters beyond crash safety: glommio probes io_uring
//! polling support with a read at offset 0 of the first file it opens on a
//! device, and on an empty file that probe succeeds spuriously and every
//! later read fails with `EOPNOTSUPP`.
//!
//! A reclaimed segment is reused in place: its superblock is rewritten with
//! a new `first_seq`, and recovery ignores any slot whose sequence number is
//! lower, so blocks from the segment's earlier life never come back.

use std::cell::{Cell, RefCell};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use glommio::io::{DmaFile, ReadResult};

use crate::error::{Error, Result};
use crate::signal::{InFlightCount, Signal};
use crate::slot::{self, PAGE_BYTES};

/// `"KVSG"`: first four bytes of every segment superblock.
pub const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"KVSG");

/// Version of the superblock layout.
pub const SEGMENT_VERSION: u16 = 1;

const OFF_MAGIC: usize = 0; // u32
const OFF_VERSION: usize = 4; // u16
const OFF_SHARD: usize = 8; // u32
const OFF_SEGMENT_ID: usize = 12; // u32
const OFF_SLOT_BYTES: usize = 16; // u64
const OFF_BLOCK_BYTES: usize = 24; // u64
const OFF_SEGMENT_BYTES: usize = 32; // u64
const OFF_FIRST_SEQ: usize = 40; // u64
const OFF_STORE_ID: usize = 48; // [u8; 16]
const OFF_CRC: usize = PAGE_BYTES as usize - 4; // u32 over bytes 0..OFF_CRC

/// A store's id as a segment's superblock holds it: the 16 bytes of
/// `store.json`'s 32-hex-digit `store_id` ([`crate::devices`]).
/// [`STORE_ID_NONE`] (zeros) names no store: segments written before
/// superblocks named their store, and those of a store made before store
/// ids (its `store.json` has none). Bytes 48..64 of the superblock were zero
/// before, under the same CRC and version, so either kind of segment opens
/// in either kvtier (docs/FORMAT.md).
pub type StoreId = [u8; 16];

/// No store named ([`StoreId`]).
pub const STORE_ID_NONE: StoreId = [0; 16];

/// The [`StoreId`] of `store.json`'s `store_id` (32 hex digits);
/// [`STORE_ID_NONE`] for none or for any other text.
pub fn store_id_bytes(id: Option<&str>) -> StoreId {
    let mut out = STORE_ID_NONE;
    match id.map(|hex| hex::decode_to_slice(hex, &mut out)) {
        Some(Ok(())) => out,
        _ => STORE_ID_NONE,
    }
}

/// The decoded superblock of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Shard that owns the segment.
    pub shard: u32,
    /// Segment id, the number in its file name.
    pub segment_id: u32,
    /// Bytes per slot (header page + payload rounded up to pages).
    pub slot_bytes: u64,
    /// Payload bytes of a block in this store.
    pub block_bytes: u64,
    /// Size of the segment file.
    pub segment_bytes: u64,
    /// Slots with a lower sequence number belong to an earlier life of this
    /// segment and are ignored.
    pub first_seq: u64,
    /// The store the segment belongs to ([`STORE_ID_NONE`]: not named).
    pub store_id: StoreId,
}

impl Superblock {
    /// Encodes into a page.
    pub fn encode(&self, page: &mut [u8]) {
        let page = &mut page[..PAGE_BYTES as usize];
        page.fill(0);
        slot::put(page, OFF_MAGIC, &SEGMENT_MAGIC.to_le_bytes());
        slot::put(page, OFF_VERSION, &SEGMENT_VERSION.to_le_bytes());
        slot::put(page, OFF_SHARD, &self.shard.to_le_bytes());
        slot::put(page, OFF_SEGMENT_ID, &self.segment_id.to_le_bytes());
        slot::put(page, OFF_SLOT_BYTES, &self.slot_bytes.to_le_bytes());
        slot::put(page, OFF_BLOCK_BYTES, &self.block_bytes.to_le_bytes());
        slot::put(page, OFF_SEGMENT_BYTES, &self.segment_bytes.to_le_bytes());
        slot::put(page, OFF_FIRST_SEQ, &self.first_seq.to_le_bytes());
        slot::put(page, OFF_STORE_ID, &self.store_id);
        let crc = crc32fast::hash(&page[..OFF_CRC]);
        slot::put(page, OFF_CRC, &crc.to_le_bytes());
        debug_assert_eq!(Superblock::decode(page), Some(*self));
    }

    /// Whether this superblock is segment `segment_id` of `shard` in store
    /// `store_id` with these slot and segment sizes; any other file is
    /// foreign. A superblock or a store that names no store
    /// ([`STORE_ID_NONE`]) matches on the rest alone.
    pub fn belongs_to(&self, shard: u32, segment_id: u32, slot_bytes: u64, segment_bytes: u64, store_id: &StoreId) -> bool {
        self.shard == shard
            && self.segment_id == segment_id
            && self.slot_bytes == slot_bytes
            && self.segment_bytes == segment_bytes
            && (self.store_id == STORE_ID_NONE || *store_id == STORE_ID_NONE || self.store_id == *store_id)
    }

    /// Decodes a page; `None` when the magic, version or CRC is wrong.
    pub fn decode(page: &[u8]) -> Option<Superblock> {
        if page.len() < PAGE_BYTES as usize {
            return None;
        }
        let page = &page[..PAGE_BYTES as usize];
        if u32::from_le_bytes(slot::get(page, OFF_MAGIC)) != SEGMENT_MAGIC
            || u16::from_le_bytes(slot::get(page, OFF_VERSION)) != SEGMENT_VERSION
            || u32::from_le_bytes(slot::get(page, OFF_CRC)) != crc32fast::hash(&page[..OFF_CRC])
        {
            return None;
        }
        Some(Superblock {
            shard: u32::from_le_bytes(slot::get(page, OFF_SHARD)),
            segment_id: u32::from_le_bytes(slot::get(page, OFF_SEGMENT_ID)),
            slot_bytes: u64::from_le_bytes(slot::get(page, OFF_SLOT_BYTES)),
            block_bytes: u64::from_le_bytes(slot::get(page, OFF_BLOCK_BYTES)),
            segment_bytes: u64::from_le_bytes(slot::get(page, OFF_SEGMENT_BYTES)),
            first_seq: u64::from_le_bytes(slot::get(page, OFF_FIRST_SEQ)),
            store_id: slot::get(page, OFF_STORE_ID),
        })
    }
}

/// Path of segment `id` in a shard directory: `seg-NNNNNN.kvt`.
pub fn segment_path(shard_dir: &Path, id: u32) -> PathBuf {
    shard_dir.join(format!("seg-{id:06}.kvt"))
}

/// Parses a segment file name back to its id.
pub fn parse_segment_name(name: &str) -> Option<u32> {
    name.strip_prefix("seg-")?.strip_suffix(".kvt")?.parse().ok()
}

/// Creates a segment file of `sb.segment_bytes` with std I/O: temp file,
/// `fallocate`, superblock, fsync, rename, fsync of the directory.
///
/// # Errors
/// [`Error::DiskFull`] when `fallocate` answers `ENOSPC` (the temp file is
/// removed), [`Error::Io`] otherwise.
pub fn create_file(shard_dir: &Path, sb: &Superblock) -> Result<PathBuf> {
    let path = segment_path(shard_dir, sb.segment_id);
    let tmp = path.with_extension("kvt.tmp");
    let result = (|| -> Result<()> {
        // off-shard: every call here runs on the executor's blocking pool (Shard::create_segment).
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
        // SAFETY: fallocate on an fd we own; mode 0 allocates and extends.
        // off-shard: the blocking pool, as above.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, sb.segment_bytes as libc::off_t) };
        if rc != 0 {
            return Err(Error::io(
                format!("preallocating {} bytes for {}", sb.segment_bytes, tmp.display()),
                std::io::Error::last_os_error(),
            ));
        }
        let mut page = vec![0u8; PAGE_BYTES as usize];
        sb.encode(&mut page);
        // off-shard: the blocking pool, as above.
        f.write_all(&page).and_then(|_| f.sync_all()).map_err(|e| Error::io(format!("writing superblock of {}", tmp.display()), e))?;
        // off-shard: the blocking pool, as above.
        fs::rename(&tmp, &path).map_err(|e| Error::io(format!("renaming {}", tmp.display()), e))?;
        // off-shard: the blocking pool, as above.
        crate::geometry::fsync_dir(shard_dir)
    })();
    if result.is_err() {
        // off-shard: the blocking pool, as above.
        let _ = fs::remove_file(&tmp);
    }
    result.map(|_| path)
}

/// Reads a segment's superblock with std I/O (before the file is opened for
/// DMA). `Ok(None)` when the file is shorter than a page or the superblock
/// does not decode.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read.
pub fn read_superblock(path: &Path) -> Result<Option<Superblock>> {
    // off-shard: called by recovery on the blocking pool and by `kvtier fsck` (no shard).
    let mut f = fs::File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut page = vec![0u8; PAGE_BYTES as usize];
    // off-shard: as above.
    match f.read_exact(&mut page) {
        Ok(()) => Ok(Superblock::decode(&page)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(Error::io(format!("reading superblock of {}", path.display()), e)),
    }
}

/// One open segment of a shard's log. Lives on the shard's executor.
#[derive(Debug)]
pub struct Segment {
    /// Segment id.
    pub id: u32,
    /// The file, opened `O_DIRECT`.
    pub file: DmaFile,
    /// Sequence number of this segment's current life (see [`Superblock`]).
    pub first_seq: Cell<u64>,
    /// Slots handed out in this life; the next write goes to this slot.
    pub slots_used: Cell<u32>,
    /// Reads in flight against this segment; reclaim waits for zero.
    pub(crate) readers: InFlightCount,
    /// Writes in flight into this segment; reclaim waits for zero.
    pub(crate) writers: InFlightCount,
    /// Reclaim is moving this segment's surviving blocks to new slots:
    /// reads of it wait, then look their block up again.
    pub compacting: Cell<bool>,
    /// While compacting: the new life's first sequence number. Reads of a
    /// block below it (a survivor not yet moved) wait; blocks written in
    /// the new life are read at once.
    pub compact_below_seq: Cell<u64>,
    /// While compacting: the old slot of the next survivor the copy has yet
    /// to read (`u32::MAX`: none). A write into a slot at or past it waits,
    /// so that no survivor is overwritten before it is read.
    pub copy_next_old_slot: Cell<u32>,
    /// Fired when the survivor copy moves past a slot or the compaction
    /// ends: what writes into a survivor's slot, reads of a survivor not
    /// yet moved, and a clean close wait for.
    pub(crate) survivors_moved: Signal,
    /// Per slot: the block there was read since it was written (it gets a
    /// second chance when the segment is reclaimed).
    pub referenced: RefCell<Vec<bool>>,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Its device's injected failure, if the store has the test double
    /// ([`crate::faults`]).
    pub fault: Option<crate::faults::FaultSwitch>,
}

impl Segment {
    /// Opens an existing segment file for DMA; its I/O fails while `fault`
    /// is on ([`crate::faults`]).
    ///
    /// # Errors
    /// [`Error::Io`] from `open(2)`.
    pub async fn open(
        path: &Path,
        id: u32,
        first_seq: u64,
        slot_bytes: u64,
        slots: u32,
        fault: Option<crate::faults::FaultSwitch>,
    ) -> Result<Segment> {
        let file = glommio::io::OpenOptions::new()
            .read(true)
            .write(true)
            .dma_open(path)
            .await
            .map_err(|e| Error::glommio(format!("opening {} for O_DIRECT", path.display()), e))?;
        Ok(Segment {
            id,
            file,
            first_seq: Cell::new(first_seq),
            slots_used: Cell::new(0),
            readers: InFlightCount::new("a segment's reads finished (reclaim)"),
            writers: InFlightCount::new("a segment's writes finished (reclaim)"),
            compacting: Cell::new(false),
            compact_below_seq: Cell::new(0),
            copy_next_old_slot: Cell::new(u32::MAX),
            survivors_moved: Signal::new("the survivor copy moved past a slot, or the compaction ended"),
            referenced: RefCell::new(vec![false; slots as usize]),
            slot_bytes,
            fault,
        })
    }

    /// `Err` while the device's injected failure is on ([`crate::faults`]).
    fn check_fault(&self, what: impl FnOnce() -> String) -> Result<()> {
        match &self.fault {
            Some(f) => f.check(what),
            None => Ok(()),
        }
    }

    /// Byte offset of slot `slot`: after the superblock page.
    pub fn slot_offset(&self, slot: u32) -> u64 {
        PAGE_BYTES + slot as u64 * self.slot_bytes
    }

    /// Writes a whole slot (header page, then payload pages) at `slot` in one
    /// aligned DMA write. `buf.len()` must be a multiple of [`PAGE_BYTES`]
    /// and at most `slot_bytes`. The buffer is shared, not consumed, so the
    /// caller can return it to its pool once the write completes.
    ///
    /// # Errors
    /// [`Error::DiskFull`] on `ENOSPC`, [`Error::Io`] on any other failure or
    /// a short write.
    pub async fn write_slot(&self, buf: Rc<glommio::io::DmaBuffer>, slot: u32) -> Result<()> {
        let len = buf.len();
        assert!((len as u64).is_multiple_of(PAGE_BYTES) && len as u64 <= self.slot_bytes, "slot write of {len} bytes");
        self.check_fault(|| format!("writing slot {slot} of segment {}", self.id))?;
        let written = self.file.write_rc_at(buf, self.slot_offset(slot)).await;
        self.check_written(slot, written, len as u64)
    }

    /// A slot write's result: the bytes written must be `want`.
    ///
    /// # Errors
    /// [`Error::DiskFull`] on `ENOSPC`, [`Error::Io`] on any other failure or
    /// a short write.
    fn check_written(&self, slot: u32, written: glommio::Result<usize, ()>, want: u64) -> Result<()> {
        let what = || format!("writing slot {slot} of segment {}", self.id);
        let written = written.map_err(|e| Error::glommio(what(), e))?;
        if written as u64 != want {
            return Err(Error::io(
                what(),
                std::io::Error::new(std::io::ErrorKind::WriteZero, format!("short write: {written} of {want} bytes")),
            ));
        }
        Ok(())
    }

    /// Writes a slot from two places at once: the header page from `header`
    /// (exactly [`PAGE_BYTES`]) and the payload from `payload`, memory
    /// outside glommio's (a RAM-tier slot) that does not change until the
    /// write completes, each with its own aligned DMA write. `payload`'s
    /// address and length must be multiples of [`PAGE_BYTES`] and the two
    /// together at most `slot_bytes`. Like one write of the whole slot, a
    /// crash in the middle may leave either part: the header's CRCs tell.
    ///
    /// # Errors
    /// As [`Segment::write_slot`].
    pub async fn write_slot_split(&self, header: Rc<glommio::io::DmaBuffer>, payload: bytes::Bytes, slot: u32) -> Result<()> {
        let len = payload.len() as u64;
        assert_eq!(header.len() as u64, PAGE_BYTES, "a header page");
        assert!(
            len.is_multiple_of(PAGE_BYTES) && (payload.as_ptr() as u64).is_multiple_of(PAGE_BYTES) && PAGE_BYTES + len <= self.slot_bytes,
            "payload write of {len} bytes at {:p}",
            payload.as_ptr()
        );
        let at = self.slot_offset(slot);
        self.check_fault(|| format!("writing slot {slot} of segment {}", self.id))?;
        let (head, body) = futures::join!(self.file.write_rc_at(header, at), self.file.write_foreign_at(payload, at + PAGE_BYTES));
        self.check_written(slot, head, PAGE_BYTES)?;
        self.check_written(slot, body, len)
    }

    /// Reads `len` bytes (a multiple of [`PAGE_BYTES`]) from the start of
    /// slot `slot`.
    ///
    /// # Errors
    /// [`Error::Io`] on failure or a short read.
    pub async fn read_slot(&self, slot: u32, len: u64) -> Result<ReadResult> {
        self.read_slot_range(slot, 0, len).await
    }

    /// Reads `len` bytes from `offset` bytes into slot `slot`; both multiples
    /// of [`PAGE_BYTES`].
    ///
    /// # Errors
    /// [`Error::Io`] on failure or a short read.
    pub async fn read_slot_range(&self, slot: u32, offset: u64, len: u64) -> Result<ReadResult> {
        debug_assert!(offset.is_multiple_of(PAGE_BYTES) && offset + len <= self.slot_bytes);
        self.check_fault(|| format!("reading slot {slot} of segment {}", self.id))?;
        let rr = self
            .file
            .read_at_aligned(self.slot_offset(slot) + offset, len as usize)
            .await
            .map_err(|e| Error::glommio(format!("reading slot {slot} of segment {}", self.id), e))?;
        if (rr.len() as u64) < len {
            return Err(Error::io(
                format!("reading slot {slot} of segment {}", self.id),
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("short read: {} of {len} bytes", rr.len())),
            ));
        }
        Ok(rr)
    }

    /// Rewrites the superblock through DMA and `fdatasync`s it: the step that
    /// starts a reclaimed segment's new life.
    ///
    /// # Errors
    /// [`Error::Io`] from the write or the sync.
    pub async fn write_superblock(&self, sb: &Superblock) -> Result<()> {
        self.check_fault(|| format!("rewriting superblock of segment {}", self.id))?;
        let mut buf = self.file.alloc_dma_buffer(PAGE_BYTES as usize);
        sb.encode(buf.as_bytes_mut());
        let written =
            self.file.write_at(buf, 0).await.map_err(|e| Error::glommio(format!("rewriting superblock of segment {}", self.id), e))?;
        if written as u64 != PAGE_BYTES {
            return Err(Error::io(
                format!("rewriting superblock of segment {}", self.id),
                std::io::Error::new(std::io::ErrorKind::WriteZero, "short superblock write"),
            ));
        }
        self.file.fdatasync().await.map_err(|e| Error::glommio(format!("fdatasync of segment {}", self.id), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trip_and_names() {
        let id = store_id_bytes(Some("00112233445566778899aabbccddeeff"));
        assert_eq!(id[0], 0x00);
        assert_eq!(id[15], 0xff);
        let sb = Superblock {
            shard: 1,
            segment_id: 7,
            slot_bytes: 69_632,
            block_bytes: 65_536,
            segment_bytes: 1 << 20,
            first_seq: 99,
            store_id: id,
        };
        let mut page = vec![0u8; 4096];
        sb.encode(&mut page);
        assert_eq!(Superblock::decode(&page), Some(sb));
        // Its own store, or no store named on either side: it belongs; another store's: foreign.
        assert!(sb.belongs_to(1, 7, 69_632, 1 << 20, &id));
        assert!(sb.belongs_to(1, 7, 69_632, 1 << 20, &STORE_ID_NONE));
        assert!(Superblock { store_id: STORE_ID_NONE, ..sb }.belongs_to(1, 7, 69_632, 1 << 20, &id));
        let other = store_id_bytes(Some("ffeeddccbbaa99887766554433221100"));
        assert!(!sb.belongs_to(1, 7, 69_632, 1 << 20, &other));
        assert_eq!(store_id_bytes(None), STORE_ID_NONE);
        assert_eq!(store_id_bytes(Some("not hex")), STORE_ID_NONE);
        page[41] ^= 1;
        assert_eq!(Superblock::decode(&page), None);
        assert_eq!(segment_path(Path::new("/d"), 7), PathBuf::from("/d/seg-000007.kvt"));
        assert_eq!(parse_segment_name("seg-000007.kvt"), Some(7));
        assert_eq!(parse_segment_name("seg-000007.kvt.tmp"), None);
        assert_eq!(parse_segment_name("notes.txt"), None);
    }
}
