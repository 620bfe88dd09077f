//! The frames of docs/LOCAL.md as the loadgen speaks them: constants, ops
//! and codes, encoding of requests and decoding of responses.

use std::time::Duration;

use serde_json::Value;

use crate::client::ClientError;

/// URL scheme of the local socket: `unix:///absolute/path` or
/// `unix://relative/path`.
pub const SCHEME: &str = "unix://";
/// Frame magic (`b"TK"` on the wire).
pub const MAGIC: u16 = 0x4B54;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;
/// Largest payload of one frame, either way: 1 MiB.
pub const PAYLOAD_BYTES_MAX: usize = 1 << 20;
/// Most items in one batch.
pub const ITEMS_MAX: usize = 4096;
/// The protocol version this client speaks.
pub const VERSION: u32 = 1;
/// `op` of the frame the server sends before closing on a framing error.
pub const OP_CONNECTION_ERROR: u8 = 0xFF;
/// Set in a response's `op`.
pub const RESPONSE_BIT: u8 = 0x80;
/// How long connection set-up (connect, HELLO, REGISTER) may wait for the
/// server on each read or write: 10 s.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// The operations (a request frame's `op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// 1: version, token and geometry check; first on every connection.
    Hello = 1,
    /// 2: register a buffer (one `SCM_RIGHTS` descriptor) → handle.
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
}

impl Op {
    /// `HELLO`, `GET_INTO`, ... as docs/LOCAL.md names them.
    pub fn name(self) -> &'static str {
        match self {
            Op::Hello => "HELLO",
            Op::Register => "REGISTER",
            Op::Unregister => "UNREGISTER",
            Op::GetInto => "GET_INTO",
            Op::PutFrom => "PUT_FROM",
            Op::Exists => "EXISTS",
            Op::Lookup => "LOOKUP",
            Op::Delete => "DELETE",
            Op::Prefetch => "PREFETCH",
        }
    }
}

/// `NOT_FOUND`: a miss.
pub const NOT_FOUND: i64 = -2;
/// `CORRUPT`: a block that failed its CRC check, a miss.
pub const CORRUPT: i64 = -8;
/// `OVERLOADED`: retry after the response's `retry_after_ms`.
pub const OVERLOADED: i64 = -9;

/// The name of a status or per-item code (docs/LOCAL.md, "Codes"), e.g.
/// `NOT_FOUND` for -2; `UNKNOWN_CODE` for one the table does not have.
pub fn code_name(code: i64) -> &'static str {
    match code {
        0 => "OK",
        -1 => "IO_ERROR",
        -2 => "NOT_FOUND",
        -3 => "INVALID_KEY",
        -4 => "WRONG_SIZE",
        -5 => "UNKNOWN_HANDLE",
        -6 => "OUT_OF_BOUNDS",
        -7 => "BUFFER_SHRUNK",
        -8 => "CORRUPT",
        -9 => "OVERLOADED",
        -10 => "DISK_FULL",
        -11 => "SHUTTING_DOWN",
        -12 => "UNAUTHORIZED",
        -13 => "BAD_REQUEST",
        -14 => "UNSUPPORTED_VERSION",
        -15 => "GEOMETRY_MISMATCH",
        -16 => "LIMIT",
        -17 => "UNKNOWN_OP",
        -18 => "BAD_BUFFER",
        -19 => "BAD_FRAME",
        _ => "UNKNOWN_CODE",
    }
}

/// The tier a wire number names: 1 `gpu`, 2 `ram`, 3 `nvme`, 4 `s3`
/// (`x-kvtier-tier`'s words); 0 is `none`, others `unknown`.
pub fn tier_name(tier: u8) -> &'static str {
    match tier {
        0 => "none",
        1 => "gpu",
        2 => "ram",
        3 => "nvme",
        4 => "s3",
        _ => "unknown",
    }
}

/// Why a local-socket operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LocalError {
    /// The target is not `unix://PATH[?http=HOST:PORT]`.
    #[error("bad target {0:?}: expected unix:///PATH/kvtier.sock[?http=HOST:PORT]")]
    BadTarget(String),
    /// Connecting or setting a connection up (memfd, HELLO, REGISTER) failed.
    #[error("local socket {path}: {message}")]
    Setup {
        /// The socket path.
        path: String,
        /// What failed, with the server's code and message where it sent one.
        message: String,
    },
    /// The connection is gone: closed by the server (with its `0xFF`
    /// frame's message when it sent one) or by a transport error.
    #[error("local socket {path}: connection lost: {message}")]
    Closed {
        /// The socket path.
        path: String,
        /// Why.
        message: String,
    },
    /// The server failed the whole request with a negative status.
    #[error("{op} failed with {name} ({code}): {message}")]
    Status {
        /// The operation (`GET_INTO`, ...).
        op: &'static str,
        /// The status code.
        code: i32,
        /// Its name ([`code_name`]).
        name: &'static str,
        /// The server's message.
        message: String,
    },
    /// One item of a batch failed with a code other than a miss.
    #[error("{op} of {key} failed with {name} ({code})")]
    Item {
        /// The operation.
        op: &'static str,
        /// The item's key.
        key: String,
        /// The per-item code.
        code: i64,
        /// Its name ([`code_name`]).
        name: &'static str,
    },
    /// A response that does not parse as docs/LOCAL.md says it should.
    #[error("bad {op} response: {message}")]
    BadResponse {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        message: String,
    },
    /// The request cannot be sent as asked (a payload over 1 MiB, a block
    /// of the wrong size for the registered slots).
    #[error("{0}")]
    Request(String),
    /// Reading `/v1/stats` over the server's HTTP address failed.
    #[error("{0}")]
    Http(String),
}

impl From<ClientError> for LocalError {
    fn from(e: ClientError) -> Self {
        LocalError::Http(e.to_string())
    }
}

/// The server's answer to `HELLO`.
#[derive(Debug, Clone)]
pub struct Hello {
    /// The protocol version picked.
    pub version: u32,
    /// Random per server process: another value after a reconnect means a
    /// restarted server.
    pub epoch: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Model of the geometry.
    pub model: String,
    /// Shards.
    pub shards: u64,
    /// The whole JSON answer.
    pub raw: Value,
}

/// A response frame: status, retry hint and body (or message).
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) op: u8,
    pub(crate) status: i32,
    pub(crate) retry_after_ms: u32,
    pub(crate) body: Vec<u8>,
}

// ------------------------------------------------------------------ wire

/// A whole frame: header and payload.
pub(crate) fn frame(op: u8, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(op);
    out.push(0);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Decodes a header: `(op, payload_bytes, request_id)`.
pub(crate) fn decode_header(b: &[u8; HEADER_BYTES]) -> Result<(u8, usize, u64), String> {
    let magic = u16::from_le_bytes([b[0], b[1]]);
    if magic != MAGIC {
        return Err(format!("response frame with magic 0x{magic:04x}, expected 0x{MAGIC:04x}"));
    }
    if b[3] != 0 {
        return Err(format!("response frame with flags {}, expected 0", b[3]));
    }
    let payload = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as usize;
    if payload > PAYLOAD_BYTES_MAX {
        return Err(format!("response frame of {payload} payload bytes, over the limit of {PAYLOAD_BYTES_MAX}"));
    }
    if payload < 8 {
        return Err(format!("response frame of {payload} payload bytes, too short for status and retry_after_ms"));
    }
    Ok((b[2], payload, u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"))))
}

pub(crate) fn decode_reply(op: u8, payload: Vec<u8>) -> Reply {
    let status = i32::from_le_bytes(payload[0..4].try_into().expect("4 bytes"));
    let retry_after_ms = u32::from_le_bytes(payload[4..8].try_into().expect("4 bytes"));
    Reply { op, status, retry_after_ms, body: payload[8..].to_vec() }
}

pub(crate) fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A `GET_INTO`/`PUT_FROM` payload: `(handle, offset, length, key)` items.
pub fn encode_items(items: &[(u64, u64, u64, &str)]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + items.iter().map(|i| 26 + i.3.len()).sum::<usize>());
    p.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for (handle, offset, length, key) in items {
        p.extend_from_slice(&handle.to_le_bytes());
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&length.to_le_bytes());
        put_str(&mut p, key);
    }
    p
}

/// A payload of keys (`EXISTS`, `LOOKUP`, `DELETE`, `PREFETCH`).
pub fn encode_keys<S: AsRef<str>>(keys: &[S]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + keys.iter().map(|k| 2 + k.as_ref().len()).sum::<usize>());
    p.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_str(&mut p, k.as_ref());
    }
    p
}

/// Reads a response body front to back.
pub(crate) struct Cursor<'a> {
    pub(crate) rest: &'a [u8],
    pub(crate) op: Op,
}

impl<'a> Cursor<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], LocalError> {
        if self.rest.len() < n {
            return Err(LocalError::BadResponse {
                op: self.op.name(),
                message: format!("body ends early ({} bytes left, {n} needed)", self.rest.len()),
            });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, LocalError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, LocalError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, LocalError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(crate) fn i64(&mut self) -> Result<i64, LocalError> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub(crate) fn end(&self) -> Result<(), LocalError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(LocalError::BadResponse { op: self.op.name(), message: format!("{} unexpected bytes after the body", self.rest.len()) })
        }
    }
    /// A count that must be `want`.
    pub(crate) fn count(&mut self, want: usize) -> Result<usize, LocalError> {
        let n = self.u32()? as usize;
        if n != want {
            return Err(LocalError::BadResponse { op: self.op.name(), message: format!("{n} results for {want} items") });
        }
        Ok(n)
    }
}

/// Decodes a batch's per-item body: `n` × (i64 `result`, u8 `extra`).
pub(crate) fn decode_results(op: Op, body: &[u8], want: usize) -> Result<Vec<(i64, u8)>, LocalError> {
    let mut c = Cursor { rest: body, op };
    let n = c.count(want)?;
    let out = (0..n).map(|_| Ok((c.i64()?, c.u8()?))).collect::<Result<Vec<_>, LocalError>>()?;
    c.end()?;
    Ok(out)
}
