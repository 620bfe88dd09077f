//! Faulting memory in on a helper thread, off the start-up path.
//!
//! The store keeps two large regions resident: each shard's registered I/O
//! memory (glommio's `io_memory`: `--io-memory-mib`, 512 MiB by default split
//! over the shards, at least 64 MiB each) and its RAM
//! tier. Faulting a page in costs its zeroing, and on a VM that hands freed
//! guest memory back to the host (virtio-balloon free page reporting) also
//! the host's fault: measured here, 256 MiB of 2 MiB pages took 30 ms when
//! the pages had just been freed and up to 670 ms when they had gone back to
//! the host. Start-up does neither: a shard serves first, and these regions
//! are faulted in afterwards by [`populate`], then the I/O memory is
//! registered with io_uring (see [`crate::store::run`]).
//!
//! [`populate`] advises [`CHUNK_BYTES`] at a time because
//! `MADV_POPULATE_WRITE` holds the process's memory-map lock (for reading)
//! for the whole range it is given: one call over 256 MiB held it for up to
//! 0.6 s, and every `mmap`/`munmap` of the process (an allocation, a thread
//! stack, an io_uring ring) waited behind it, and every page fault behind
//! those. A chunk holds it for a few ms at most.

use std::sync::atomic::{AtomicBool, Ordering};

/// Bytes faulted in per `madvise` call: one 2 MiB huge page.
pub const CHUNK_BYTES: usize = 2 << 20;

/// Faults in the pages of `[addr, addr + len)` for writing
/// (`MADV_POPULATE_WRITE`, Linux 5.14+), [`CHUNK_BYTES`] at a time, until
/// done or `stop` is set. Returns `Ok(true)` when every page is present,
/// `Ok(false)` when stopped first.
///
/// The advice only maps pages not yet present and never changes data, so
/// the memory may be in use meanwhile (buffers handed out, slots filled); a
/// range that is no longer mapped fails with `ENOMEM` and changes nothing.
///
/// # Errors
/// The `madvise` error (`EINVAL` on kernels without the advice).
pub fn populate(addr: usize, len: usize, stop: &AtomicBool) -> std::io::Result<bool> {
    let end = addr + len;
    let mut at = addr;
    while at < end {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let n = CHUNK_BYTES.min(end - at);
        // SAFETY: MADV_POPULATE_WRITE only faults in absent pages of the
        // range (see above); it reads and writes no data.
        if unsafe { libc::madvise(at as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        at += n;
    }
    Ok(true)
}

/// Makes the calling helper thread a background one: free to run on any
/// CPU the process's main thread may use (a thread spawned by a shard
/// inherits its pinning to the shard's CPU and would take half of it), and
/// at nice 10, so that a shard with work runs first.
pub fn run_in_background() {
    // SAFETY: sched_getaffinity/sched_setaffinity fill and read a cpu_set_t
    // we own; pid 0 is this thread, getpid() the main thread; setpriority
    // with who 0 changes only this thread (Linux: nice is per thread).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(libc::getpid(), std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
        libc::setpriority(libc::PRIO_PROCESS, 0, 10);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn populates_every_chunk_and_keeps_data() {
        let len = 3 * CHUNK_BYTES + 4096;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a fresh anonymous mapping, unmapped below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: the mapping is `len` bytes long and ours alone.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) };
        bytes[0] = 7;
        bytes[len - 1] = 9;
        let stop = AtomicBool::new(false);
        assert!(populate(p as usize, len, &stop).unwrap());
        assert_eq!((bytes[0], bytes[CHUNK_BYTES], bytes[len - 1]), (7, 0, 9));
        stop.store(true, Ordering::Relaxed);
        assert!(!populate(p as usize, len, &stop).unwrap());
        // SAFETY: unmapping the mapping made above; `bytes` is not used again.
        unsafe { libc::munmap(p, len) };
    }
}
