//! Memory files the engine shares read-only with same-host clients (the
//! RAM tier's arena, `ram/arena.rs`; the index tables, `shared_index.rs`):
//! a memfd mapped shared and writable here, then sealed so no later mapping
//! can write it, nor its size change, nor its seals; clients get a
//! descriptor reopened read-only.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A memfd named `name` of `bytes`, mapped `MAP_SHARED` and writable:
/// `hugetlb` of reserved 2 MiB pages, faulted in at once. Returns the file
/// and the mapping's address; the caller owns the mapping (`munmap`).
///
/// # Errors
/// The `memfd_create`, `ftruncate` or `mmap` that failed, with the OS error.
pub(crate) fn create(name: &std::ffi::CStr, bytes: usize, hugetlb: bool) -> std::io::Result<(OwnedFd, *mut libc::c_void)> {
    let fail = |what: &str| std::io::Error::other(format!("{what}: {}", std::io::Error::last_os_error()));
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | if hugetlb { libc::MFD_HUGETLB } else { 0 };
    // SAFETY: creates a memory file; the result is checked and owned.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(fail("memfd_create"));
    }
    // SAFETY: a descriptor just created, owned by no one else.
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizes the file just made.
    if unsafe { libc::ftruncate(file.as_raw_fd(), bytes as libc::off_t) } != 0 {
        return Err(fail("ftruncate"));
    }
    let populate = if hugetlb { libc::MAP_POPULATE } else { 0 };
    // SAFETY: maps the file just sized; the result is checked.
    let ptr = unsafe {
        libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | populate, file.as_raw_fd(), 0)
    };
    if ptr == libc::MAP_FAILED {
        return Err(fail("mmap"));
    }
    Ok((file, ptr))
}

/// Seals `file` (`F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_FUTURE_WRITE`,
/// `F_SEAL_SEAL`): the writable mapping made before stays writable, no
/// mapping made after can write. On failure unmaps `ptr` (`bytes`).
///
/// # Errors
/// The `fcntl` that failed.
pub(crate) fn seal(file: &OwnedFd, ptr: *mut libc::c_void, bytes: usize) -> std::io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: seals a file the caller owns.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        let e = std::io::Error::other(format!("sealing: {}", std::io::Error::last_os_error()));
        // SAFETY: unmaps the caller's mapping of `bytes` at `ptr`.
        unsafe { libc::munmap(ptr, bytes) };
        return Err(e);
    }
    Ok(())
}

/// A new descriptor of `file`, opened read-only through `/proc/self/fd`
/// (a new open file description, so the client cannot write through it
/// whatever the seals say).
///
/// # Errors
/// The reopen failed.
pub(crate) fn reopen_read_only(file: &OwnedFd) -> std::io::Result<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL in a path of digits");
    // SAFETY: opens a path; the result is checked and owned.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
