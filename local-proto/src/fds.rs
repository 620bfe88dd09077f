//! Descriptors in `SCM_RIGHTS`, both ways, for the server and the client
//! core: the `msghdr` that carries them on `sendmsg`, the room for them on
//! `recvmsg`, and the walk over what the kernel handed back. The socket
//! calls themselves stay with each caller (blocking, glommio, tokio).

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Descriptors one control buffer holds, at most.
pub const FDS_MAX: usize = 16;

/// Room for the control message of up to [`FDS_MAX`] descriptors; u64
/// storage keeps it aligned for `cmsghdr`.
pub type Control = [u64; 16];

fn space(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE is a size computation.
    unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) as usize }
}

/// A `msghdr` for `sendmsg` of `iov` with `fds` in one `SCM_RIGHTS` control
/// message written into `control` (none when `fds` is empty). The
/// descriptors stay the caller's; the receiver gets its own.
///
/// # Panics
/// More than [`FDS_MAX`] descriptors.
pub fn sending(iov: &mut libc::iovec, control: &mut Control, fds: &[RawFd]) -> libc::msghdr {
    assert!(fds.len() <= FDS_MAX, "{} descriptors in one message; at most {FDS_MAX}", fds.len());
    // SAFETY: a zeroed msghdr is valid; it is pointed at the caller's live
    // iovec and control buffer, and the one cmsghdr is written inside
    // `control`, which CMSG_SPACE(FDS_MAX descriptors) fits.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let data_bytes = std::mem::size_of_val(fds) as u32;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space(fds.len()) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(data_bytes) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
        }
        msg
    }
}

/// A `msghdr` for `recvmsg` into `iov` with room in `control` for up to
/// `fds` descriptors (at most [`FDS_MAX`]).
pub fn receiving(iov: &mut libc::iovec, control: &mut Control, fds: usize) -> libc::msghdr {
    // SAFETY: a zeroed msghdr is valid; it is pointed at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space(fds.min(FDS_MAX)) as _;
    msg
}

/// The descriptors (now the caller's) that a `recvmsg` into `msg` received
/// in `SCM_RIGHTS`.
///
/// # Safety
/// `msg` was filled by a successful `recvmsg`, and its control buffer is
/// still alive.
pub unsafe fn received(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `msg`;
    // each SCM_RIGHTS descriptor is new to this process and owned from here.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    fds
}
