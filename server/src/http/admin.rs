//! The tenants' admin routes (`/v1/admin/tenants`), the tenants section of
//! `/v1/stats`, and applying a changed tenants table to the store (admin
//! route, or SIGHUP through [`watch_reloads`]).

use std::rc::Rc;
use std::sync::Arc;

use http::{Request, StatusCode};
use hyper::body::Incoming;
use kvtier_engine::tenant::Owners;
use kvtier_engine::{ShardStats, Store};
use serde_json::{json, Value};

use super::reply::{engine_error, error, json_reply, Reply};
use super::request::read_body;
use super::Ctx;
use crate::tenants::{QuotaChange, QuotaGb, QuotaRefusal, Tenancy};

/// Largest body `PUT /v1/admin/tenants/{name}` takes.
const QUOTA_BODY_BYTES_MAX: u64 = 4096;

fn not_configured() -> Reply {
    error(
        StatusCode::CONFLICT,
        "tenants_not_configured",
        "this server has no tenants: start kvtier serve with --tenants FILE (docs/OPERATIONS.md, \"Tenants\")",
    )
}

/// `GET /v1/admin/tenants`: the file, how reloads went, and each tenant
/// and namespace as configured (quotas in GiB, namespaces, uids) with its
/// usage ([`crate::metrics::owners_json`]).
pub(super) async fn tenants(ctx: &Ctx) -> Reply {
    let Some(tenancy) = ctx.service.access.tenancy() else { return not_configured() };
    let shards = match ctx.store().stats().await {
        Ok(s) => s,
        Err(e) => return engine_error(&e),
    };
    json_reply(StatusCode::OK, &tenants_body(tenancy, &shards, ctx.store().geometry().block_bytes))
}

fn tenants_body(tenancy: &Tenancy, shards: &[ShardStats], block_bytes: u64) -> Value {
    let table = tenancy.table();
    let usage = crate::metrics::owners_json(shards, block_bytes);
    let owners: Vec<Value> = table
        .entries
        .iter()
        .map(|e| {
            let tenant = table.tenant(&e.name);
            let mut v = json!({
                "name": e.name,
                "kind": e.kind,
                "quotas_gb": e.quotas,
                "usage": usage.iter().find(|u| u["name"] == e.name.as_str()),
            });
            if let Some(t) = tenant {
                v["admin"] = json!(t.admin);
                v["uids"] = json!(t.uids);
            }
            if let Some((prefix, readers, writers)) = &e.namespace {
                v["key_prefix"] = json!(prefix);
                v["readers"] = json!(readers);
                v["writers"] = json!(writers);
            }
            v
        })
        .collect();
    // Owners no longer in the file (their blocks stay until evicted) and
    // the default owner (blocks written without tenants).
    let others: Vec<&Value> = usage.iter().filter(|u| !table.entries.iter().any(|e| u["name"] == e.name.as_str())).collect();
    json!({
        "file": tenancy.path(),
        "reload": tenancy.status(),
        "unauthorized_requests": tenancy.unauthorized.load(std::sync::atomic::Ordering::Relaxed),
        "owners": owners,
        "not_in_file": others,
    })
}

/// `PUT /v1/admin/tenants/{name}`: changes a tenant's or namespace's
/// quotas (the JSON body's fields, in GiB; `null` removes one) until the
/// next reload, and applies them on every shard; a lowered limit moves
/// that owner's oldest blocks down in the background.
pub(super) async fn set_tenant(ctx: &Ctx, name: &str, req: Request<Incoming>) -> Reply {
    let Some(tenancy) = ctx.service.access.tenancy() else { return not_configured() };
    let body = match read_body(ctx, req, QUOTA_BODY_BYTES_MAX).await {
        Ok((chunks, _)) => chunks.concat(),
        Err(r) => return r,
    };
    let expected = "expected {\"ram_reserved_gb\": 4, \"ram_limit_gb\": null, ...} (gpu_, ram_, nvme_ × reserved_gb, limit_gb)";
    let change: QuotaChange = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_json", format!("{expected}: {e}")),
    };
    // Its fields and their types, before any tenant's quotas are looked at.
    if let Err(e) = QuotaGb::default().merged(&change) {
        return error(StatusCode::BAD_REQUEST, "bad_json", format!("{expected}: {e}"));
    }
    let owners = match tenancy.set_quotas(name, &change) {
        Ok(Some(o)) => o,
        Ok(None) => return error(StatusCode::NOT_FOUND, "unknown_tenant", format!("no tenant or namespace is named {name:?}")),
        Err(QuotaRefusal::OverCapacity(e)) => return error(StatusCode::CONFLICT, "over_capacity", e),
        Err(QuotaRefusal::Invalid(e)) => return error(StatusCode::BAD_REQUEST, "bad_quota", e),
    };
    if let Err(e) = ctx.store().set_owners(owners).await {
        return engine_error(&e);
    }
    tracing::info!(tenant = name, "tenant quotas changed by the admin route");
    tenants(ctx).await
}

/// `POST /v1/admin/tenants/reload`: reads the tenants file again (as
/// SIGHUP does); a refused file leaves the one in use.
pub(super) async fn reload(ctx: &Ctx) -> Reply {
    let Some(tenancy) = ctx.service.access.tenancy() else { return not_configured() };
    match apply_reload(ctx.store(), tenancy).await {
        Ok(()) => tenants(ctx).await,
        Err(e) => error(StatusCode::BAD_REQUEST, "tenants_file_invalid", format!("{e}; the tenants in use are kept")),
    }
}

async fn apply_reload(store: &Store, tenancy: &Arc<Tenancy>) -> Result<(), String> {
    // The file is read on the blocking pool, never on the shard's thread.
    let reading = tenancy.clone();
    let owners: Arc<Owners> = glommio::executor().spawn_blocking(move || reading.reload()).await?;
    let n = owners.len() - 1;
    store.set_owners(owners).await.map_err(|e| e.to_string())?;
    tracing::info!(owners = n, file = %tenancy.path().display(), "tenants file reloaded");
    Ok(())
}

/// Shard 0's task: reloads the tenants file as soon as SIGHUP asks for it
/// ([`Tenancy::request_reload`]), until shutdown; a refused file is logged
/// and the tenants in use are kept.
pub async fn watch_reloads(service: Rc<crate::service::Service>, tenancy: Arc<Tenancy>) {
    loop {
        let stop = futures_lite::future::or(
            async {
                tenancy.reload_requested().await;
                false
            },
            async {
                service.shutdown.requested().await;
                true
            },
        )
        .await;
        if stop {
            return;
        }
        if let Err(e) = apply_reload(&service.store, &tenancy).await {
            tracing::error!("SIGHUP: {e}; the tenants in use are kept");
        }
    }
}
