//! Reading requests: the bearer token, declared lengths, bodies within
//! their limit and the body timeout, a refused PUT's body drained, and the
//! key lists of `/v1/lookup` and `/v1/prefetch`.

// Handlers return `Result<_, Reply>` so a check can answer early; the
// error path is a finished response, so boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use bytes::Bytes;
use http::{header, HeaderMap, Request, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;

use super::reply::{error, scope_error, Reply};
use super::Ctx;
use crate::limits;
use crate::service::ScopedKey;
use crate::tenants::{ScopeError, Tenant};

/// The bearer token a request carries.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    headers.get(header::AUTHORIZATION).and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
}

/// The declared body length, checked against `expected` before any body
/// byte is read.
pub fn declared_length(headers: &HeaderMap, expected: u64, what: &str) -> Result<u64, Reply> {
    let Some(value) = headers.get(header::CONTENT_LENGTH) else {
        return Err(error(
            StatusCode::LENGTH_REQUIRED,
            "length_required",
            format!("{what} needs a Content-Length header; expected {expected} bytes"),
        ));
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| error(StatusCode::BAD_REQUEST, "bad_content_length", format!("Content-Length {value:?} is not a number")))
}

/// Reads a body of at most `limit` bytes as the frames hyper delivered (no
/// copy). A body longer than `limit` is refused as soon as it is seen (413);
/// one that has not ended within `ctx.body_timeout` answers 408; a broken
/// one (the peer closed early, a protocol error) 400.
pub(crate) async fn read_body(ctx: &Ctx, req: Request<Incoming>, limit: u64) -> Result<(Vec<Bytes>, u64), Reply> {
    let timeout = ctx.body_timeout;
    futures_lite::future::or(read_body_frames(req, limit), async move {
        glommio::timer::sleep(timeout).await;
        Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!("the request body did not arrive within {} s (--body-timeout-s); nothing was stored", timeout.as_secs_f64()),
        ))
    })
    .await
}

pub(crate) async fn read_body_frames(req: Request<Incoming>, limit: u64) -> Result<(Vec<Bytes>, u64), Reply> {
    let mut body = req.into_body();
    let (mut chunks, mut total) = (Vec::new(), 0u64);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| error(StatusCode::BAD_REQUEST, "body_read_failed", format!("reading the body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            total += data.len() as u64;
            if total > limit {
                return Err(error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("body exceeds {limit} bytes")));
            }
            chunks.push(data);
        }
    }
    Ok((chunks, total))
}

/// Answers a PUT refused before its body was read, after reading and
/// discarding that body (at most `block_bytes`, within the body timeout).
///
/// An answer sent while the client is still sending ends the HTTP/2 stream
/// with RST_STREAM(NO_ERROR); curl 7.88 then reports error 92 and drops the
/// status. Once the body has arrived the stream closes normally and every
/// client sees the status. A body declared larger than a block is refused
/// without this (413): the client may be reset. An HTTP/1 client that sent
/// `Expect: 100-continue` has not sent its body and will not: it gets the
/// answer at once.
pub(crate) async fn refuse_put(ctx: &Ctx, req: Request<Incoming>, reply: Reply) -> Reply {
    let waits_for_continue = req.version() < Version::HTTP_2
        && req.headers().get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if waits_for_continue {
        return reply;
    }
    let limit = ctx.store().geometry().block_bytes;
    let timeout = ctx.body_timeout;
    let mut body = req.into_body();
    let discard = async {
        let mut total = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                total += data.len() as u64;
                if total > limit {
                    break;
                }
            }
        }
    };
    futures_lite::future::or(discard, async {
        glommio::timer::sleep(timeout).await;
    })
    .await;
    reply
}

/// Body of `POST /v1/lookup`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LookupRequest {
    keys: Vec<String>,
}

/// Reads and checks a `{"keys":[...]}` body (lookup, prefetch): size,
/// JSON shape, key count, every key valid.
pub(crate) async fn read_keys(ctx: &Ctx, caller: Option<&Tenant>, req: Request<Incoming>) -> Result<Vec<ScopedKey>, Reply> {
    if let Some(Ok(declared)) = req.headers().get(header::CONTENT_LENGTH).map(|v| v.to_str().map(|s| s.parse::<u64>())) {
        if declared.map(|n| n > limits::LOOKUP_BODY_BYTES_MAX).unwrap_or(false) {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("key-list bodies are limited to {} bytes", limits::LOOKUP_BODY_BYTES_MAX),
            ));
        }
    }
    let (chunks, _) = read_body(ctx, req, limits::LOOKUP_BODY_BYTES_MAX).await?;
    let keys = parse_keys(&chunks.concat())?;
    ctx.service.scope_all(caller, &keys).map_err(|(i, e)| match e {
        ScopeError::InvalidKey(m) => error(StatusCode::BAD_REQUEST, "invalid_key", format!("keys[{i}]: {m}")),
        e => scope_error(e),
    })
}

/// Parses and checks a `/v1/lookup` or `/v1/prefetch` body:
/// `{"keys": ["k0", "k1", ...]}` with at most [`limits::LOOKUP_KEYS_MAX`]
/// keys, each a valid key. Pure: the fuzz target `key_list` drives it.
///
/// # Errors
/// The reply to send: 400 `bad_json` for a body that is not that JSON,
/// 413 `too_many_keys`, 400 `invalid_key` naming the first bad key's index.
pub fn parse_keys(body: &[u8]) -> Result<Vec<String>, Reply> {
    let parsed: LookupRequest = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, "bad_json", format!("expected {{\"keys\":[\"k0\",\"k1\",...]}}: {e}")))?;
    if parsed.keys.len() > limits::LOOKUP_KEYS_MAX {
        return Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_many_keys",
            format!("{} keys given; a request takes at most {}", parsed.keys.len(), limits::LOOKUP_KEYS_MAX),
        ));
    }
    for (i, k) in parsed.keys.iter().enumerate() {
        if let Err(e) = kvtier_engine::key::validate(k) {
            return Err(error(StatusCode::BAD_REQUEST, "invalid_key", format!("keys[{i}]: {e}")));
        }
    }
    Ok(parsed.keys)
}
