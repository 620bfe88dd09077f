//! One connection of the same-host data plane, on the shard that accepted
//! it: a reader that takes frames (and the descriptors that come with
//! `REGISTER`) off the socket, a task per data request (many in flight), and
//! a writer that sends the responses as they finish.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::mpsc;
use futures::StreamExt;
use glommio::sync::{Semaphore, StaticPermit};

use super::watch::Admitted;

use super::inbox::Inbox;
use super::ops::{data_op, hello, register, unregister};
use super::proto::{self, Code, Header, Op, HEADER_BYTES, OP_CONNECTION_ERROR};
use super::revoke::Peer;
use super::session::{Conn, Outgoing};
use super::LocalShared;
use crate::limits;
use crate::service::Service;

/// Requests in flight on one connection; past it the reader stops reading.
pub const IN_FLIGHT_MAX: u64 = 256;
/// Descriptors received and not yet claimed by a `REGISTER` frame; past
/// it the connection is closed (a client flooding descriptors).
const PENDING_FDS_MAX: usize = 64;
/// After the client stops sending, its requests in flight get this long to
/// finish and be answered before the connection closes. They copy nothing
/// into or out of its memory meanwhile (it gave up: `revoke.rs`), so most
/// end at once.
const DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves one accepted, peer-checked connection until it closes, or the
/// server shuts down: then it reads no more requests, answers those in
/// flight (for up to [`limits::SHUTDOWN_GRACE`]) and closes, so the shard's
/// store handle is let go and the shard can stop.
///
/// When the client's stream ends (EOF, a reset, a framing error) the client
/// has given up: before anything else, every copy into or out of its memory
/// is revoked ([`Conn::give_up`]); the requests in flight are answered
/// without them, and the close that follows tells the client that no copy
/// runs any more.
pub async fn serve(stream: UnixStream, peer_uid: u32, service: Rc<Service>, shared: Arc<LocalShared>) {
    let peer = Arc::new(Peer::new(&stream));
    let stream = Rc::new(stream);
    let (out, rx) = mpsc::unbounded();
    let writer = glommio::spawn_local(write_loop(stream.clone(), rx));
    let conn = Rc::new(Conn {
        service,
        shared,
        out,
        said_hello: Cell::new(false),
        version: Cell::new(1),
        peer_uid,
        caller: RefCell::new(None),
        regions: RefCell::default(),
        peer,
        next_handle: Cell::new(1),
        leases: RefCell::default(),
    });
    let in_flight = Rc::new(Semaphore::new(IN_FLIGHT_MAX));
    // `Ok(true)`: the server is stopping; `Ok(false)`: the client's stream
    // ended; `Err`: it broke.
    let ended = futures_lite::future::or(async { read_loop(&stream, &conn, &in_flight).await.map(|()| false) }, async {
        conn.service.shutdown.requested().await;
        Ok(true)
    })
    .await;
    if ended != Ok(true) {
        // The client gave up: nothing of its memory is touched from now on,
        // by the requests in flight either.
        conn.give_up();
    }
    match ended {
        // The client stopped sending (a half-close, or gone), or the server
        // is stopping: let the requests already read finish and their
        // responses go out first.
        Ok(_) => {
            let limit = if conn.service.shutdown.is_requested() { limits::SHUTDOWN_GRACE } else { DRAIN_MAX };
            let drained = futures_lite::future::or(async { in_flight.acquire(IN_FLIGHT_MAX).await.is_ok() }, async {
                glommio::timer::sleep(limit).await;
                false
            })
            .await;
            if !drained {
                tracing::debug!("local connection closed with requests still in flight after {limit:?}");
            }
        }
        Err(why) => tracing::debug!("local connection closed: {why}"),
    }
    // Requests still in flight past the drain (or the stop's grace) copy
    // nothing after the close either: the close is the client's word that
    // its memory is its own again.
    conn.give_up();
    conn.drop_regions();
    super::lease::drop_all(&conn);
    let _ = conn.out.unbounded_send(None);
    writer.await;
    // SAFETY: shutdown on the socket this task owns; in-flight tasks only
    // hold the response queue, not the descriptor.
    unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_RDWR) };
}

/// Sends the responses queued in `rx`, coalesced, until the queue ends. A
/// send that fails (the peer is gone, or the socket broke) shuts the
/// connection down both ways at once and says why, once: the reader then
/// sees the end of the stream and stops dispatching, and the client sees
/// EOF on every request in flight and every later one, never silence.
async fn write_loop(stream: Rc<UnixStream>, rx: mpsc::UnboundedReceiver<Outgoing>) {
    let fd = stream.as_raw_fd();
    if let Err(e) = send_responses(fd, rx).await {
        tracing::warn!("closing a local connection: sending its responses failed ({e}); its client sees the connection end");
        // SAFETY: shutdown on the socket this connection owns; the reader
        // then reads the end of the stream.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    }
}

async fn send_responses(fd: RawFd, mut rx: mpsc::UnboundedReceiver<Outgoing>) -> std::io::Result<()> {
    let mut batch = Vec::new();
    let mut permits = Vec::new();
    let mut next = rx.next().await.flatten();
    while let Some((frame, permit, passed)) = next.take() {
        permits.extend(permit);
        if let Some(passed) = passed {
            // A frame with a descriptor goes alone: the descriptor travels
            // with its first byte.
            send_with_fd(fd, &frame, &passed).await?;
            permits.clear();
            next = rx.next().await.flatten();
            continue;
        }
        batch.clear();
        batch.extend_from_slice(&frame);
        // Coalesce what is already queued into one send, up to a frame
        // with a descriptor.
        let mut stop = false;
        while batch.len() < (1 << 20) {
            match rx.try_recv() {
                Ok(Some((f, p, None))) => {
                    batch.extend_from_slice(&f);
                    permits.extend(p);
                }
                Ok(Some(with_fd)) => {
                    next = Some(with_fd);
                    break;
                }
                Ok(None) | Err(mpsc::TryRecvError::Closed) => {
                    stop = true;
                    break;
                }
                Err(_) => break,
            }
        }
        send_all(fd, &batch).await?;
        if stop {
            return Ok(());
        }
        permits.clear();
        if next.is_none() {
            next = rx.next().await.flatten();
        }
    }
    Ok(())
}

/// Sends `frame` with `passed` in `SCM_RIGHTS` on its first byte, then the
/// rest as [`send_all`] does.
async fn send_with_fd(fd: RawFd, frame: &[u8], passed: &OwnedFd) -> std::io::Result<()> {
    loop {
        let mut iov = libc::iovec { iov_base: frame.as_ptr() as *mut libc::c_void, iov_len: 1 };
        let mut control = kvtier_local_proto::fds::Control::default();
        let msg = kvtier_local_proto::fds::sending(&mut iov, &mut control, &[passed.as_raw_fd()]);
        // SAFETY: `msg` points at the iovec and control buffer above, alive
        // for the call.
        let sent = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if sent == 1 {
            return send_all(fd, &frame[1..]).await;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => glommio::executor().wait_writable(fd).await?,
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

async fn send_all(fd: RawFd, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: send from a live slice on the connection's socket.
        let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
        if n >= 0 {
            buf = &buf[n as usize..];
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => glommio::executor().wait_writable(fd).await?,
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Reads and dispatches frames until the peer closes or breaks the framing
/// (then one `0xFF` frame says why).
async fn read_loop(stream: &UnixStream, conn: &Rc<Conn>, in_flight: &Rc<Semaphore>) -> Result<(), String> {
    let fd = stream.as_raw_fd();
    let mut inbox = Inbox { buf: Vec::new(), base: 0, fds: VecDeque::new() };
    loop {
        let mut pos = 0usize;
        let need = loop {
            let (header, frame_bytes) = match proto::next_frame(&inbox.buf[pos..]) {
                Ok(proto::Next::Frame(h, n)) => (h, n),
                Ok(proto::Next::Need(n)) => break n,
                Err(why) => return Err(connection_error(conn, why)),
            };
            let frame_start = inbox.base + pos as u64;
            let payload = inbox.buf[pos + HEADER_BYTES..pos + frame_bytes].to_vec();
            pos += frame_bytes;
            let fd_for_register = (header.op == Op::Register as u8).then(|| inbox.claim(frame_start));
            let permit = in_flight.acquire_static_permit(1).await.map_err(|e| format!("in-flight limit: {e:?}"))?;
            dispatch(conn, header, payload, fd_for_register, permit);
        };
        inbox.buf.drain(..pos);
        inbox.base += pos as u64;
        if inbox.pending_fds() > PENDING_FDS_MAX {
            return Err(connection_error(conn, format!("over {PENDING_FDS_MAX} descriptors sent without REGISTER frames")));
        }
        match inbox.recv(fd, need) {
            Ok(0) if inbox.buf.is_empty() => return Ok(()),
            Ok(0) => return Err(format!("the peer closed the connection inside a frame ({} bytes of it read)", inbox.buf.len())),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                glommio::executor().wait_readable(fd).await.map_err(|e| e.to_string())?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::Other => return Err(connection_error(conn, e.to_string())),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Sends the `0xFF` frame and counts the close; returns the reason.
fn connection_error(conn: &Conn, why: String) -> String {
    conn.shared.frame_errors.fetch_add(1, Ordering::Relaxed);
    conn.send(proto::response(OP_CONNECTION_ERROR, 0, Code::BadFrame as i32, 0, why.as_bytes()), None);
    why
}

fn dispatch(conn: &Rc<Conn>, header: Header, payload: Vec<u8>, fd: Option<Result<OwnedFd, String>>, permit: StaticPermit) {
    let started = Instant::now();
    let op = Op::from_u8(header.op);
    let permit = Admitted::new(permit, op, header.request_id, conn.peer_uid);
    // The ops answered here, in stream order (a handle registered is known
    // to every later frame); the data ops run as tasks, below.
    let answered: Result<Vec<u8>, (Code, String)> = match op {
        None => Err((Code::UnknownOp, format!("unknown op {}; this server speaks ops 1-{} (docs/LOCAL.md)", header.op, Op::ALL.len()))),
        Some(Op::Hello) => hello(conn, &payload),
        Some(_) if !conn.said_hello.get() => Err((Code::Unauthorized, "the first request on a connection must be HELLO".into())),
        Some(op) if op.since_version() > conn.version.get() => Err((
            Code::UnsupportedVersion,
            format!(
                "{} is an op of version {}; this connection speaks version {} (HELLO)",
                op.name(),
                op.since_version(),
                conn.version.get()
            ),
        )),
        Some(Op::Register) => register(conn, &payload, fd.expect("claimed for REGISTER")),
        Some(Op::Unregister) => unregister(conn, &payload),
        Some(Op::MapArena) => match super::lease::map_arena(conn, &payload) {
            Ok((body, passed)) => return conn.answer_with_fd(header, body, passed, started, permit),
            Err(e) => Err(e),
        },
        Some(Op::MapIndex) => match super::lease::map_index(conn, &payload) {
            Ok((body, passed)) => return conn.answer_with_fd(header, body, passed, started, permit),
            Err(e) => Err(e),
        },
        Some(op) => {
            let conn = conn.clone();
            glommio::spawn_local(async move {
                let (result, bytes_in, bytes_out) = data_op(&conn, op, &payload).await;
                conn.answer(header, result, started, bytes_in, bytes_out, permit);
            })
            .detach();
            return;
        }
    };
    conn.answer(header, answered.map(|body| (body, 0)), started, 0, 0, permit);
}
