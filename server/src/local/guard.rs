//! `SIGBUS` guards for mappings of client files that may shrink.
//!
//! Touching a page of a `MAP_SHARED` mapping past the end of its file raises
//! `SIGBUS`, which kills the process. A sealed memfd (`F_SEAL_SHRINK`) cannot
//! shrink, but the engines' own host buffers are not sealed (vLLM's
//! `/dev/shm` primary tier, LMCache's `shm_name` segment, SGLang's `shm`
//! memfd), and `pread`/`pwrite` on them runs at about half the speed of a
//! `memcpy` through a mapping (docs/BENCHMARKS.md). So such a file is mapped
//! under a guard, as Wayland compositors do with their clients' `wl_shm`
//! pools (libwayland's `wl_shm_buffer_begin_access`): a process-wide
//! `SIGBUS` handler looks the faulting address up among the guarded ranges
//! and, when it lies in one, maps anonymous zero pages over the whole range
//! (`MAP_FIXED`) and marks it faulted, so the copy in progress completes
//! harmlessly and its caller answers `BUFFER_SHRUNK`; every later copy
//! through that range fails the same way until the client registers again.
//! A `SIGBUS` anywhere else goes to the handler installed before this one
//! (Rust's own, for stack overflows), or kills the process as by default.
//!
//! The handler reads only a fixed table of atomics and calls only `mmap`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

/// Guarded ranges at once, at most (a registration beyond it uses file I/O).
pub const GUARDS_MAX: usize = 4096;

struct Slot {
    in_use: AtomicBool,
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // the initializer of a static array
const FREE: Slot =
    Slot { in_use: AtomicBool::new(false), start: AtomicUsize::new(0), len: AtomicUsize::new(0), faulted: AtomicBool::new(false) };
static SLOTS: [Slot; GUARDS_MAX] = [FREE; GUARDS_MAX];
static INSTALL: Once = Once::new();
/// `SIGBUS` faults caught in guarded ranges since start.
static CAUGHT: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The `SIGBUS` action before ours; written once, before ours is installed.
static mut PREVIOUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::zeroed();

/// A guarded range `[start, start + len)` of this process's address space
/// (a mapping of a client's file); unguarded on drop, which must come before
/// the range is unmapped.
pub struct Guard {
    slot: usize,
}

impl Guard {
    /// Guards `len` bytes at `start`, installing the handler on first use.
    /// `None` when the table is full or the handler cannot be installed (the
    /// caller then uses file I/O).
    pub fn new(start: usize, len: usize) -> Option<Guard> {
        INSTALL.call_once(install);
        if !INSTALLED.load(Ordering::Acquire) {
            return None;
        }
        let slot = SLOTS.iter().position(|s| s.in_use.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok())?;
        let s = &SLOTS[slot];
        s.faulted.store(false, Ordering::Relaxed);
        s.len.store(len, Ordering::Relaxed);
        s.start.store(start, Ordering::Release);
        Some(Guard { slot })
    }

    /// Whether the range is lost: a `SIGBUS` in it replaced it with zero
    /// pages (the client's file shrank under the mapping), or [`Guard::lose`].
    pub fn faulted(&self) -> bool {
        SLOTS[self.slot].faulted.load(Ordering::Acquire)
    }

    /// Marks the range lost without a fault (its file was seen shrunk), so
    /// every later copy fails alike, whether or not one faulted.
    pub fn lose(&self) {
        SLOTS[self.slot].faulted.store(true, Ordering::Release);
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &SLOTS[self.slot];
        s.start.store(0, Ordering::Release);
        s.in_use.store(false, Ordering::Release);
    }
}

/// `SIGBUS` faults caught in guarded ranges since start: copies that met a
/// client's file shrunk under them (each costs that registration).
pub fn faults_caught() -> u64 {
    CAUGHT.load(Ordering::Relaxed)
}

fn install() {
    // SAFETY: sigaction with a zeroed struct whose handler is `on_sigbus`, an
    // `extern "C"` function of the signature SA_SIGINFO expects; PREVIOUS is
    // written here once, before the handler that reads it can run.
    unsafe {
        let mut ours: libc::sigaction = std::mem::zeroed();
        ours.sa_sigaction = on_sigbus as *const () as usize;
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // Every other signal waits until the handler returns. It runs on
        // the thread's alternate signal stack (Rust's: 8 KiB, for stack
        // overflows), and a handler that lands on top of it runs there too:
        // the stall detector's, which unwinds the stack with libgcc, ran
        // past it and the process died of SIGSEGV (a copy into a shrinking
        // buffer that took past the stall threshold, 1 run in 2 on a busy
        // machine).
        libc::sigfillset(&mut ours.sa_mask);
        if libc::sigaction(libc::SIGBUS, &ours, (*std::ptr::addr_of_mut!(PREVIOUS)).as_mut_ptr()) == 0 {
            INSTALLED.store(true, Ordering::Release);
        } else {
            tracing::warn!("cannot install the SIGBUS handler: {}; unsealed client buffers use file I/O", std::io::Error::last_os_error());
        }
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &SLOTS {
        let start = s.start.load(Ordering::Acquire);
        if start == 0 || addr < start {
            continue;
        }
        let len = s.len.load(Ordering::Acquire);
        if addr - start < len {
            // SAFETY: replaces the guarded range, a mapping this process made
            // and still holds (the guard outlives it), with private zero
            // pages: the faulting access, and any other in flight, completes.
            let p = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                s.faulted.store(true, Ordering::Release);
                CAUGHT.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }
    // Not ours: what was there before.
    // SAFETY: PREVIOUS was written before this handler was installed; its
    // handler, if any, has the signature its flags say.
    unsafe {
        let previous = (*std::ptr::addr_of!(PREVIOUS)).assume_init_ref();
        match previous.sa_sigaction {
            libc::SIG_DFL | libc::SIG_IGN => {
                // Back to the default action; returning re-runs the faulting
                // access, which now ends the process as it would have.
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
            f if previous.sa_flags & libc::SA_SIGINFO != 0 => {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(f);
                f(sig, info, ctx)
            }
            f => {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(f);
                f(sig)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handler_blocks_the_stall_detectors_signal_while_it_runs_on_the_alternate_stack() {
        let _ = Guard::new(0x1000, 1);
        // SAFETY: sigaction reads the current action into a zeroed struct.
        let (flags, stall_blocked) = unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut now), 0);
            (now.sa_flags, libc::sigismember(&now.sa_mask, kvtier_engine::stall::STALL_SIGNAL))
        };
        assert_ne!(flags & libc::SA_ONSTACK, 0, "the handler runs on the alternate stack");
        assert_eq!(stall_blocked, 1, "the stall detector's handler (an unwinder) must not nest on the alternate stack");
    }

    #[test]
    fn a_file_shrunk_under_a_guarded_mapping_faults_into_zero_pages_not_a_crash() {
        let page = 4096usize;
        // SAFETY: a memfd of two pages, mapped shared, then truncated to one.
        unsafe {
            let fd = libc::memfd_create(c"guard-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, 2 * page as i64), 0);
            let base = libc::mmap(std::ptr::null_mut(), 2 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            assert_ne!(base, libc::MAP_FAILED);
            let guard = Guard::new(base as usize, 2 * page).expect("a guard slot");
            std::ptr::write_bytes(base.cast::<u8>(), 7, 2 * page);
            assert!(!guard.faulted());
            assert_eq!(libc::ftruncate(fd, page as i64), 0);
            // The second page is past the end of the file now: SIGBUS, caught.
            std::ptr::write_volatile(base.cast::<u8>().add(page + 1), 9);
            assert!(guard.faulted());
            assert_eq!(std::ptr::read_volatile(base.cast::<u8>().add(page + 1)), 9, "the range is private zero pages now");
            drop(guard);
            libc::munmap(base, 2 * page);
            libc::close(fd);
        }
    }
}
