//! The same-host ops on a [`Connection`]: each request's payload
//! (`kvtier_local_proto`'s encoders, the server's own), its answer decoded,
//! and item batches split into requests that fit the protocol's limits and
//! sent all at once ([`Connection::batch`]).

use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvtier_local_proto as proto;
use kvtier_local_proto::{ArenaAnswer, Code, Cursor, IndexAnswer, LeaseItem, Op, ITEMS_MAX, PAYLOAD_BYTES_MAX, VERSIONS, VERSION_LEASES};
use serde_json::{json, Value};

use crate::conn::{op_name, Connection, Response};
use crate::Error;

/// Payload bytes of one `GET_INTO`/`PUT_FROM` item, not counting its key
/// (u64 handle, u64 offset, u64 length, u16 key length).
pub const ITEM_BYTES: usize = 26;
/// Payload bytes of one part of a `GET_INTO_V`/`PUT_FROM_V` item.
pub const PART_BYTES: usize = 24;

/// What the hello asks of the server.
#[derive(Debug, Clone, Default)]
pub struct HelloRequest<'a> {
    /// The token (`--auth-token-file`).
    pub token: Option<&'a str>,
    /// The block size the client expects, checked by the server.
    pub block_bytes: Option<u64>,
    /// The model the client expects, checked by the server.
    pub model: Option<&'a str>,
    /// What the hello's `client` field says.
    pub client: &'a str,
    /// Versions offered (default: every one this client speaks, [`VERSIONS`]).
    pub versions: Option<&'a [u32]>,
}

/// One item of a batch: where its block goes or comes from, its key and,
/// for a put on a version-2 connection, its encoded block tag.
#[derive(Debug, Clone)]
pub struct BatchItem {
    /// `(handle, offset, length)` spans: one for `GET_INTO`/`PUT_FROM`,
    /// the block's bytes laid across them in order for the `_V` ops.
    pub parts: Vec<(u64, u64, u64)>,
    /// The key.
    pub key: String,
    /// The encoded block tag (empty: untagged); sent only where the op and
    /// connection carry tags.
    pub tag: Vec<u8>,
}

/// What [`Connection::batch`] answers.
#[derive(Debug, Default)]
pub struct BatchAnswer {
    /// Per item `(result, tier or created)`: bytes moved (or stored, ≥ 0)
    /// or a negative code.
    pub results: Vec<(i64, u8)>,
    /// The largest `retry_after_ms` of the requests whose items were
    /// refused `OVERLOADED`.
    pub retry_after_ms: u32,
    /// The messages of the requests that failed as a whole, but for a lost
    /// connection (a client misconfigured, a server refusing the form).
    pub failures: Vec<String>,
}

fn bad(op: Op, e: String) -> Error {
    Error::BadAnswer(format!("{} answer: {e}", op.name()))
}

/// A batch answer's `n` × (i64 result, u8 extra) for a request of `want` items.
///
/// # Errors
/// [`Error::BadAnswer`]: another count, or a body of another length.
pub fn decode_results(op: Op, body: &[u8], want: usize) -> Result<Vec<(i64, u8)>, Error> {
    let mut c = Cursor::new(body);
    let n = counted(op, &mut c, want, 9)?;
    let out = (0..n).map(|_| Ok((c.u64("result")? as i64, c.u8("extra")?))).collect::<Result<Vec<_>, String>>().map_err(|e| bad(op, e))?;
    c.end().map_err(|e| bad(op, e))?;
    Ok(out)
}

fn counted(op: Op, c: &mut Cursor<'_>, want: usize, each: usize) -> Result<usize, Error> {
    let n = c.count(each).map_err(|e| bad(op, e))?;
    if n != want {
        return Err(bad(op, format!("{n} items for a request of {want}")));
    }
    Ok(n)
}

fn u32_pair(op: Op, body: &[u8]) -> Result<(u32, u32), Error> {
    let mut c = Cursor::new(body);
    let pair = (c.u32("the first count").map_err(|e| bad(op, e))?, c.u32("the second count").map_err(|e| bad(op, e))?);
    c.end().map_err(|e| bad(op, e))?;
    Ok(pair)
}

/// A `REGISTER` answer: `(handle, access)`.
///
/// # Errors
/// [`Error::BadAnswer`]: not 9 bytes.
pub fn decode_registered(body: &[u8]) -> Result<(u64, u8), Error> {
    let mut c = Cursor::new(body);
    let r = (c.u64("handle").map_err(|e| bad(Op::Register, e))?, c.u8("access").map_err(|e| bad(Op::Register, e))?);
    c.end().map_err(|e| bad(Op::Register, e))?;
    Ok(r)
}

/// An `EXISTS` answer for `want` keys: each key's tier.
///
/// # Errors
/// [`Error::BadAnswer`]: another count, or a body of another length.
pub fn decode_tiers(body: &[u8], want: usize) -> Result<Vec<u8>, Error> {
    let mut c = Cursor::new(body);
    let n = counted(Op::Exists, &mut c, want, 1)?;
    let tiers = (0..n).map(|_| c.u8("a tier")).collect::<Result<Vec<_>, _>>().map_err(|e| bad(Op::Exists, e))?;
    c.end().map_err(|e| bad(Op::Exists, e))?;
    Ok(tiers)
}

/// A `LOOKUP` answer: `(prefix_hits, the hits' tiers)`.
///
/// # Errors
/// [`Error::BadAnswer`]: a tier count other than the hits, or a body of
/// another length.
pub fn decode_lookup(body: &[u8]) -> Result<(u32, Vec<u8>), Error> {
    let short = || bad(Op::Lookup, format!("{} bytes, too few for its two counts", body.len()));
    let hits = u32::from_le_bytes(body.get(0..4).ok_or_else(short)?.try_into().expect("4 bytes"));
    let n = u32::from_le_bytes(body.get(4..8).ok_or_else(short)?.try_into().expect("4 bytes"));
    if n != hits || body.len() != 8 + n as usize {
        return Err(bad(Op::Lookup, format!("{hits} hits with {n} tiers in {} bytes", body.len())));
    }
    Ok((hits, body[8..].to_vec()))
}

/// A `DELETE` answer for `want` keys: per key 0 or a negative code.
///
/// # Errors
/// [`Error::BadAnswer`]: another count, or a body of another length.
pub fn decode_deleted(body: &[u8], want: usize) -> Result<Vec<i64>, Error> {
    let mut c = Cursor::new(body);
    let n = counted(Op::Delete, &mut c, want, 8)?;
    let out = (0..n).map(|_| c.u64("a result").map(|r| r as i64)).collect::<Result<Vec<_>, _>>().map_err(|e| bad(Op::Delete, e))?;
    c.end().map_err(|e| bad(Op::Delete, e))?;
    Ok(out)
}

/// A `PREFETCH` answer: `(requested, found locally)`.
///
/// # Errors
/// [`Error::BadAnswer`]: not 8 bytes.
pub fn decode_prefetched(body: &[u8]) -> Result<(u32, u32), Error> {
    u32_pair(Op::Prefetch, body)
}

/// A `RELEASE` answer: the leases the connection still held.
///
/// # Errors
/// [`Error::BadAnswer`]: not 4 bytes.
pub fn decode_released(body: &[u8]) -> Result<u32, Error> {
    let b: [u8; 4] = body.try_into().map_err(|_| bad(Op::Release, format!("{} bytes; released is 4", body.len())))?;
    Ok(u32::from_le_bytes(b))
}

/// A `LEASE` answer for `want` keys.
///
/// # Errors
/// [`Error::BadAnswer`]: another count, or a body that does not parse.
pub fn decode_leases(body: &[u8], want: usize) -> Result<Vec<LeaseItem>, Error> {
    let items = proto::decode_leases(body).map_err(|e| bad(Op::Lease, e))?;
    if items.len() != want {
        return Err(bad(Op::Lease, format!("{} items for a request of {want}", items.len())));
    }
    Ok(items)
}

/// The hello's answer checked: a version this client speaks, the block
/// size asked for, and from version 3 the `leases` object.
fn check_hello(info: &Value, block_bytes: Option<u64>) -> Result<u32, Error> {
    let field = |k: &str| info[k].as_u64().ok_or_else(|| Error::BadAnswer(format!("unreadable HELLO answer (no {k}): {info}")));
    let (version, _epoch, bb) = (field("version")?, field("epoch")?, field("block_bytes")?);
    let version = u32::try_from(version).ok().filter(|v| VERSIONS.contains(v));
    let Some(version) = version else {
        return Err(Error::Protocol(format!("the server chose version {}; this client speaks {VERSIONS:?}", info["version"])));
    };
    if let Some(want) = block_bytes.filter(|w| *w != bb) {
        return Err(Error::code(Code::GeometryMismatch, format!("the server's block_bytes is {bb}; the client expects {want}")));
    }
    if version >= VERSION_LEASES {
        let o = &info["leases"];
        let ok = o["offered"].is_boolean()
            && (o["why_not"].is_null() || o["why_not"].is_string())
            && o["lease_ms"].is_i64()
            && o["leases_max"].is_i64()
            && o.get("arenas").is_none_or(|a| a.as_array().is_some_and(|a| a.iter().all(Value::is_i64)));
        if !ok {
            return Err(Error::BadAnswer(format!(
                "a version-{VERSION_LEASES} HELLO answer needs leases: {{\"offered\": bool, \"why_not\": str|null, \"lease_ms\": int, \"leases_max\": int}}, got {o}"
            )));
        }
    }
    Ok(version)
}

impl Connection {
    /// One request of `op` and its response (whose status each caller
    /// reads with [`Response::body`]).
    fn body(&self, op: Op, payload: &[u8], fd: Option<RawFd>, timeout: Duration) -> Result<Response, Error> {
        self.call(op as u8, payload, fd, timeout)
    }

    /// `HELLO`, the first request: the versions offered, the client's name,
    /// and the token and expected geometry when given. Returns the
    /// server's answer (`version`, `epoch`, `block_bytes`, `model`,
    /// `max_items`, `leases`, …), also kept for [`Connection::version`].
    ///
    /// # Errors
    /// `UNAUTHORIZED` (the peer or token refused), `GEOMETRY_MISMATCH`,
    /// [`Error::Protocol`] (no version in common), [`Error::BadAnswer`].
    pub fn hello(&self, req: &HelloRequest<'_>, timeout: Duration) -> Result<Value, Error> {
        let mut ask = json!({ "versions": req.versions.unwrap_or(&VERSIONS), "client": req.client });
        if let Some(t) = req.token {
            ask["token"] = json!(t);
        }
        if let Some(b) = req.block_bytes {
            ask["block_bytes"] = json!(b);
        }
        if let Some(m) = req.model {
            ask["model"] = json!(m);
        }
        let r = self.body(Op::Hello, ask.to_string().as_bytes(), None, timeout)?;
        let body = r.body(Op::Hello as u8)?.0;
        let info: Value = serde_json::from_slice(body).map_err(|e| {
            Error::BadAnswer(format!("unreadable HELLO answer {:?}: {e}", String::from_utf8_lossy(&body[..body.len().min(200)])))
        })?;
        let version = check_hello(&info, req.block_bytes)?;
        self.version.store(version, Ordering::Release);
        *self.hello.lock().unwrap_or_else(|e| e.into_inner()) = Some(info.clone());
        Ok(info)
    }

    /// `REGISTER` `length` bytes of file `fd` from `offset` (the
    /// descriptor travels in `SCM_RIGHTS`; the caller keeps its own):
    /// `(handle, access)`, access 1 mapped, 2 file I/O, 3 guarded.
    ///
    /// # Errors
    /// The server's refusal (`BAD_BUFFER`, `LIMIT`, …) or a lost connection.
    pub fn register(&self, fd: RawFd, offset: u64, length: u64, timeout: Duration) -> Result<(u64, u8), Error> {
        let r = self.body(Op::Register, &proto::encode_register(offset, length), Some(fd), timeout)?;
        decode_registered(r.body(Op::Register as u8)?.0)
    }

    /// `UNREGISTER` `handle`; items in flight on it finish.
    ///
    /// # Errors
    /// `UNKNOWN_HANDLE`, or a lost connection.
    pub fn unregister(&self, handle: u64, timeout: Duration) -> Result<(), Error> {
        let r = self.body(Op::Unregister, &proto::encode_unregister(handle), None, timeout)?;
        r.body(Op::Unregister as u8).map(drop)
    }

    /// `EXISTS`: each key's tier (0 not stored, 1 gpu, 2 ram, 3 nvme, 4 s3).
    ///
    /// # Errors
    /// The request's failure (`LIMIT` over 4,096 keys, …), a lost
    /// connection, or an answer of another count.
    pub fn exists<S: AsRef<str>>(&self, keys: &[S], timeout: Duration) -> Result<Vec<u8>, Error> {
        let r = self.body(Op::Exists, &proto::encode_keys(keys), None, timeout)?;
        decode_tiers(r.body(Op::Exists as u8)?.0, keys.len())
    }

    /// `LOOKUP` a prefix chain: `(prefix_hits, the hits' tiers)`.
    ///
    /// # Errors
    /// As [`Connection::exists`].
    pub fn lookup<S: AsRef<str>>(&self, keys: &[S], timeout: Duration) -> Result<(u32, Vec<u8>), Error> {
        let r = self.body(Op::Lookup, &proto::encode_keys(keys), None, timeout)?;
        decode_lookup(r.body(Op::Lookup as u8)?.0)
    }

    /// `DELETE`: per key 0 (deleted) or a negative code (`NOT_FOUND`: none stored).
    ///
    /// # Errors
    /// As [`Connection::exists`].
    pub fn delete<S: AsRef<str>>(&self, keys: &[S], timeout: Duration) -> Result<Vec<i64>, Error> {
        let r = self.body(Op::Delete, &proto::encode_keys(keys), None, timeout)?;
        decode_deleted(r.body(Op::Delete as u8)?.0, keys.len())
    }

    /// `PREFETCH`: `(requested, found locally)`.
    ///
    /// # Errors
    /// As [`Connection::exists`].
    pub fn prefetch<S: AsRef<str>>(&self, keys: &[S], timeout: Duration) -> Result<(u32, u32), Error> {
        let r = self.body(Op::Prefetch, &proto::encode_keys(keys), None, timeout)?;
        decode_prefetched(r.body(Op::Prefetch as u8)?.0)
    }

    /// `LEASE` (version 3) of up to 4,096 keys: per key its answer
    /// (`result` `block_bytes` when leased, else a negative code).
    ///
    /// # Errors
    /// `LEASES_OFF` (the server's reason), `UNSUPPORTED_VERSION`, a lost
    /// connection, an answer of another count.
    pub fn lease<S: AsRef<str>>(&self, keys: &[S], timeout: Duration) -> Result<Vec<LeaseItem>, Error> {
        let r = self.body(Op::Lease, &proto::encode_keys(keys), None, timeout)?;
        decode_leases(r.body(Op::Lease as u8)?.0, keys.len())
    }

    /// `RELEASE` of up to 4,096 lease ids: how many the connection still
    /// held (the others had ended, or were never its).
    ///
    /// # Errors
    /// The request's failure, or a lost connection.
    pub fn release(&self, ids: &[u64], timeout: Duration) -> Result<u32, Error> {
        let r = self.body(Op::Release, &proto::encode_release(ids), None, timeout)?;
        decode_released(r.body(Op::Release as u8)?.0)
    }

    /// `MAP_ARENA` (version 3) of `arena`: a read-only descriptor of its
    /// sealed memfd, the caller's to map and close, and its layout.
    ///
    /// # Errors
    /// `LEASES_OFF`, `NOT_FOUND` (no such arena), `UNSUPPORTED_VERSION`, an
    /// answer without exactly one descriptor.
    pub fn map_arena(&self, arena: u32, timeout: Duration) -> Result<(OwnedFd, ArenaAnswer), Error> {
        self.map(Op::MapArena, arena, timeout, proto::decode_arena)
    }

    /// `MAP_INDEX` (version 3) of shard `shard`'s index table
    /// (docs/LOCAL.md, "The shared index"): a read-only descriptor, the
    /// caller's, and the table's size.
    ///
    /// # Errors
    /// As [`Connection::map_arena`].
    pub fn map_index(&self, shard: u32, timeout: Duration) -> Result<(OwnedFd, IndexAnswer), Error> {
        self.map(Op::MapIndex, shard, timeout, proto::decode_index)
    }

    fn map<T>(&self, op: Op, number: u32, timeout: Duration, decode: fn(&[u8]) -> Result<T, String>) -> Result<(OwnedFd, T), Error> {
        let mut r = self.body(op, &proto::encode_map_arena(number), None, timeout)?;
        let answer = decode(r.body(op as u8)?.0).map_err(|e| bad(op, e))?;
        if r.fds.len() != 1 {
            return Err(Error::BadAnswer(format!("{} {number} came with {} descriptors; it brings one", op.name(), r.fds.len())));
        }
        Ok((r.fds.pop().expect("one"), answer))
    }

    /// `GET_INTO`/`PUT_FROM` or their `_V` forms of `items`, split into
    /// requests of at most 4,096 items and 1 MiB of payload, all in flight
    /// at once. A put's items carry their tags on a connection of version 2
    /// or later (on an older one an item with a tag fails
    /// `UNSUPPORTED_VERSION`, untagged ones are stored). Each request waits
    /// up to `timeout` plus `seconds_per_gib` per GiB it moves; one with no
    /// answer by then gives the connection up. Never fails as a whole: a
    /// request's failure is its items' code.
    pub fn batch(&self, op: Op, items: &[BatchItem], timeout: Duration, seconds_per_gib: f64) -> BatchAnswer {
        let mut out = BatchAnswer { results: vec![(crate::CONNECTION_LOST, 0); items.len()], ..BatchAnswer::default() };
        let vectored = op.is_vectored();
        let put = matches!(op, Op::PutFrom | Op::PutFromV);
        let tagged = op.carries_tags(self.version());
        let mut sendable = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            if it.parts.is_empty() || (!vectored && it.parts.len() != 1) {
                out.results[i] = (Code::BadRequest as i64, 0); // not an item of this op's form
            } else if put && !tagged && !it.tag.is_empty() {
                out.results[i] = (Code::UnsupportedVersion as i64, 0); // a version-1 server takes no tags
            } else {
                sendable.push(i);
            }
        }
        let each = |i: usize| {
            let it = &items[i];
            let spans = if vectored { 2 + PART_BYTES * it.parts.len() } else { ITEM_BYTES };
            spans + it.key.len() + if put { 2 + it.tag.len() } else { 0 }
        };
        let mut flights = Vec::new();
        for chunk in chunks(&sendable, each) {
            let rows = chunk.iter().map(|&i| &items[i]);
            let payload = encode(vectored, tagged, rows);
            let nbytes: u64 = chunk.iter().flat_map(|&i| items[i].parts.iter().map(|p| p.2)).sum();
            let limit = timeout + Duration::from_secs_f64(seconds_per_gib * nbytes as f64 / (1u64 << 30) as f64);
            flights.push((chunk, limit, self.request(op as u8, &payload, None)));
        }
        for (chunk, limit, ticket) in flights {
            let answer = ticket.and_then(|t| t.wait(limit)).and_then(|r| {
                let (body, hint) = r.body(op as u8)?;
                Ok((decode_results(op, body, chunk.len())?, hint))
            });
            match answer {
                Ok((results, hint)) => {
                    if results.iter().any(|r| r.0 == Code::Overloaded as i64) {
                        out.retry_after_ms = out.retry_after_ms.max(hint);
                    }
                    for (&i, r) in chunk.iter().zip(results) {
                        out.results[i] = r;
                    }
                }
                Err(e) => {
                    let code = e.code_number();
                    if code == Code::Overloaded as i64 {
                        out.retry_after_ms = out.retry_after_ms.max(e.retry_after_ms());
                    } else if code != crate::CONNECTION_LOST {
                        out.failures.push(format!("{} items of a {} failed as a whole: {e}", chunk.len(), op_name(op as u8)));
                    }
                    for &i in &chunk {
                        out.results[i] = (code, 0);
                    }
                }
            }
        }
        out
    }
}

/// `idx` in order, in pieces of at most [`ITEMS_MAX`] items whose payload
/// (u32 n, then `each(i)` bytes for item `i`) stays within
/// [`PAYLOAD_BYTES_MAX`].
pub fn chunks(idx: &[usize], each: impl Fn(usize) -> usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut chunk = Vec::new();
    let mut nbytes = 4;
    for &i in idx {
        let cost = each(i);
        if !chunk.is_empty() && (chunk.len() == ITEMS_MAX || nbytes + cost > PAYLOAD_BYTES_MAX) {
            out.push(std::mem::take(&mut chunk));
            nbytes = 4;
        }
        chunk.push(i);
        nbytes += cost;
    }
    if !chunk.is_empty() {
        out.push(chunk);
    }
    out
}

/// One request's payload of `rows`, in the form of its op (`vectored`) and
/// connection (`tagged`: each item ends with its tag).
pub fn encode<'a>(vectored: bool, tagged: bool, rows: impl Iterator<Item = &'a BatchItem>) -> Vec<u8> {
    let rows: Vec<&BatchItem> = rows.collect();
    match (vectored, tagged) {
        (false, false) => {
            proto::encode_items(&rows.iter().map(|r| (r.parts[0].0, r.parts[0].1, r.parts[0].2, r.key.as_str())).collect::<Vec<_>>())
        }
        (false, true) => proto::encode_tagged_items(
            &rows.iter().map(|r| (r.parts[0].0, r.parts[0].1, r.parts[0].2, r.key.as_str(), r.tag.as_slice())).collect::<Vec<_>>(),
        ),
        (true, false) => proto::encode_items_v(&rows.iter().map(|r| (r.parts.as_slice(), r.key.as_str())).collect::<Vec<_>>()),
        (true, true) => {
            proto::encode_tagged_items_v(&rows.iter().map(|r| (r.parts.as_slice(), r.key.as_str(), r.tag.as_slice())).collect::<Vec<_>>())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(version: u64, leases: Option<Value>) -> Value {
        let mut v = json!({ "version": version, "epoch": 1, "block_bytes": 4096 });
        if let Some(l) = leases {
            v["leases"] = l;
        }
        v
    }

    #[test]
    fn a_version_3_hello_must_carry_the_leases_offer() {
        let offer = json!({ "offered": false, "why_not": "--ram-shared off", "lease_ms": 30000, "leases_max": 16384 });
        assert_eq!(check_hello(&hello(3, Some(offer.clone())), None), Ok(3));
        let mut bad = vec![Value::Null];
        for (k, v) in [("offered", json!(1)), ("lease_ms", json!("30000")), ("why_not", json!(3)), ("arenas", json!(["1"]))] {
            let mut o = offer.clone();
            o[k] = v;
            bad.push(o);
        }
        for o in bad {
            let e = check_hello(&hello(3, Some(o.clone())), None).expect_err("a bad offer");
            assert!(matches!(&e, Error::BadAnswer(m) if m.contains("needs leases")), "{o}: {e:?}");
        }
        // Version 2 has no leases object to check.
        assert_eq!(check_hello(&hello(2, None), None), Ok(2));
    }

    #[test]
    fn a_hello_of_another_version_or_block_size_is_refused() {
        assert!(matches!(check_hello(&hello(9, None), None), Err(Error::Protocol(m)) if m.contains("version 9")));
        let e = check_hello(&hello(2, None), Some(8192)).expect_err("another block size");
        assert_eq!(e.code_number(), Code::GeometryMismatch as i64);
        assert!(matches!(check_hello(&json!({ "version": 2 }), None), Err(Error::BadAnswer(m)) if m.contains("no epoch")));
    }

    #[test]
    fn chunks_keep_to_the_item_and_payload_limits() {
        let idx: Vec<usize> = (0..10_000).collect();
        let c = chunks(&idx, |_| 30);
        assert_eq!(c.iter().map(Vec::len).collect::<Vec<_>>(), vec![4096, 4096, 1808]);
        let c = chunks(&idx[..100], |_| 300_000);
        assert_eq!(c.iter().map(Vec::len).collect::<Vec<_>>(), vec![3; 33].into_iter().chain([1]).collect::<Vec<_>>());
        assert!(chunks(&[], |_| 1).is_empty());
    }
}
