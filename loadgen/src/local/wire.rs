//! The loadgen's side of docs/LOCAL.md: the frames, ops and codes of
//! `kvtier-local-proto` (shared with the server), this client's errors, and
//! the decoding of responses into them.

use std::time::Duration;

use serde_json::Value;

use crate::client::ClientError;

/// URL scheme of the local socket: `unix:///absolute/path` or
/// `unix://relative/path`.
pub const SCHEME: &str = "unix://";
pub use kvtier_local_proto::{
    encode_items, encode_keys, frame, tier_name, Code, Op, HEADER_BYTES, ITEMS_MAX, OP_CONNECTION_ERROR, PAYLOAD_BYTES_MAX, RESPONSE_BIT,
};

/// The protocol version this client speaks: 1, whose `PUT_FROM` items
/// carry no block tag (the loadgen sends untagged blocks; version 2 adds the
/// tag, docs/LOCAL.md).
pub const VERSION: u32 = kvtier_local_proto::VERSIONS[0];
/// How long connection set-up (connect, HELLO, REGISTER) may wait for the
/// server on each read or write: 10 s.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `NOT_FOUND`: a miss.
pub const NOT_FOUND: i64 = Code::NotFound as i64;
/// `CORRUPT`: a block that failed its CRC check, a miss.
pub const CORRUPT: i64 = Code::Corrupt as i64;
/// `OVERLOADED`: retry after the response's `retry_after_ms`.
pub const OVERLOADED: i64 = Code::Overloaded as i64;

/// The name of a status or per-item code ([`Code::name_of`]).
pub fn code_name(code: i64) -> &'static str {
    Code::name_of(code)
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

/// Decodes a response header: `(op, payload_bytes, request_id)`; a
/// response payload holds at least its status and `retry_after_ms`.
pub(crate) fn decode_header(b: &[u8; HEADER_BYTES]) -> Result<(u8, usize, u64), String> {
    let h = kvtier_local_proto::Header::decode(b).map_err(|e| format!("response frame: {e}"))?;
    if h.payload_bytes < 8 {
        return Err(format!("response frame of {} payload bytes, too short for status and retry_after_ms", h.payload_bytes));
    }
    Ok((h.op, h.payload_bytes as usize, h.request_id))
}

pub(crate) fn decode_reply(op: u8, payload: Vec<u8>) -> Reply {
    let status = i32::from_le_bytes(payload[0..4].try_into().expect("4 bytes"));
    let retry_after_ms = u32::from_le_bytes(payload[4..8].try_into().expect("4 bytes"));
    Reply { op, status, retry_after_ms, body: payload[8..].to_vec() }
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
