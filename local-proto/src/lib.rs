//! The framed protocol of kvtier's same-host data plane (docs/LOCAL.md):
//! frame headers, operations, status codes, and the encoding and decoding of
//! payloads, both ways. One definition for the server (`server/src/local/`)
//! and the load generator's client (`loadgen/src/local/`). Pure functions
//! over bytes, so every decoder is tested (and can be fuzzed) without a
//! socket. Its frames are written down, byte for byte, in
//! `tests/data/local_frame_vectors.json` (`tests/frame_vectors.rs`) for
//! other clients to check themselves against.

/// Frame magic, `b"TK"` on the wire (0x4B54 little-endian).
pub const MAGIC: u16 = 0x4B54;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;
/// Largest payload of one frame: 1 MiB.
pub const PAYLOAD_BYTES_MAX: usize = 1 << 20;
/// Most items in one batch.
pub const ITEMS_MAX: usize = 4096;
/// Most spans (`parts`) of one `GET_INTO_V`/`PUT_FROM_V` item.
pub const PARTS_MAX: usize = 256;
/// Protocol versions this server speaks.
pub const VERSIONS: [u32; 1] = [1];
/// `op` of the frame the server sends before closing on a framing error.
pub const OP_CONNECTION_ERROR: u8 = 0xFF;
/// Set in a response's `op`.
pub const RESPONSE_BIT: u8 = 0x80;

/// An operation (the request frame's `op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// 1: version, token and geometry check; must come first.
    Hello = 1,
    /// 2: a buffer (one `SCM_RIGHTS` descriptor) → handle.
    Register = 2,
    /// 3: drop a handle.
    Unregister = 3,
    /// 4: copy blocks into registered memory.
    GetInto = 4,
    /// 5: store blocks from registered memory.
    PutFrom = 5,
    /// 6: the tier holding each key.
    Exists = 6,
    /// 7: prefix hits of a chain of keys.
    Lookup = 7,
    /// 8: delete keys.
    Delete = 8,
    /// 9: promote keys toward the fastest tier.
    Prefetch = 9,
    /// 10: copy blocks into registered memory, each scattered over spans.
    GetIntoV = 10,
    /// 11: store blocks from registered memory, each gathered from spans.
    PutFromV = 11,
}

impl Op {
    /// Every operation, in `op` order (metrics label order).
    pub const ALL: [Op; 11] = [
        Op::Hello,
        Op::Register,
        Op::Unregister,
        Op::GetInto,
        Op::PutFrom,
        Op::Exists,
        Op::Lookup,
        Op::Delete,
        Op::Prefetch,
        Op::GetIntoV,
        Op::PutFromV,
    ];

    /// The operation numbered `op`, if known.
    pub fn from_u8(op: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|o| *o as u8 == op)
    }

    /// `HELLO`, `GET_INTO`, ... as docs/LOCAL.md names them.
    pub fn name(self) -> &'static str {
        ["HELLO", "REGISTER", "UNREGISTER", "GET_INTO", "PUT_FROM", "EXISTS", "LOOKUP", "DELETE", "PREFETCH", "GET_INTO_V", "PUT_FROM_V"]
            [self as usize - 1]
    }

    /// Whether the op copies blocks into registered memory (`GET_INTO`,
    /// `GET_INTO_V`).
    pub fn is_get(self) -> bool {
        matches!(self, Op::GetInto | Op::GetIntoV)
    }

    /// Whether the op's items carry a `parts` count and several spans
    /// (`GET_INTO_V`, `PUT_FROM_V`).
    pub fn is_vectored(self) -> bool {
        matches!(self, Op::GetIntoV | Op::PutFromV)
    }
}

/// Metrics labels (`/v1/stats` `local.routes`, `kvtier_local_requests`):
/// op `n` is `ROUTE_NAMES[n - 1]`, then `other` (unknown ops).
pub const ROUTE_NAMES: [&str; 12] = [
    "hello",
    "register",
    "unregister",
    "get_into",
    "put_from",
    "exists",
    "lookup",
    "delete",
    "prefetch",
    "get_into_v",
    "put_from_v",
    "other",
];

/// A status or per-item code (docs/LOCAL.md, "Codes"). Negative on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // each is documented in the table in docs/LOCAL.md
pub enum Code {
    IoError = -1,
    NotFound = -2,
    InvalidKey = -3,
    WrongSize = -4,
    UnknownHandle = -5,
    OutOfBounds = -6,
    BufferShrunk = -7,
    Corrupt = -8,
    Overloaded = -9,
    DiskFull = -10,
    ShuttingDown = -11,
    Unauthorized = -12,
    BadRequest = -13,
    UnsupportedVersion = -14,
    GeometryMismatch = -15,
    Limit = -16,
    UnknownOp = -17,
    BadBuffer = -18,
    BadFrame = -19,
}

impl Code {
    /// Every code, from -1 down.
    pub const ALL: [Code; 19] = [
        Code::IoError,
        Code::NotFound,
        Code::InvalidKey,
        Code::WrongSize,
        Code::UnknownHandle,
        Code::OutOfBounds,
        Code::BufferShrunk,
        Code::Corrupt,
        Code::Overloaded,
        Code::DiskFull,
        Code::ShuttingDown,
        Code::Unauthorized,
        Code::BadRequest,
        Code::UnsupportedVersion,
        Code::GeometryMismatch,
        Code::Limit,
        Code::UnknownOp,
        Code::BadBuffer,
        Code::BadFrame,
    ];

    /// The name docs/LOCAL.md gives a status or item code (`NOT_FOUND` for
    /// -2, `OK` for 0); `UNKNOWN_CODE` for one the table does not have.
    pub fn name_of(code: i64) -> &'static str {
        const NAMES: [&str; 19] = [
            "IO_ERROR",
            "NOT_FOUND",
            "INVALID_KEY",
            "WRONG_SIZE",
            "UNKNOWN_HANDLE",
            "OUT_OF_BOUNDS",
            "BUFFER_SHRUNK",
            "CORRUPT",
            "OVERLOADED",
            "DISK_FULL",
            "SHUTTING_DOWN",
            "UNAUTHORIZED",
            "BAD_REQUEST",
            "UNSUPPORTED_VERSION",
            "GEOMETRY_MISMATCH",
            "LIMIT",
            "UNKNOWN_OP",
            "BAD_BUFFER",
            "BAD_FRAME",
        ];
        match code {
            0 => "OK",
            -19..=-1 => NAMES[(-code - 1) as usize],
            _ => "UNKNOWN_CODE",
        }
    }

    /// Whether the server is at fault (counted as a server error), rather
    /// than the request or the data asked for.
    pub fn is_server_side(self) -> bool {
        matches!(self, Code::IoError | Code::DiskFull | Code::ShuttingDown | Code::Overloaded)
    }
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The operation (a response has [`RESPONSE_BIT`] set).
    pub op: u8,
    /// Payload bytes that follow.
    pub payload_bytes: u32,
    /// Chosen by the client, echoed in the response.
    pub request_id: u64,
}

impl Header {
    /// Decodes a header from its 16 bytes.
    ///
    /// # Errors
    /// A message for the `BAD_FRAME` reply: wrong magic, nonzero flags, or
    /// a payload over [`PAYLOAD_BYTES_MAX`].
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(format!("bad frame magic 0x{magic:04x} (expected 0x{MAGIC:04x}, b\"TK\"): not a kvtier local-protocol client?"));
        }
        if b[3] != 0 {
            return Err(format!("frame flags must be 0, got {}", b[3]));
        }
        let payload_bytes = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        if payload_bytes as usize > PAYLOAD_BYTES_MAX {
            return Err(format!("frame payload of {payload_bytes} bytes is over the limit of {PAYLOAD_BYTES_MAX}"));
        }
        Ok(Header { op: b[2], payload_bytes, request_id: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")) })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        b[2] = self.op;
        b[4..8].copy_from_slice(&self.payload_bytes.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b
    }
}

/// What the front of a receive buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// A whole frame: its header and its length, header included, bytes.
    Frame(Header, usize),
    /// Not a whole frame yet: read at least this many more bytes (a whole
    /// header's worth while the header is incomplete).
    Need(usize),
}

/// The frame at the front of `buf`, the one framing rule of the socket's
/// read loop (server/src/local/conn.rs) and of the fuzz target
/// `local_frames`.
///
/// # Errors
/// A connection error (the header's own, [`Header::decode`]): the rest of
/// the stream cannot be framed.
pub fn next_frame(buf: &[u8]) -> Result<Next, String> {
    let Some(head) = buf.get(..HEADER_BYTES) else {
        return Ok(Next::Need(HEADER_BYTES));
    };
    let header = Header::decode(head.try_into().expect("16 bytes"))?;
    let frame_bytes = HEADER_BYTES + header.payload_bytes as usize;
    if buf.len() < frame_bytes {
        return Ok(Next::Need(frame_bytes - buf.len()));
    }
    Ok(Next::Frame(header, frame_bytes))
}

/// A response frame: header, status, retry hint, then the body or message.
pub fn response(op: u8, request_id: u64, status: i32, retry_after_ms: u32, body: &[u8]) -> Vec<u8> {
    let payload_bytes = (8 + body.len()) as u32;
    let mut out = Vec::with_capacity(HEADER_BYTES + payload_bytes as usize);
    out.extend_from_slice(&Header { op, payload_bytes, request_id }.encode());
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&retry_after_ms.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A failed request's response: the code and a message naming what was wrong.
pub fn failure(op: u8, request_id: u64, code: Code, message: &str) -> Vec<u8> {
    response(op | RESPONSE_BIT, request_id, code as i32, 0, message.as_bytes())
}

/// Reads a payload front to back; every read checks the length left.
pub struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    /// A cursor over `payload`.
    pub fn new(payload: &'a [u8]) -> Self {
        Cursor { rest: payload }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.rest.len() < n {
            return Err(format!("payload ends inside {what} (needs {n} bytes, {} left)", self.rest.len()));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// A little-endian u16.
    pub fn u16(&mut self, what: &str) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes")))
    }

    /// A little-endian u32.
    pub fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }

    /// A little-endian u64.
    pub fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }

    /// A `str`: u16 length and UTF-8 bytes.
    pub fn str(&mut self, what: &str) -> Result<&'a str, String> {
        let n = self.u16(what)? as usize;
        std::str::from_utf8(self.take(n, what)?).map_err(|_| format!("{what} is not UTF-8"))
    }

    /// A batch count: at most [`ITEMS_MAX`], and no more than the payload
    /// left could hold at `min_item_bytes` each.
    pub fn count(&mut self, min_item_bytes: usize) -> Result<usize, String> {
        let n = self.u32("the item count")? as usize;
        if n > ITEMS_MAX {
            return Err(format!("{n} items in one batch; the limit is {ITEMS_MAX}"));
        }
        if n * min_item_bytes > self.rest.len() {
            return Err(format!("{n} items cannot fit in the {} payload bytes left", self.rest.len()));
        }
        Ok(n)
    }

    /// Fails unless the whole payload was read.
    pub fn end(&self) -> Result<(), String> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected bytes after the payload", self.rest.len()))
        }
    }
}

/// One span of registered memory: `length` bytes at `offset` in the
/// region `handle` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Registration handle.
    pub handle: u64,
    /// Offset within the registered region, bytes.
    pub offset: u64,
    /// Bytes of the span.
    pub length: u64,
}

/// One item of a `GET_INTO`/`PUT_FROM` batch (one part) or of a
/// `GET_INTO_V`/`PUT_FROM_V` batch (1 to [`PARTS_MAX`] parts): the block's
/// bytes, in order, laid across the parts in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item<'a> {
    /// The spans: room for the block (get) or its bytes (put).
    pub parts: Vec<Span>,
    /// Block key.
    pub key: &'a str,
}

impl Item<'_> {
    /// Bytes of all the parts together (saturating at `u64::MAX`).
    pub fn length(&self) -> u64 {
        self.parts.iter().fold(0u64, |sum, p| sum.saturating_add(p.length))
    }
}

/// Decodes a `GET_INTO`/`PUT_FROM` payload: each item one span.
///
/// # Errors
/// [`Code::BadRequest`] with a message for a payload that does not parse
/// (truncated, trailing bytes); [`Code::Limit`] for over [`ITEMS_MAX`] items.
pub fn decode_items(payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    decode_batch(payload, false)
}

/// Decodes a `GET_INTO_V`/`PUT_FROM_V` payload: each item a u16 `parts`
/// count (1 to [`PARTS_MAX`]) before its spans.
///
/// # Errors
/// As [`decode_items`]; a `parts` of 0 or over [`PARTS_MAX`] is
/// [`Code::BadRequest`].
pub fn decode_items_v(payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    decode_batch(payload, true)
}

/// The one decoder of item batches; `vectored` items carry a `parts` count.
fn decode_batch(payload: &[u8], vectored: bool) -> Result<Vec<Item<'_>>, (Code, String)> {
    let mut c = Cursor::new(payload);
    // Smallest item: one span and an empty key's length; a vectored item's
    // is counted from its `parts` and key length alone, so an item with 0
    // parts is refused for that, not for its size.
    let n = c.count(if vectored { 2 + 2 } else { 24 + 2 }).map_err(count_code)?;
    let mut items = Vec::with_capacity(n);
    for i in 0..n {
        let bad = |e: String| (Code::BadRequest, format!("item {i}: {e}"));
        let parts = if vectored { c.u16("a parts count").map_err(bad)? as usize } else { 1 };
        if !(1..=PARTS_MAX).contains(&parts) {
            return Err(bad(format!("{parts} parts; an item has 1 to {PARTS_MAX}")));
        }
        let parts = (0..parts)
            .map(|_| Ok(Span { handle: c.u64("a handle")?, offset: c.u64("an offset")?, length: c.u64("a length")? }))
            .collect::<Result<Vec<_>, String>>()
            .map_err(bad)?;
        items.push(Item { parts, key: c.str("a key").map_err(bad)? });
    }
    c.end().map_err(|e| (Code::BadRequest, e))?;
    Ok(items)
}

/// Decodes a payload of keys (`EXISTS`, `LOOKUP`, `DELETE`, `PREFETCH`).
pub fn decode_keys(payload: &[u8]) -> Result<Vec<&str>, (Code, String)> {
    let mut c = Cursor::new(payload);
    let n = c.count(2).map_err(count_code)?;
    let keys = (0..n).map(|i| c.str("a key").map_err(|e| (Code::BadRequest, format!("key {i}: {e}")))).collect::<Result<Vec<_>, _>>()?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    Ok(keys)
}

fn count_code(e: String) -> (Code, String) {
    if e.contains("the limit is") {
        (Code::Limit, e)
    } else {
        (Code::BadRequest, e)
    }
}

/// Tier names by wire number: 0 none, 1 `gpu`, 2 `ram`, 3 `nvme`, 4 `s3`
/// (the words of `x-kvtier-tier`).
pub const TIER_NAMES: [&str; 5] = ["none", "gpu", "ram", "nvme", "s3"];

/// The tier a wire number names ([`TIER_NAMES`]); `unknown` past them.
pub fn tier_name(tier: u8) -> &'static str {
    TIER_NAMES.get(tier as usize).copied().unwrap_or("unknown")
}

/// A whole frame: header and payload.
pub fn frame(op: u8, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&Header { op, payload_bytes: payload.len() as u32, request_id }.encode());
    out.extend_from_slice(payload);
    out
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A `GET_INTO`/`PUT_FROM` payload: `(handle, offset, length, key)` items
/// ([`decode_items`] reads it).
pub fn encode_items(items: &[(u64, u64, u64, &str)]) -> Vec<u8> {
    encode_batch(items.iter().map(|&(handle, offset, length, key)| (None, [(handle, offset, length)].into_iter(), key)))
}

/// One item for [`encode_items_v`]: its parts, each a `(handle, offset,
/// length)` span (bytes), and its key.
pub type ItemV<'a> = (&'a [(u64, u64, u64)], &'a str);

/// A `GET_INTO_V`/`PUT_FROM_V` payload: items of `(parts, key)`, each part a
/// `(handle, offset, length)` span ([`decode_items_v`] reads it). Nothing is
/// checked: a part count of 0 or over [`PARTS_MAX`] is sent as it is (the
/// server refuses it with `BAD_REQUEST`).
pub fn encode_items_v(items: &[ItemV<'_>]) -> Vec<u8> {
    encode_batch(items.iter().map(|&(parts, key)| (Some(parts.len() as u16), parts.iter().copied(), key)))
}

/// The one encoder of item batches: u32 `n`, then per item its `parts`
/// count (vectored ops only), its spans and its key.
fn encode_batch<'k, S: Iterator<Item = (u64, u64, u64)>>(items: impl ExactSizeIterator<Item = (Option<u16>, S, &'k str)>) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + items.len() * 64);
    p.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for (parts, spans, key) in items {
        if let Some(parts) = parts {
            p.extend_from_slice(&parts.to_le_bytes());
        }
        for (handle, offset, length) in spans {
            p.extend_from_slice(&handle.to_le_bytes());
            p.extend_from_slice(&offset.to_le_bytes());
            p.extend_from_slice(&length.to_le_bytes());
        }
        put_str(&mut p, key);
    }
    p
}

/// A payload of keys (`EXISTS`, `LOOKUP`, `DELETE`, `PREFETCH`;
/// [`decode_keys`] reads it).
pub fn encode_keys<S: AsRef<str>>(keys: &[S]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + keys.iter().map(|k| 2 + k.as_ref().len()).sum::<usize>());
    p.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_str(&mut p, k.as_ref());
    }
    p
}

/// A batch's per-item body: u32 `n`, then `n` × (i64 `result`, u8 `extra`).
pub fn encode_results(results: &[(i64, u8)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + results.len() * 9);
    out.extend_from_slice(&(results.len() as u32).to_le_bytes());
    for (r, x) in results {
        out.extend_from_slice(&r.to_le_bytes());
        out.push(*x);
    }
    out
}

/// A `REGISTER` payload: u64 `offset` and u64 `length`, bytes of the file
/// whose descriptor travels with the frame (`SCM_RIGHTS`).
pub fn encode_register(offset: u64, length: u64) -> Vec<u8> {
    let mut p = offset.to_le_bytes().to_vec();
    p.extend_from_slice(&length.to_le_bytes());
    p
}

/// A `REGISTER` response body: u64 `handle`, u8 `access` (1 mapped, 2 file
/// I/O, 3 guarded).
pub fn encode_registered(handle: u64, access: u8) -> Vec<u8> {
    let mut b = handle.to_le_bytes().to_vec();
    b.push(access);
    b
}

/// An `UNREGISTER` payload: u64 `handle`. (Its response body is empty.)
pub fn encode_unregister(handle: u64) -> Vec<u8> {
    handle.to_le_bytes().to_vec()
}

/// An `EXISTS` response body: u32 `n`, then `n` × u8 `tier` (0: not stored;
/// [`TIER_NAMES`]).
pub fn encode_tiers(tiers: &[u8]) -> Vec<u8> {
    let mut b = (tiers.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(tiers);
    b
}

/// A `LOOKUP` response body: u32 `prefix_hits`, u32 `n` (the same number),
/// then `n` × u8 `tier`: the tiers of the chain's leading hits.
pub fn encode_lookup(hit_tiers: &[u8]) -> Vec<u8> {
    let mut b = (hit_tiers.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&encode_tiers(hit_tiers));
    b
}

/// A `DELETE` response body: u32 `n`, then `n` × i64 `result` (0 deleted,
/// or a negative [`Code`]: `NOT_FOUND` for a key with no block).
pub fn encode_deleted(results: &[i64]) -> Vec<u8> {
    let mut b = (results.len() as u32).to_le_bytes().to_vec();
    b.extend(results.iter().flat_map(|r| r.to_le_bytes()));
    b
}

/// A `PREFETCH` response body: u32 `requested` (keys asked for), u32
/// `found` (of those, stored locally).
pub fn encode_prefetched(requested: u32, found: u32) -> Vec<u8> {
    let mut b = requested.to_le_bytes().to_vec();
    b.extend_from_slice(&found.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_frame_waits_for_whole_frames_and_refuses_a_bad_header() {
        let f = frame(Op::Exists as u8, 7, &encode_keys(&["a", "bc"]));
        assert_eq!(next_frame(&[]), Ok(Next::Need(HEADER_BYTES)));
        assert_eq!(next_frame(&f[..HEADER_BYTES - 1]), Ok(Next::Need(HEADER_BYTES)));
        assert_eq!(next_frame(&f[..HEADER_BYTES + 2]), Ok(Next::Need(f.len() - HEADER_BYTES - 2)));
        let header = Header { op: Op::Exists as u8, payload_bytes: (f.len() - HEADER_BYTES) as u32, request_id: 7 };
        assert_eq!(next_frame(&f), Ok(Next::Frame(header, f.len())));
        let mut two = f.clone();
        two.extend_from_slice(&f);
        assert_eq!(next_frame(&two), Ok(Next::Frame(header, f.len())));
        let mut bad = f.clone();
        bad[3] = 1;
        assert!(next_frame(&bad).unwrap_err().contains("flags must be 0"));
    }

    #[test]
    fn a_header_round_trips_and_bad_ones_say_why() {
        let h = Header { op: 4, payload_bytes: 1234, request_id: u64::MAX - 7 };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[0] = b'G';
        assert!(Header::decode(&b).unwrap_err().contains("magic"));
        let mut b = h.encode();
        b[3] = 1;
        assert!(Header::decode(&b).unwrap_err().contains("flags"));
        let b = Header { op: 4, payload_bytes: PAYLOAD_BYTES_MAX as u32 + 1, request_id: 1 }.encode();
        assert!(Header::decode(&b).unwrap_err().contains("over the limit"));
    }

    #[test]
    fn items_decode_and_malformed_payloads_are_bad_requests() {
        let p = encode_items(&[(1, 0, 16, "a"), (2, 4096, 16, "key-b")]);
        let items = decode_items(&p).unwrap();
        assert_eq!(items[1], Item { parts: vec![Span { handle: 2, offset: 4096, length: 16 }], key: "key-b" });
        assert_eq!(items[1].length(), 16);
        for cut in 1..p.len() {
            let e = decode_items(&p[..cut]).unwrap_err();
            assert_eq!(e.0, Code::BadRequest, "cut at {cut}: {}", e.1);
        }
        let mut extra = p.clone();
        extra.push(0);
        assert!(decode_items(&extra).unwrap_err().1.contains("unexpected bytes"));
        let mut many = (ITEMS_MAX as u32 + 1).to_le_bytes().to_vec();
        many.resize(1 << 20, 0);
        assert_eq!(decode_items(&many).unwrap_err().0, Code::Limit);
        // A count the payload cannot hold is refused before any allocation.
        assert_eq!(decode_items(&4000u32.to_le_bytes()).unwrap_err().0, Code::BadRequest);
    }

    #[test]
    fn vectored_items_round_trip() {
        let two: &[(u64, u64, u64)] = &[(1, 0, 40), (3, 1000, 60)];
        let one: &[(u64, u64, u64)] = &[(2, 8, 100)];
        let most: Vec<(u64, u64, u64)> = (0..PARTS_MAX as u64).map(|i| (1, i * 10, 10)).collect();
        let p = encode_items_v(&[(two, "k-two"), (one, "k-one"), (&most, "")]);
        let items = decode_items_v(&p).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0].parts, vec![Span { handle: 1, offset: 0, length: 40 }, Span { handle: 3, offset: 1000, length: 60 }]);
        assert_eq!((items[0].key, items[0].length()), ("k-two", 100));
        assert_eq!(items[1], Item { parts: vec![Span { handle: 2, offset: 8, length: 100 }], key: "k-one" });
        assert_eq!((items[2].parts.len(), items[2].key, items[2].length()), (PARTS_MAX, "", 10 * PARTS_MAX as u64));
        // One part is the plain item with a u16 count in front of it.
        let plain = encode_items(&[(2, 8, 100, "k-one")]);
        let v = encode_items_v(&[(one, "k-one")]);
        assert_eq!((&v[..4], &v[4..6], &v[6..]), (&plain[..4], &1u16.to_le_bytes()[..], &plain[4..]));
        assert_eq!(decode_items_v(&v).unwrap(), decode_items(&plain).unwrap());
        assert_eq!(decode_items_v(&encode_items_v(&[])).unwrap(), vec![]);
        // Lengths that would overflow a u64 saturate.
        let huge: &[(u64, u64, u64)] = &[(1, 0, u64::MAX), (1, 0, 2)];
        assert_eq!(decode_items_v(&encode_items_v(&[(huge, "x")])).unwrap()[0].length(), u64::MAX);
    }

    #[test]
    fn malformed_vectored_payloads_are_bad_requests_and_too_many_items_a_limit() {
        let two: &[(u64, u64, u64)] = &[(1, 0, 40), (3, 1000, 60)];
        let p = encode_items_v(&[(two, "a"), (two, "key-b")]);
        for cut in 1..p.len() {
            let e = decode_items_v(&p[..cut]).unwrap_err();
            assert_eq!(e.0, Code::BadRequest, "cut at {cut}: {}", e.1);
        }
        let mut extra = p.clone();
        extra.push(0);
        let e = decode_items_v(&extra).unwrap_err();
        assert!(e.0 == Code::BadRequest && e.1.contains("unexpected bytes"), "{e:?}");
        // parts 0 and PARTS_MAX + 1, with room for the spans they claim.
        for parts in [0usize, PARTS_MAX + 1] {
            let spans = vec![(1, 0, 1); parts];
            let mut bad = encode_items_v(&[(&spans, "k")]);
            bad.extend_from_slice(&[0; 64]);
            let e = decode_items_v(&bad).unwrap_err();
            assert_eq!(e.0, Code::BadRequest, "{parts} parts: {}", e.1);
            assert!(e.1.contains(&format!("{parts} parts")) && e.1.contains("item 0"), "{}", e.1);
        }
        // A second item's bad count names it.
        let zero: &[(u64, u64, u64)] = &[];
        let e = decode_items_v(&encode_items_v(&[(two, "a"), (zero, "b")])).unwrap_err();
        assert!(e.1.starts_with("item 1: 0 parts"), "{}", e.1);
        let mut many = (ITEMS_MAX as u32 + 1).to_le_bytes().to_vec();
        many.resize(1 << 20, 0);
        assert_eq!(decode_items_v(&many).unwrap_err().0, Code::Limit);
        // A count the payload cannot hold is refused before any allocation.
        assert_eq!(decode_items_v(&4000u32.to_le_bytes()).unwrap_err().0, Code::BadRequest);
        // Bad UTF-8 in a key.
        let mut bad_key = encode_items_v(&[(two, "k")]);
        *bad_key.last_mut().unwrap() = 0xFF;
        assert!(decode_items_v(&bad_key).unwrap_err().1.contains("UTF-8"));
        // A plain payload is not a vectored one (its handle's low bytes
        // read as a parts count).
        let plain = encode_items(&[(0, 0, 16, "a")]);
        assert_eq!(decode_items_v(&plain).unwrap_err().0, Code::BadRequest);
    }

    #[test]
    fn register_and_reply_bodies_have_the_documented_layout() {
        let register = encode_register(4096, 1 << 40);
        let mut c = Cursor::new(&register);
        assert_eq!((c.u64("offset"), c.u64("length"), c.end()), (Ok(4096), Ok(1 << 40), Ok(())));
        assert_eq!(encode_unregister(0x0102_0304_0506_0708), [8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(encode_registered(0x0102, 3), [2, 1, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(encode_tiers(&[2, 0, 4]), [3, 0, 0, 0, 2, 0, 4]);
        assert_eq!(encode_tiers(&[]), [0, 0, 0, 0]);
        // prefix_hits and n are the same number.
        assert_eq!(encode_lookup(&[1, 2]), [2, 0, 0, 0, 2, 0, 0, 0, 1, 2]);
        let deleted = encode_deleted(&[0, Code::NotFound as i64]);
        assert_eq!(deleted.len(), 4 + 2 * 8);
        assert_eq!((&deleted[..4], &deleted[4..12], &deleted[12..]), (&[2, 0, 0, 0][..], &[0; 8][..], &(-2i64).to_le_bytes()[..]));
        assert_eq!(encode_prefetched(3, 2), [3, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(encode_results(&[(-9, 0)])[4..12], (-9i64).to_le_bytes());
    }

    #[test]
    fn keys_decode_and_bad_utf8_is_refused() {
        assert_eq!(decode_keys(&encode_keys(&["x", "yz"])).unwrap(), vec!["x", "yz"]);
        let bad = [1, 0, 0, 0, 1, 0, 0xFF];
        assert!(decode_keys(&bad).unwrap_err().1.contains("UTF-8"));
    }

    #[test]
    fn every_op_and_code_has_one_number() {
        for op in Op::ALL {
            assert_eq!(Op::from_u8(op as u8), Some(op));
        }
        assert_eq!(Op::from_u8(0), None);
        assert_eq!(Op::from_u8(12), None);
        assert_eq!(Op::from_u8(10), Some(Op::GetIntoV));
        assert_eq!(Op::PutFromV as u8, 11);
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, i + 1, "ops are numbered 1.. in ALL's order");
            assert_eq!(ROUTE_NAMES[i], op.name().to_lowercase(), "the route label is the op's name");
        }
        assert_eq!(ROUTE_NAMES[ROUTE_NAMES.len() - 1], "other");
        assert_eq!((Op::GetIntoV.name(), Op::PutFromV.name()), ("GET_INTO_V", "PUT_FROM_V"));
        assert!(Op::GetIntoV.is_get() && Op::GetIntoV.is_vectored() && Op::PutFromV.is_vectored());
        assert!(!Op::PutFrom.is_get() && !Op::PutFromV.is_get() && !Op::GetInto.is_vectored());
        assert_eq!(Code::BadFrame as i32, -19);
        assert_eq!(ROUTE_NAMES[Op::GetInto as usize - 1], "get_into");
        assert_eq!(ROUTE_NAMES.len(), Op::ALL.len() + 1);
        assert_eq!(Op::GetInto.name(), "GET_INTO");
        for code in Code::ALL {
            assert_ne!(Code::name_of(code as i64), "UNKNOWN_CODE");
        }
        assert_eq!(Code::name_of(-2), "NOT_FOUND");
        assert_eq!(Code::name_of(-19), "BAD_FRAME");
        assert_eq!(Code::name_of(0), "OK");
        assert_eq!(Code::name_of(-20), "UNKNOWN_CODE");
        assert_eq!(tier_name(3), "nvme");
        assert_eq!(tier_name(9), "unknown");
    }
}
