//! The HTTP route table: every route the block API answers, its metrics
//! label, and which route a method and path are for.

use http::Method;

/// The routes metrics are kept for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `PUT /v1/blocks/{key}`
    PutBlock,
    /// `GET /v1/blocks/{key}`
    GetBlock,
    /// `HEAD /v1/blocks/{key}`
    HeadBlock,
    /// `DELETE /v1/blocks/{key}`
    DeleteBlock,
    /// `POST /v1/lookup`
    Lookup,
    /// `POST /v1/prefetch`
    Prefetch,
    /// `GET /v1/stats`
    Stats,
    /// `GET /metrics`
    Metrics,
    /// `GET /healthz`
    Healthz,
    /// `GET /readyz`
    Readyz,
    /// `GET /v1/admin/trace`
    AdminTrace,
    /// `POST /v1/admin/trace/start`
    AdminTraceStart,
    /// `POST /v1/admin/trace/stop`
    AdminTraceStop,
    /// `GET /v1/admin/tenants`
    AdminTenants,
    /// `PUT /v1/admin/tenants/{name}`
    AdminTenantSet,
    /// `POST /v1/admin/tenants/reload`
    AdminTenantsReload,
    /// Anything else (404, 405, 401).
    Other,
}

impl Route {
    /// Whether it is one of the `/v1/admin/*` routes (with tenants, for
    /// `admin` tenants only).
    pub fn is_admin(self) -> bool {
        matches!(
            self,
            Route::AdminTrace
                | Route::AdminTraceStart
                | Route::AdminTraceStop
                | Route::AdminTenants
                | Route::AdminTenantSet
                | Route::AdminTenantsReload
        )
    }
}

/// Labels of the [`Route`]s, in declaration order (`route as usize`).
pub const HTTP_ROUTE_NAMES: [&str; 17] = [
    "put_block",
    "get_block",
    "head_block",
    "delete_block",
    "lookup",
    "prefetch",
    "stats",
    "metrics",
    "healthz",
    "readyz",
    "admin_trace",
    "admin_trace_start",
    "admin_trace_stop",
    "admin_tenants",
    "admin_tenant_set",
    "admin_tenants_reload",
    "other",
];

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
