//! `kvtier._native.Connection`: one same-host connection of
//! `kvtier-client` (docs/LOCAL.md) for Python. Every call that waits on
//! the server (connecting, each op, a batch's answers) releases the GIL;
//! errors are raised as the classes of `kvtier.errors`
//! (`error_from_code`), so Python sees what it always saw.

use std::os::fd::{IntoRawFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use kvtier_client::ops::{chunks, decode_leases, decode_released, decode_results, encode};
use kvtier_client::{BatchItem, Error, HelloRequest};
use kvtier_local_proto::{self as proto, Op, ITEMS_MAX, VERSION_LEASES, VERSION_TAGS};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyTuple};

/// What the hello's ``client`` field says unless told otherwise.
pub const CLIENT_NAME: &str = concat!("kvtier-python ", env!("CARGO_PKG_VERSION"));

/// The `kvtier.errors` class of `e`: `error_from_code` of its code, or a
/// `ProtocolError` for an unreadable answer (``code`` ``"bad_answer"``) and
/// for no version in common.
pub fn py_error(py: Python<'_>, e: Error) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let errors = py.import("kvtier.errors")?;
        let err = match &e {
            Error::Code { code, message, retry_after_ms } => {
                errors.getattr("error_from_code")?.call1((*code, message.as_str(), f64::from(*retry_after_ms) / 1000.0))?
            }
            Error::BadAnswer(m) => {
                let kw = [("code", "bad_answer")].into_py_dict(py)?;
                errors.getattr("ProtocolError")?.call((m.as_str(),), Some(&kw))?
            }
            Error::Protocol(m) => errors.getattr("ProtocolError")?.call1((m.as_str(),))?,
        };
        Ok(PyErr::from_value(err))
    })();
    made.unwrap_or_else(|import_failed| import_failed)
}

/// One request in flight (:meth:`Connection.request`); wait for it with
/// :meth:`Connection.wait` (once).
#[pyclass(module = "kvtier._native", frozen)]
pub struct Ticket {
    inner: Mutex<Option<kvtier_client::Ticket>>,
}

/// What :meth:`Connection.transfer` answers: per item ``(result, tier or
/// created)``, the largest ``OVERLOADED`` hint in ms, and the messages of
/// requests that failed as a whole.
type TransferAnswer = (Vec<(i64, u8)>, u32, Vec<String>);

/// Items of a batch as Python gives them: ``(handle, offset, length, key)``,
/// or for a vectored op ``(parts, key)`` with parts ``(handle, offset,
/// length)`` spans.
type PyItem<'py> = Bound<'py, PyTuple>;

fn batch_items(items: &[PyItem<'_>], vectored: bool, tags: Option<Vec<Vec<u8>>>) -> PyResult<Vec<BatchItem>> {
    let mut out = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let (parts, key) = if vectored {
            let (parts, key): (Vec<(u64, u64, u64)>, String) = it.extract()?;
            (parts, key)
        } else {
            let (h, o, l, key): (u64, u64, u64, String) = it.extract()?;
            (vec![(h, o, l)], key)
        };
        let tag = tags.as_ref().map(|t| t.get(i).cloned().unwrap_or_default()).unwrap_or_default();
        out.push(BatchItem { parts, key, tag });
    }
    if let Some(t) = &tags {
        if t.len() != items.len() {
            return Err(PyValueError::new_err(format!("{} tags for {} items", t.len(), items.len())));
        }
    }
    Ok(out)
}

fn op_of(op: u8) -> PyResult<Op> {
    Op::from_u8(op).ok_or_else(|| PyValueError::new_err(format!("no op numbered {op}")))
}

/// One connection to a kvtier Unix socket (docs/LOCAL.md), thread-safe:
/// ``Connection(path, *, timeout_s=30.0)`` connects (``OSError`` when it
/// cannot: ``FileNotFoundError``, ``ConnectionRefusedError``,
/// ``PermissionError``). ``timeout_s`` bounds each answer unless a call
/// names another; a request with no answer in time gives the connection up
/// (:meth:`abandon`). Every op raises the ``kvtier.errors`` class of a
/// request-wide failure (``local_code`` its negative code),
/// ``KvtierConnectionError`` (``local_code`` -21) once the connection is
/// gone.
#[pyclass(module = "kvtier._native", frozen, subclass)]
pub struct Connection {
    inner: kvtier_client::Connection,
    timeout_s: f64,
}

impl Connection {
    fn limit(&self, timeout_s: Option<f64>) -> Duration {
        Duration::from_secs_f64(timeout_s.unwrap_or(self.timeout_s).max(0.0))
    }
}

#[pymethods]
impl Connection {
    #[new]
    #[pyo3(signature = (path, *, timeout_s = 30.0))]
    fn new(py: Python<'_>, path: String, timeout_s: f64) -> PyResult<Connection> {
        let inner = py.detach(|| kvtier_client::Connection::connect(&path))?;
        Ok(Connection { inner, timeout_s })
    }

    /// The socket's path.
    #[getter]
    fn path(&self) -> &str {
        self.inner.path()
    }

    /// The limit for an answer, in seconds, unless a call names another.
    #[getter]
    fn timeout_s(&self) -> f64 {
        self.timeout_s
    }

    /// ``False`` once the connection broke or was closed.
    #[getter]
    fn alive(&self) -> bool {
        self.inner.alive()
    }

    /// ``True`` once the client gave this connection up (a request timed
    /// out): what it sent may still have been under way in the server.
    #[getter]
    fn gave_up(&self) -> bool {
        self.inner.gave_up()
    }

    /// After :meth:`abandon`: whether the server's close has come: no copy
    /// into or out of this client's memory runs in the server any more, nor
    /// will, for anything sent here. :meth:`abandon` waits 0.25 s for it; a
    /// server held still past that may still finish the piece of a copy it
    /// was in when it runs again, and this turns ``True`` when its close
    /// comes, whenever that is, while this object is kept.
    #[getter]
    fn close_confirmed(&self) -> bool {
        self.inner.close_confirmed()
    }

    /// Waits up to ``timeout_s`` seconds for the server's close
    /// (:attr:`close_confirmed`), the GIL released; whether it came.
    fn wait_close_confirmed(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let limit = std::time::Duration::from_secs_f64(timeout_s.max(0.0));
        py.detach(|| self.inner.wait_close_confirmed(limit))
    }

    /// The protocol version the hello chose (1 before it).
    #[getter]
    fn version(&self) -> u32 {
        self.inner.version()
    }

    /// The server's pid as this process sees it (``SO_PEERCRED``); 0 when
    /// the server runs in a pid namespace this process cannot see into.
    fn peer_pid(&self) -> PyResult<i32> {
        Ok(self.inner.peer_pid()?)
    }

    /// Closes the socket; requests in flight fail with ``CONNECTION_LOST``.
    #[pyo3(signature = (reason = "the client closed the connection"))]
    fn close(&self, py: Python<'_>, reason: &str) {
        py.detach(|| self.inner.close(reason));
    }

    /// Gives the connection up (a request timed out): the requests in
    /// flight fail with ``CONNECTION_LOST``, the writing side is shut down
    /// (the server then copies nothing more into or out of this client's
    /// memory, docs/LOCAL.md "When a client gives up"), and the server's
    /// close is awaited up to 0.25 s (:attr:`close_confirmed`). Never raises.
    fn abandon(&self, py: Python<'_>, reason: &str) {
        py.detach(|| self.inner.abandon(reason));
    }

    /// Sends one request frame of ``op`` and ``payload`` (with ``fd`` in
    /// ``SCM_RIGHTS``): the :class:`Ticket` to :meth:`wait` on. For tests
    /// and tools that speak the protocol frame by frame.
    #[pyo3(signature = (op, payload, *, fd = None))]
    fn request(&self, py: Python<'_>, op: u8, payload: &[u8], fd: Option<RawFd>) -> PyResult<Ticket> {
        let t = py.detach(|| self.inner.request(op, payload, fd)).map_err(|e| py_error(py, e))?;
        Ok(Ticket { inner: Mutex::new(Some(t)) })
    }

    /// ``(body, retry_after_ms, descriptors)`` of a :meth:`request`'s
    /// answer (the descriptors are the caller's to close). Raises its
    /// request-wide error.
    #[pyo3(signature = (ticket, timeout_s = None))]
    fn wait<'py>(&self, py: Python<'py>, ticket: &Ticket, timeout_s: Option<f64>) -> PyResult<(Bound<'py, PyBytes>, u32, Vec<i32>)> {
        let t = ticket.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        let t = t.ok_or_else(|| PyValueError::new_err("this request was waited on already"))?;
        let op = t.op();
        let limit = self.limit(timeout_s);
        let r = py.detach(|| t.wait(limit)).map_err(|e| py_error(py, e))?;
        let (body, hint) = r.body(op).map_err(|e| py_error(py, e))?;
        let body = PyBytes::new(py, body);
        Ok((body, hint, r.fds.into_iter().map(IntoRawFd::into_raw_fd).collect()))
    }

    /// Sends a request whose answer nobody waits for (the reader drops it);
    /// ``False`` when the connection is gone or the send failed.
    fn post(&self, py: Python<'_>, op: u8, payload: &[u8]) -> bool {
        py.detach(|| self.inner.post(op, payload))
    }

    /// ``HELLO``: the versions this client speaks (or ``versions``), its
    /// name, and the token and expected geometry when given. Returns the
    /// server's answer as JSON text.
    ///
    /// Raises:
    ///     UnauthorizedError: the peer or token is refused.
    ///     GeometryMismatchError: ``block_bytes``/``model`` differ.
    ///     ProtocolError: no version in common, or an unreadable answer.
    #[pyo3(signature = (*, token = None, block_bytes = None, model = None, client = CLIENT_NAME, versions = None))]
    fn hello(
        &self,
        py: Python<'_>,
        token: Option<&str>,
        block_bytes: Option<u64>,
        model: Option<&str>,
        client: &str,
        versions: Option<Vec<u32>>,
    ) -> PyResult<String> {
        let req = HelloRequest { token, block_bytes, model, client, versions: versions.as_deref() };
        let limit = self.limit(None);
        py.detach(|| self.inner.hello(&req, limit)).map(|v| v.to_string()).map_err(|e| py_error(py, e))
    }

    /// ``REGISTER`` ``length`` bytes of file ``fd`` from ``offset`` (the
    /// descriptor travels in ``SCM_RIGHTS``; the caller keeps its own):
    /// ``(handle, access)``, access 1 mapped, 2 file I/O, 3 guarded.
    fn register(&self, py: Python<'_>, fd: RawFd, offset: u64, length: u64) -> PyResult<(u64, u8)> {
        let limit = self.limit(None);
        py.detach(|| self.inner.register(fd, offset, length, limit)).map_err(|e| py_error(py, e))
    }

    /// ``UNREGISTER`` ``handle``; items in flight on it finish.
    fn unregister(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        let limit = self.limit(None);
        py.detach(|| self.inner.unregister(handle, limit)).map_err(|e| py_error(py, e))
    }

    /// One ``GET_INTO`` request of ``(handle, offset, length, key)`` items:
    /// per item ``(bytes written or a negative code, tier)``.
    #[pyo3(signature = (items, timeout_s = None))]
    fn get_into(&self, py: Python<'_>, items: Vec<PyItem<'_>>, timeout_s: Option<f64>) -> PyResult<Vec<(i64, u8)>> {
        let rows = batch_items(&items, false, None)?;
        self.one(py, Op::GetInto, &rows, timeout_s)
    }

    /// One ``PUT_FROM`` request: each item's bytes stored under its key,
    /// with ``tags[i]`` (an encoded block tag, ``b""`` for none) when
    /// given; per item ``(result: >= 0 stored, else a negative code,
    /// created)``.
    ///
    /// Raises:
    ///     UnsupportedVersionError: tags on a connection of version 1.
    #[pyo3(signature = (items, timeout_s = None, *, tags = None))]
    fn put_from(
        &self,
        py: Python<'_>,
        items: Vec<PyItem<'_>>,
        timeout_s: Option<f64>,
        tags: Option<Vec<Vec<u8>>>,
    ) -> PyResult<Vec<(i64, u8)>> {
        let version = self.inner.version();
        if version < VERSION_TAGS && tags.as_ref().is_some_and(|t| t.iter().any(|t| !t.is_empty())) {
            let m = format!(
                "the server at {} speaks protocol version {version}, whose PUT_FROM carries no block tags (version {VERSION_TAGS} \
                 does): upgrade kvtier, or put tagged blocks over HTTP",
                self.inner.path()
            );
            return Err(py_error(py, Error::code(proto::Code::UnsupportedVersion, m)));
        }
        let rows = batch_items(&items, false, tags)?;
        self.one(py, Op::PutFrom, &rows, timeout_s)
    }

    /// ``GET_INTO``/``PUT_FROM`` or their ``_V`` forms (``op``) of
    /// ``items``, split into requests within the protocol's limits, all in
    /// flight at once, with the GIL released. A put's ``tags`` (encoded,
    /// ``b""`` for none) go where the connection carries them. Each request
    /// waits ``timeout_s`` plus ``seconds_per_gib`` per GiB it moves.
    /// Returns ``(results, retry_after_ms, failures)``: per item ``(result,
    /// tier or created)``, the largest ``OVERLOADED`` hint, and the
    /// messages of requests that failed as a whole (but for a lost
    /// connection). Raises only for items of the wrong shape.
    #[pyo3(signature = (op, items, tags, timeout_s, seconds_per_gib))]
    fn transfer(
        &self,
        py: Python<'_>,
        op: u8,
        items: Vec<PyItem<'_>>,
        tags: Option<Vec<Vec<u8>>>,
        timeout_s: f64,
        seconds_per_gib: f64,
    ) -> PyResult<TransferAnswer> {
        let op = op_of(op)?;
        let rows = batch_items(&items, op.is_vectored(), tags)?;
        let limit = Duration::from_secs_f64(timeout_s.max(0.0));
        let a = py.detach(|| self.inner.batch(op, &rows, limit, seconds_per_gib));
        Ok((a.results, a.retry_after_ms, a.failures))
    }

    /// ``EXISTS``: each key's tier (0 not stored, 1 gpu, 2 ram, 3 nvme, 4 s3).
    fn exists(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<u32>> {
        let limit = self.limit(None);
        let tiers = py.detach(|| self.inner.exists(&keys, limit)).map_err(|e| py_error(py, e))?;
        Ok(tiers.into_iter().map(u32::from).collect())
    }

    /// ``LOOKUP`` a prefix chain: ``(prefix_hits, the hits' tiers)``.
    fn lookup(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<(u32, Vec<u32>)> {
        let limit = self.limit(None);
        let (hits, tiers) = py.detach(|| self.inner.lookup(&keys, limit)).map_err(|e| py_error(py, e))?;
        Ok((hits, tiers.into_iter().map(u32::from).collect()))
    }

    /// ``DELETE``: per key 0 (deleted) or a negative code (-2: none stored).
    fn delete(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<i64>> {
        let limit = self.limit(None);
        py.detach(|| self.inner.delete(&keys, limit)).map_err(|e| py_error(py, e))
    }

    /// ``PREFETCH``: ``(requested, found locally)``.
    fn prefetch(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<(u32, u32)> {
        let limit = self.limit(None);
        py.detach(|| self.inner.prefetch(&keys, limit)).map_err(|e| py_error(py, e))
    }

    /// ``LEASE`` (version 3) of any number of keys, in requests of 4,096
    /// all in flight at once: per key ``(result, tier, arena, offset,
    /// generation, lease)``; ``result`` is ``block_bytes`` when leased,
    /// else a negative code (``NOT_IN_RAM``: ``tier`` where it is stored).
    ///
    /// Raises:
    ///     UnsupportedVersionError: the connection did not choose version 3.
    ///     LeasesOffError: the server offers no leases (its reason).
    #[allow(clippy::type_complexity)]
    fn lease(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<(i64, u8, u32, u64, u64, u64)>> {
        let version = self.inner.version();
        if version < VERSION_LEASES {
            let m = format!(
                "the server at {} speaks socket protocol version {version}; leases need version {VERSION_LEASES} \
                 upgrade kvtier, or read blocks with get_into",
                self.inner.path()
            );
            return Err(py_error(py, Error::code(proto::Code::UnsupportedVersion, m)));
        }
        let limit = self.limit(None);
        let idx: Vec<usize> = (0..keys.len()).collect();
        let answer = py.detach(|| -> Result<Vec<_>, Error> {
            let mut failure = None;
            let mut flights = Vec::new();
            for c in chunks(&idx, |i| 2 + keys[i].len()) {
                let ks: Vec<&str> = c.iter().map(|&i| keys[i].as_str()).collect();
                match self.inner.request(Op::Lease as u8, &proto::encode_keys(&ks), None) {
                    Ok(t) => flights.push((c.len(), t)),
                    Err(e) => {
                        failure = Some(e); // the connection died under an earlier request
                        break;
                    }
                }
            }
            let mut out = Vec::with_capacity(keys.len());
            for (n, t) in flights {
                let items = t.wait(limit).and_then(|r| decode_leases(r.body(Op::Lease as u8)?.0, n));
                match items {
                    Ok(items) => out.extend(items.into_iter().map(|i| (i.result, i.tier, i.arena, i.offset, i.generation, i.lease))),
                    Err(e) => failure = failure.or(Some(e)),
                }
            }
            match failure {
                None => Ok(out),
                Some(e) => {
                    // What other requests granted ends now, not at --lease-ms.
                    self.inner.release_later(out.iter().filter(|i| i.0 >= 0).map(|i| i.5).collect());
                    Err(e)
                }
            }
        });
        answer.map_err(|e| py_error(py, e))
    }

    /// ``RELEASE`` of lease ``ids``, in requests of 4,096: how many the
    /// connection still held (the others had ended, or were never its).
    fn release(&self, py: Python<'_>, ids: Vec<u64>) -> PyResult<u32> {
        let limit = self.limit(None);
        let released = py.detach(|| -> Result<u32, Error> {
            let tickets =
                ids.chunks(ITEMS_MAX).map(|c| self.inner.request(Op::Release as u8, &proto::encode_release(c), None)).collect::<Vec<_>>();
            let mut n = 0;
            for t in tickets {
                let r = t?.wait(limit)?;
                n += decode_released(r.body(Op::Release as u8)?.0)?;
            }
            Ok(n)
        });
        released.map_err(|e| py_error(py, e))
    }

    /// Sends ``RELEASE`` frames of ``ids`` (4,096 per frame) without
    /// waiting for their answers; ``False`` when the connection is gone or
    /// a send failed.
    fn release_post(&self, py: Python<'_>, ids: Vec<u64>) -> bool {
        py.detach(|| ids.chunks(ITEMS_MAX).all(|c| self.inner.post(Op::Release as u8, &proto::encode_release(c))))
    }

    /// Queues a ``RELEASE`` of ``ids`` for the connection's releaser
    /// thread, waiting for nothing: safe from a finalizer on any thread.
    /// Nothing is sent once the connection is gone (its leases ended with it).
    fn release_later(&self, ids: Vec<u64>) {
        self.inner.release_later(ids);
    }

    /// ``MAP_ARENA`` (version 3): ``(fd, (file_bytes, slot_bytes, slots,
    /// generations_offset))``; ``fd`` is a read-only descriptor of the
    /// arena's sealed memfd, the caller's to map and close.
    ///
    /// Raises:
    ///     LeasesOffError: the server offers no leases.
    ///     ProtocolError: an unknown arena, or an answer without one descriptor.
    #[allow(clippy::type_complexity)]
    fn map_arena(&self, py: Python<'_>, arena: u32) -> PyResult<(i32, (u64, u64, u32, u64))> {
        let limit = self.limit(None);
        let (fd, a) = py.detach(|| self.inner.map_arena(arena, limit)).map_err(|e| py_error(py, e))?;
        Ok((fd.into_raw_fd(), (a.file_bytes, a.slot_bytes, a.slots, a.generations_offset)))
    }

    /// ``MAP_INDEX`` (version 3): ``(fd, (file_bytes, buckets, shards))`` of
    /// shard ``shard``'s index table; ``fd`` is read-only and the caller's.
    ///
    /// Raises:
    ///     LeasesOffError: the server offers no shared index.
    ///     ProtocolError: an unknown shard, or an answer without one descriptor.
    fn map_index(&self, py: Python<'_>, shard: u32) -> PyResult<(i32, (u64, u32, u32))> {
        let limit = self.limit(None);
        let (fd, a) = py.detach(|| self.inner.map_index(shard, limit)).map_err(|e| py_error(py, e))?;
        Ok((fd.into_raw_fd(), (a.file_bytes, a.buckets, a.shards)))
    }
}

impl Connection {
    /// One request of `rows` (no splitting): its per-item results, or its
    /// request-wide error raised.
    fn one(&self, py: Python<'_>, op: Op, rows: &[BatchItem], timeout_s: Option<f64>) -> PyResult<Vec<(i64, u8)>> {
        let tagged = op.carries_tags(self.inner.version());
        let limit = self.limit(timeout_s);
        let r = py.detach(|| -> Result<Vec<(i64, u8)>, Error> {
            let payload = encode(false, tagged, rows.iter());
            let resp = self.inner.call(op as u8, &payload, None, limit)?;
            decode_results(op, resp.body(op as u8)?.0, rows.len())
        });
        r.map_err(|e| py_error(py, e))
    }
}
