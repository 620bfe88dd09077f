//! The loadgen's side of docs/LOCAL.md: the ops and codes of
//! `kvtier-local-proto` (shared with the server) and this client's errors;
//! the connection and the decoders are `kvtier-client`'s.

use std::time::Duration;

use serde_json::Value;

use crate::client::ClientError;

/// URL scheme of the local socket: `unix:///absolute/path` or
/// `unix://relative/path`.
pub const SCHEME: &str = "unix://";
pub use kvtier_local_proto::{encode_items, encode_keys, tier_name, Code, Op, ITEMS_MAX, PAYLOAD_BYTES_MAX};

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
