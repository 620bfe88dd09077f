//! The socket calls std does not offer: a write with one descriptor in
//! `SCM_RIGHTS`, a read that takes the descriptors coming with its bytes,
//! and the peer's pid (`SO_PEERCRED`).

use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use kvtier_local_proto::fds;

/// Writes `bytes` with `fd` in `SCM_RIGHTS` on the first `sendmsg`, the
/// rest (if the kernel took only part) with plain writes. `fd` stays the
/// caller's; the receiver gets its own.
///
/// # Errors
/// The `sendmsg` or write error (`EPIPE` once the peer closed).
pub fn send_with_fd(mut stream: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut control = fds::Control::default();
    let msg = fds::sending(&mut iov, &mut control, &[fd]);
    let n = loop {
        // SAFETY: `msg` points at the iovec and control buffer above.
        let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    stream.write_all(&bytes[n..])
}

/// Reads exactly `buf.len()` bytes, adding the descriptors that come with
/// them (close-on-exec) to `fds`. `Ok(false)`: the stream ended before the
/// first byte. A descriptor beyond the one the control room fits is closed
/// by the kernel (`MSG_CTRUNC`); `truncated` is then set.
///
/// # Errors
/// The `recvmsg` error, or `UnexpectedEof` when the stream ends inside `buf`.
pub fn recv_exact(stream: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>, truncated: &mut bool) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let mut iov = libc::iovec { iov_base: buf[got..].as_mut_ptr().cast(), iov_len: buf.len() - got };
        let mut control = fds::Control::default();
        let mut msg = fds::receiving(&mut iov, &mut control, 1);
        // SAFETY: `msg` points at live buffers of the lengths given.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: `msg` was filled by the recvmsg above; `control` lives.
        fds.extend(unsafe { fds::received(&msg) });
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            *truncated = true;
        }
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the connection ended {got} bytes into a {}-byte read", buf.len()),
            ));
        }
        got += n as usize;
    }
    Ok(true)
}

/// The peer's pid (`SO_PEERCRED`); 0 when it runs in a pid namespace this
/// process cannot see into.
///
/// # Errors
/// The `getsockopt` error.
pub fn peer_pid(stream: &UnixStream) -> io::Result<i32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live and sized for SO_PEERCRED.
    let rc = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid)
}
