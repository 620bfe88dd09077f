//! A client's registered memory: a descriptor passed with `SCM_RIGHTS`, an
//! offset and a length (docs/LOCAL.md, `REGISTER`).
//!
//! Three ways in, chosen per registration, because a mapping of a file that
//! shrinks under it raises `SIGBUS` on access (which would kill the server):
//! - **mapped**: a memfd sealed with `F_SEAL_SHRINK` cannot shrink, so the
//!   server maps it and copies with `memcpy` (numpy-copy speed);
//! - **guarded**: any other file on tmpfs (an unsealed memfd, a `/dev/shm`
//!   file: what the engines allocate) is mapped too, under a `SIGBUS` guard
//!   (`guard.rs`): a shrink under a copy turns the range into zero pages and
//!   the item into `BUFFER_SHRUNK`, instead of killing the server;
//! - **file I/O**: `pread`/`pwrite` on the descriptor, which return a short
//!   count instead of faulting (about half the speed on tmpfs, measured in
//!   docs/BENCHMARKS.md), when no guard slot is free.
//!
//! Only memory is registered (memfds, tmpfs, hugetlbfs): a file on a disk
//! or a network filesystem would block the shard's thread in `pread`.
//!
//! A `Region` is shared (`Arc`) by the connection's table and every item in
//! flight on it, so a client that unregisters or disconnects mid-copy only
//! drops the table's reference: the mapping and descriptor go when the last
//! item finishes. Those items copy nothing more, though: every copy asks its
//! region's [`Claim`] first, piece by piece, and a client that unregistered
//! the buffer or gave up on the connection has revoked it (`revoke.rs`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kvtier_engine::BlockSink;

use super::guard::Guard;
use super::proto::Code;
use super::revoke::{cancelled, is_cancelled, Claim, Peer, COPY_PIECE_BYTES};

const HUGETLBFS_MAGIC: libc::c_long = 0x9584_58f6;
/// tmpfs and shmem (memfds, `/dev/shm`).
const TMPFS_MAGIC: libc::c_long = 0x0102_1994;

/// How the server reaches a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Mapped (a memfd sealed against shrinking): `memcpy`.
    Mapped = 1,
    /// `pread`/`pwrite` on the descriptor.
    FileIo = 2,
    /// Mapped under a `SIGBUS` guard (a tmpfs file that may shrink): `memcpy`.
    Guarded = 3,
}

/// One registered buffer.
pub struct Region {
    fd: OwnedFd,
    /// Offset of the region in the file.
    file_offset: u64,
    /// Region length, bytes.
    len: u64,
    /// With [`Access::Mapped`] or [`Access::Guarded`]: the mapping
    /// (page-aligned) and where the region starts in it.
    map: Option<Mapping>,
    /// Whether the client still wants copies into and out of the region.
    claim: Claim,
}

struct Mapping {
    base: *mut u8,
    map_len: usize,
    region_at: usize,
    /// Unsealed: the guard over the mapping; released before the unmap.
    guard: Option<Guard>,
}

impl Mapping {
    /// `BUFFER_SHRUNK` when the guard caught a shrink under the mapping.
    fn intact(&self) -> std::io::Result<()> {
        match &self.guard {
            Some(g) if g.faulted() => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the registered file shrank under the server's mapping (SIGBUS caught); register the buffer again",
            )),
            _ => Ok(()),
        }
    }
}

// SAFETY: the mapping is shared memory owned by this `Region` until drop;
// copies through it from several threads are byte copies into or out of
// memory the client owns (a client racing its own buffer gets torn bytes in
// its buffer, as with any DMA target; the server's own data is not at stake).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        drop(self.guard.take());
        // SAFETY: `base`/`map_len` came from a successful mmap, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

impl Region {
    /// Checks `fd` and makes the region `[offset, offset + len)` of it.
    ///
    /// # Errors
    /// A message for `BAD_BUFFER`: not a regular file, not open read-write,
    /// an empty region, a region past the end of the file, not on tmpfs or
    /// hugetlbfs, an unsealed hugetlbfs file, or a mapping the kernel
    /// refused.
    pub fn new(fd: OwnedFd, offset: u64, len: u64) -> Result<Region, String> {
        Region::registered(fd, offset, len, Arc::new(Peer::detached()))
    }

    /// [`Region::new`], registered on the connection of `peer`: copies stop
    /// when that client gives up.
    ///
    /// # Errors
    /// As [`Region::new`].
    pub(super) fn registered(fd: OwnedFd, offset: u64, len: u64, peer: Arc<Peer>) -> Result<Region, String> {
        let raw = fd.as_raw_fd();
        // SAFETY: fstat/fcntl/fstatfs on a descriptor we own, into zeroed structs.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(raw, &mut st) } != 0 {
            return Err(format!("fstat of the descriptor failed: {}", errno()));
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err("the descriptor is not a regular file (pass a memfd or a shared-memory file)".into());
        }
        let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
        if flags < 0 || flags & libc::O_ACCMODE != libc::O_RDWR {
            return Err("the descriptor is not open read-write".into());
        }
        if len == 0 {
            return Err("the region is empty (length 0)".into());
        }
        let end = offset.checked_add(len).ok_or("offset + length overflows")?;
        if end > st.st_size as u64 {
            return Err(format!("offset {offset} + length {len} is past the end of the {}-byte file", st.st_size));
        }
        // Memory only: a copy to or from a file on a disk or a network
        // filesystem would block the shard's thread on that device.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatfs(raw, &mut fs) } != 0 {
            return Err(format!("fstatfs of the descriptor failed: {}", errno()));
        }
        let fs_type = fs.f_type as libc::c_long;
        if fs_type != TMPFS_MAGIC && fs_type != HUGETLBFS_MAGIC {
            return Err(format!(
                "the descriptor is a file on filesystem type 0x{fs_type:x}, not shared memory: register a memfd, or a file on tmpfs (/dev/shm) or hugetlbfs"
            ));
        }
        let hugetlb = fs_type == HUGETLBFS_MAGIC;
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        let sealed = seals >= 0 && seals & libc::F_SEAL_SHRINK != 0;
        if hugetlb && !sealed {
            return Err("a hugetlbfs file cannot be read or written with pread/pwrite: register a memfd made with \
                        MFD_HUGETLB | MFD_ALLOW_SEALING and sealed with F_SEAL_SHRINK"
                .into());
        }
        let map = if sealed {
            Some(map_region(raw, offset, len, hugetlb)?)
        } else {
            // Unsealed tmpfs: mapped under a guard while a slot is free.
            map_region(raw, offset, len, false).ok().and_then(|mut m| {
                m.guard = Some(Guard::new(m.base as usize, m.map_len)?);
                Some(m)
            })
        };
        Ok(Region { fd, file_offset: offset, len, map, claim: Claim::new(peer) })
    }

    /// Revokes the region (`UNREGISTER`, or its connection closing): once
    /// this returns no copy into or out of it runs, and none starts.
    pub fn revoke(&self) {
        self.claim.revoke();
    }

    /// Maps ahead, in the server's page tables, the pages of the region that
    /// the client's file already holds, so that copies into and out of them
    /// take no page fault: each page's first touch through the server's
    /// mapping otherwise costs a fault on the copy's path (an 8K-token load
    /// into vLLM's registered cache, 1 GiB in 16 MiB blocks, took 300,000
    /// faults and 2.7 server CPU-s against 0.24 with its pages mapped:
    /// docs/BENCHMARKS.md, issue 62). Pages the file does not hold yet are
    /// left alone (`mincore`): mapping them would allocate the client's
    /// memory. Blocking (a 3 GiB cache takes a fraction of a second): call it
    /// in the blocking pool. Best effort: stops at the first error (a file
    /// shrunk under the mapping, a kernel before 5.14 without
    /// `MADV_POPULATE_WRITE`). Returns the bytes mapped ahead.
    pub fn map_ahead(&self) -> u64 {
        let Some(m) = &self.map else { return 0 };
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let mut resident = vec![0u8; m.map_len.div_ceil(page)];
        // SAFETY: the mapping is ours and alive for `self`; the vector holds
        // one byte per page of it.
        if unsafe { libc::mincore(m.base.cast(), m.map_len, resident.as_mut_ptr()) } != 0 {
            return 0;
        }
        let mut mapped = 0u64;
        let mut i = 0;
        while i < resident.len() {
            if resident[i] & 1 == 0 {
                i += 1;
                continue;
            }
            let run = resident[i..].iter().take_while(|r| *r & 1 != 0).count();
            let len = (run * page).min(m.map_len - i * page);
            // SAFETY: a range of the mapping, as above.
            if unsafe { libc::madvise(m.base.add(i * page).cast(), len, libc::MADV_POPULATE_WRITE) } != 0 {
                tracing::debug!("local: mapping a registered region ahead stopped: {}", errno());
                break;
            }
            mapped += len as u64;
            i += run;
        }
        mapped
    }

    /// How the server reaches this region.
    pub fn access(&self) -> Access {
        match &self.map {
            Some(m) if m.guard.is_some() => Access::Guarded,
            Some(_) => Access::Mapped,
            None => Access::FileIo,
        }
    }

    /// Region length, bytes (never 0: [`Region::new`] refuses an empty
    /// region, so there is no `is_empty`).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Checks that `[at, at + n)` lies in the region and, unless sealed,
    /// that the file still holds it (`BUFFER_SHRUNK`; a copy checks again,
    /// as the file may shrink after this). A guarded region whose file
    /// shrank is lost: `BUFFER_SHRUNK` for every item until the client
    /// registers the buffer again.
    pub fn check(&self, at: u64, n: u64) -> Result<(), (Code, String)> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => {}
            _ => return Err((Code::OutOfBounds, format!("offset {at} + length {n} is past the {}-byte region", self.len))),
        }
        if let Some(m) = &self.map {
            m.intact().map_err(|e| (Code::BufferShrunk, e.to_string()))?;
        }
        if self.access() != Access::Mapped {
            self.check_size(at, n).map_err(|e| {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    return (Code::IoError, e.to_string());
                }
                // A guarded mapping of a file that shrank is lost whole: every
                // item on it fails alike from now on, faulted or not.
                if let Some(g) = self.map.as_ref().and_then(|m| m.guard.as_ref()) {
                    g.lose();
                }
                (Code::BufferShrunk, e.to_string())
            })?;
        }
        Ok(())
    }

    /// File I/O only: fails with `BUFFER_SHRUNK` when the file no longer
    /// holds the region's bytes `[at, at + n)`.
    fn check_size(&self, at: u64, n: u64) -> std::io::Result<()> {
        // SAFETY: fstat on our descriptor into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) } != 0 {
            return Err(errno());
        }
        let end = self.file_offset + at + n;
        if (st.st_size as u64) < end {
            return Err(shrunk(st.st_size as u64, end));
        }
        Ok(())
    }

    /// Copies `src` to `at` in the region (bounds checked by the caller),
    /// [`COPY_PIECE_BYTES`] at a time, each piece only while the region is
    /// wanted ([`Claim::enter`]; else a [`cancelled`] error).
    pub fn write(&self, at: u64, src: &[u8]) -> std::io::Result<()> {
        debug_assert!(at + src.len() as u64 <= self.len);
        for (i, piece) in src.chunks(COPY_PIECE_BYTES).enumerate() {
            let _copying = self.claim.enter().ok_or_else(cancelled)?;
            self.write_piece(at + (i * COPY_PIECE_BYTES) as u64, piece)?;
        }
        Ok(())
    }

    fn write_piece(&self, at: u64, src: &[u8]) -> std::io::Result<()> {
        if let Some(m) = &self.map {
            m.intact()?;
            // SAFETY: in bounds of a live mapping (checked above); sealed, the
            // pages cannot fault; guarded, a fault is caught (zero pages).
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), m.base.add(m.region_at + at as usize), src.len()) };
            return m.intact();
        }
        // A file shrunk between this check and the write grows back (pwrite
        // extends it); nothing faults.
        self.check_size(at, src.len() as u64)?;
        let mut done = 0usize;
        while done < src.len() {
            let rest = &src[done..];
            let pos = (self.file_offset + at) as i64 + done as i64;
            // SAFETY: pwrite from a live slice on our descriptor.
            let n = unsafe { libc::pwrite(self.fd.as_raw_fd(), rest.as_ptr().cast(), rest.len(), pos) };
            if n < 0 {
                let e = errno();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes at `at` out of the region into `out`
    /// (bounds checked by the caller), a piece at a time while wanted, as
    /// [`Region::write`].
    ///
    /// # Errors
    /// `BUFFER_SHRUNK` when the file ends early; `CANCELLED` when no longer
    /// wanted; `IO_ERROR` otherwise.
    fn read_into(&self, at: u64, out: &mut [u8]) -> Result<(), (Code, String)> {
        for (i, piece) in out.chunks_mut(COPY_PIECE_BYTES).enumerate() {
            let _copying = self.claim.enter().ok_or_else(|| (Code::Cancelled, cancelled().to_string()))?;
            self.read_piece(at + (i * COPY_PIECE_BYTES) as u64, piece)?;
        }
        Ok(())
    }

    fn read_piece(&self, at: u64, out: &mut [u8]) -> Result<(), (Code, String)> {
        let n = out.len();
        debug_assert!(at + n as u64 <= self.len);
        if let Some(m) = &self.map {
            let shrunk = |e: std::io::Error| (Code::BufferShrunk, e.to_string());
            m.intact().map_err(shrunk)?;
            // SAFETY: as in `write`; `out` is `n` bytes long.
            unsafe { std::ptr::copy_nonoverlapping(m.base.add(m.region_at + at as usize), out.as_mut_ptr(), n) };
            return m.intact().map_err(shrunk);
        }
        let mut done = 0usize;
        while done < n {
            let pos = (self.file_offset + at) as i64 + done as i64;
            // SAFETY: reads into `out`, `n` bytes long.
            let got = unsafe { libc::pread(self.fd.as_raw_fd(), out.as_mut_ptr().add(done).cast(), n - done, pos) };
            match got {
                0 => {
                    let e = shrunk(self.file_offset + at + done as u64, self.file_offset + at + n as u64);
                    return Err((Code::BufferShrunk, e.to_string()));
                }
                g if g < 0 => {
                    let e = errno();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err((Code::IoError, format!("reading the client's buffer: {e}")));
                    }
                }
                g => done += g as usize,
            }
        }
        Ok(())
    }
}

/// One span of an item in registered memory, checked against its region:
/// `len` bytes at `at`.
#[derive(Clone)]
pub struct Part {
    /// The region, kept alive by the item.
    pub region: Arc<Region>,
    /// Offset of the span in the region.
    pub at: u64,
    /// Bytes of the span.
    pub len: u64,
}

/// Whether the client still wants the parts' memory touched: none of their
/// regions revoked, and their connection's client still there (one `poll`:
/// every part of an item is on the connection that sent it).
pub fn wanted(parts: &[Part]) -> bool {
    parts.first().is_none_or(|p| p.region.claim.peer().wants()) && parts.iter().all(|p| p.region.claim.wanted_here())
}

/// [`wanted`] of `parts`, for the owning shard to ask once it has read a
/// block out of their [`views`] and before it stores it
/// ([`kvtier_engine::StillWanted`]).
pub fn still_wanted(parts: &[Part]) -> kvtier_engine::StillWanted {
    let parts = parts.to_vec();
    Arc::new(move || wanted(&parts))
}

/// The parts as views of the client's memory, with no copy, when every
/// part lies in a mapping: a sealed memfd ([`Access::Mapped`]: it cannot
/// shrink) or a tmpfs file under the `SIGBUS` guard ([`Access::Guarded`],
/// not faulted yet: the guard is process-wide, so a shrink under a read on
/// any thread turns the range into zero pages instead of killing the
/// server; [`views_intact`] tells afterwards). `None` otherwise (then
/// [`gather`] copies). A view keeps its region (mapping and descriptor)
/// alive. The client may write the memory at any time: such views go to
/// [`kvtier_engine::Store::put_in_place`], which reads them once and stores
/// the block only if [`still_wanted`] says so afterwards.
pub fn views(parts: &[Part]) -> Option<Vec<Bytes>> {
    let mapped = |p: &Part| p.region.map.as_ref().is_some_and(|m| m.intact().is_ok());
    if !parts.iter().all(mapped) {
        return None;
    }
    Some(
        parts
            .iter()
            .map(|p| {
                debug_assert!(p.at + p.len <= p.region.len);
                Bytes::from_owner(RegionView { region: p.region.clone(), at: p.at as usize, len: p.len as usize })
            })
            .collect(),
    )
}

/// After a store read [`views`] of `parts`: `BUFFER_SHRUNK` when a guarded
/// file shrank under the read (the block may hold zero pages where the
/// client's bytes were).
///
/// # Errors
/// `BUFFER_SHRUNK`, with the guard's message.
pub fn views_intact(parts: &[Part]) -> Result<(), (Code, String)> {
    for p in parts {
        if let Some(m) = &p.region.map {
            m.intact().map_err(|e| (Code::BufferShrunk, e.to_string()))?;
        }
    }
    Ok(())
}

/// Owner of a [`views`] `Bytes`: a span of a mapped region.
struct RegionView {
    region: Arc<Region>,
    at: usize,
    len: usize,
}

impl AsRef<[u8]> for RegionView {
    fn as_ref(&self) -> &[u8] {
        let m = self.region.map.as_ref().expect("a view is made of a mapped region only");
        // SAFETY: in bounds of the live mapping (the part was checked
        // against its region; `views` checked the region is mapped), which
        // `self.region` keeps mapped. A sealed memfd cannot shrink, so its
        // pages never fault; a guarded file's fault is caught (zero pages,
        // seen by `views_intact`). The client may change the bytes at any
        // time; the reader copies them once (`Store::put_in_place`).
        unsafe { std::slice::from_raw_parts(m.base.add(m.region_at + self.at), self.len) }
    }
}

/// Copies the parts' bytes, in order, out of their regions into buffers of
/// [`GATHER_PIECE_BYTES`], the block's chunks for the store (`PUT_FROM`: one
/// part; `PUT_FROM_V`: several), while the client wants it: the caller asks
/// [`wanted`] again once the copy is made, before storing it.
///
/// # Errors
/// `BUFFER_SHRUNK` when a file ends early; `CANCELLED` when the client gave
/// up on the memory; `IO_ERROR` otherwise.
pub fn gather(parts: &[Part]) -> Result<Vec<Bytes>, (Code, String)> {
    if !wanted(parts) {
        return Err((Code::Cancelled, cancelled().to_string()));
    }
    let total: usize = parts.iter().map(|p| p.len as usize).sum();
    let mut pieces = Vec::with_capacity(total.div_ceil(GATHER_PIECE_BYTES));
    let (mut part, mut at) = (0usize, 0u64);
    let mut left = total;
    while left > 0 {
        let mut piece = vec![0u8; left.min(GATHER_PIECE_BYTES)];
        let mut filled = 0usize;
        while filled < piece.len() {
            let p = &parts[part];
            let n = ((p.len - at) as usize).min(piece.len() - filled);
            p.region.read_into(p.at + at, &mut piece[filled..filled + n])?;
            filled += n;
            at += n as u64;
            if at == p.len {
                part += 1;
                at = 0;
            }
        }
        left -= piece.len();
        pieces.push(Bytes::from(piece));
    }
    Ok(pieces)
}

/// Bytes of each buffer a `PUT_FROM` block is gathered into: below
/// jemalloc's `oversize_threshold` (8 MiB), whose arena returns freed pages
/// to the kernel at once, so a block-sized buffer would be faulted in page
/// by page on every PUT; pieces this size come back warm from jemalloc's
/// caches: 16 MiB PUTs from a `/dev/shm` buffer ran at 1.5-2.0 GB/s and
/// 0.5-0.7 server CPU s/GB this way, 1.1-1.4 GB/s and 0.8-1.4 s/GB through
/// a pool of block-sized buffers (which the RAM tier keeps, so it ran dry).
const GATHER_PIECE_BYTES: usize = 1 << 20;

fn shrunk(size: u64, needed: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!("the registered file is {size} bytes, shorter than the item needs (up to byte {needed})"),
    )
}

fn map_region(fd: i32, offset: u64, len: u64, hugetlb: bool) -> Result<Mapping, String> {
    // hugetlbfs maps in huge pages; its page size is the file's block size.
    let page = if hugetlb {
        // SAFETY: fstat on the caller's descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        unsafe { libc::fstat(fd, &mut st) };
        st.st_blksize as u64
    } else {
        // SAFETY: sysconf has no preconditions.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) as u64 }
    };
    let start = offset / page * page;
    let region_at = (offset - start) as usize;
    let map_len = (region_at as u64 + len) as usize;
    // SAFETY: a new shared mapping of a descriptor we own; checked below.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, start as i64) };
    if base == libc::MAP_FAILED {
        return Err(format!("mapping the client's file failed: {}", errno()));
    }
    let m = Mapping { base: base.cast(), map_len, region_at, guard: None };
    // A huge page that cannot be had faults with SIGBUS on first touch:
    // take them all now, where the kernel answers with an error instead.
    // SAFETY: the range is the mapping just made.
    if hugetlb && unsafe { libc::madvise(base, map_len, libc::MADV_POPULATE_WRITE) } != 0 {
        return Err(format!("faulting in the huge pages of the region failed: {}", errno()));
    }
    Ok(m)
}

/// The destination of one `GET_INTO` item (one part) or `GET_INTO_V` item
/// (several): the block's bytes, in order, laid across the parts in order.
pub struct ItemSink {
    /// The spans, in block order.
    pub parts: Vec<Part>,
    /// Set when a client's file was shorter than its region.
    pub shrunk: AtomicBool,
    /// Set when the client gave up on the memory before the block was in.
    pub cancelled: AtomicBool,
}

impl ItemSink {
    /// A sink over `parts`.
    pub fn new(parts: Vec<Part>) -> ItemSink {
        ItemSink { parts, shrunk: AtomicBool::new(false), cancelled: AtomicBool::new(false) }
    }

    /// Writes `chunk`, block offset `offset`, into the parts it falls in.
    fn scatter(&self, offset: u64, chunk: &[u8]) -> std::io::Result<()> {
        let room: u64 = self.parts.iter().map(|p| p.len).sum();
        if offset + chunk.len() as u64 > room {
            return Err(std::io::Error::other(format!("a block overruns the item's {room} bytes of room")));
        }
        // `start`: block offset of the part's first byte.
        let mut start = 0u64;
        for p in &self.parts {
            let end = start + p.len;
            let (from, to) = (offset.max(start), (offset + chunk.len() as u64).min(end));
            if from < to {
                p.region.write(p.at + (from - start), &chunk[(from - offset) as usize..(to - offset) as usize])?;
            }
            start = end;
        }
        Ok(())
    }
}

impl BlockSink for ItemSink {
    fn write_at(&self, offset: u64, chunk: &[u8]) -> std::io::Result<()> {
        // The socket is asked once per chunk; each piece's copy checks the
        // flags it leaves (`Region::write`).
        let r = if wanted(&self.parts) { self.scatter(offset, chunk) } else { Err(cancelled()) };
        if let Err(e) = &r {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.shrunk.store(true, Ordering::Relaxed);
            } else if is_cancelled(e) {
                self.cancelled.store(true, Ordering::Relaxed);
            }
        }
        r
    }
}
