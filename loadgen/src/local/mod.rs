//! A client of kvtier's same-host data plane (docs/LOCAL.md): a Unix socket
//! and memory registered with the server, through which blocks are copied
//! into (`GET_INTO`) and out of (`PUT_FROM`) the client's own memory.
//!
//! [`LocalTarget`] is what `--target unix:///PATH/kvtier.sock` opens. It
//! holds a small pool of connections; each says `HELLO`, then registers one
//! sealed memfd (`MFD_ALLOW_SEALING`, sealed with `F_SEAL_SHRINK |
//! F_SEAL_GROW`, so the server maps it) cut into block-sized *slots*. An
//! operation takes a free slot (waiting for one when all are busy), so the
//! slots bound the requests in flight: one per worker. Every connection
//! carries many requests at once. The connection is `kvtier-client`'s (the
//! one the Python package binds): its reader thread hands each response to
//! its request by `request_id`, whatever order the server finishes them in,
//! and a request's ticket is awaited here as a future.
//!
//! A block read is verified where the server wrote it: the returned body is
//! a view of the slot (no copy), which goes back to the pool when the body is
//! dropped. A block write copies the payload into the slot first, skipping
//! the chunks the slot already holds from its last write (the loadgen's
//! payloads share one base buffer, so a write copies only the key stamp),
//! the way an engine's KV cache is already in its memory.
//!
//! Set-up (connect, HELLO, REGISTER with the descriptor in `SCM_RIGHTS`)
//! blocks, so it runs on tokio's blocking pool.
//!
//! `wire`: the ops, codes and errors of this client.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvtier_client::ops::{decode_lookup, decode_results, decode_tiers};
use kvtier_client::{Connection, HelloRequest};
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::client::{BodyChunks, Client};
use crate::retry::OverloadRetry;

mod wire;

pub use wire::*;

// ---------------------------------------------------------------- memory

/// A sealed memfd mapped read-write: the memory a connection registers.
pub struct Region {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who writes where is ordered by
// the slot discipline (a slot is written by one holder at a time, and by the
// server only while its holder awaits the GET_INTO answer).
unsafe impl Send for Region {}
// SAFETY: as for Send; the Region itself is never mutated.
unsafe impl Sync for Region {}

impl Region {
    /// A memfd of `len` bytes (`MFD_ALLOW_SEALING`), sealed against
    /// shrinking and growing so the server may map it, mapped shared.
    ///
    /// # Errors
    /// The failing system call's error (memfd_create, ftruncate, fcntl
    /// F_ADD_SEALS, mmap).
    pub fn new(len: usize) -> std::io::Result<Region> {
        let os = |what: &str| {
            let e = std::io::Error::last_os_error();
            std::io::Error::new(e.kind(), format!("{what}: {e}"))
        };
        // SAFETY: a NUL-terminated name and valid flags.
        let raw = unsafe { libc::memfd_create(c"kvtier-loadgen".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(os("memfd_create"));
        }
        // SAFETY: memfd_create returned a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain calls on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os(&format!("ftruncate to {len} bytes")));
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) } != 0 {
            return Err(os("fcntl(F_ADD_SEALS)"));
        }
        // SAFETY: a fresh shared mapping of the whole file.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(os(&format!("mmap of {len} bytes")));
        }
        Ok(Region { fd, ptr: NonNull::new(p.cast()).expect("mmap succeeded"), len })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes (never: regions hold at least one block).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; no slice of it outlives the
        // Region (slot bodies hold the pool, which holds the Region).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One block-sized piece of a connection's region.
struct Slot {
    conn: usize,
    /// Offset within the connection's region.
    offset: u64,
    /// The chunks the slot holds from its last write, at their offsets
    /// (kept alive, so the same pointer means the same bytes).
    holds: Mutex<Vec<(usize, Bytes)>>,
}

/// Every connection's slots, and which are free.
struct SlotPool {
    block_bytes: usize,
    slots: Vec<Slot>,
    regions: Vec<Arc<Region>>,
    free: Mutex<Vec<usize>>,
    available: Semaphore,
}

/// A slot held for one operation; back in the pool on drop.
struct SlotGuard {
    pool: Arc<SlotPool>,
    index: usize,
}

impl SlotPool {
    async fn acquire(self: &Arc<Self>) -> SlotGuard {
        self.available.acquire().await.expect("the slot semaphore is never closed").forget();
        let index = self.free.lock().expect("slot lock").pop().expect("a permit means a free slot");
        SlotGuard { pool: self.clone(), index }
    }
}

impl SlotGuard {
    fn slot(&self) -> &Slot {
        &self.pool.slots[self.index]
    }

    fn ptr(&self) -> *mut u8 {
        let s = self.slot();
        // SAFETY: the offset lies within the region (slots are laid out in it).
        unsafe { self.pool.regions[s.conn].ptr.as_ptr().add(s.offset as usize) }
    }

    /// Copies `chunks` (at most a block) into the slot, skipping each that
    /// the slot already holds at the same offset.
    fn fill(&self, chunks: &[Bytes]) {
        let mut holds = self.slot().holds.lock().expect("slot lock");
        let mut at = 0usize;
        let mut now = Vec::with_capacity(chunks.len());
        for c in chunks {
            let held = holds.iter().any(|(o, b)| *o == at && b.as_ptr() == c.as_ptr() && b.len() == c.len());
            if !held {
                // SAFETY: the caller checked the chunks fit the slot; we hold
                // the slot, and no request into it is in flight.
                unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), self.ptr().add(at), c.len()) };
            }
            now.push((at, c.clone()));
            at += c.len();
        }
        *holds = now;
    }

    /// The server is about to write the slot: it holds nothing known.
    fn overwritten(&self) {
        self.slot().holds.lock().expect("slot lock").clear();
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.pool.free.lock().expect("slot lock").push(self.index);
        self.pool.available.add_permits(1);
    }
}

/// A block the server wrote into a slot, readable in place.
struct SlotBytes {
    guard: SlotGuard,
    len: usize,
}

impl AsRef<[u8]> for SlotBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` ≤ block_bytes (checked when made); the server wrote
        // these bytes before answering, and nothing writes the slot while
        // this guard holds it.
        unsafe { std::slice::from_raw_parts(self.guard.ptr(), self.len) }
    }
}

// ------------------------------------------------------------ connection

/// One connection: HELLO said, one region registered.
struct Conn {
    conn: Connection,
    /// The registration's handle.
    handle: u64,
    /// 1 mapped, 2 file I/O (the server's `access`).
    access: u8,
}

/// The client crate's error as this client's.
fn local_error(path: &str, op: Op, e: kvtier_client::Error) -> LocalError {
    match e {
        kvtier_client::Error::Code { code, message, .. } if code == kvtier_client::CONNECTION_LOST => {
            LocalError::Closed { path: path.to_string(), message }
        }
        kvtier_client::Error::Code { code, message, .. } => {
            LocalError::Status { op: op.name(), code: code as i32, name: code_name(code), message }
        }
        kvtier_client::Error::BadAnswer(message) | kvtier_client::Error::Protocol(message) => {
            LocalError::BadResponse { op: op.name(), message }
        }
    }
}

/// Connects and says HELLO (asking for `block_bytes` when given, with
/// `token` when given). Blocking.
fn connect_hello(path: &str, block_bytes: Option<u64>, token: Option<&str>) -> Result<(Connection, Hello), String> {
    let conn = Connection::connect(path).map_err(|e| format!("cannot connect: {e}"))?;
    let req = HelloRequest {
        token,
        block_bytes,
        model: None,
        client: concat!("kvtier-loadgen ", env!("CARGO_PKG_VERSION")),
        versions: Some(&[VERSION]),
    };
    let raw = conn.hello(&req, SETUP_TIMEOUT).map_err(|e| format!("HELLO failed: {e}"))?;
    let field = |k: &str| raw[k].as_u64().ok_or_else(|| format!("HELLO answer has no {k}: {raw}"));
    let hello = Hello {
        version: field("version")? as u32,
        epoch: field("epoch")?,
        block_bytes: field("block_bytes")?,
        block_tokens: field("block_tokens")?,
        model: raw["model"].as_str().unwrap_or_default().to_string(),
        shards: field("shards")?,
        raw: raw.clone(),
    };
    Ok((conn, hello))
}

/// Makes a region of `bytes` and registers it on the (greeted)
/// connection; returns it with its handle and `access`. Blocking.
fn register(conn: &Connection, bytes: usize) -> Result<(Arc<Region>, u64, u8), String> {
    let region = Arc::new(Region::new(bytes).map_err(|e| format!("cannot make the shared memory: {e}"))?);
    let (handle, access) = conn
        .register(region.fd.as_raw_fd(), 0, bytes as u64, SETUP_TIMEOUT)
        .map_err(|e| format!("REGISTER of a {bytes}-byte sealed memfd failed: {e}"))?;
    Ok((region, handle, access))
}

impl Conn {
    /// Sends one request and awaits its response body and retry hint; a
    /// non-zero status is [`LocalError::Status`].
    async fn call(&self, op: Op, payload: &[u8]) -> Result<(Vec<u8>, u32), LocalError> {
        if payload.len() > PAYLOAD_BYTES_MAX {
            return Err(LocalError::Request(format!(
                "a {} payload of {} bytes is over the {PAYLOAD_BYTES_MAX}-byte limit",
                op.name(),
                payload.len()
            )));
        }
        let path = self.conn.path();
        let ticket = self.conn.request(op as u8, payload, None).map_err(|e| local_error(path, op, e))?;
        let r = ticket.await.map_err(|e| local_error(path, op, e))?;
        let (body, hint) = r.body(op as u8).map_err(|e| local_error(path, op, e))?;
        Ok((body.to_vec(), hint))
    }
}

// ---------------------------------------------------------------- target

/// kvtier's local socket as a load-generator target: connections, their
/// registered slots, and optionally the server's HTTP address for
/// `/v1/stats` (byte counters, the policy oracle's settings).
pub struct LocalTarget {
    url: String,
    path: String,
    conns: Vec<Conn>,
    pool: Arc<SlotPool>,
    hello: Hello,
    http: Option<Client>,
    refusals: AtomicU64,
    misses_corrupt: AtomicU64,
    next_conn: AtomicUsize,
}

/// `unix://PATH[?http=HOST:PORT]` → (path, HTTP base URL).
fn parse_url(url: &str) -> Result<(String, Option<String>), LocalError> {
    let rest = url.strip_prefix(SCHEME).ok_or_else(|| LocalError::BadTarget(url.into()))?;
    let (path, query) = match rest.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (rest, None),
    };
    if path.is_empty() {
        return Err(LocalError::BadTarget(url.into()));
    }
    let http = match query {
        None => None,
        Some(q) => {
            let addr = q.strip_prefix("http=").ok_or_else(|| LocalError::BadTarget(url.into()))?;
            Some(if addr.starts_with("http://") { addr.to_string() } else { format!("http://{addr}") })
        }
    };
    Ok((path.to_string(), http))
}

impl LocalTarget {
    /// Connects `connections` connections (at least 1, at most `slots`) to
    /// the socket at `url` (`unix:///PATH[?http=HOST:PORT]`), each saying
    /// HELLO and registering one sealed memfd; `slots` block-sized slots
    /// (at least 1) are dealt round-robin over them and bound the
    /// operations in flight. `/v1/stats` is read at `?http=`, else at the
    /// address the HELLO gives, and its `local.epoch` must be the socket's
    /// (the same server).
    ///
    /// # Errors
    /// [`LocalError::BadTarget`] for a malformed URL; [`LocalError::Setup`]
    /// when connecting, HELLO (with the server's code and message),
    /// creating the memfd or REGISTER fails, or the HTTP address is another
    /// server's.
    pub async fn connect(url: &str, connections: usize, slots: usize, token: Option<&str>) -> Result<LocalTarget, LocalError> {
        let token = token.map(str::to_string);
        let (path, http_url) = parse_url(url)?;
        if path.len() > 107 {
            return Err(LocalError::Setup { path, message: "the path is longer than the 107 bytes of sun_path".into() });
        }
        let slots = slots.max(1);
        let connections = connections.clamp(1, slots);
        let setup_err = |message: String| LocalError::Setup { path: path.clone(), message };
        // The first HELLO tells the block size the regions are cut into.
        let (p, t) = (path.clone(), token.clone());
        let first =
            tokio::task::spawn_blocking(move || connect_hello(&p, None, t.as_deref())).await.expect("set-up task").map_err(setup_err)?;
        let hello = first.1.clone();
        let block_bytes = hello.block_bytes as usize;
        let mut first = Some(first.0);
        let mut conns = Vec::with_capacity(connections);
        let mut regions = Vec::with_capacity(connections);
        let mut slot_list = Vec::with_capacity(slots);
        for c in 0..connections {
            let n = (slots - c).div_ceil(connections);
            let (p, bb, s, t) = (path.clone(), hello.block_bytes, first.take(), token.clone());
            let epoch = hello.epoch;
            let (conn, region, handle, access) = tokio::task::spawn_blocking(move || {
                let s = match s {
                    Some(s) => s,
                    None => {
                        let (s, h) = connect_hello(&p, Some(bb), t.as_deref())?;
                        if h.epoch != epoch {
                            return Err(format!("the server restarted while connecting (epoch {epoch}, then {})", h.epoch));
                        }
                        s
                    }
                };
                let (region, handle, access) = register(&s, n * bb as usize)?;
                Ok((s, region, handle, access))
            })
            .await
            .expect("set-up task")
            .map_err(setup_err)?;
            conns.push(Conn { conn, handle, access });
            regions.push(region);
            for i in 0..n {
                slot_list.push(Slot { conn: c, offset: (i * block_bytes) as u64, holds: Mutex::new(Vec::new()) });
            }
        }
        // Slot i of every connection before slot i+1 of any: free slots
        // spread over the connections (the free list is a stack).
        let mut order: Vec<usize> = (0..slot_list.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(slot_list[i].offset), slot_list[i].conn));
        let pool = Arc::new(SlotPool {
            block_bytes,
            available: Semaphore::new(slot_list.len()),
            slots: slot_list,
            regions,
            free: Mutex::new(order),
        });
        // Without `?http=`, the HTTP address the server gave in its HELLO.
        let http_url = http_url.or_else(|| hello.raw["http"].as_str().map(|a| format!("http://{a}")));
        let http = match http_url {
            None => None,
            Some(u) => {
                let mut client = Client::new(&u, false, 1).map_err(|e| setup_err(e.to_string()))?;
                if let Some(t) = &token {
                    client = client.with_token(t).map_err(|e| setup_err(e.to_string()))?;
                }
                let stats = client.stats().await.map_err(|e| setup_err(format!("cannot read /v1/stats at {u}: {e}")))?;
                if stats["local"]["epoch"].as_u64() != Some(hello.epoch) {
                    return Err(setup_err(format!(
                        "{u} is another server than the socket's: its local.epoch is {}, the socket's HELLO said {}",
                        stats["local"]["epoch"], hello.epoch
                    )));
                }
                Some(client)
            }
        };
        Ok(LocalTarget {
            url: url.to_string(),
            path,
            conns,
            pool,
            hello,
            http,
            refusals: AtomicU64::new(0),
            misses_corrupt: AtomicU64::new(0),
            next_conn: AtomicUsize::new(0),
        })
    }

    /// The target URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        Path::new(&self.path)
    }

    /// The server's HELLO answer (geometry, epoch, shards).
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Connections open.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Block slots registered over all connections (the most operations in
    /// flight at once).
    pub fn slots(&self) -> usize {
        self.pool.slots.len()
    }

    /// How the server reaches each connection's memory: 1 mapped, 2 file
    /// I/O (the REGISTER answer's `access`; sealed memfds are mapped).
    pub fn access(&self) -> Vec<u8> {
        self.conns.iter().map(|c| c.access).collect()
    }

    /// The HTTP client of `?http=`, for `/v1/stats`.
    pub fn http(&self) -> Option<&Client> {
        self.http.as_ref()
    }

    /// Items answered `OVERLOADED` and sent again after `retry_after_ms`.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Reads answered `CORRUPT` (a block that failed its CRC check),
    /// counted as misses.
    pub fn corrupt_misses(&self) -> u64 {
        self.misses_corrupt.load(Ordering::Relaxed)
    }

    /// `GET_INTO` of one block into a free slot: its bytes (a view of the
    /// slot, which is held until the body is dropped) and the tier that
    /// served it; `None` for `NOT_FOUND` or `CORRUPT` (misses).
    ///
    /// # Errors
    /// [`LocalError::Item`] for any other per-item code (with its name);
    /// [`LocalError::Status`], [`LocalError::Closed`],
    /// [`LocalError::BadResponse`] for the request.
    pub async fn get(&self, key: &str) -> Result<Option<(BodyChunks, &'static str)>, LocalError> {
        let slot = self.pool.acquire().await;
        let (conn, offset) = { (&self.conns[slot.slot().conn], slot.slot().offset) };
        slot.overwritten();
        let bb = self.pool.block_bytes as u64;
        let (body, _) = conn.call(Op::GetInto, &encode_items(&[(conn.handle, offset, bb, key)])).await?;
        let (result, tier) = decode_results(Op::GetInto, &body, 1).map_err(|e| local_error(&self.path, Op::GetInto, e))?[0];
        match result {
            n if n >= 0 => {
                if n as u64 > bb {
                    return Err(LocalError::BadResponse { op: "GET_INTO", message: format!("{n} bytes written into a {bb}-byte slot") });
                }
                let body = Bytes::from_owner(SlotBytes { guard: slot, len: n as usize });
                Ok(Some((BodyChunks::from(body), tier_name(tier))))
            }
            NOT_FOUND => Ok(None),
            CORRUPT => {
                self.misses_corrupt.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
            code => Err(LocalError::Item { op: "GET_INTO", key: key.to_string(), code, name: code_name(code) }),
        }
    }

    /// `PUT_FROM` of one block: `chunks` (a whole block) are copied into a
    /// free slot, then stored from there. An item answered `OVERLOADED` is
    /// sent again after the response's `retry_after_ms`, as
    /// [`OverloadRetry`] says (at most
    /// [`RETRY_AFTER_MAX`](crate::retry::RETRY_AFTER_MAX), up to
    /// [`OVERLOAD_RETRIES_MAX`](crate::retry::OVERLOAD_RETRIES_MAX) times).
    /// Returns whether the key was new.
    ///
    /// # Errors
    /// [`LocalError::Request`] when the chunks are not one block;
    /// [`LocalError::Item`] for a failing per-item code (the last
    /// `OVERLOADED` included); request failures as [`LocalTarget::get`].
    pub async fn put(&self, key: &str, chunks: &[Bytes]) -> Result<bool, LocalError> {
        let total: usize = chunks.iter().map(|c| c.len()).sum();
        if total != self.pool.block_bytes {
            return Err(LocalError::Request(format!(
                "a {total}-byte block for {key}; the server stores {}-byte blocks",
                self.pool.block_bytes
            )));
        }
        let slot = self.pool.acquire().await;
        let (conn, offset) = (&self.conns[slot.slot().conn], slot.slot().offset);
        slot.fill(chunks);
        let payload = encode_items(&[(conn.handle, offset, total as u64, key)]);
        let mut retry = OverloadRetry::new();
        loop {
            let (body, retry_after_ms) = conn.call(Op::PutFrom, &payload).await?;
            let (result, created) = decode_results(Op::PutFrom, &body, 1).map_err(|e| local_error(&self.path, Op::PutFrom, e))?[0];
            match result {
                r if r >= 0 => return Ok(created == 1),
                // Counted only when retried: a refusal that stands is an error.
                OVERLOADED if !retry.exhausted() => {
                    self.refusals.fetch_add(1, Ordering::Relaxed);
                    retry.wait(Duration::from_millis(u64::from(retry_after_ms).max(1))).await;
                }
                code => return Err(LocalError::Item { op: "PUT_FROM", key: key.to_string(), code, name: code_name(code) }),
            }
        }
    }

    fn conn(&self) -> &Conn {
        &self.conns[self.next_conn.fetch_add(1, Ordering::Relaxed) % self.conns.len()]
    }

    /// `LOOKUP` of a prefix chain: how many leading keys are stored. A
    /// chain over [`ITEMS_MAX`] keys or a 1 MiB payload is asked in parts,
    /// each only if every key before it hit.
    ///
    /// # Errors
    /// As [`LocalTarget::get`]; [`LocalError::BadResponse`] when the hits
    /// and their tiers disagree.
    pub async fn lookup<S: AsRef<str>>(&self, keys: &[S]) -> Result<usize, LocalError> {
        let mut hits = 0;
        for part in split_keys(keys) {
            let (body, _) = self.conn().call(Op::Lookup, &encode_keys(part)).await?;
            let (prefix, _) = decode_lookup(&body).map_err(|e| local_error(&self.path, Op::Lookup, e))?;
            let prefix = prefix as usize;
            if prefix > part.len() {
                return Err(LocalError::BadResponse { op: "LOOKUP", message: format!("prefix_hits {prefix} for {} keys", part.len()) });
            }
            hits += prefix;
            if prefix < part.len() {
                break;
            }
        }
        Ok(hits)
    }

    /// `EXISTS`: the tier holding each key (`None`: not stored).
    ///
    /// # Errors
    /// As [`LocalTarget::get`]; [`LocalError::Request`] for a batch over
    /// [`ITEMS_MAX`] keys or 1 MiB.
    pub async fn exists<S: AsRef<str>>(&self, keys: &[S]) -> Result<Vec<Option<&'static str>>, LocalError> {
        if keys.len() > ITEMS_MAX {
            return Err(LocalError::Request(format!("{} keys in one EXISTS; the limit is {ITEMS_MAX}", keys.len())));
        }
        let (body, _) = self.conn().call(Op::Exists, &encode_keys(keys)).await?;
        let tiers = decode_tiers(&body, keys.len()).map_err(|e| local_error(&self.path, Op::Exists, e))?;
        Ok(tiers.into_iter().map(|t| (t != 0).then(|| tier_name(t))).collect())
    }

    /// `/v1/stats` over `?http=`.
    ///
    /// # Errors
    /// [`LocalError::Http`] without `?http=` or when the request fails.
    pub async fn stats(&self) -> Result<Value, LocalError> {
        let Some(http) = &self.http else {
            return Err(LocalError::Http(format!(
                "{}: /v1/stats needs the server's HTTP address: give it as unix://{}?http=HOST:PORT",
                self.url, self.path
            )));
        };
        Ok(http.stats().await?)
    }

    /// The local plane's block bytes received and sent, `(in, out)`, summed
    /// over shards (`/v1/stats` `local.per_shard`).
    ///
    /// # Errors
    /// As [`LocalTarget::stats`].
    pub async fn server_bytes(&self) -> Result<(u64, u64), LocalError> {
        let v = self.stats().await?;
        let shards = v["local"]["per_shard"].as_array().cloned().unwrap_or_default();
        let sum = |f: &str| shards.iter().map(|s| s[f].as_u64().unwrap_or(0)).sum::<u64>();
        Ok((sum("bytes_in"), sum("bytes_out")))
    }
}

/// Splits a chain into parts of at most [`ITEMS_MAX`] keys and a 1 MiB
/// payload.
fn split_keys<S: AsRef<str>>(keys: &[S]) -> Vec<&[S]> {
    let mut parts = Vec::new();
    let (mut start, mut bytes) = (0, 4);
    for (i, k) in keys.iter().enumerate() {
        let b = 2 + k.as_ref().len();
        if i > start && (i - start == ITEMS_MAX || bytes + b > PAYLOAD_BYTES_MAX) {
            parts.push(&keys[start..i]);
            (start, bytes) = (i, 4);
        }
        bytes += b;
    }
    if start < keys.len() || keys.is_empty() {
        parts.push(&keys[start..]);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_and_without_an_http_address() {
        assert_eq!(parse_url("unix:///tmp/k.sock").unwrap(), ("/tmp/k.sock".into(), None));
        assert_eq!(parse_url("unix://rel/k.sock").unwrap(), ("rel/k.sock".into(), None));
        assert_eq!(parse_url("unix:///k.sock?http=127.0.0.1:8085").unwrap().1.as_deref(), Some("http://127.0.0.1:8085"));
        assert_eq!(parse_url("unix:///k.sock?http=http://h:1").unwrap().1.as_deref(), Some("http://h:1"));
        assert!(parse_url("unix://").is_err());
        assert!(parse_url("unix:///k.sock?stats=x").is_err());
        assert!(parse_url("http://x").is_err());
    }

    #[test]
    fn items_encode_as_docs_local_says() {
        let p = encode_items(&[(7, 4096, 65536, "k1")]);
        assert_eq!(p.len(), 4 + 8 + 8 + 8 + 2 + 2);
        assert_eq!(&p[..4], &1u32.to_le_bytes());
        assert_eq!(&p[28..30], &2u16.to_le_bytes());
        assert_eq!(&p[30..], b"k1");
        assert_eq!(code_name(-2), "NOT_FOUND");
        assert_eq!(code_name(-19), "BAD_FRAME");
        assert_eq!(tier_name(3), "nvme");
    }

    #[test]
    fn long_chains_split_by_count_and_bytes() {
        let keys: Vec<String> = (0..9000).map(|i| format!("{i:016x}")).collect();
        let parts = split_keys(&keys);
        assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), vec![4096, 4096, 808]);
        let big: Vec<String> = (0..5000).map(|i| format!("{i:0256}")).collect();
        let parts = split_keys(&big);
        assert!(parts.iter().all(|p| encode_keys(p).len() <= PAYLOAD_BYTES_MAX && !p.is_empty()));
        assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), 5000);
        assert_eq!(split_keys::<String>(&[]).len(), 1);
    }

    #[test]
    fn a_region_is_a_sealed_memfd() {
        let r = Region::new(1 << 20).unwrap();
        // SAFETY: reading the seals of our own descriptor.
        let seals = unsafe { libc::fcntl(r.fd.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW), libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        // SAFETY: within the mapping.
        unsafe { *r.ptr.as_ptr().add((1 << 20) - 1) = 7 };
        assert_eq!(r.len(), 1 << 20);
    }
}
