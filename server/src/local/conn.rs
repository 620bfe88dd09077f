//! One connection of the same-host data plane, on the shard that accepted
//! it: a reader that takes frames (and the descriptors that come with
//! `REGISTER`) off the socket, a task per data request (many in flight), and
//! a writer that sends the responses as they finish.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::mpsc;
use futures::StreamExt;
use glommio::sync::{Semaphore, StaticPermit};
use kvtier_engine::PutOutcome;
use serde_json::json;

use super::proto::{self, code_of, Code, Header, Item, Op, HEADER_BYTES, OP_CONNECTION_ERROR, RESPONSE_BIT};
use super::region::{gather, ItemSink, Part, Region};
use super::LocalShared;
use crate::limits;
use crate::routes::{Caller, Ctx};
use crate::server::{shutdown_requested, Shared};
use crate::tenants::{stored_key, ScopeError};

/// Requests in flight on one connection; past it the reader stops reading.
pub const IN_FLIGHT_MAX: u64 = 256;
/// Registrations one connection may hold.
pub const REGISTRATIONS_MAX: usize = 4096;
/// Descriptors received and not yet claimed by a `REGISTER` frame; past
/// it the connection is closed (a client flooding descriptors).
const PENDING_FDS_MAX: usize = 64;
/// After the client stops sending, its requests in flight get this long to
/// finish and be answered before the connection closes.
const DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(30);
/// Control-message room: this many descriptors per `recvmsg`.
const FDS_PER_RECV: usize = 16;

/// A frame to send and, for a data request, its in-flight permit (given
/// back once the response is on the socket, so a client that stops reading
/// responses stops the server reading its requests).
type Outgoing = Option<(Vec<u8>, Option<StaticPermit>)>;

struct Conn {
    ctx: Rc<Ctx>,
    shared: Arc<LocalShared>,
    out: mpsc::UnboundedSender<Outgoing>,
    said_hello: Cell<bool>,
    /// The peer's uid (`SO_PEERCRED`).
    peer_uid: u32,
    /// The tenant HELLO named (by token, else by the peer's uid); `None`
    /// without `--tenants`.
    caller: RefCell<Caller>,
    regions: RefCell<HashMap<u64, Arc<Region>>>,
    next_handle: Cell<u64>,
}

impl Conn {
    fn send(&self, frame: Vec<u8>, permit: Option<StaticPermit>) {
        let _ = self.out.unbounded_send(Some((frame, permit)));
    }

    fn record(&self, op: Option<Op>, code: Option<Code>, started: Instant, bytes_in: u64, bytes_out: u64) {
        let status = match code {
            None => 200,
            Some(c) if c.is_server_side() => 500,
            Some(_) => 400,
        };
        let route = op.map_or(proto::ROUTE_NAMES.len() - 1, |o| o as usize - 1);
        let us = started.elapsed().as_micros() as u64;
        self.shared.stats.record(self.ctx.store.shard_id(), route, status, us, bytes_in, bytes_out);
    }

    fn drop_regions(&self) {
        let regions = std::mem::take(&mut *self.regions.borrow_mut());
        self.shared.registrations_open.fetch_sub(regions.len() as u64, Ordering::Relaxed);
        self.shared.registered_bytes.fetch_sub(regions.values().map(|r| r.len()).sum(), Ordering::Relaxed);
    }
}

/// Serves one accepted, peer-checked connection until it closes, or the
/// server shuts down: then it reads no more requests, answers those in
/// flight (for up to [`limits::SHUTDOWN_GRACE`]) and closes, so the shard's
/// store handle is let go and the shard can stop.
pub async fn serve(stream: UnixStream, peer_uid: u32, ctx: Rc<Ctx>, shared: Arc<LocalShared>, server: Arc<Shared>) {
    let stream = Rc::new(stream);
    let (out, rx) = mpsc::unbounded();
    let writer = glommio::spawn_local(write_loop(stream.clone(), rx));
    let conn = Rc::new(Conn {
        ctx,
        shared,
        out,
        said_hello: Cell::new(false),
        peer_uid,
        caller: RefCell::new(None),
        regions: RefCell::default(),
        next_handle: Cell::new(1),
    });
    let in_flight = Rc::new(Semaphore::new(IN_FLIGHT_MAX));
    let ended = futures_lite::future::or(read_loop(&stream, &conn, &in_flight), async {
        shutdown_requested(&server).await;
        Ok(())
    })
    .await;
    match ended {
        // The client stopped sending (a half-close, or gone), or the server
        // is stopping: let the requests already read finish and their
        // responses go out first.
        Ok(()) => {
            let limit = if server.shutdown.load(Ordering::Relaxed) { limits::SHUTDOWN_GRACE } else { DRAIN_MAX };
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
    conn.drop_regions();
    let _ = conn.out.unbounded_send(None);
    writer.await;
    // SAFETY: shutdown on the socket this task owns; in-flight tasks only
    // hold the response queue, not the descriptor.
    unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_RDWR) };
}

async fn write_loop(stream: Rc<UnixStream>, mut rx: mpsc::UnboundedReceiver<Outgoing>) {
    let fd = stream.as_raw_fd();
    let mut batch = Vec::new();
    let mut permits = Vec::new();
    while let Some(Some((frame, permit))) = rx.next().await {
        batch.clear();
        batch.extend_from_slice(&frame);
        permits.extend(permit);
        // Coalesce what is already queued into one send.
        let mut stop = false;
        while batch.len() < (1 << 20) {
            match rx.try_recv() {
                Ok(Some((f, p))) => {
                    batch.extend_from_slice(&f);
                    permits.extend(p);
                }
                Ok(None) | Err(mpsc::TryRecvError::Closed) => {
                    stop = true;
                    break;
                }
                Err(_) => break,
            }
        }
        if send_all(fd, &batch).await.is_err() || stop {
            return;
        }
        permits.clear();
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

/// Bytes read off the socket and not yet parsed into frames, with the
/// descriptors that came with them.
struct Inbox {
    buf: Vec<u8>,
    /// Stream offset of `buf[0]`.
    base: u64,
    /// Descriptors received, each batch tagged with the stream offset just
    /// past the bytes of the `recvmsg` that carried it.
    fds: VecDeque<(u64, Vec<OwnedFd>)>,
}

impl Inbox {
    /// The descriptor of a `REGISTER` frame starting at `frame_start`:
    /// the batch that came with its first bytes. Earlier, unclaimed
    /// descriptors are closed.
    fn claim(&mut self, frame_start: u64) -> Result<OwnedFd, String> {
        while self.fds.front().is_some_and(|(end, _)| *end <= frame_start) {
            self.fds.pop_front();
        }
        match self.fds.pop_front() {
            Some((_, mut fds)) if fds.len() == 1 => Ok(fds.pop().expect("one")),
            Some((_, fds)) => Err(format!("REGISTER came with {} descriptors; send exactly one per frame", fds.len())),
            None => Err("REGISTER came without a descriptor (send one with SCM_RIGHTS in the frame's sendmsg)".into()),
        }
    }

    fn pending_fds(&self) -> usize {
        self.fds.iter().map(|(_, f)| f.len()).sum()
    }

    /// One `recvmsg` into the buffer; the bytes read (0 at end of stream).
    fn recv(&mut self, fd: RawFd, want: usize) -> std::io::Result<usize> {
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
    // The ops answered here, in stream order (a handle registered is known
    // to every later frame); the data ops run as tasks, below.
    let answered: Result<Vec<u8>, (Code, String)> = match op {
        None => Err((Code::UnknownOp, format!("unknown op {}; this server speaks ops 1-{} (docs/LOCAL.md)", header.op, Op::ALL.len()))),
        Some(Op::Hello) => hello(conn, &payload),
        Some(_) if !conn.said_hello.get() => Err((Code::Unauthorized, "the first request on a connection must be HELLO".into())),
        Some(Op::Register) => register(conn, &payload, fd.expect("claimed for REGISTER")),
        Some(Op::Unregister) => unregister(conn, &payload),
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

impl Conn {
    /// Sends the response to `header`'s request and counts it.
    fn answer(
        &self,
        header: Header,
        result: Result<(Vec<u8>, u32), (Code, String)>,
        started: Instant,
        bytes_in: u64,
        bytes_out: u64,
        permit: StaticPermit,
    ) {
        let op = Op::from_u8(header.op);
        let frame = match result {
            Ok((body, retry_after_ms)) => {
                self.record(op, None, started, bytes_in, bytes_out);
                proto::response(header.op | RESPONSE_BIT, header.request_id, 0, retry_after_ms, &body)
            }
            Err((code, message)) => {
                self.record(op, Some(code), started, 0, 0);
                proto::failure(header.op, header.request_id, code, &message)
            }
        };
        self.send(frame, Some(permit));
    }
}

fn unregister(conn: &Conn, payload: &[u8]) -> Result<Vec<u8>, (Code, String)> {
    let mut c = proto::Cursor::new(payload);
    let handle = c.u64("a handle").map_err(|e| (Code::BadRequest, e))?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    let region = conn.regions.borrow_mut().remove(&handle);
    let region = region.ok_or_else(|| (Code::UnknownHandle, format!("handle {handle} is not registered on this connection")))?;
    conn.shared.registrations_open.fetch_sub(1, Ordering::Relaxed);
    conn.shared.registered_bytes.fetch_sub(region.len(), Ordering::Relaxed);
    Ok(Vec::new())
}

/// What a HELLO asks for (docs/LOCAL.md): the protocol version chosen
/// (the highest both sides speak), and the token, block size and model the
/// client expects, where it gave them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The version the connection will speak, from [`proto::VERSIONS`].
    pub version: u32,
    /// `token`, when a string.
    pub token: Option<String>,
    /// `block_bytes`, when an unsigned integer.
    pub block_bytes: Option<u64>,
    /// `model`, when a string.
    pub model: Option<String>,
}

/// Parses a HELLO payload: a JSON object whose `versions` lists the
/// protocol versions the client speaks. Fields of another type than the
/// one named above are ignored, as absent. Pure: the fuzz target
/// `local_frames` drives it.
///
/// # Errors
/// `BAD_REQUEST` for a payload that is not JSON, `UNSUPPORTED_VERSION`
/// when no listed version is one the server speaks.
pub fn parse_hello(payload: &[u8]) -> Result<Hello, (Code, String)> {
    let req: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| (Code::BadRequest, format!("HELLO payload is not JSON: {e}")))?;
    let versions: Vec<u32> = req.get("versions").and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
    let Some(version) = versions.iter().copied().filter(|v| proto::VERSIONS.contains(v)).max() else {
        return Err((Code::UnsupportedVersion, format!("client speaks versions {versions:?}, server speaks {:?}", proto::VERSIONS)));
    };
    Ok(Hello {
        version,
        token: req.get("token").and_then(|t| t.as_str()).map(str::to_string),
        block_bytes: req.get("block_bytes").and_then(|v| v.as_u64()),
        model: req.get("model").and_then(|v| v.as_str()).map(str::to_string),
    })
}

fn hello(conn: &Conn, payload: &[u8]) -> Result<Vec<u8>, (Code, String)> {
    if conn.said_hello.get() {
        return Err((Code::BadRequest, "HELLO was already said on this connection".into()));
    }
    let req = parse_hello(payload)?;
    if let Some(tenancy) = &conn.ctx.tenancy {
        let table = tenancy.table();
        let tenant = match &req.token {
            Some(token) => table.by_token(token.as_bytes()),
            None => table.by_uid(conn.peer_uid),
        };
        let Some(tenant) = tenant else {
            tenancy.unauthorized.fetch_add(1, Ordering::Relaxed);
            let why = match &req.token {
                Some(_) => "the HELLO's `token` is no tenant's (--tenants)".to_string(),
                None => format!("the HELLO has no `token` and peer uid {} is no tenant's `uids` (--tenants)", conn.peer_uid),
            };
            return Err((Code::Unauthorized, why));
        };
        *conn.caller.borrow_mut() = Some(tenant.clone());
    } else if let Some(token) = &conn.ctx.auth_token {
        let given = req.token.as_deref().unwrap_or("").as_bytes();
        let same = given.len() == token.len() && given.iter().zip(token.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if !same {
            return Err((Code::Unauthorized, "the server has a bearer token and the HELLO's `token` does not match it".into()));
        }
    }
    let g = conn.ctx.store.geometry();
    if let Some(want) = req.block_bytes {
        if want != g.block_bytes {
            return Err((
                Code::GeometryMismatch,
                format!(
                    "client expects block_bytes {want}, server has block_bytes {} (model {}, {} tokens per block)",
                    g.block_bytes, g.model, g.block_tokens
                ),
            ));
        }
    }
    if let Some(want) = &req.model {
        if *want != g.model {
            return Err((
                Code::GeometryMismatch,
                format!("client expects model {want:?}, server has model {:?} (block_bytes {})", g.model, g.block_bytes),
            ));
        }
    }
    let version = req.version;
    conn.said_hello.set(true);
    let body = json!({
        "version": version,
        "epoch": conn.shared.epoch,
        "block_bytes": g.block_bytes,
        "model": g.model,
        "block_tokens": g.block_tokens,
        "bytes_per_token": g.bytes_per_token,
        "shards": conn.ctx.store.shards(),
        "max_items": proto::ITEMS_MAX,
        "max_payload_bytes": proto::PAYLOAD_BYTES_MAX,
        "max_registrations": REGISTRATIONS_MAX,
        "ops": Op::ALL.map(Op::name),
        "tenant": conn.caller.borrow().as_ref().map(|t| t.name.clone()),
        "server": concat!("kvtier ", env!("CARGO_PKG_VERSION")),
        "http": conn.shared.http_addr.get().map(|a| {
            // A wildcard listener is reached on loopback from this host.
            let ip = match a.ip() {
                std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
                std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
                ip => ip,
            };
            std::net::SocketAddr::new(ip, a.port()).to_string()
        }),
    });
    Ok(serde_json::to_vec(&body).expect("JSON"))
}

fn register(conn: &Conn, payload: &[u8], fd: Result<OwnedFd, String>) -> Result<Vec<u8>, (Code, String)> {
    let fd = fd.map_err(|e| (Code::BadBuffer, e))?;
    let mut c = proto::Cursor::new(payload);
    let offset = c.u64("the offset").map_err(|e| (Code::BadRequest, e))?;
    let length = c.u64("the length").map_err(|e| (Code::BadRequest, e))?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    if conn.regions.borrow().len() >= REGISTRATIONS_MAX {
        return Err((Code::Limit, format!("this connection holds {REGISTRATIONS_MAX} registrations, the limit; unregister some")));
    }
    let region = Region::new(fd, offset, length).map_err(|e| (Code::BadBuffer, e))?;
    let handle = conn.next_handle.get();
    conn.next_handle.set(handle + 1);
    let mut body = handle.to_le_bytes().to_vec();
    body.push(region.access() as u8);
    conn.shared.registrations_open.fetch_add(1, Ordering::Relaxed);
    conn.shared.registrations_total.fetch_add(1, Ordering::Relaxed);
    conn.shared.registered_bytes.fetch_add(length, Ordering::Relaxed);
    conn.regions.borrow_mut().insert(handle, Arc::new(region));
    Ok(body)
}

type DataResult = (Result<(Vec<u8>, u32), (Code, String)>, u64, u64);

async fn data_op(conn: &Conn, op: Op, payload: &[u8]) -> DataResult {
    let store = &conn.ctx.store;
    let fail = |e: (Code, String)| (Err(e), 0, 0);
    let engine = |e: kvtier_engine::Error| (code_of(&e), e.to_string());
    match op {
        Op::GetInto | Op::PutFrom | Op::GetIntoV | Op::PutFromV => {
            let decoded = if op.is_vectored() { proto::decode_items_v(payload) } else { proto::decode_items(payload) };
            let items = match decoded {
                Ok(i) => i,
                Err(e) => return fail(e),
            };
            let block_bytes = store.geometry().block_bytes;
            let futures = items.iter().map(|item| async move {
                let (key, parts) = match item_parts(conn, item, block_bytes, op.is_get()) {
                    Ok(p) => p,
                    Err(code) => return (code as i64, 0u8),
                };
                if op.is_get() {
                    get_item(conn, &key, parts).await
                } else {
                    put_item(conn, &key, parts, block_bytes).await
                }
            });
            let results: Vec<(i64, u8)> = futures::future::join_all(futures).await;
            let moved: u64 = results.iter().filter(|(r, _)| *r >= 0).count() as u64 * block_bytes;
            let overloaded = results.iter().any(|(r, _)| *r == Code::Overloaded as i64);
            let retry = if overloaded { (limits::RETRY_AFTER_S * 1000) as u32 } else { 0 };
            let (bytes_in, bytes_out) = if op.is_get() { (0, moved) } else { (moved, 0) };
            (Ok((proto::encode_results(&results), retry)), bytes_in, bytes_out)
        }
        Op::Exists | Op::Lookup | Op::Delete | Op::Prefetch => {
            let keys = match proto::decode_keys(payload) {
                Ok(k) => k,
                Err(e) => return fail(e),
            };
            let caller = conn.caller.borrow().clone();
            let caller = caller.as_deref();
            if op == Op::Delete {
                // Per key: one that cannot be used answers its own code.
                let done = futures::future::join_all(keys.iter().map(|k| async move {
                    match stored_key(caller, k, true) {
                        Ok(stored) => store.delete(&stored).await.map_or_else(|e| code_of(&e) as i64, |_| 0),
                        Err(e) => scope_code(&e) as i64,
                    }
                }))
                .await;
                let mut b = (done.len() as u32).to_le_bytes().to_vec();
                b.extend(done.iter().flat_map(|r| r.to_le_bytes()));
                return (Ok((b, 0)), 0, 0);
            }
            // The other ops refuse the request for its first unusable key.
            let stored = match keys
                .iter()
                .enumerate()
                .map(|(i, k)| stored_key(caller, k, false).map_err(|e| (Code::InvalidKey, format!("key {i}: {e}"))))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(s) => s,
                Err(e) => return fail(e),
            };
            let keys: Vec<&str> = stored.iter().map(|k| &**k).collect();
            let body = match op {
                Op::Exists => store.exists_many(&keys).await.map(|found| {
                    let mut b = (found.len() as u32).to_le_bytes().to_vec();
                    b.extend(found.into_iter().map(proto::tier_code));
                    b
                }),
                Op::Lookup => store.lookup_prefix(&keys).await.map(|tiers| {
                    let mut b = (tiers.len() as u32).to_le_bytes().to_vec();
                    b.extend_from_slice(&(tiers.len() as u32).to_le_bytes());
                    b.extend(tiers.into_iter().map(|t| proto::tier_code(Some(t))));
                    b
                }),
                _ => store.prefetch(&keys).await.map(|report| {
                    let mut b = (keys.len() as u32).to_le_bytes().to_vec();
                    b.extend_from_slice(&(report.found as u32).to_le_bytes());
                    b
                }),
            };
            (body.map(|b| (b, 0)).map_err(engine), 0, 0)
        }
        Op::Hello | Op::Register | Op::Unregister => unreachable!("answered by the reader"),
    }
}

/// The code of a key its caller cannot use: `INVALID_KEY`, or
/// `UNAUTHORIZED` for a write into a namespace it only reads.
fn scope_code(e: &ScopeError) -> Code {
    match e {
        ScopeError::InvalidKey(_) => Code::InvalidKey,
        ScopeError::ReadOnly(_) => Code::Unauthorized,
    }
}

/// The item's stored key (scoped to the caller, `tenants.rs`) and its
/// parts in their regions, after the checks every item gets (key, then
/// each part's handle and bounds in order, then the size: room for the
/// block for a get, exactly the block for a put), so an item that fails
/// any of them copies nothing.
fn item_parts(conn: &Conn, item: &Item<'_>, block_bytes: u64, get: bool) -> Result<(String, Vec<Part>), Code> {
    let key = stored_key(conn.caller.borrow().as_deref(), item.key, !get).map_err(|e| scope_code(&e))?.into_owned();
    let parts = item
        .parts
        .iter()
        .map(|span| {
            let region = conn.regions.borrow().get(&span.handle).cloned().ok_or(Code::UnknownHandle)?;
            region.check(span.offset, span.length).map_err(|(c, _)| c)?;
            Ok(Part { region, at: span.offset, len: span.length })
        })
        .collect::<Result<Vec<_>, Code>>()?;
    let length = item.length();
    let size_ok = if get { length >= block_bytes } else { length == block_bytes };
    if !size_ok {
        return Err(Code::WrongSize);
    }
    Ok((key, parts))
}

async fn get_item(conn: &Conn, key: &str, parts: Vec<Part>) -> (i64, u8) {
    let sink = Arc::new(ItemSink::new(parts));
    match conn.ctx.store.get_into(key, sink.clone()).await {
        Ok((n, tier)) => (n as i64, proto::tier_code(Some(tier))),
        Err(_) if sink.shrunk.load(Ordering::Relaxed) => (Code::BufferShrunk as i64, 0),
        Err(e) => {
            if code_of(&e).is_server_side() {
                tracing::warn!(key, "local GET_INTO failed: {e}");
            }
            (code_of(&e) as i64, 0)
        }
    }
}

/// A PUT admitted against the shard's PUT-bytes budget (shared with HTTP),
/// given back when the item ends.
struct Admitted<'a>(&'a Ctx, u64);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let c = &self.0.put_inflight_bytes;
        c.set(c.get() - self.1);
    }
}

/// Stores the block the parts hold (`block_bytes` together, checked).
async fn put_item(conn: &Conn, key: &str, parts: Vec<Part>, block_bytes: u64) -> (i64, u8) {
    let ctx = &conn.ctx;
    let held = ctx.put_inflight_bytes.get();
    if held > 0 && held + block_bytes > ctx.put_inflight_bytes_max {
        // The socket's own series (kvtier_local_put_bytes_refusals_total);
        // the budget is the shard's, shared with HTTP.
        conn.shared.stats.shard(ctx.store.shard_id()).put_bytes_refusals.fetch_add(1, Ordering::Relaxed);
        return (Code::Overloaded as i64, 0);
    }
    ctx.put_inflight_bytes.set(held + block_bytes);
    let _admitted = Admitted(ctx, block_bytes);
    // All-or-nothing: the whole block is copied out of the client's memory
    // (gathered from its parts into one buffer) before the store sees any
    // of it.
    let bytes = match gather(&parts) {
        Ok(b) => b,
        Err((code, _)) => return (code as i64, 0),
    };
    drop(parts);
    match ctx.store.put_reporting(key, bytes).await {
        Ok(report) => (0, (report.outcome == PutOutcome::Created) as u8),
        Err(e) => {
            if code_of(&e).is_server_side() {
                tracing::warn!(key, "local PUT_FROM failed: {e}");
            }
            (code_of(&e) as i64, 0)
        }
    }
}
