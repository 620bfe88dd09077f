//! Bytes read off a same-host connection and not yet parsed into frames,
//! with the descriptors (`SCM_RIGHTS`) that came with them.

use std::collections::VecDeque;
use std::os::fd::{OwnedFd, RawFd};

/// Control-message room: this many descriptors per `recvmsg`.
const FDS_PER_RECV: usize = kvtier_local_proto::fds::FDS_MAX;

/// Bytes read off the socket and not yet parsed into frames, with the
/// descriptors that came with them.
pub(super) struct Inbox {
    pub(super) buf: Vec<u8>,
    /// Stream offset of `buf[0]`.
    pub(super) base: u64,
    /// Descriptors received, each batch tagged with the stream offset just
    /// past the bytes of the `recvmsg` that carried it.
    pub(super) fds: VecDeque<(u64, Vec<OwnedFd>)>,
}

impl Inbox {
    /// The descriptor of a `REGISTER` frame starting at `frame_start`:
    /// the batch that came with its first bytes. Earlier, unclaimed
    /// descriptors are closed.
    pub(super) fn claim(&mut self, frame_start: u64) -> Result<OwnedFd, String> {
        while self.fds.front().is_some_and(|(end, _)| *end <= frame_start) {
            self.fds.pop_front();
        }
        match self.fds.pop_front() {
            Some((_, mut fds)) if fds.len() == 1 => Ok(fds.pop().expect("one")),
            Some((_, fds)) => Err(format!("REGISTER came with {} descriptors; send exactly one per frame", fds.len())),
            None => Err("REGISTER came without a descriptor (send one with SCM_RIGHTS in the frame's sendmsg)".into()),
        }
    }

    pub(super) fn pending_fds(&self) -> usize {
        self.fds.iter().map(|(_, f)| f.len()).sum()
    }

    /// One `recvmsg` into the buffer; the bytes read (0 at end of stream).
    pub(super) fn recv(&mut self, fd: RawFd, want: usize) -> std::io::Result<usize> {
        self.buf.reserve(want.max(64 << 10));
        let spare = self.buf.capacity() - self.buf.len();
        let mut iov = libc::iovec { iov_base: unsafe { self.buf.as_mut_ptr().add(self.buf.len()) }.cast(), iov_len: spare };
        let mut control = kvtier_local_proto::fds::Control::default();
        let mut msg = kvtier_local_proto::fds::receiving(&mut iov, &mut control, FDS_PER_RECV);
        // SAFETY: recvmsg into the iovec and control buffer set up above.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel wrote `n` bytes into the spare capacity.
        unsafe { self.buf.set_len(self.buf.len() + n as usize) };
        // SAFETY: `msg` was filled by the recvmsg above; `control` lives.
        let fds = unsafe { kvtier_local_proto::fds::received(&msg) };
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(std::io::Error::other(format!("more than {FDS_PER_RECV} descriptors in one message; the extra were lost")));
        }
        if !fds.is_empty() {
            self.fds.push_back((self.base + self.buf.len() as u64, fds));
        }
        Ok(n as usize)
    }
}
