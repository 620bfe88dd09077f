//! hyper 1.x on glommio: the three pieces hyper needs from a runtime, built
//! on glommio's thread-per-core executor without `Send`.
//!
//! - [`LocalExec`]: hyper's executor; spawns connection sub-tasks (HTTP/2
//!   streams) on the current glommio executor.
//! - [`GlommioTimer`]: hyper's timer. Without one hyper silently skips the
//!   HTTP/1 header-read timeout and panics if one is configured.
//! - [`GlommioIo`]: `hyper::rt::{Read, Write}` over glommio's `TcpStream`,
//!   with a vectored write. h2 hands over each 9-byte frame header and its
//!   payload as separate buffers; written one at a time that is a syscall per
//!   frame header, which measured 0.66 GB/s against 1.70 GB/s with `sendmsg`
//!   of all buffers at once on this machine.

use std::future::Future;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::unix::io::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_lite::io::{AsyncRead, AsyncWrite};
use glommio::net::TcpStream;

/// hyper executor that spawns on the current glommio executor.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
    F::Output: 'static,
{
    fn execute(&self, fut: F) {
        glommio::spawn_local(fut).detach();
    }
}

/// hyper timer over glommio timers.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlommioTimer;

/// A glommio timer marked `Send + Sync` because hyper's `Sleep` demands it.
/// Sound here because hyper creates, polls and drops each sleep inside the
/// connection task that asked for it, which never leaves its executor.
struct LocalSleep(glommio::timer::Timer);

// SAFETY: see the type's docs: it never crosses a thread.
unsafe impl Send for LocalSleep {}
// SAFETY: as above; it is never shared between threads either.
unsafe impl Sync for LocalSleep {}

impl Future for LocalSleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.0).poll(cx).map(|_| ())
    }
}

impl hyper::rt::Sleep for LocalSleep {}

impl hyper::rt::Timer for GlommioTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(LocalSleep(glommio::timer::Timer::new(duration)))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep(deadline.saturating_duration_since(Instant::now()))
    }
}

/// A glommio TCP stream as hyper I/O.
pub struct GlommioIo {
    stream: TcpStream,
    /// The last write returned `Pending`, so the caller was promised a wake.
    /// glommio keeps that promise with a POLLOUT poll, but drops the poll
    /// (and the wake) when a later write succeeds first. hyper's HTTP/1
    /// dispatcher relies on the wake anyway, as tokio's readiness wake
    /// survives such a write: a flush that was `Pending` inside its body
    /// loop and then completed in its outer flush returns `Pending` with
    /// nothing armed, and a streamed body is never polled again (measured
    /// here: one 16 MiB response in ~2,000 stopped for good). So a write
    /// that succeeds after a `Pending` wakes the task itself.
    ///
    /// glommio holds no bytes while a write waits (it sends with a direct
    /// syscall, then polls for room), so a direct `sendmsg` may follow a
    /// `Pending` without reordering anything.
    write_waiting: bool,
}

impl GlommioIo {
    /// Wraps an accepted stream.
    pub fn new(stream: TcpStream) -> Self {
        GlommioIo { stream, write_waiting: false }
    }
}

impl hyper::rt::Read for GlommioIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, mut buf: hyper::rt::ReadBufCursor<'_>) -> Poll<io::Result<()>> {
        // SAFETY: the bytes are zeroed before being viewed as `[u8]`, and
        // `advance` is called with exactly the count the read filled.
        let filled = unsafe {
            let uninit: &mut [MaybeUninit<u8>] = buf.as_mut();
            std::ptr::write_bytes(uninit.as_mut_ptr(), 0, uninit.len());
            let dst = &mut *(uninit as *mut [MaybeUninit<u8>] as *mut [u8]);
            match Pin::new(&mut self.stream).poll_read(cx, dst) {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        };
        // SAFETY: `filled` bytes were written by the read above.
        unsafe { buf.advance(filled) };
        Poll::Ready(Ok(()))
    }
}

impl GlommioIo {
    fn poll_write_glommio(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.wrote(cx, polled)
    }

    /// Keeps the wake promised by an earlier `Pending` (see `write_waiting`).
    fn wrote<T>(&mut self, cx: &mut Context<'_>, polled: Poll<T>) -> Poll<T> {
        if self.write_waiting && polled.is_ready() {
            cx.waker().wake_by_ref();
        }
        self.write_waiting = polled.is_pending();
        polled
    }
}

impl hyper::rt::Write for GlommioIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_glommio(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let first = bufs.iter().find(|b| !b.is_empty()).map(|b| &b[..]).unwrap_or(&[]);
        if bufs.len() <= 1 {
            return self.poll_write_glommio(cx, first);
        }
        // SAFETY: msghdr is plain data; iov points at `bufs`, which outlive
        // the call, and IoSlice is ABI-compatible with iovec.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = bufs.len().min(libc::UIO_MAXIOV as usize) as _;
            libc::sendmsg(self.stream.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        if sent >= 0 {
            return self.wrote(cx, Poll::Ready(Ok(sent as usize)));
        }
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::WouldBlock {
            // The socket buffer is full: let glommio wait for room.
            return self.poll_write_glommio(cx, first);
        }
        Poll::Ready(Err(err))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    struct CountWakes(AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// One write of `buf`: as one slice, or as two with `vectored`.
    fn write_once(io: &mut GlommioIo, cx: &mut Context<'_>, buf: &[u8], vectored: bool) -> Poll<io::Result<usize>> {
        let (a, b) = buf.split_at(buf.len() / 2);
        if vectored {
            hyper::rt::Write::poll_write_vectored(Pin::new(io), cx, &[IoSlice::new(a), IoSlice::new(b)])
        } else {
            hyper::rt::Write::poll_write(Pin::new(io), cx, buf)
        }
    }

    /// Writes `buf` until the socket is full and the write answers `Pending`.
    fn fill(io: &mut GlommioIo, cx: &mut Context<'_>, buf: &[u8], vectored: bool) {
        for _ in 0..10_000 {
            match write_once(io, cx, buf, vectored) {
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => panic!("write failed: {e}"),
                Poll::Pending => return,
            }
        }
        panic!("the socket never filled");
    }

    /// Reads what the peer has, then retries the write until it succeeds.
    fn drain_until_written(io: &mut GlommioIo, cx: &mut Context<'_>, peer: &mut std::net::TcpStream, buf: &[u8], vectored: bool) {
        let mut sink = vec![0u8; 1 << 20];
        for _ in 0..1_000 {
            while peer.read(&mut sink).map(|n| n > 0).unwrap_or(false) {}
            match write_once(io, cx, buf, vectored) {
                Poll::Ready(Ok(n)) => return assert!(n > 0),
                Poll::Ready(Err(e)) => panic!("write failed: {e}"),
                Poll::Pending => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        panic!("the socket never drained");
    }

    /// A write that succeeds after a `Pending` wakes the task, through
    /// glommio's write and through the vectored `sendmsg`: hyper's HTTP/1
    /// dispatcher waits for that wake before it polls a streamed body again.
    /// The reactor never runs between the two polls here, so glommio's own
    /// POLLOUT wake cannot be what is counted.
    #[test]
    fn a_write_that_succeeds_after_pending_wakes_the_task() {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| async {
                let listener = glommio::net::TcpListener::bind("127.0.0.1:0").expect("bind");
                let mut peer = std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
                peer.set_nonblocking(true).expect("nonblocking");
                let mut io = GlommioIo::new(listener.accept().await.expect("accept"));
                let wakes = Arc::new(CountWakes(AtomicUsize::new(0)));
                let waker = Waker::from(wakes.clone());
                let mut cx = Context::from_waker(&waker);
                let buf = vec![7u8; 1 << 20];
                for (round, vectored) in [false, true, false, true].into_iter().enumerate() {
                    fill(&mut io, &mut cx, &buf, vectored);
                    let before = wakes.0.load(Ordering::SeqCst);
                    drain_until_written(&mut io, &mut cx, &mut peer, &buf, vectored);
                    assert_eq!(wakes.0.load(Ordering::SeqCst), before + 1, "round {round} (vectored: {vectored}): no wake after Pending");
                    // A write that never waited owes no wake.
                    while peer.read(&mut vec![0u8; 1 << 20]).map(|n| n > 0).unwrap_or(false) {}
                }
            })
            .expect("executor")
            .join()
            .expect("test body");
    }
}
