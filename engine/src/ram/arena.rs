//! The RAM tier's slot memory: one mapping per shard of `slots` slots of
//! `slot_bytes`, then one u64 **generation** per slot. With `--ram-shared`
//! the mapping is a sealed memory file (memfd) that same-host clients map
//! read-only to read leased blocks in place (docs/LOCAL.md, "Leases");
//! otherwise anonymous memory. Either way 2 MiB huge pages where the kernel
//! has them.
//!
//! **Generations.** Before a slot is written again ([`Arena::reuse`]) its
//! generation goes up by one, ahead of any byte (a release fence orders the
//! increment before the writes). A client that read a leased slot and then
//! finds its generation unchanged (after an acquire fence) read the block
//! it leased: the seqlock rule, with the pin protocol of the module above
//! keeping a leased slot from being written at all while its lease lasts.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use serde::Serialize;

use crate::error::{Error, Result};

/// Huge page size the arena asks for: 2 MiB (x86-64 and arm64 default).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// How the arena's memory is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HugePages {
    /// `MAP_HUGETLB`: reserved 2 MiB pages (`vm.nr_hugepages`).
    Reserved,
    /// Transparent huge pages, asked for with `madvise(MADV_HUGEPAGE)`.
    Transparent,
    /// 4 KiB pages (the madvise was refused).
    None,
}

/// When the RAM tier's memory is a file same-host clients can map
/// (`--ram-shared`; docs/LOCAL.md, "Leases").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RamShared {
    /// Shared when that keeps the pages the tier has unshared: reserved
    /// huge pages, or transparent huge pages where shared memory gets them
    /// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled` not `never`).
    Auto,
    /// Always shared (4 KiB pages where shared memory gets no huge pages):
    /// the default, as GET_INTO from a 4 KiB-page arena measured 0.98-0.99x
    /// the huge-page one, within noise (docs/BENCHMARKS.md, "Leases").
    #[default]
    On,
    /// Never shared: anonymous memory, no leases.
    Off,
}

/// Where an arena's parts lie in its memory file, as `MAP_ARENA` tells a
/// client (docs/LOCAL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaLayout {
    /// Bytes of the file: the slots, rounded up to a huge page, then the
    /// generations, rounded up likewise.
    pub file_bytes: u64,
    /// Bytes per slot (`block_bytes`).
    pub slot_bytes: u64,
    /// Slots in the arena.
    pub slots: u32,
    /// Offset of slot 0's generation (u64 little-endian per slot).
    pub generations_offset: u64,
}

/// Slot memory, shared with the `Bytes` that pin its slots.
pub struct Arena {
    /// Process-wide number of this arena (`MAP_ARENA`'s `arena`).
    id: u32,
    base: NonNull<u8>,
    /// Bytes of the slots' part of the mapping (a huge-page multiple); the
    /// generations follow.
    map_bytes: usize,
    /// Bytes of the whole mapping: slots and generations.
    total_bytes: usize,
    slot_bytes: usize,
    pins: Box<[AtomicU32]>,
    huge_pages: HugePages,
    /// The sealed memory file behind a shared arena.
    file: Option<OwnedFd>,
    /// [`Arena::prefault_in_background`] ran (or nothing to fault in).
    prefault_started: AtomicBool,
}

// SAFETY: the arena is plain memory; who may write which slot and when is
// the pin protocol in the module docs, kept by `RamTier` (single-threaded)
// and `SlotRef` (atomics).
unsafe impl Send for Arena {}
// SAFETY: as above; shared access is reads of pinned slots and atomic pins.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps `slots` slots of `slot_bytes` and their generations, shared or
    /// not as `shared` says: reserved huge pages (faulted in at once) when
    /// the kernel has them, else transparent huge pages where it gives
    /// them, faulted in on a helper thread once
    /// [`Arena::prefault_in_background`] is called (after start-up).
    ///
    /// # Errors
    /// [`Error::Config`] when the mapping or the memory file fails (too
    /// large for memory or `vm.max_map_count`).
    pub fn new(slots: u32, slot_bytes: usize, shared: RamShared) -> Result<Arc<Arena>> {
        let bytes = slots as usize * slot_bytes;
        let map_bytes = bytes.div_ceil(HUGE_PAGE_BYTES).max(1) * HUGE_PAGE_BYTES;
        let total_bytes = map_bytes + (slots as usize * 8).div_ceil(HUGE_PAGE_BYTES).max(1) * HUGE_PAGE_BYTES;
        let too_big =
            |what: &str, e: std::io::Error| Error::Config(format!("cannot {what} a RAM tier of {total_bytes} bytes: {e}; lower --ram-gb"));
        let (ptr, huge_pages, file) = match shared {
            RamShared::Off => map_anonymous(total_bytes).map_err(|e| too_big("map", e))?,
            RamShared::On | RamShared::Auto => match map_file(total_bytes, true) {
                Ok(mapped) => mapped,
                Err(_) if shared == RamShared::Auto && !shmem_gets_huge_pages() => {
                    map_anonymous(total_bytes).map_err(|e| too_big("map", e))?
                }
                Err(_) => map_file(total_bytes, false).map_err(|e| too_big("share", e))?,
            },
        };
        let arena = Arc::new(Arena {
            id: NEXT_ARENA.fetch_add(1, Ordering::Relaxed),
            base: NonNull::new(ptr.cast()).expect("mmap returned a non-null address"),
            map_bytes,
            total_bytes,
            slot_bytes,
            pins: (0..slots).map(|_| AtomicU32::new(0)).collect(),
            huge_pages,
            file,
            prefault_started: AtomicBool::new(huge_pages == HugePages::Reserved),
        });
        if arena.file.is_some() {
            let mut shared = SHARED_ARENAS.lock().unwrap_or_else(|e| e.into_inner());
            shared.retain(|a| a.strong_count() > 0);
            shared.push(Arc::downgrade(&arena));
        }
        Ok(arena)
    }

    /// The arena's process-wide number.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Whether clients can map it (a memory file).
    pub fn is_shared(&self) -> bool {
        self.file.is_some()
    }

    /// How the memory is backed.
    pub fn huge_pages(&self) -> HugePages {
        self.huge_pages
    }

    /// Where its parts lie in its file.
    pub fn layout(&self) -> ArenaLayout {
        ArenaLayout {
            file_bytes: self.total_bytes as u64,
            slot_bytes: self.slot_bytes as u64,
            slots: self.pins.len() as u32,
            generations_offset: self.map_bytes as u64,
        }
    }

    /// A new descriptor of the memory file, opened read-only, for a client
    /// to map (the file is sealed against writes through any new mapping,
    /// against size changes and against new seals).
    ///
    /// # Errors
    /// The arena is not shared, or the reopen failed.
    pub fn read_only_fd(&self) -> std::io::Result<OwnedFd> {
        match &self.file {
            Some(file) => crate::sealed::reopen_read_only(file),
            None => Err(std::io::Error::other("the RAM tier is not shared (--ram-shared)")),
        }
    }

    fn generation(&self, slot: u32) -> &AtomicU64 {
        assert!((slot as usize) < self.pins.len(), "slot {slot} in an arena of {}", self.pins.len());
        // SAFETY: the generations start at `map_bytes`, 8-byte aligned (a
        // huge-page multiple), one u64 per slot, inside the mapping; only
        // atomics touch them.
        unsafe { &*(self.base.as_ptr().add(self.map_bytes + 8 * slot as usize) as *const AtomicU64) }
    }

    /// The generation of `slot` now.
    pub fn generation_of(&self, slot: u32) -> u64 {
        self.generation(slot).load(Ordering::Acquire)
    }

    /// Marks `slot` as about to be written again: its generation goes up by
    /// one before any of its bytes change (module docs).
    pub(crate) fn reuse(&self, slot: u32) {
        self.generation(slot).fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Faults every page in on a helper thread
    /// ([`crate::populate::populate`]: `MADV_POPULATE_WRITE`, Linux 5.14+, a
    /// huge page per call), so steady-state PUTs take no page faults; once
    /// per arena (reserved huge pages are in already). Called after the
    /// shard serves, not at start-up: populating 1 GiB took ~1 s here (page
    /// by page from user space 3.8 s), and up to 2.6 s on a VM whose freed
    /// memory had gone back to the host. The advice only maps pages not yet
    /// present and never changes data, so it may run while slots are being
    /// filled. Older kernels refuse it and pages fault on first use instead.
    pub fn prefault_in_background(self: &Arc<Self>) {
        if self.prefault_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let arena = self.clone();
        let spawned = std::thread::Builder::new().name("kvtier-ram-prefault".into()).spawn(move || {
            crate::populate::run_in_background();
            // `arena` keeps the mapping alive until this returns.
            let stop = AtomicBool::new(false);
            if let Err(e) = crate::populate::populate(arena.base.as_ptr() as usize, arena.total_bytes, &stop) {
                tracing::debug!("RAM tier prefault not available: {e}");
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("RAM tier prefault thread not started ({e}); pages fault on first use");
        }
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize) < self.pins.len());
        // SAFETY: slot < slots, so the offset lies inside the mapping.
        unsafe { self.base.as_ptr().add(slot as usize * self.slot_bytes) }
    }

    pub(crate) fn pinned(&self, slot: u32) -> bool {
        self.pins[slot as usize].load(Ordering::Acquire) > 0
    }

    /// A `Bytes` over `slot`, pinning it until the last clone drops.
    pub(crate) fn pin(self: &Arc<Self>, slot: u32) -> Bytes {
        self.pin_range(slot, 0, self.slot_bytes)
    }

    /// A `Bytes` over `len` bytes of `slot` from `offset`, pinning the slot
    /// until the last clone drops. A slot being filled chunk by chunk hands
    /// out each filled range while later ranges are still written: the
    /// ranges never overlap, so no byte a reader holds is written.
    pub(crate) fn pin_range(self: &Arc<Self>, slot: u32, offset: usize, len: usize) -> Bytes {
        assert!(offset + len <= self.slot_bytes, "range within the slot");
        self.pins[slot as usize].fetch_add(1, Ordering::AcqRel);
        Bytes::from_owner(SlotRef { arena: self.clone(), slot, offset, len })
    }

    /// Copies `bytes` to `offset` in `slot`, handing each 256 KiB step to
    /// `inspect` just after it is copied, as the slot now holds it (a CRC
    /// reads it while hot, and covers the slot's bytes even when the source
    /// is memory another process may change meanwhile: a client's
    /// registered region). The range must not have been handed out
    /// ([`Arena::pin_range`]) and the slot must be unreachable by lookups
    /// (reserved, not mapped).
    pub(crate) fn fill_range(&self, slot: u32, offset: usize, bytes: &[u8], mut inspect: impl FnMut(&[u8])) {
        const STEP_BYTES: usize = 256 << 10;
        assert!(offset + bytes.len() <= self.slot_bytes, "block larger than a RAM slot");
        let mut at = offset;
        for step in bytes.chunks(STEP_BYTES) {
            // SAFETY: in bounds (checked above); no reader holds this range
            // and only this thread writes it (the caller's protocol, above),
            // so the slice read back is the bytes just copied.
            let copied = unsafe {
                let to = self.slot_ptr(slot).add(at);
                std::ptr::copy_nonoverlapping(step.as_ptr(), to, step.len());
                std::slice::from_raw_parts(to, step.len())
            };
            inspect(copied);
            at += step.len();
        }
    }

    /// Copies `parts` (together `slot_bytes`) into an unpinned slot that no
    /// reader can reach.
    pub(crate) fn fill(&self, slot: u32, parts: &[&[u8]]) {
        assert!(!self.pinned(slot), "a pinned RAM slot is never written");
        let mut at = 0;
        for p in parts {
            self.fill_range(slot, at, p, |_| {});
            at += p.len();
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; no `SlotRef` outlives the
        // arena (each holds an `Arc` of it).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.total_bytes) };
    }
}

/// Owner of a RAM-served `Bytes`: keeps the slot pinned.
struct SlotRef {
    arena: Arc<Arena>,
    slot: u32,
    offset: usize,
    len: usize,
}

impl AsRef<[u8]> for SlotRef {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot is pinned while this exists, so nothing writes
        // this range (`pin_range` checked it lies inside the slot).
        unsafe { std::slice::from_raw_parts(self.arena.slot_ptr(self.slot).add(self.offset), self.len) }
    }
}

impl Drop for SlotRef {
    fn drop(&mut self) {
        self.arena.pins[self.slot as usize].fetch_sub(1, Ordering::Release);
    }
}

/// Numbers arenas across the process (from 1).
static NEXT_ARENA: AtomicU32 = AtomicU32::new(1);

/// The shared arenas alive in this process, for [`shared_arena`].
static SHARED_ARENAS: Mutex<Vec<Weak<Arena>>> = Mutex::new(Vec::new());

/// The shared arena numbered `id`, if it is alive (`MAP_ARENA`).
pub fn shared_arena(id: u32) -> Option<Arc<Arena>> {
    SHARED_ARENAS.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).find(|a| a.id == id)
}

/// The numbers of the shared arenas alive in this process, ascending: a
/// server's RAM tiers, one per shard (HELLO's `leases.arenas`, so that a
/// client can map and page-lock them all before its first lease).
pub fn shared_arena_ids() -> Vec<u32> {
    let mut ids: Vec<u32> =
        SHARED_ARENAS.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).map(|a| a.id).collect();
    ids.sort_unstable();
    ids
}

/// Whether shared memory (shmem, memfds) gets transparent huge pages:
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` is not `[never]`
/// (or `[deny]`).
fn shmem_gets_huge_pages() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .is_ok_and(|s| !s.contains("[never]") && !s.contains("[deny]"))
}

type Mapped = (*mut libc::c_void, HugePages, Option<OwnedFd>);

/// An anonymous private mapping of `bytes`: reserved huge pages, else
/// transparent ones where `madvise` takes the advice.
fn map_anonymous(bytes: usize) -> std::io::Result<Mapped> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    // SAFETY: an anonymous private mapping; the result is checked.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), bytes, prot, flags | libc::MAP_HUGETLB | libc::MAP_POPULATE, -1, 0) };
    if ptr != libc::MAP_FAILED {
        return Ok((ptr, HugePages::Reserved, None));
    }
    // SAFETY: as above.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), bytes, prot, flags, -1, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: advice on the mapping just made.
    let huge = if unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) } == 0 { HugePages::Transparent } else { HugePages::None };
    Ok((ptr, huge, None))
}

/// A sealed memory file of `bytes`, mapped shared and writable here:
/// `hugetlb` a hugetlb memfd of reserved 2 MiB pages (faulted in at once),
/// else a memfd with transparent huge pages where shared memory gets them.
/// The seals (`F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_FUTURE_WRITE`,
/// `F_SEAL_SEAL`) go on after this mapping is made, so it stays writable
/// while no later mapping can be.
fn map_file(bytes: usize, hugetlb: bool) -> std::io::Result<Mapped> {
    let (file, ptr) = crate::sealed::create(c"kvtier-ram", bytes, hugetlb)?;
    let huge = if hugetlb {
        HugePages::Reserved
    } else if shmem_gets_huge_pages() && unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) } == 0 {
        // SAFETY (above): advice on the mapping just made.
        HugePages::Transparent
    } else {
        HugePages::None
    };
    crate::sealed::seal(&file, ptr, bytes)?;
    Ok((ptr, huge, Some(file)))
}
