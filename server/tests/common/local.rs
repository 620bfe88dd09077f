//! A raw client of the same-host data plane (docs/LOCAL.md) for tests:
//! frames as bytes, nothing checked on the way out, so a test can send
//! what a broken client would.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub const HELLO: u8 = 1;
pub const REGISTER: u8 = 2;
pub const UNREGISTER: u8 = 3;
pub const GET_INTO: u8 = 4;
pub const PUT_FROM: u8 = 5;
pub const EXISTS: u8 = 6;
pub const GET_INTO_V: u8 = 10;
pub const PUT_FROM_V: u8 = 11;

/// A raw protocol connection: frames as bytes, nothing checked on the way
/// out, so tests can send what a broken client would.
pub struct Raw {
    /// The socket.
    pub s: UnixStream,
    next_id: u64,
}

/// A response: op, request id, status, retry hint, body or message.
#[derive(Debug)]
pub struct Answer {
    /// Response op (request op | 0x80, or 0xFF).
    pub op: u8,
    /// Echoed request id.
    pub id: u64,
    /// 0 or a negative code.
    pub status: i32,
    /// `retry_after_ms` (with `OVERLOADED`).
    pub retry_after_ms: u32,
    /// Body, or the error message.
    pub body: Vec<u8>,
}

impl Answer {
    pub fn message(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Per-item `(result, extra)` of a batch body.
    pub fn items(&self) -> Vec<(i64, u8)> {
        assert_eq!(self.status, 0, "{}", self.message());
        let n = u32::from_le_bytes(self.body[..4].try_into().unwrap()) as usize;
        (0..n).map(|i| (i64::from_le_bytes(self.body[4 + 9 * i..12 + 9 * i].try_into().unwrap()), self.body[12 + 9 * i])).collect()
    }
}

pub use kvtier_local_proto::frame;

/// A payload of keys.
pub fn keys_payload(keys: &[&str]) -> Vec<u8> {
    kvtier_local_proto::encode_keys(keys)
}

/// A `GET_INTO`/`PUT_FROM` payload of `(handle, offset, length, key)` items.
pub fn items_payload(items: &[(u64, u64, u64, &str)]) -> Vec<u8> {
    kvtier_local_proto::encode_items(items)
}

/// A `GET_INTO_V`/`PUT_FROM_V` payload of `(parts, key)` items, each part a
/// `(handle, offset, length)` span; part counts are not checked, so a test
/// can send 0 or 17.
pub fn items_v_payload(items: &[kvtier_local_proto::ItemV<'_>]) -> Vec<u8> {
    kvtier_local_proto::encode_items_v(items)
}

/// Copies `bytes` to `at` in the test's own memfd.
pub fn write_at(fd: &OwnedFd, at: u64, bytes: &[u8]) {
    // SAFETY: pwrite from a live slice on the test's own descriptor.
    let n = unsafe { libc::pwrite(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), at as i64) };
    assert_eq!(n, bytes.len() as isize, "pwrite at {at}");
}

/// `n` bytes at `at` in the test's own memfd.
pub fn read_at(fd: &OwnedFd, at: u64, n: u64) -> Vec<u8> {
    let mut out = vec![0u8; n as usize];
    // SAFETY: pread into a live buffer of `n` bytes on the test's own descriptor.
    let got = unsafe { libc::pread(fd.as_raw_fd(), out.as_mut_ptr().cast(), out.len(), at as i64) };
    assert_eq!(got, n as isize, "pread at {at}");
    out
}

impl Raw {
    /// A `GET_INTO_V` (`op` [`GET_INTO_V`]) or `PUT_FROM_V` batch of
    /// `(parts, key)` items: the per-item `(result, tier | created)`.
    pub fn call_v(&mut self, op: u8, items: &[kvtier_local_proto::ItemV<'_>]) -> Vec<(i64, u8)> {
        self.call(op, &items_v_payload(items)).items()
    }

    pub fn connect(path: &Path) -> Raw {
        let s = UnixStream::connect(path).unwrap_or_else(|e| panic!("connect {}: {e}", path.display()));
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw { s, next_id: 1 }
    }

    /// Connected and past a good hello.
    pub fn ready(path: &Path) -> Raw {
        let mut r = Raw::connect(path);
        let a = r.call(HELLO, br#"{"versions":[1]}"#);
        assert_eq!(a.status, 0, "{}", a.message());
        r
    }

    pub fn send(&mut self, op: u8, payload: &[u8]) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.s.write_all(&frame(op, id, payload)).unwrap();
        id
    }

    pub fn read(&mut self) -> Option<Answer> {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).ok()?;
        assert_eq!(&h[..2], &[0x54, 0x4B], "magic");
        let n = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        let mut p = vec![0u8; n];
        self.s.read_exact(&mut p).unwrap();
        Some(Answer {
            op: h[2],
            id: u64::from_le_bytes(h[8..16].try_into().unwrap()),
            status: i32::from_le_bytes(p[..4].try_into().unwrap()),
            retry_after_ms: u32::from_le_bytes(p[4..8].try_into().unwrap()),
            body: p[8..].to_vec(),
        })
    }

    pub fn call(&mut self, op: u8, payload: &[u8]) -> Answer {
        let id = self.send(op, payload);
        let a = self.read().expect("an answer");
        assert_eq!(a.id, id);
        a
    }

    /// `REGISTER` with `fds` attached (none, one, or several).
    pub fn register(&mut self, fds: &[i32], offset: u64, len: u64) -> Answer {
        let mut payload = offset.to_le_bytes().to_vec();
        payload.extend_from_slice(&len.to_le_bytes());
        let id = self.next_id;
        self.next_id += 1;
        send_with_fds(&self.s, &frame(REGISTER, id, &payload), fds);
        self.read().expect("an answer")
    }

    /// Whether the server closed the connection (EOF within 5 s).
    pub fn closed(&mut self) -> bool {
        self.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0))
    }
}

pub fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[i32]) {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
    let mut control = kvtier_local_proto::fds::Control::default();
    let msg = kvtier_local_proto::fds::sending(&mut iov, &mut control, fds);
    // SAFETY: `msg` points at the iovec and control buffer above.
    assert_eq!(unsafe { libc::sendmsg(s.as_raw_fd(), &msg, 0) }, bytes.len() as isize);
}

/// A memfd of `len` bytes, sealed against shrinking when `sealed`.
pub fn memfd(len: u64, sealed: bool) -> OwnedFd {
    // SAFETY: plain syscalls; the fd is owned from here on.
    unsafe {
        let fd = libc::memfd_create(c"kvtier-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as i64), 0);
        if sealed {
            assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW), 0);
        }
        OwnedFd::from_raw_fd(fd)
    }
}

/// Connects to `path`, registers a sealed memfd of two blocks and returns
/// the connection, the memfd and its handle.
pub fn ready_with_buffer(path: &Path, block_bytes: u64) -> (Raw, OwnedFd, u64) {
    let mut r = Raw::ready(path);
    let fd = memfd(2 * block_bytes, true);
    let a = r.register(&[fd.as_raw_fd()], 0, 2 * block_bytes);
    assert_eq!(a.status, 0, "{}", a.message());
    let handle = u64::from_le_bytes(a.body[..8].try_into().unwrap());
    (r, fd, handle)
}

/// `PUT_FROM` of `block` under `key` through the buffer's first block.
pub fn put_block(r: &mut Raw, fd: &OwnedFd, handle: u64, key: &str, block: &[u8]) -> i64 {
    // SAFETY: pwrite on the test's own memfd.
    unsafe { libc::pwrite(fd.as_raw_fd(), block.as_ptr().cast(), block.len(), 0) };
    r.call(PUT_FROM, &items_payload(&[(handle, 0, block.len() as u64, key)])).items()[0].0
}

/// `GET_INTO` of `key` into the buffer's second block: the item's result,
/// its tier number, and the bytes that landed there.
pub fn get_block(r: &mut Raw, fd: &OwnedFd, handle: u64, key: &str, block_bytes: u64) -> (i64, u8, Vec<u8>) {
    let (result, tier) = r.call(GET_INTO, &items_payload(&[(handle, block_bytes, block_bytes, key)])).items()[0];
    let mut back = vec![0u8; block_bytes as usize];
    // SAFETY: pread on the test's own memfd.
    unsafe { libc::pread(fd.as_raw_fd(), back.as_mut_ptr().cast(), back.len(), block_bytes as i64) };
    (result, tier, back)
}
