//! One connection to a kvtier Unix socket (docs/LOCAL.md): 16-byte frames,
//! a request id per request, and a reader thread that hands each response
//! to the request waiting for it, so any number of threads (up to
//! [`IN_FLIGHT_MAX`] requests at once, the server's limit) share one
//! connection. A [`Ticket`] is waited on by blocking ([`Ticket::wait`]) or
//! awaited (it is a `Future`), so the Python binding and the loadgen's
//! tokio tasks use the same connection.
//!
//! Descriptors come both ways: a `REGISTER` request carries one in
//! `SCM_RIGHTS`, a `MAP_ARENA`/`MAP_INDEX` answer brings one with its first
//! byte. The reader never reads past the end of the frame it is reading,
//! so a descriptor it receives belongs to that frame; one that comes with
//! an answer nobody waits for is closed.
//!
//! A request that gets no answer in time gives the connection up
//! ([`Connection::abandon`]): the writing side is shut down, which the
//! server takes as the client giving up, and from then on it copies nothing
//! into or out of the memory the connection registered (docs/LOCAL.md,
//! "When a client gives up").

use std::collections::HashMap;
use std::future::Future;
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_local_proto::{frame, Code, Header, Op, HEADER_BYTES, ITEMS_MAX, OP_CONNECTION_ERROR, RESPONSE_BIT};

use crate::sys;
use crate::Error;

/// Requests in flight on one connection, at most (the server stops
/// reading beyond).
pub const IN_FLIGHT_MAX: usize = 256;

/// After giving a connection up, how long [`Connection::abandon`] waits for
/// the server's close, which confirms that no copy into or out of the
/// client's memory runs any more (docs/LOCAL.md, "When a client gives up").
pub const CLOSE_CONFIRM: Duration = Duration::from_millis(250);

/// A response frame as it came: its op, its payload (status, hint, body)
/// and the descriptors that came with it.
#[derive(Debug)]
pub struct Response {
    /// The frame's op (the request's with [`RESPONSE_BIT`]).
    pub op: u8,
    /// The payload: i32 status, u32 `retry_after_ms`, then the body.
    pub payload: Vec<u8>,
    /// Descriptors (`SCM_RIGHTS`, close-on-exec) that came with it.
    pub fds: Vec<OwnedFd>,
}

impl Response {
    /// `(body, retry_after_ms)` of this response to a request of `op`.
    ///
    /// # Errors
    /// [`Error::BadAnswer`] for another op or a payload shorter than its
    /// status and hint; [`Error::Code`] for a nonzero status (the server's
    /// message, the hint in `retry_after_ms`).
    pub fn body(&self, op: u8) -> Result<(&[u8], u32), Error> {
        let name = op_name(op);
        if self.op != op | RESPONSE_BIT || self.payload.len() < 8 {
            return Err(Error::BadAnswer(format!("answer to {name} has op {:#x} and {} bytes", self.op, self.payload.len())));
        }
        let status = i32::from_le_bytes(self.payload[0..4].try_into().expect("4 bytes"));
        let retry_after_ms = u32::from_le_bytes(self.payload[4..8].try_into().expect("4 bytes"));
        if status != 0 {
            let text = String::from_utf8_lossy(&self.payload[8..]);
            return Err(Error::Code { code: status as i64, message: format!("{name}: {text}"), retry_after_ms });
        }
        Ok((&self.payload[8..], retry_after_ms))
    }
}

/// The name docs/LOCAL.md gives `op`, or its number.
pub fn op_name(op: u8) -> String {
    Op::from_u8(op).map_or_else(|| op.to_string(), |o| o.name().to_string())
}

/// Where one request's response lands.
#[derive(Default)]
struct Slot {
    done: Option<Result<Response, Error>>,
    waker: Option<Waker>,
}

#[derive(Default)]
struct Waiter {
    slot: Mutex<Slot>,
    ready: Condvar,
}

impl Waiter {
    fn finish(&self, r: Result<Response, Error>) {
        let mut s = lock(&self.slot);
        if s.done.is_none() {
            s.done = Some(r);
        }
        if let Some(w) = s.waker.take() {
            w.wake();
        }
        self.ready.notify_all();
    }
}

/// One request in flight: wait for its response with [`Ticket::wait`], or
/// `.await` it.
pub struct Ticket {
    waiter: Arc<Waiter>,
    op: u8,
    conn: Arc<Shared>,
}

impl Ticket {
    /// The request's op.
    pub fn op(&self) -> u8 {
        self.op
    }

    /// The response, waiting up to `timeout`. With none in time the
    /// connection is given up ([`Connection::abandon`]) and the request
    /// fails with `CONNECTION_LOST`, unless its answer came just before.
    ///
    /// # Errors
    /// [`Error::Code`] `CONNECTION_LOST`: the connection broke, was closed,
    /// or gave no answer in time.
    pub fn wait(self, timeout: Duration) -> Result<Response, Error> {
        let deadline = Instant::now() + timeout;
        let mut s = lock(&self.waiter.slot);
        while s.done.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(s);
                self.conn.abandon(&format!(
                    "no answer to {} from {} within {:.1} s ({})",
                    op_name(self.op),
                    self.conn.path,
                    timeout.as_secs_f64(),
                    queued_bytes(&self.conn.sock)
                ));
                s = lock(&self.waiter.slot);
                break;
            }
            s = self.waiter.ready.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        s.done.take().unwrap_or_else(|| Err(self.conn.dead_error()))
    }
}

impl Future for Ticket {
    type Output = Result<Response, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = lock(&self.waiter.slot);
        match s.done.take() {
            Some(r) => Poll::Ready(r),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// What the socket still holds when a request times out, which tells the
/// causes apart: bytes the server has not read (`SIOCOUTQ`, which on a
/// Unix socket counts the kernel's buffers with their overhead: a few
/// hundred bytes per message; the server stopped reading: a stalled shard
/// or a full connection), bytes this client has not read (`SIOCINQ`: its
/// reader thread is behind), or neither (the server read the request and
/// has not answered).
fn queued_bytes(sock: &UnixStream) -> String {
    let ask = |request: libc::Ioctl| {
        let mut n: libc::c_int = 0;
        // SAFETY: SIOCOUTQ/SIOCINQ write one int through the pointer.
        (unsafe { libc::ioctl(sock.as_raw_fd(), request, &mut n) } == 0).then_some(n)
    };
    let show = |n: Option<libc::c_int>| n.map_or_else(|| "?".to_string(), |n| n.to_string());
    format!(
        "the socket holds {} bytes (with the kernel's overhead) sent and not yet read by the server, {} bytes received and not yet read here",
        show(ask(libc::TIOCOUTQ)),
        show(ask(libc::FIONREAD))
    )
}

struct State {
    pending: HashMap<u64, Arc<Waiter>>,
    /// Why the connection is gone (a code and message), once it is.
    dead: Option<(i64, String)>,
    next_id: u64,
    reader_done: bool,
    /// The server closed at a frame's end (its close confirms a give-up).
    eof: bool,
    /// This side shut the socket down (its reads then end as a close
    /// would: not the server's).
    closed_here: bool,
    releases: Option<mpsc::Sender<Vec<u64>>>,
}

/// What the connection's handle, its tickets and its reader thread share.
struct Shared {
    path: String,
    sock: UnixStream,
    send: Mutex<()>,
    state: Mutex<State>,
    /// Signalled when a slot frees and when the reader ends.
    changed: Condvar,
    gave_up: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn dead_error(&self) -> Error {
        let s = lock(&self.state);
        let (code, message) = s.dead.clone().unwrap_or((crate::CONNECTION_LOST, "the connection is gone".into()));
        Error::Code { code, message, retry_after_ms: 0 }
    }

    /// Marks the connection dead (the first reason stays) and fails every
    /// request waiting on it.
    fn fail_pending(&self, code: i64, message: &str) {
        let (pending, why) = {
            let mut s = lock(&self.state);
            if s.dead.is_none() {
                s.dead = Some((code, message.to_string()));
            }
            s.releases = None;
            (std::mem::take(&mut s.pending), s.dead.clone().expect("set above"))
        };
        self.changed.notify_all();
        for w in pending.into_values() {
            w.finish(Err(Error::Code { code: why.0, message: why.1.clone(), retry_after_ms: 0 }));
        }
    }

    fn die(&self, code: i64, message: &str) {
        self.fail_pending(code, message);
        lock(&self.state).closed_here = true;
        let _ = self.sock.shutdown(Shutdown::Both);
    }

    fn abandon(&self, reason: &str) {
        self.gave_up.store(true, Ordering::Release);
        self.fail_pending(crate::CONNECTION_LOST, reason);
        let _ = self.sock.shutdown(Shutdown::Write);
        // Unconfirmed, the reading side stays open: the reader drops the
        // answers still coming and sees the server's close whenever it
        // comes ([`Connection::close_confirmed`] turns true then). Dropping
        // the connection shuts it down all the same.
        self.wait_close(CLOSE_CONFIRM);
    }

    /// Waits up to `limit` for the reader to end; whether the server closed.
    fn wait_close(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut s = lock(&self.state);
        while !s.reader_done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self.changed.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        s.eof
    }

    fn send(&self, bytes: &[u8], fd: Option<RawFd>) -> io::Result<()> {
        let _g = lock(&self.send);
        match fd {
            None => (&self.sock).write_all(bytes),
            Some(fd) => sys::send_with_fd(&self.sock, bytes, fd),
        }
    }

    fn read_loop(&self) {
        let ended = self.read_frames();
        let (code, message) = match &ended {
            Ok(()) => (crate::CONNECTION_LOST, "the server closed the connection".to_string()),
            Err(why) => why.clone(),
        };
        self.fail_pending(code, &message);
        if ended.is_err() && self.gave_up.load(Ordering::Acquire) {
            self.drain_to_close();
        }
        let mut s = lock(&self.state);
        s.reader_done = true;
        drop(s);
        self.changed.notify_all();
    }

    /// After a give-up whose frames stopped making sense (a connection
    /// error frame, a broken frame): reads and drops bytes until the
    /// server's close, which still confirms the give-up (a reset: the
    /// server's end is gone too). Descriptors that come are closed.
    fn drain_to_close(&self) {
        let mut buf = [0u8; 4096];
        let mut fds = Vec::new();
        let mut truncated = false;
        // A full buffer reads on; the stream's end (at or inside a
        // buffer) or an error (a reset) is the server's end.
        while let Ok(true) = sys::recv_exact(&self.sock, &mut buf, &mut fds, &mut truncated) {
            fds.clear();
        }
        let mut s = lock(&self.state);
        s.eof = !s.closed_here;
    }

    /// Reads frames until the stream ends (`Ok`) or cannot go on (the code
    /// and message the requests in flight fail with).
    fn read_frames(&self) -> Result<(), (i64, String)> {
        let lost = |m: String| (crate::CONNECTION_LOST, m);
        let mut fds = Vec::new();
        let mut truncated = false;
        loop {
            let mut head = [0u8; HEADER_BYTES];
            let broke = |e: io::Error| lost(format!("the connection to {} broke: {e}", self.path));
            if !sys::recv_exact(&self.sock, &mut head, &mut fds, &mut truncated).map_err(broke)? {
                let mut s = lock(&self.state);
                s.eof = !s.closed_here;
                return Ok(());
            }
            let h = Header::decode(&head).map_err(|e| (Code::BadFrame as i64, format!("the server sent {e}")))?;
            let mut payload = vec![0u8; h.payload_bytes as usize];
            if !payload.is_empty() && !sys::recv_exact(&self.sock, &mut payload, &mut fds, &mut truncated).map_err(broke)? {
                return Err(lost("the server closed the connection inside a frame".into()));
            }
            if h.op == OP_CONNECTION_ERROR {
                let status = payload.get(0..4).map_or(0, |b| i32::from_le_bytes(b.try_into().expect("4 bytes"))) as i64;
                let code = if status == 0 { Code::BadFrame as i64 } else { status };
                let text = String::from_utf8_lossy(payload.get(8..).unwrap_or_default());
                return Err((code, format!("the server closed the connection with {}: {text}", Code::name_of(code))));
            }
            let waiter = lock(&self.state).pending.remove(&h.request_id);
            let mine = std::mem::take(&mut fds);
            let carries_fd = matches!(Op::from_u8(h.op & !RESPONSE_BIT), Some(Op::MapArena | Op::MapIndex));
            // A descriptor with any other frame, or with an answer nobody
            // waits for (timed out, or posted), is closed here (dropped).
            let mine = if carries_fd { mine } else { Vec::new() };
            if let Some(w) = waiter {
                w.finish(Ok(Response { op: h.op, payload, fds: mine }));
                self.changed.notify_all();
            }
            truncated = false;
        }
    }
}

/// One connection to a kvtier Unix socket. Thread-safe; dropping it closes
/// the socket (requests in flight fail with `CONNECTION_LOST`).
pub struct Connection {
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
    /// The protocol version the hello chose (1 before it).
    pub(crate) version: AtomicU32,
    /// The hello's answer, as JSON.
    pub(crate) hello: Mutex<Option<serde_json::Value>>,
}

impl Connection {
    /// Connects to the socket at `path` and starts its reader thread.
    ///
    /// # Errors
    /// The connect error (`NotFound`, `ConnectionRefused`,
    /// `PermissionDenied`, ...), or the thread's.
    pub fn connect(path: &str) -> io::Result<Connection> {
        let sock = UnixStream::connect(path)?;
        let shared = Arc::new(Shared {
            path: path.to_string(),
            sock,
            send: Mutex::new(()),
            state: Mutex::new(State {
                pending: HashMap::new(),
                dead: None,
                next_id: 1,
                reader_done: false,
                eof: false,
                closed_here: false,
                releases: None,
            }),
            changed: Condvar::new(),
            gave_up: AtomicBool::new(false),
        });
        let r = shared.clone();
        let reader = std::thread::Builder::new().name("kvtier-local-reader".into()).spawn(move || r.read_loop())?;
        Ok(Connection { shared, reader: Some(reader), version: AtomicU32::new(1), hello: Mutex::new(None) })
    }

    /// The socket's path.
    pub fn path(&self) -> &str {
        &self.shared.path
    }

    /// `false` once the connection broke or was closed.
    pub fn alive(&self) -> bool {
        lock(&self.shared.state).dead.is_none()
    }

    /// Whether the client gave this connection up (a request timed out):
    /// what it sent may still have been under way in the server.
    pub fn gave_up(&self) -> bool {
        self.shared.gave_up.load(Ordering::Acquire)
    }

    /// After [`Connection::abandon`]: whether the server has closed the
    /// connection, so no copy into or out of this client's memory runs in
    /// the server any more, nor will, for anything sent here. `abandon`
    /// waits [`CLOSE_CONFIRM`] for it; a server held still past that (a
    /// SIGSTOP, a frozen VM) may still finish the piece of a copy it was in
    /// when it runs again (docs/LOCAL.md, "When a client gives up"), and
    /// this turns true when its close comes, whenever that is, while the
    /// connection is kept: the reading side stays open until then.
    pub fn close_confirmed(&self) -> bool {
        lock(&self.shared.state).eof
    }

    /// Waits up to `limit` for the server's close
    /// ([`Connection::close_confirmed`]); whether it came.
    pub fn wait_close_confirmed(&self, limit: Duration) -> bool {
        self.shared.wait_close(limit)
    }

    /// The protocol version the hello chose (1 before it).
    pub fn version(&self) -> u32 {
        self.version.load(Ordering::Acquire)
    }

    /// The server's pid as this process sees it; 0 when the server runs in
    /// a pid namespace this process cannot see into.
    ///
    /// # Errors
    /// The `getsockopt` error.
    pub fn peer_pid(&self) -> io::Result<i32> {
        sys::peer_pid(&self.shared.sock)
    }

    /// Closes the socket; requests in flight fail with `CONNECTION_LOST`
    /// and `reason`.
    pub fn close(&self, reason: &str) {
        self.shared.die(crate::CONNECTION_LOST, reason);
    }

    /// Gives the connection up (a request timed out): the requests in
    /// flight fail with `CONNECTION_LOST`, the writing side is shut down at
    /// once (the server then copies nothing more into or out of this
    /// client's memory for them, ends them and closes), and the server's
    /// close is awaited up to [`CLOSE_CONFIRM`]
    /// ([`Connection::close_confirmed`] says whether it came, then or later).
    pub fn abandon(&self, reason: &str) {
        self.shared.abandon(reason);
    }

    /// Sends one request frame of `op` and `payload` (with `fd` in
    /// `SCM_RIGHTS`, in the same `sendmsg`), waiting first while
    /// [`IN_FLIGHT_MAX`] requests are in flight.
    ///
    /// # Errors
    /// `CONNECTION_LOST` (or the code of the server's connection-error
    /// frame): the connection is gone, or the send failed.
    pub fn request(&self, op: u8, payload: &[u8], fd: Option<RawFd>) -> Result<Ticket, Error> {
        let waiter = Arc::new(Waiter::default());
        let id = {
            let mut s = lock(&self.shared.state);
            loop {
                if s.dead.is_some() {
                    drop(s);
                    return Err(self.shared.dead_error());
                }
                if s.pending.len() < IN_FLIGHT_MAX {
                    break;
                }
                s = self.shared.changed.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            let id = s.next_id;
            s.next_id += 1;
            s.pending.insert(id, waiter.clone());
            id
        };
        if let Err(e) = self.shared.send(&frame(op, id, payload), fd) {
            // The server may have closed after an error frame
            // (UNAUTHORIZED): let the reader take that frame in first, so
            // the request fails with what it said.
            self.wait_reader(Duration::from_secs(2));
            self.shared.die(crate::CONNECTION_LOST, &format!("sending {} to {} failed: {e}", op_name(op), self.shared.path));
        }
        Ok(Ticket { waiter, op, conn: self.shared.clone() })
    }

    fn wait_reader(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut s = lock(&self.shared.state);
        while !s.reader_done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            s = self.shared.changed.wait_timeout(s, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Sends one request frame whose answer nobody waits for (the reader
    /// drops it and closes any descriptor with it); takes no in-flight
    /// slot. `false` when the connection is gone or the send failed.
    pub fn post(&self, op: u8, payload: &[u8]) -> bool {
        let id = {
            let mut s = lock(&self.shared.state);
            if s.dead.is_some() {
                return false;
            }
            s.next_id += 1;
            s.next_id - 1
        };
        self.shared.send(&frame(op, id, payload), None).is_ok()
    }

    /// `request` and `wait`: the response.
    ///
    /// # Errors
    /// As [`Connection::request`] and [`Ticket::wait`].
    pub fn call(&self, op: u8, payload: &[u8], fd: Option<RawFd>, timeout: Duration) -> Result<Response, Error> {
        self.request(op, payload, fd)?.wait(timeout)
    }

    /// Queues a `RELEASE` of lease `ids` for the connection's releaser
    /// thread (started on first use), without waiting for anything: safe
    /// from a finalizer on any thread. Nothing is sent once the connection
    /// is gone (its leases ended with it).
    pub fn release_later(&self, ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        let mut s = lock(&self.shared.state);
        if s.dead.is_some() {
            return;
        }
        if s.releases.is_none() {
            let (tx, rx) = mpsc::channel::<Vec<u64>>();
            let conn = self.shared.clone();
            let started = std::thread::Builder::new().name("kvtier-releaser".into()).spawn(move || release_loop(&conn, &rx));
            if started.is_err() {
                return; // the leases end with the connection instead
            }
            s.releases = Some(tx);
        }
        if let Some(tx) = &s.releases {
            let _ = tx.send(ids);
        }
    }
}

/// Sends what [`Connection::release_later`] queues, what is queued at once
/// in the same frames, until the connection is gone.
fn release_loop(conn: &Shared, rx: &mpsc::Receiver<Vec<u64>>) {
    while let Ok(mut ids) = rx.recv() {
        while let Ok(more) = rx.try_recv() {
            ids.extend(more);
        }
        for chunk in ids.chunks(ITEMS_MAX) {
            let id = {
                let mut s = lock(&conn.state);
                if s.dead.is_some() {
                    return;
                }
                s.next_id += 1;
                s.next_id - 1
            };
            if conn.send(&frame(Op::Release as u8, id, &kvtier_local_proto::encode_release(chunk)), None).is_err() {
                return;
            }
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shared.die(crate::CONNECTION_LOST, "the client closed the connection");
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

impl AsRawFd for Connection {
    fn as_raw_fd(&self) -> RawFd {
        self.shared.sock.as_raw_fd()
    }
}
