//! HTTP replies: JSON bodies, errors as `{"error":{"code","message"}}`,
//! and the one mapping from engine errors to statuses (docs/API.md).

use http::{header, HeaderValue, Response, StatusCode};
use kvtier_engine::Error;
use serde::Serialize;
use serde_json::json;

use super::body::ReplyBody;
use crate::limits;
use crate::tenants::ScopeError;

/// Response type of every route.
pub type Reply = Response<ReplyBody>;

/// Header naming the tier a GET was served from.
pub const TIER_HEADER: &str = "x-kvtier-tier";

/// A JSON error: `{"error":{"code":...,"message":...}}`.
pub fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Reply {
    let body = json!({ "error": { "code": code, "message": message.into() } });
    json_reply(status, &body)
}

pub(crate) fn json_reply(status: StatusCode, body: &impl Serialize) -> Reply {
    let mut bytes = serde_json::to_vec(body).expect("JSON serializes");
    // A trailing newline keeps curl's output off the shell prompt.
    bytes.push(b'\n');
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(ReplyBody::full(bytes))
        .expect("valid response")
}

/// The one mapping from engine errors to HTTP statuses.
pub fn engine_error(e: &Error) -> Reply {
    let (status, code) = match e {
        Error::InvalidKey { .. } => (StatusCode::BAD_REQUEST, "invalid_key"),
        Error::InvalidTag(_) => (StatusCode::BAD_REQUEST, "invalid_tag"),
        Error::WrongSize { expected, got } if got > expected => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        Error::WrongSize { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "wrong_block_size"),
        Error::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        // A corrupt block is a miss for the client: it recomputes the block.
        Error::Corrupt { .. } => (StatusCode::NOT_FOUND, "corrupt_block"),
        Error::DiskFull(_) => (StatusCode::INSUFFICIENT_STORAGE, "disk_full"),
        Error::Overloaded(m) => return overloaded(m.clone()),
        Error::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        Error::DeviceDown(_) => (StatusCode::SERVICE_UNAVAILABLE, "device_down"),
        Error::GeometryMismatch { .. } | Error::Config(_) | Error::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    };
    if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
        tracing::error!("request failed: {e}");
    }
    error(status, code, e.to_string())
}

/// 503 `overloaded` with `Retry-After`: the client should retry later.
pub(crate) fn overloaded(message: String) -> Reply {
    let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message);
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(limits::RETRY_AFTER_S));
    r
}

pub(crate) fn method_not_allowed(allow: &'static str) -> Reply {
    let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("allowed: {allow}"));
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// The reply for a key its caller cannot use: 400 `invalid_key`, 403
/// `namespace_read_only`.
pub(crate) fn scope_error(e: ScopeError) -> Reply {
    match e {
        ScopeError::InvalidKey(m) => error(StatusCode::BAD_REQUEST, "invalid_key", m),
        ScopeError::ReadOnly(m) => error(StatusCode::FORBIDDEN, "namespace_read_only", m),
    }
}
