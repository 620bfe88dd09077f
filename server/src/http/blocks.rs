//! The block routes: PUT, GET, HEAD, DELETE of `/v1/blocks/{key}`, and
//! `/v1/lookup`, `/v1/prefetch`; every key already scoped to its caller
//! ([`crate::service::ScopedKey`]).

use http::{header, Request, Response, StatusCode};
use hyper::body::Incoming;
use kvtier_engine::{BlockBody, Error, PutOutcome};
use serde_json::json;

use super::body::ReplyBody;
use super::reply::{engine_error, error, json_reply, overloaded, Reply, TIER_HEADER};
use super::request::{declared_length, read_body, read_keys, refuse_put};
use super::tag::tag_from_headers;
use super::Ctx;
use crate::service::{PutRefused, ScopedKey};
use crate::tenants::Tenant;

/// `PUT /v1/blocks/{client_key}`, stored under `key` (the caller's scope),
/// with the block tag its `x-kvtier-*` headers give ([`tag_from_headers`]).
pub(crate) async fn put_block(ctx: &Ctx, client_key: &str, key: &ScopedKey, req: Request<Incoming>) -> Reply {
    let block_bytes = ctx.store().geometry().block_bytes;
    // The tag is read before the body, so a bad one stores nothing.
    let tag = match tag_from_headers(req.headers(), block_bytes) {
        Ok(t) => t,
        Err(why) => return refuse_put(ctx, req, error(StatusCode::BAD_REQUEST, "invalid_tag", why)).await,
    };
    let declared = match declared_length(req.headers(), block_bytes, "PUT") {
        Ok(n) => n,
        Err(r) => return refuse_put(ctx, req, r).await,
    };
    if declared > block_bytes {
        return engine_error(&Error::WrongSize { expected: block_bytes, got: declared });
    }
    if declared < block_bytes {
        return refuse_put(ctx, req, engine_error(&Error::WrongSize { expected: block_bytes, got: declared })).await;
    }
    // Admission: refused before a body byte is read, so an overloaded shard
    // holds no more PUT bodies than its limit (one PUT always gets in).
    let _admission = match ctx.service.put_budget.admit(declared) {
        Ok(a) => a,
        Err(PutRefused { held_bytes, max_bytes }) => {
            ctx.http.shard(ctx.store().shard_id()).put_bytes_refusals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return overloaded(format!(
                "shard {} already holds {held_bytes} bytes of PUT bodies in flight (--put-inflight-mib {}); retry shortly",
                ctx.store().shard_id(),
                max_bytes >> 20
            ));
        }
    };
    let (chunks, got) = match read_body(ctx, req, block_bytes).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match ctx.service.put(key, chunks, tag).await {
        Ok(report) => {
            let (status, word) = match report.outcome {
                PutOutcome::Created => (StatusCode::CREATED, "created"),
                PutOutcome::Replaced => (StatusCode::OK, "replaced"),
            };
            let mut body = json!({ "key": client_key, "block_bytes": got, "status": word });
            // What the remote tier did with it, under the tier's name.
            if let (Some(remote), Some(upload)) = (ctx.store().remote(), report.upload) {
                body[remote.name()] = json!(upload.as_str());
            }
            json_reply(status, &body)
        }
        Err(e) => engine_error(&e),
    }
}

pub(crate) fn block_reply(body: BlockBody, tier: &'static str) -> Reply {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, body.len())
        .header(TIER_HEADER, tier)
        .body(ReplyBody::block(body))
        .expect("valid response")
}

/// A block, answered once its first chunk has passed its CRC-32 check and
/// streamed from there ([`ReplyBody`]): a damaged later chunk cuts the
/// response off instead of completing it (the block is dropped, so the next
/// GET falls through to the tiers below). Every tier, the remote one
/// included, is behind [`Store::get_stream`].
pub(crate) async fn get_block(ctx: &Ctx, key: &ScopedKey) -> Reply {
    match ctx.service.get_stream(key).await {
        Ok((body, tier)) => block_reply(body, tier.as_str()),
        Err(e) => engine_error(&e),
    }
}

pub(crate) async fn head_block(ctx: &Ctx, key: &ScopedKey) -> Reply {
    match ctx.service.contains(key).await {
        Ok(Some(_)) => Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, ctx.store().geometry().block_bytes)
            .body(ReplyBody::empty())
            .expect("valid response"),
        Ok(_) => engine_error(&Error::NotFound),
        Err(e) => engine_error(&e),
    }
}

pub(crate) async fn delete_block(ctx: &Ctx, key: &ScopedKey) -> Reply {
    match ctx.service.delete(key).await {
        Ok(()) => Response::builder().status(StatusCode::NO_CONTENT).body(ReplyBody::empty()).expect("valid response"),
        Err(e) => engine_error(&e),
    }
}

pub(crate) async fn lookup(ctx: &Ctx, caller: Option<&Tenant>, req: Request<Incoming>) -> Reply {
    let keys = match read_keys(ctx, caller, req).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    match ctx.service.lookup_prefix(&keys).await {
        Ok(tiers) => {
            let names: Vec<&str> = tiers.iter().map(|t| t.as_str()).collect();
            json_reply(StatusCode::OK, &json!({ "prefix_hits": names.len(), "tiers": names }))
        }
        Err(e) => engine_error(&e),
    }
}

/// `POST /v1/prefetch`: promotes the stored keys toward the fastest tier and
/// copies the others from the remote tier, in the background; 202 with how
/// many were found locally and (with a remote tier) how many were asked of
/// it (`<tier>_requested`).
pub(crate) async fn prefetch(ctx: &Ctx, caller: Option<&Tenant>, req: Request<Incoming>) -> Reply {
    let keys = match read_keys(ctx, caller, req).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    match ctx.service.prefetch(&keys).await {
        Ok(report) => {
            let mut body = json!({ "requested": keys.len(), "found": report.found });
            if let Some(remote) = ctx.store().remote() {
                body[format!("{}_requested", remote.name())] = json!(report.remote_requested);
            }
            json_reply(StatusCode::ACCEPTED, &body)
        }
        Err(e) => engine_error(&e),
    }
}
