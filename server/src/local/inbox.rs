//! Bytes read off a same-host connection and not yet parsed into frames,
//! with the descriptors (`SCM_RIGHTS`) that came with them.

use std::collections::VecDeque;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Control-message room: this many descriptors per `recvmsg`.
const FDS_PER_RECV: usize = 16;

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
        // u64 storage keeps the control buffer aligned for cmsghdr.
        let mut control = [0u64; 64];
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE((FDS_PER_RECV * std::mem::size_of::<RawFd>()) as u32) } as usize;
        debug_assert!(space <= std::mem::size_of_val(&control));
        // SAFETY: zeroed msghdr, then pointed at live buffers.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: recvmsg into the iovec and control buffer set up above.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel wrote `n` bytes into the spare capacity.
        unsafe { self.buf.set_len(self.buf.len() + n as usize) };
        let mut fds = Vec::new();
        // SAFETY: walking the control messages the kernel wrote into `msg`.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(std::io::Error::other(format!("more than {FDS_PER_RECV} descriptors in one message; the extra were lost")));
        }
        if !fds.is_empty() {
            self.fds.push_back((self.base + self.buf.len() as u64, fds));
        }
        Ok(n as usize)
    }
}
