//! kvtier's same-host client core (docs/LOCAL.md), under the Python
//! package's native module (`clients/python/native`, `kvtier._native`) and
//! the loadgen's same-host target.
//!
//! - [`conn`]: one connection: frames, request ids, a reader thread,
//!   descriptors both ways, giving a connection up, lease releases queued
//!   from anywhere.
//! - [`ops`]: every op's request and answer, and item batches split to the
//!   protocol's limits. The payloads are `kvtier_local_proto`'s, the
//!   server's own encoders, so the wire is written once.
//! - [`lease`]: reading a leased block in place, the reader's half of the
//!   RAM tier's generation protocol (an acquire fence, then the load).
//! - [`index`]: the shared index read in the client; the table layout and
//!   its reader are `kvtier_local_proto::shared_index`, the code the
//!   server's shards write with.

pub mod conn;
pub mod index;
pub mod lease;
pub mod ops;
mod sys;

pub use conn::{Connection, Response, Ticket, CLOSE_CONFIRM, IN_FLIGHT_MAX};
pub use index::{IndexError, SharedIndex, Table, BAD_KEY};
pub use ops::{BatchAnswer, BatchItem, HelloRequest};

use kvtier_local_proto::Code;

/// The client's own code for a connection that broke, was closed, or gave
/// no answer in time (docs/LOCAL.md; the server never sends it).
pub const CONNECTION_LOST: i64 = -21;
/// The client's own code for memory that is in no registered buffer
/// (docs/LOCAL.md; the server never sends it).
pub const NOT_REGISTERED: i64 = -20;

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A negative code: the server's status (with its message and
    /// `retry_after_ms` hint) or the client's own ([`CONNECTION_LOST`]).
    Code {
        /// The code (docs/LOCAL.md's table).
        code: i64,
        /// What failed, in words.
        message: String,
        /// The server's hint for `OVERLOADED`, in ms (0: none).
        retry_after_ms: u32,
    },
    /// An answer that does not parse as docs/LOCAL.md says it should.
    BadAnswer(String),
    /// The server speaks no version this client does.
    Protocol(String),
}

impl Error {
    /// An [`Error::Code`] of `code` without a hint.
    pub fn code(code: Code, message: String) -> Error {
        Error::Code { code: code as i64, message, retry_after_ms: 0 }
    }

    /// The error's code: its own, `BAD_FRAME` for an unreadable answer,
    /// `UNSUPPORTED_VERSION` for no version in common.
    pub fn code_number(&self) -> i64 {
        match self {
            Error::Code { code, .. } => *code,
            Error::BadAnswer(_) => Code::BadFrame as i64,
            Error::Protocol(_) => Code::UnsupportedVersion as i64,
        }
    }

    /// The server's `retry_after_ms` hint (0: none).
    pub fn retry_after_ms(&self) -> u32 {
        match self {
            Error::Code { retry_after_ms, .. } => *retry_after_ms,
            _ => 0,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Code { message, .. } | Error::BadAnswer(message) | Error::Protocol(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {}
