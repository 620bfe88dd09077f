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
//! one no tenant has), its keys are scoped to it ([`Service::scope`]), and
//! `/v1/admin/*` is for tenants marked `admin` (403 otherwise). The probes
//! answer without a token ([`Plan::Probe`]).

use std::convert::Infallible;
use std::rc::Rc;

use http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode, Version};
use hyper::body::Incoming;
use serde_json::json;

use super::blocks::{delete_block, get_block, head_block, lookup, prefetch, put_block};
use super::body::ReplyBody;
use super::reply::{error, json_reply, method_not_allowed, scope_error, Reply};
use super::request::{bearer, refuse_put};
use super::status::{admin_trace, healthz, metrics, readyz, stats};
pub use super::table::{route_of, Route, HTTP_ROUTE_NAMES};
use super::{admin, Ctx};
use crate::limits;
use crate::service::{Auth, Caller};

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
    let caller: Caller = match auth.identify(bearer(headers)) {
        Ok(caller) => caller,
        Err(_) => return anonymous(),
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
    ctx.http.record(ctx.store().shard_id(), route as usize, reply.status().as_u16(), latency_us, bytes_in, bytes_out);
    Ok(reply)
}

async fn dispatch(ctx: &Ctx, req: Request<Incoming>) -> Reply {
    let is_head = req.method() == Method::HEAD;
    let plan = ctx.service.access.with(|auth| plan(req.method(), req.uri().path(), req.version(), req.headers(), auth));
    let mut reply = match plan {
        Plan::Refuse(r) if r.status() == StatusCode::UNAUTHORIZED => {
            ctx.service.access.count_refusal();
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
            match ctx.service.scope(caller.as_deref(), &key, matches!(route, Route::PutBlock | Route::DeleteBlock)) {
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
