//! The HTTP routes of the block API (docs/API.md), and the one table that
//! maps engine errors to HTTP statuses.
//!
//! | method, path | answers |
//! |---|---|
//! | `PUT /v1/blocks/{key}` | 201 created, 200 replaced; 411 / 413 / 422 naming `block_bytes` |
//! | `GET /v1/blocks/{key}` | 200 + body + `x-kvtier-tier`; 404 |
//! | `HEAD /v1/blocks/{key}` | 200 / 404 |
//! | `DELETE /v1/blocks/{key}` | 204 / 404 |
//! | `POST /v1/lookup` | `{"prefix_hits":n,"tiers":[...]}` |
//! | `POST /v1/prefetch` | 202 `{"requested":n,"found":m}` |
//! | `GET /v1/stats` | JSON |
//! | `GET /metrics` | Prometheus text |
//! | `GET /healthz` | 200: the process answers (liveness) |
//! | `GET /readyz` | 200 with each tier's state; 503 when the log cannot be written |
//! | `GET /v1/admin/trace` | 200 the trace recorder's state; 409 without `--trace-dir` |
//! | `POST /v1/admin/trace/start`, `/stop` | 200 the recorder's state after; 409 without `--trace-dir`; 500 the file cannot be created |
//! | `GET /v1/admin/tenants` | 200 tenants, quotas, usage, reload state; 409 without `--tenants` |
//! | `PUT /v1/admin/tenants/{name}` | 200 the tenant after; 404 unknown name; 400 bad body; 409 over capacity |
//! | `POST /v1/admin/tenants/reload` | 200 reloaded; 400 the file is refused (the old one stays) |
//!
//! With `--tenants`, the bearer token names the calling tenant (401 for
//! one no tenant has), its keys are scoped to it (`tenants.rs`), and
//! `/v1/admin/*` is for tenants marked `admin` (403 otherwise).

// Handlers return `Result<_, Reply>` so a check can answer early; the
// error path is a finished response, so boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::rc::Rc;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use kvtier_engine::health::HealthState;
use kvtier_engine::{BlockBody, Error, PutOutcome, Store, Tier};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::body::ReplyBody;
use crate::limits;
use crate::metrics::{RequestStats, Route};
use crate::tenants::{stored_key, ScopeError, Table, Tenancy, Tenant};

mod admin;
pub use admin::{owners_json, watch_reloads};

/// Everything a request handler needs, one per shard.
pub struct Ctx {
    /// The process's Prometheus registry (`GET /metrics`).
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// This shard's store handle.
    pub store: Rc<Store>,
    /// Bearer token every request must carry, when set.
    pub auth_token: Option<Rc<[u8]>>,
    /// Tenants, with `--tenants`: tokens name the caller, keys are scoped.
    pub tenancy: Option<std::sync::Arc<Tenancy>>,
    /// Request metrics of every shard (this one records into its own).
    pub http: std::sync::Arc<RequestStats>,
    /// The local socket's state and counters, when it is on.
    pub local: Option<std::sync::Arc<crate::local::LocalShared>>,
    /// A request body must arrive in full within this.
    pub body_timeout: std::time::Duration,
    /// PUT body bytes this shard admits at once (`--put-inflight-mib`).
    pub put_inflight_bytes_max: u64,
    /// Declared body bytes of the PUTs admitted and not yet answered.
    pub put_inflight_bytes: std::cell::Cell<u64>,
}

/// An admitted PUT's share of [`Ctx::put_inflight_bytes`], given back when
/// the handler ends, however it ends (a reset stream drops it mid-body).
struct PutAdmission<'a> {
    ctx: &'a Ctx,
    bytes: u64,
}

impl Drop for PutAdmission<'_> {
    fn drop(&mut self) {
        let c = &self.ctx.put_inflight_bytes;
        c.set(c.get() - self.bytes);
    }
}

/// 503 `overloaded` with `Retry-After`: the client should retry later.
fn overloaded(message: String) -> Reply {
    let mut r = error(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message);
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(limits::RETRY_AFTER_S));
    r
}

/// Response type of every route.
pub type Reply = Response<ReplyBody>;

/// Header naming the tier a GET was served from.
pub const TIER_HEADER: &str = "x-kvtier-tier";

/// A JSON error: `{"error":{"code":...,"message":...}}`.
pub fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Reply {
    let body = json!({ "error": { "code": code, "message": message.into() } });
    json_reply(status, &body)
}

fn json_reply(status: StatusCode, body: &impl Serialize) -> Reply {
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
        Error::WrongSize { expected, got } if got > expected => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        Error::WrongSize { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "wrong_block_size"),
        Error::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        // A corrupt block is a miss for the client: it recomputes the block.
        Error::Corrupt { .. } => (StatusCode::NOT_FOUND, "corrupt_block"),
        Error::DiskFull(_) => (StatusCode::INSUFFICIENT_STORAGE, "disk_full"),
        Error::Overloaded(m) => return overloaded(m.clone()),
        Error::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        Error::GeometryMismatch { .. } | Error::Config(_) | Error::Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    };
    if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
        tracing::error!("request failed: {e}");
    }
    error(status, code, e.to_string())
}

/// Which route a method and path are for (the metrics label; a request
/// that is refused is still counted under the route it asked for).
pub fn route_of(method: &Method, path: &str) -> Route {
    if path.starts_with("/v1/blocks/") {
        return match *method {
            Method::PUT => Route::PutBlock,
            Method::GET => Route::GetBlock,
            Method::HEAD => Route::HeadBlock,
            Method::DELETE => Route::DeleteBlock,
            _ => Route::Other,
        };
    }
    match (method, path) {
        (&Method::POST, "/v1/lookup") => Route::Lookup,
        (&Method::POST, "/v1/prefetch") => Route::Prefetch,
        (&Method::GET, "/v1/stats") => Route::Stats,
        (&Method::GET, "/metrics") => Route::Metrics,
        (&Method::GET, "/healthz") => Route::Healthz,
        (&Method::GET, "/readyz") => Route::Readyz,
        (&Method::GET, "/v1/admin/trace") => Route::AdminTrace,
        (&Method::POST, "/v1/admin/trace/start") => Route::AdminTraceStart,
        (&Method::POST, "/v1/admin/trace/stop") => Route::AdminTraceStop,
        (&Method::GET, "/v1/admin/tenants") => Route::AdminTenants,
        (&Method::POST, "/v1/admin/tenants/reload") => Route::AdminTenantsReload,
        (&Method::PUT, p) if p.strip_prefix("/v1/admin/tenants/").is_some_and(|n| !n.is_empty() && n != "reload") => Route::AdminTenantSet,
        _ => Route::Other,
    }
}

/// How requests are authenticated.
#[derive(Clone, Copy)]
pub enum Auth<'a> {
    /// Anyone on the listening address (loopback only).
    Open,
    /// One bearer token for every request (`--auth-token-file`).
    Token(&'a [u8]),
    /// The bearer token names a tenant (`--tenants`).
    Tenants(&'a Table),
}

/// Who is calling: the tenant its token names; `None` without `--tenants`.
pub type Caller = Option<std::sync::Arc<Tenant>>;

/// What the front door decides from a request's method, path, version and
/// headers alone, before any body byte is read.
pub enum Plan {
    /// Run the handler of this route (never [`Route::Other`]) for the
    /// caller; block routes carry the key as the path gave it (not yet
    /// validated: the handler answers an invalid key), the tenant route
    /// the tenant's name.
    Handle(Route, Option<String>, Caller),
    /// Answer with this reply (431 headers too large, 401 no or wrong
    /// token, 405 wrong method, 404 no route); the body of a PUT refused
    /// for its token is still drained first (`refuse_put`).
    Refuse(Reply),
    /// A probe without a valid token on a server that needs one:
    /// [`Route::Healthz`] answers as always, [`Route::Readyz`] with its
    /// status code and status only. Neither names a tenant, a key or a
    /// tier's reason, so a kubelet or load balancer needs no secret
    /// (as etcd's, MinIO's and Vault's health endpoints).
    Probe(Route),
}

/// Routes a request: the header-size limit (HTTP/1; HTTP/2 enforces its
/// own), then the bearer token when the server has one or tenants
/// (`auth`), then the route table of docs/API.md, then (with tenants) the
/// admin routes' check. Pure: the fuzz target `http_route` drives it with
/// arbitrary requests.
pub fn plan(method: &Method, path: &str, version: Version, headers: &HeaderMap, auth: Auth<'_>) -> Plan {
    // HTTP/2 enforces this as its header-list size before a request gets
    // here; HTTP/1's read buffer is larger (body throughput), so its header
    // block is measured here.
    let header_bytes: usize =
        if version < Version::HTTP_2 { headers.iter().map(|(n, v)| n.as_str().len() + v.len() + 32).sum() } else { 0 };
    if header_bytes > limits::HEADER_BYTES_MAX as usize {
        return Plan::Refuse(error(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!("request headers take {header_bytes} bytes; the limit is {}", limits::HEADER_BYTES_MAX),
        ));
    }
    let unauthorized = || {
        let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong 'Authorization: Bearer <token>'");
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        Plan::Refuse(r)
    };
    let route = route_of(method, path);
    // Without a valid token, the liveness and readiness probes still answer.
    let anonymous = || match route {
        Route::Healthz | Route::Readyz => Plan::Probe(route),
        _ => unauthorized(),
    };
    let caller: Caller = match auth {
        Auth::Open => None,
        Auth::Token(token) if authorized(headers, token) => None,
        Auth::Token(_) => return anonymous(),
        Auth::Tenants(table) => match bearer(headers).and_then(|t| table.by_token(t)) {
            Some(t) => Some(t.clone()),
            None => return anonymous(),
        },
    };
    if route.is_admin() && caller.as_ref().is_some_and(|t| !t.admin) {
        return Plan::Refuse(error(
            StatusCode::FORBIDDEN,
            "admin_only",
            "the /v1/admin routes are for tenants marked `admin = true` in the tenants file",
        ));
    }
    match route {
        route @ (Route::PutBlock | Route::GetBlock | Route::HeadBlock | Route::DeleteBlock) => {
            Plan::Handle(route, path.strip_prefix("/v1/blocks/").map(str::to_string), caller)
        }
        Route::AdminTenantSet => Plan::Handle(route, path.strip_prefix("/v1/admin/tenants/").map(str::to_string), caller),
        Route::Other => Plan::Refuse(match path {
            _ if path.starts_with("/v1/blocks/") => method_not_allowed("PUT, GET, HEAD, DELETE"),
            "/v1/lookup" | "/v1/prefetch" | "/v1/admin/trace/start" | "/v1/admin/trace/stop" | "/v1/admin/tenants/reload" => {
                method_not_allowed("POST")
            }
            "/v1/stats" | "/healthz" | "/readyz" | "/metrics" | "/v1/admin/trace" | "/v1/admin/tenants" => method_not_allowed("GET"),
            _ if path.strip_prefix("/v1/admin/tenants/").is_some_and(|n| !n.is_empty()) => method_not_allowed("PUT"),
            _ => error(StatusCode::NOT_FOUND, "no_route", format!("no route for {path}; see docs/API.md")),
        }),
        route => Plan::Handle(route, None, caller),
    }
}

/// Routes one request and records its metrics. Never fails: every error is
/// a JSON reply.
pub async fn handle(ctx: Rc<Ctx>, req: Request<Incoming>) -> Result<Reply, Infallible> {
    let started = std::time::Instant::now();
    let route = route_of(req.method(), req.uri().path());
    let bytes_in = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok()).unwrap_or(0);
    let reply = dispatch(&ctx, req).await;
    let bytes_out = http_body::Body::size_hint(reply.body()).exact().unwrap_or(0);
    let latency_us = started.elapsed().as_micros() as u64;
    ctx.http.record(ctx.store.shard_id(), route as usize, reply.status().as_u16(), latency_us, bytes_in, bytes_out);
    Ok(reply)
}

async fn dispatch(ctx: &Ctx, req: Request<Incoming>) -> Reply {
    let is_head = req.method() == Method::HEAD;
    let table = ctx.tenancy.as_ref().map(|t| t.table());
    let auth = match (&table, &ctx.auth_token) {
        (Some(table), _) => Auth::Tenants(table),
        (None, Some(token)) => Auth::Token(token),
        (None, None) => Auth::Open,
    };
    let plan = plan(req.method(), req.uri().path(), req.version(), req.headers(), auth);
    drop(table);
    let mut reply = match plan {
        Plan::Refuse(r) if r.status() == StatusCode::UNAUTHORIZED => {
            if let Some(t) = &ctx.tenancy {
                t.unauthorized.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            if req.method() == Method::PUT {
                refuse_put(ctx, req, r).await
            } else {
                r
            }
        }
        Plan::Refuse(r) if r.status() == StatusCode::FORBIDDEN && req.method() == Method::PUT => refuse_put(ctx, req, r).await,
        Plan::Refuse(r) => r,
        Plan::Probe(Route::Readyz) => {
            let full = readyz(ctx).await;
            let status = full.status();
            json_reply(status, &json!({ "status": if status == StatusCode::OK { "ready" } else { "not_ready" } }))
        }
        Plan::Probe(_) => healthz(ctx),
        Plan::Handle(route @ (Route::PutBlock | Route::GetBlock | Route::HeadBlock | Route::DeleteBlock), key, caller) => {
            // The key as the caller's tenant stores it (tenants.rs), once
            // for every block route.
            let key = key.unwrap_or_default();
            match stored_key(caller.as_deref(), &key, matches!(route, Route::PutBlock | Route::DeleteBlock)) {
                Err(e) if route == Route::PutBlock => refuse_put(ctx, req, scope_error(e)).await,
                Err(e) => scope_error(e),
                Ok(stored) => match route {
                    Route::PutBlock => put_block(ctx, &key, &stored, req).await,
                    Route::GetBlock => get_block(ctx, &stored).await,
                    Route::HeadBlock => head_block(ctx, &stored).await,
                    _ => delete_block(ctx, &stored).await,
                },
            }
        }
        Plan::Handle(route, key, caller) => {
            let key = key.unwrap_or_default();
            let caller = caller.as_deref();
            match route {
                Route::Lookup => lookup(ctx, caller, req).await,
                Route::Prefetch => prefetch(ctx, caller, req).await,
                Route::Stats => stats(ctx, caller).await,
                Route::Metrics => metrics(ctx, req.headers()).await,
                Route::Healthz => healthz(ctx),
                Route::Readyz => readyz(ctx).await,
                Route::AdminTrace | Route::AdminTraceStart | Route::AdminTraceStop => admin_trace(ctx, route).await,
                Route::AdminTenants => admin::tenants(ctx).await,
                Route::AdminTenantSet => admin::set_tenant(ctx, &key, req).await,
                Route::AdminTenantsReload => admin::reload(ctx).await,
                Route::PutBlock | Route::GetBlock | Route::HeadBlock | Route::DeleteBlock => unreachable!("block routes are handled above"),
                Route::Other => unreachable!("plan never hands Route::Other to a handler"),
            }
        }
    };
    if is_head {
        // HTTP/1 drops a HEAD response's body, but hyper's HTTP/2 server
        // would send it as DATA frames, which clients reject: send none.
        *reply.body_mut() = ReplyBody::empty();
    }
    reply
}

/// The bearer token a request carries.
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    headers.get(header::AUTHORIZATION).and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
}

/// Constant-time comparison of the bearer token: the time taken does not
/// depend on how many leading bytes match. (Tenants' tokens are compared
/// as SHA-256 digests, `tenants.rs`: the time then depends on the
/// digest, which tells nothing about the token.)
fn authorized(headers: &HeaderMap, token: &[u8]) -> bool {
    let Some(given) = bearer(headers) else {
        return false;
    };
    if given.len() != token.len() {
        return false;
    }
    given.iter().zip(token).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

fn method_not_allowed(allow: &'static str) -> Reply {
    let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", format!("allowed: {allow}"));
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
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
async fn read_body(ctx: &Ctx, req: Request<Incoming>, limit: u64) -> Result<(Vec<Bytes>, u64), Reply> {
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

async fn read_body_frames(req: Request<Incoming>, limit: u64) -> Result<(Vec<Bytes>, u64), Reply> {
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
async fn refuse_put(ctx: &Ctx, req: Request<Incoming>, reply: Reply) -> Reply {
    let waits_for_continue = req.version() < Version::HTTP_2
        && req.headers().get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if waits_for_continue {
        return reply;
    }
    let limit = ctx.store.geometry().block_bytes;
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

/// The reply for a key its caller cannot use: 400 `invalid_key`, 403
/// `namespace_read_only`.
fn scope_error(e: ScopeError) -> Reply {
    match e {
        ScopeError::InvalidKey(m) => error(StatusCode::BAD_REQUEST, "invalid_key", m),
        ScopeError::ReadOnly(m) => error(StatusCode::FORBIDDEN, "namespace_read_only", m),
    }
}

/// `PUT /v1/blocks/{client_key}`, stored under `key` (the caller's scope).
async fn put_block(ctx: &Ctx, client_key: &str, key: &str, req: Request<Incoming>) -> Reply {
    let block_bytes = ctx.store.geometry().block_bytes;
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
    let inflight = ctx.put_inflight_bytes.get();
    if inflight > 0 && inflight + declared > ctx.put_inflight_bytes_max {
        ctx.http.shard(ctx.store.shard_id()).put_bytes_refusals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return overloaded(format!(
            "shard {} already holds {inflight} bytes of PUT bodies in flight (--put-inflight-mib {}); retry shortly",
            ctx.store.shard_id(),
            ctx.put_inflight_bytes_max >> 20
        ));
    }
    ctx.put_inflight_bytes.set(inflight + declared);
    let _admission = PutAdmission { ctx, bytes: declared };
    let (chunks, got) = match read_body(ctx, req, block_bytes).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match ctx.store.put_reporting(key, chunks).await {
        Ok(report) => {
            let (status, word) = match report.outcome {
                PutOutcome::Created => (StatusCode::CREATED, "created"),
                PutOutcome::Replaced => (StatusCode::OK, "replaced"),
            };
            let mut body = json!({ "key": client_key, "block_bytes": got, "status": word });
            // What the remote tier did with it, under the tier's name.
            if let (Some(remote), Some(upload)) = (ctx.store.remote(), report.upload) {
                body[remote.name()] = json!(upload.as_str());
            }
            json_reply(status, &body)
        }
        Err(e) => engine_error(&e),
    }
}

fn block_reply(body: BlockBody, tier: &'static str) -> Reply {
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
async fn get_block(ctx: &Ctx, key: &str) -> Reply {
    match ctx.store.get_stream(key).await {
        Ok((body, tier)) => block_reply(body, tier.as_str()),
        Err(e) => engine_error(&e),
    }
}

async fn head_block(ctx: &Ctx, key: &str) -> Reply {
    match ctx.store.contains(key).await {
        Ok(Some(_)) => Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, ctx.store.geometry().block_bytes)
            .body(ReplyBody::empty())
            .expect("valid response"),
        Ok(_) => engine_error(&Error::NotFound),
        Err(e) => engine_error(&e),
    }
}

async fn delete_block(ctx: &Ctx, key: &str) -> Reply {
    match ctx.store.delete(key).await {
        Ok(()) => Response::builder().status(StatusCode::NO_CONTENT).body(ReplyBody::empty()).expect("valid response"),
        Err(e) => engine_error(&e),
    }
}

/// Body of `POST /v1/lookup`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LookupRequest {
    keys: Vec<String>,
}

/// Reads and checks a `{"keys":[...]}` body (lookup, prefetch): size,
/// JSON shape, key count, every key valid.
async fn read_keys(ctx: &Ctx, caller: Option<&Tenant>, req: Request<Incoming>) -> Result<Vec<String>, Reply> {
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
    if caller.is_none() {
        return Ok(keys); // checked by parse_keys; stored as given
    }
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            stored_key(caller, k, false).map(std::borrow::Cow::into_owned).map_err(|e| match e {
                ScopeError::InvalidKey(m) => error(StatusCode::BAD_REQUEST, "invalid_key", format!("keys[{i}]: {m}")),
                e => scope_error(e),
            })
        })
        .collect()
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

async fn lookup(ctx: &Ctx, caller: Option<&Tenant>, req: Request<Incoming>) -> Reply {
    let keys = match read_keys(ctx, caller, req).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    match ctx.store.lookup_prefix(&keys).await {
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
async fn prefetch(ctx: &Ctx, caller: Option<&Tenant>, req: Request<Incoming>) -> Reply {
    let keys = match read_keys(ctx, caller, req).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    match ctx.store.prefetch(&keys).await {
        Ok(report) => {
            let mut body = json!({ "requested": keys.len(), "found": report.found });
            if let Some(remote) = ctx.store.remote() {
                body[format!("{}_requested", remote.name())] = json!(report.remote_requested);
            }
            json_reply(StatusCode::ACCEPTED, &body)
        }
        Err(e) => engine_error(&e),
    }
}

/// `GET /readyz`: whether the store serves what it promises. 503 when the
/// log cannot be written (a PUT would fail, or in write-back lose its
/// block); 200 otherwise, naming the degraded tiers (they cost misses or
/// refusals, not correctness). Each tier's state, reason and since when.
/// `GET /healthz`: the process serves (liveness). Open to probes without
/// a token.
fn healthz(ctx: &Ctx) -> Reply {
    json_reply(StatusCode::OK, &json!({"status": "ok", "shards": ctx.store.shards()}))
}

async fn readyz(ctx: &Ctx) -> Reply {
    let health = match ctx.store.health().await {
        Ok(h) => h,
        Err(e) => return engine_error(&e),
    };
    let names = |state: HealthState| -> Vec<&str> { health.iter().filter(|h| h.state == state).map(|h| h.tier.as_str()).collect() };
    let ready = !health.iter().any(|h| h.tier == Tier::Nvme.as_str() && h.state == HealthState::Down);
    let tiers: Vec<_> =
        health.iter().map(|h| json!({ "tier": h.tier, "state": h.state, "reason": h.reason, "since_unix_ms": h.since_unix_ms })).collect();
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "degraded": names(HealthState::Degraded),
        "down": names(HealthState::Down),
        "tiers": tiers,
    });
    json_reply(if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, &body)
}

/// The trace recorder: its state, or start or stop it. Authenticated as
/// every route is (the bearer token, when the server has one).
async fn admin_trace(ctx: &Ctx, route: Route) -> Reply {
    let status = match route {
        Route::AdminTraceStart => ctx.store.trace_start().await.map(|r| {
            r.map_err(|e| {
                error(StatusCode::INTERNAL_SERVER_ERROR, "trace_start_failed", format!("the trace recorder could not start: {e}"))
            })
        }),
        Route::AdminTraceStop => ctx.store.trace_stop().await.map(Ok),
        _ => ctx.store.trace_status().map(Ok),
    };
    match status {
        None => error(
            StatusCode::CONFLICT,
            "trace_not_configured",
            "this server has no trace recorder: start kvtier serve with --trace-dir DIR (docs/OPERATIONS.md, \"Sizing the tiers\")",
        ),
        Some(Err(reply)) => reply,
        Some(Ok(status)) => json_reply(StatusCode::OK, &status),
    }
}

async fn stats(ctx: &Ctx, caller: Option<&Tenant>) -> Reply {
    let shards = match ctx.store.stats().await {
        Ok(s) => s,
        Err(e) => return engine_error(&e),
    };
    let health = ctx.store.health_table(shards.iter().flat_map(|s| &s.health));
    let sum = |f: fn(&kvtier_engine::ShardStats) -> u64| shards.iter().map(f).sum::<u64>();
    let body = json!({
        "geometry": ctx.store.geometry(),
        "shards": ctx.store.shards(),
        "totals": {
            "blocks": sum(|s| s.blocks),
            "capacity_blocks": sum(|s| s.capacity_blocks),
            "disk_bytes": sum(|s| s.disk_bytes),
            "puts": sum(|s| s.puts),
            "gets": sum(|s| s.gets),
            "hits": sum(|s| s.hits),
            "misses": sum(|s| s.misses),
            "deletes": sum(|s| s.deletes),
            "corrupt_blocks": sum(|s| s.corrupt_blocks),
            "disk_full_refusals": sum(|s| s.disk_full_refusals),
            "io_queue_refusals": sum(|s| s.io_queue_refusals),
            // Both front doors' refusals (one budget per shard).
            "put_bytes_refusals": ctx.http.put_bytes_refusals() + ctx.local.as_ref().map_or(0, |l| l.stats.put_bytes_refusals()),
            "invalid_headers_at_start": sum(|s| s.recovery.headers_invalid),
            "foreign_files_at_start": sum(|s| s.recovery.foreign_files),
            "truncated_segments_at_start": sum(|s| s.recovery.segments_truncated),
            "invalid_snapshots_at_start": sum(|s| s.recovery.snapshot_invalid as u64),
            "evicted_blocks": sum(|s| s.evicted_blocks),
            "bytes_written": sum(|s| s.bytes_written),
            "bytes_read": sum(|s| s.bytes_read),
        },
        "write_policy": shards.first().map(|s| s.write_policy),
        "promote": shards.first().map(|s| s.promote),
        "tiers": kvtier_engine::shard::tier_totals(&shards),
        "health": health,
        "per_shard": shards,
        "http": { "routes": ctx.http.routes_json(), "per_shard": ctx.http.shards_json() },
        "local": crate::local::stats_json(ctx.local.as_deref()),
        "trace": ctx.store.trace_status(),
        "tenants": admin::owners_json(&shards, ctx.store.geometry().block_bytes),
        // The calling tenant (its token's), null without --tenants.
        "tenant": caller.map(|t| t.name.as_str()),
    });
    let mut body = body;
    if let Some(remote) = ctx.store.remote() {
        body[remote.name()] = remote.stats_json();
    }
    json_reply(StatusCode::OK, &body)
}

/// `GET /metrics`: OpenMetrics when the scraper's `Accept` asks for it (a
/// Prometheus server does), else Prometheus' text format 0.0.4 (curl,
/// `promtool check metrics`, older scrapers), as client_golang negotiates.
async fn metrics(ctx: &Ctx, headers: &HeaderMap) -> Reply {
    let shards = match ctx.store.stats().await {
        Ok(s) => s,
        Err(e) => return engine_error(&e),
    };
    let health = ctx.store.health_table(shards.iter().flat_map(|s| &s.health));
    let text = ctx.metrics.render(crate::metrics::EngineSnapshot { engine: shards, health, trace: ctx.store.trace_status() });
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().starts_with("application/openmetrics-text")));
    let (body, content_type) = if openmetrics {
        (text, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    } else {
        (crate::metrics::openmetrics_to_text_0_0_4(&text), "text/plain; version=0.0.4; charset=utf-8")
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, content_type)
        .body(ReplyBody::full(body))
        .expect("valid response")
}
