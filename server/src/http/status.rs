//! The status routes: `/healthz`, `/readyz`, `/v1/stats`, `/metrics`, and
//! `/v1/admin/trace*`.

// A check answers early with a finished reply; boxing it would buy nothing.
#![allow(clippy::result_large_err)]

use http::{header, HeaderMap, Response, StatusCode};
use kvtier_engine::health::HealthState;
use kvtier_engine::Tier;
use serde_json::json;

use super::body::ReplyBody;
use super::reply::{engine_error, error, json_reply, Reply};
use super::table::Route;
use super::Ctx;
use crate::tenants::Tenant;

/// `GET /healthz`: the process serves (liveness). Open to probes without
/// a token.
pub(crate) fn healthz(ctx: &Ctx) -> Reply {
    json_reply(StatusCode::OK, &json!({"status": "ok", "shards": ctx.store().shards()}))
}

/// `GET /readyz`: whether the store serves what it promises. 503 when the
/// log cannot be written (a PUT would fail, or in write-back lose its
/// block); 200 otherwise, naming the degraded tiers (they cost misses or
/// refusals, not correctness). Each tier's state, reason and since when.
/// With several data directories (devices) the store is ready while any
/// device's logs can be written: `status` is then `degraded`, and
/// `devices_down` names each device that is not, with its directory and
/// reason (its shards' blocks miss; the rest serve).
pub(crate) async fn readyz(ctx: &Ctx) -> Reply {
    let shards = match ctx.store().stats().await {
        Ok(s) => s,
        Err(e) => return engine_error(&e),
    };
    let health = ctx.store().health_table(shards.iter().flat_map(|s| &s.health));
    let devices = ctx.store().devices(&shards);
    let names = |state: HealthState| -> Vec<&str> { health.iter().filter(|h| h.state == state).map(|h| h.tier.as_str()).collect() };
    let down: Vec<_> = devices
        .iter()
        .filter(|d| d.state == HealthState::Down)
        .map(|d| json!({ "device": d.index, "dir": d.dir, "shards": d.shards, "reason": d.reason }))
        .collect();
    let ready = if devices.len() > 1 {
        down.len() < devices.len()
    } else {
        !health.iter().any(|h| h.tier == Tier::Nvme.as_str() && h.state == HealthState::Down)
    };
    let tiers: Vec<_> =
        health.iter().map(|h| json!({ "tier": h.tier, "state": h.state, "reason": h.reason, "since_unix_ms": h.since_unix_ms })).collect();
    let status = match (ready, down.is_empty()) {
        (false, _) => "not_ready",
        (true, false) => "degraded",
        (true, true) => "ready",
    };
    let body = json!({
        "status": status,
        "degraded": names(HealthState::Degraded),
        "down": names(HealthState::Down),
        "devices_down": down,
        "tiers": tiers,
    });
    json_reply(if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, &body)
}

/// The trace recorder: its state, or start or stop it. Authenticated as
/// every route is (the bearer token, when the server has one).
pub(crate) async fn admin_trace(ctx: &Ctx, route: Route) -> Reply {
    let status = match route {
        Route::AdminTraceStart => ctx.store().trace_start().await.map(|r| {
            r.map_err(|e| {
                error(StatusCode::INTERNAL_SERVER_ERROR, "trace_start_failed", format!("the trace recorder could not start: {e}"))
            })
        }),
        Route::AdminTraceStop => ctx.store().trace_stop().await.map(Ok),
        _ => ctx.store().trace_status().map(Ok),
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

pub(crate) async fn stats(ctx: &Ctx, caller: Option<&Tenant>) -> Reply {
    let shards = match ctx.store().stats().await {
        Ok(s) => s,
        Err(e) => return engine_error(&e),
    };
    let health = ctx.store().health_table(shards.iter().flat_map(|s| &s.health));
    let devices = ctx.store().devices(&shards);
    let snapshot = crate::metrics::EngineSnapshot { engine: shards, health, trace: ctx.store().trace_status(), devices };
    json_reply(StatusCode::OK, &ctx.metrics.stats_json(&snapshot, ctx.store().shards(), caller.map(|t| t.name.as_str())))
}

/// `GET /metrics`: OpenMetrics when the scraper's `Accept` asks for it (a
/// Prometheus server does), else Prometheus' text format 0.0.4 (curl,
/// `promtool check metrics`, older scrapers), as client_golang negotiates.
pub(crate) async fn metrics(ctx: &Ctx, headers: &HeaderMap) -> Reply {
    let shards = match ctx.store().stats().await {
        Ok(s) => s,
        Err(e) => return engine_error(&e),
    };
    let health = ctx.store().health_table(shards.iter().flat_map(|s| &s.health));
    let devices = ctx.store().devices(&shards);
    let text = ctx.metrics.render(crate::metrics::EngineSnapshot { engine: shards, health, trace: ctx.store().trace_status(), devices });
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
