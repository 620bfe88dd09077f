//! Request metrics: per-shard, per-route counts and latency histograms
//! (hdrhistogram, microseconds), connection and byte counters, and their
//! rendering as `/v1/stats` JSON and Prometheus text (`GET /metrics`,
//! through prometheus-client).
//!
//! Each shard records only into its own [`ShardRequestStats`], so its mutex is
//! uncontended on the request path; a stats or metrics request reads every
//! shard's. Metric names follow `kvtier_<layer>_<what>` (docs/API.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;
use kvtier_engine::health::{HealthState, TierHealth};
use kvtier_engine::{Geometry, ShardStats};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};

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

#[derive(Clone)]
struct RouteCounters {
    requests: u64,
    client_errors: u64,
    server_errors: u64,
    latency_us: Histogram<u64>,
}

impl Default for RouteCounters {
    fn default() -> Self {
        // 1 µs to 10 min at 2 significant digits: ~10 KiB per route.
        RouteCounters {
            requests: 0,
            client_errors: 0,
            server_errors: 0,
            latency_us: Histogram::new_with_bounds(1, 600_000_000, 2).expect("valid bounds"),
        }
    }
}

/// One shard's HTTP counters.
pub struct ShardRequestStats {
    routes: Mutex<Vec<RouteCounters>>,
    /// Request body bytes received (declared Content-Length of requests).
    pub bytes_in: AtomicU64,
    /// Response body bytes sent.
    pub bytes_out: AtomicU64,
    /// Connections open now.
    pub connections_open: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// PUTs refused with 503 because the shard's PUT bytes in flight were at
    /// `--put-inflight-mib`.
    pub put_bytes_refusals: AtomicU64,
}

/// Every shard's HTTP counters.
pub struct RequestStats {
    names: &'static [&'static str],
    shards: Vec<ShardRequestStats>,
}

impl RequestStats {
    /// Counters for `shards` shards and the routes `names` (indexed as
    /// [`RequestStats::record`]'s `route`): [`HTTP_ROUTE_NAMES`] for HTTP,
    /// the local socket's ops for it.
    pub fn new(shards: usize, names: &'static [&'static str]) -> Arc<Self> {
        Arc::new(RequestStats {
            names,
            shards: (0..shards)
                .map(|_| ShardRequestStats {
                    routes: Mutex::new(vec![RouteCounters::default(); names.len()]),
                    bytes_in: AtomicU64::new(0),
                    bytes_out: AtomicU64::new(0),
                    connections_open: AtomicU64::new(0),
                    connections_total: AtomicU64::new(0),
                    put_bytes_refusals: AtomicU64::new(0),
                })
                .collect(),
        })
    }

    /// One shard's counters.
    pub fn shard(&self, shard: usize) -> &ShardRequestStats {
        &self.shards[shard]
    }

    /// PUTs refused for PUT bytes in flight, summed over shards.
    pub fn put_bytes_refusals(&self) -> u64 {
        self.shards.iter().map(|s| s.put_bytes_refusals.load(Ordering::Relaxed)).sum()
    }

    /// Records one finished request on route number `route` (an index into
    /// the names given to [`RequestStats::new`]); `status` is HTTP's or its
    /// equivalent (4xx the client's fault, 5xx the server's).
    pub fn record(&self, shard: usize, route: usize, status: u16, latency_us: u64, bytes_in: u64, bytes_out: u64) {
        let s = &self.shards[shard];
        s.bytes_in.fetch_add(bytes_in, Ordering::Relaxed);
        s.bytes_out.fetch_add(bytes_out, Ordering::Relaxed);
        let mut routes = s.routes.lock().expect("route stats lock");
        let r = &mut routes[route];
        r.requests += 1;
        match status {
            400..=499 => r.client_errors += 1,
            500..=599 => r.server_errors += 1,
            _ => {}
        }
        r.latency_us.saturating_record(latency_us.max(1));
    }

    /// Counters of each route summed over shards.
    fn merged(&self) -> Vec<RouteCounters> {
        let mut total = vec![RouteCounters::default(); self.names.len()];
        for s in &self.shards {
            for (t, r) in total.iter_mut().zip(s.routes.lock().expect("route stats lock").iter()) {
                t.requests += r.requests;
                t.client_errors += r.client_errors;
                t.server_errors += r.server_errors;
                t.latency_us.add(&r.latency_us).expect("same bounds");
            }
        }
        total
    }

    /// Per-route JSON for `/v1/stats`: requests, errors, latency percentiles.
    pub fn routes_json(&self) -> Value {
        let merged = self.merged();
        let mut out = serde_json::Map::new();
        for (route, r) in self.names.iter().zip(&merged) {
            let q = |p: f64| if r.latency_us.is_empty() { 0 } else { r.latency_us.value_at_quantile(p) };
            out.insert(
                (*route).into(),
                json!({
                    "requests": r.requests,
                    "client_errors": r.client_errors,
                    "server_errors": r.server_errors,
                    "latency_us_p50": q(0.5),
                    "latency_us_p95": q(0.95),
                    "latency_us_p99": q(0.99),
                }),
            );
        }
        Value::Object(out)
    }

    /// Per-shard connection and byte counters for `/v1/stats`.
    pub fn shards_json(&self) -> Vec<Value> {
        self.shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let requests: u64 = s.routes.lock().expect("route stats lock").iter().map(|r| r.requests).sum();
                json!({
                    "shard": i,
                    "requests": requests,
                    "connections_open": s.connections_open.load(Ordering::Relaxed),
                    "connections_total": s.connections_total.load(Ordering::Relaxed),
                    "bytes_in": s.bytes_in.load(Ordering::Relaxed),
                    "bytes_out": s.bytes_out.load(Ordering::Relaxed),
                    "put_bytes_refusals": s.put_bytes_refusals.load(Ordering::Relaxed),
                })
            })
            .collect()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierOpQuantileLabel {
    tier: String,
    op: String,
    quantile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuantileLabel {
    route: String,
    quantile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardQuantileLabel {
    shard: String,
    quantile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantTierLabel {
    tenant: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantEvictionLabel {
    tenant: String,
    tier: String,
    /// `own`: to make room for its own blocks or to meet its limit;
    /// `other`: for another owner's (in the log: a reclaim).
    cause: String,
}

/// Per block owner (tenant, namespace, `default`): the `tenant` label takes
/// only names from the tenants file (and `default`), never a value from a
/// request, so there are at most [`kvtier_engine::tenant::OWNERS_MAX`].
fn register_tenants(registry: &mut Registry, engine: &[ShardStats], block_bytes: u64, tenancy: Option<&crate::tenants::Tenancy>) {
    use kvtier_engine::tenant::QuotaTier;
    let owners = kvtier_engine::shard::owner_totals(engine);
    let bytes = Family::<TenantTierLabel, Gauge>::default();
    let blocks = Family::<TenantTierLabel, Gauge>::default();
    let reserved = Family::<TenantTierLabel, Gauge>::default();
    let limit = Family::<TenantTierLabel, Gauge>::default();
    let evictions = Family::<TenantEvictionLabel, Counter>::default();
    let (hits, misses) = (Family::<TenantLabel, Counter>::default(), Family::<TenantLabel, Counter>::default());
    let (lookup_keys, prefix_hits) = (Family::<TenantLabel, Counter>::default(), Family::<TenantLabel, Counter>::default());
    for o in &owners {
        let tenant = o.name.clone();
        for t in QuotaTier::ALL {
            let (i, tier) = (t as usize, t.as_str().to_string());
            let l = TenantTierLabel { tenant: tenant.clone(), tier: tier.clone() };
            blocks.get_or_create(&l).set(o.blocks[i] as i64);
            bytes.get_or_create(&l).set((o.blocks[i] * block_bytes) as i64);
            reserved.get_or_create(&l).set((o.reserved_blocks[i] * block_bytes) as i64);
            limit.get_or_create(&l).set((o.limit_blocks[i] * block_bytes) as i64);
            for (cause, n) in [("own", o.counters.evicted_own[i]), ("other", o.counters.evicted_by_other[i])] {
                evictions.get_or_create(&TenantEvictionLabel { tenant: tenant.clone(), tier: tier.clone(), cause: cause.into() }).inc_by(n);
            }
        }
        let l = TenantLabel { tenant };
        hits.get_or_create(&l).inc_by(o.counters.hits);
        misses.get_or_create(&l).inc_by(o.counters.misses);
        lookup_keys.get_or_create(&l).inc_by(o.counters.lookup_keys);
        prefix_hits.get_or_create(&l).inc_by(o.counters.prefix_hits);
    }
    registry.register("tenant_blocks", "Blocks a tenant (or shared namespace) holds in a tier", blocks);
    registry.register("tenant_bytes", "Bytes a tenant holds in a tier", bytes);
    registry.register("tenant_reserved_bytes", "Bytes of a tier reserved for a tenant (whole blocks per shard)", reserved);
    registry.register("tenant_limit_bytes", "Most bytes a tenant may hold in a tier (the tier's size when it has no limit)", limit);
    registry.register("tenant_evictions", "Blocks of a tenant moved out of a tier, by cause (own pressure or limit; another's)", evictions);
    registry.register("tenant_hits", "GETs of a tenant answered with a block", hits);
    registry.register("tenant_misses", "GETs of a tenant that found no block", misses);
    registry.register("tenant_lookup_keys", "Keys a tenant's prefix lookups asked for", lookup_keys);
    registry.register("tenant_prefix_hits", "Of those, keys found in the prefix", prefix_hits);
    if let Some(t) = tenancy {
        let status = t.status();
        let c = |v: u64| {
            let c = Counter::<u64>::default();
            c.inc_by(v);
            c
        };
        registry.register("tenants_reloads", "Reloads of the tenants file that took effect (SIGHUP or the admin route)", c(status.reloads));
        registry.register(
            "tenants_reload_failures",
            "Reloads of the tenants file refused (the tenants in use were kept)",
            c(status.reload_failures),
        );
        registry.register(
            "tenants_unauthorized",
            "Requests and local HELLOs refused because their token (or uid) is no tenant's",
            c(t.unauthorized.load(Ordering::Relaxed)),
        );
    }
}

fn shard_counter(registry: &mut Registry, name: &str, help: &str, engine: &[ShardStats], value: fn(&ShardStats) -> u64) {
    let family = Family::<ShardLabel, Counter>::default();
    for s in engine {
        family.get_or_create(&ShardLabel { shard: s.shard.to_string() }).inc_by(value(s));
    }
    registry.register(name, help, family);
}

fn shard_gauge(registry: &mut Registry, name: &str, help: &str, engine: &[ShardStats], value: fn(&ShardStats) -> f64) {
    let family = Family::<ShardLabel, Gauge<f64, AtomicU64>>::default();
    for s in engine {
        family.get_or_create(&ShardLabel { shard: s.shard.to_string() }).set(value(s));
    }
    registry.register(name, help, family);
}

/// Registers one transport's request metrics as `kvtier_{prefix}_*`: per
/// route (summed over shards) requests, 4xx/5xx-class errors and latency
/// percentiles; per shard bytes, connections and PUT refusals.
fn register_requests(registry: &mut Registry, stats: &RequestStats, prefix: &str, what: &str, bytes: &str, refused: &str) {
    let merged = stats.merged();
    let requests = Family::<RouteLabel, Counter>::default();
    let client_errors = Family::<RouteLabel, Counter>::default();
    let server_errors = Family::<RouteLabel, Counter>::default();
    let latency = Family::<QuantileLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    for (route, r) in stats.names.iter().zip(&merged) {
        let label = RouteLabel { route: (*route).into() };
        requests.get_or_create(&label).inc_by(r.requests);
        client_errors.get_or_create(&label).inc_by(r.client_errors);
        server_errors.get_or_create(&label).inc_by(r.server_errors);
        for q in ["0.5", "0.95", "0.99"] {
            let value = if r.latency_us.is_empty() { 0 } else { r.latency_us.value_at_quantile(q.parse().expect("quantile")) };
            latency.get_or_create(&QuantileLabel { route: (*route).into(), quantile: q.into() }).set(value as i64);
        }
    }
    registry.register(format!("{prefix}_requests"), format!("{what} answered, by route"), requests);
    registry.register(
        format!("{prefix}_client_errors"),
        format!("{what} failed by the client's fault (HTTP 4xx), by route"),
        client_errors,
    );
    registry.register(
        format!("{prefix}_server_errors"),
        format!("{what} failed by the server's fault (HTTP 5xx), by route"),
        server_errors,
    );
    registry.register(format!("{prefix}_request_latency_us"), format!("{what}: latency percentiles in microseconds, by route"), latency);
    let bytes_in = Family::<ShardLabel, Counter>::default();
    let bytes_out = Family::<ShardLabel, Counter>::default();
    let open = Family::<ShardLabel, Gauge>::default();
    let accepted = Family::<ShardLabel, Counter>::default();
    let put_refusals = Family::<ShardLabel, Counter>::default();
    for (i, s) in stats.shards.iter().enumerate() {
        let label = ShardLabel { shard: i.to_string() };
        bytes_in.get_or_create(&label).inc_by(s.bytes_in.load(Ordering::Relaxed));
        bytes_out.get_or_create(&label).inc_by(s.bytes_out.load(Ordering::Relaxed));
        open.get_or_create(&label).set(s.connections_open.load(Ordering::Relaxed) as i64);
        accepted.get_or_create(&label).inc_by(s.connections_total.load(Ordering::Relaxed));
        put_refusals.get_or_create(&label).inc_by(s.put_bytes_refusals.load(Ordering::Relaxed));
    }
    registry.register(format!("{prefix}_body_bytes_in"), format!("{bytes} received"), bytes_in);
    registry.register(format!("{prefix}_body_bytes_out"), format!("{bytes} sent"), bytes_out);
    registry.register(format!("{prefix}_connections_open"), "Connections open now", open);
    registry.register(format!("{prefix}_connections_accepted"), "Connections accepted", accepted);
    registry.register(
        format!("{prefix}_put_bytes_refusals"),
        format!("{refused} because the shard held --put-inflight-mib of PUT bodies"),
        put_refusals,
    );
}

/// What `/metrics` is rendered from.
pub struct Sources<'a> {
    /// HTTP request counters.
    pub http: &'a RequestStats,
    /// The local socket's state, when it is on.
    pub local: Option<&'a crate::local::LocalShared>,
    /// Every shard's stats.
    pub engine: &'a [ShardStats],
    /// The store's geometry.
    pub geometry: &'a Geometry,
    /// The remote tier, when there is one.
    pub remote: Option<&'a dyn kvtier_engine::remote::Remote>,
    /// Each tier's health.
    pub health: &'a [TierHealth],
    /// The trace recorder's state, with `--trace-dir`.
    pub trace: Option<&'a kvtier_engine::trace::TraceStatus>,
    /// The tenants, with `--tenants`.
    pub tenancy: Option<&'a crate::tenants::Tenancy>,
}

/// Renders every metric in the Prometheus (OpenMetrics) text format.
pub fn prometheus_text(sources: &Sources<'_>) -> String {
    let Sources { http, local, engine, geometry, remote, health, trace, tenancy } = *sources;
    let mut registry = Registry::with_prefix("kvtier");
    register_tenants(&mut registry, engine, geometry.block_bytes, tenancy);
    let block = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    block.set(geometry.block_bytes as i64);
    registry.register("block_bytes", "Payload bytes of one block (fixed per store)", block);

    // HTTP, per route (summed over shards) and per shard.
    register_requests(&mut registry, http, "http", "HTTP requests", "Request body bytes", "PUTs refused with 503");
    let counter = |v: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        c
    };
    if let Some(l) = local {
        register_requests(&mut registry, &l.stats, "local", "Local-socket requests", "Block bytes", "PUT_FROM items refused OVERLOADED");
        let gauge = |v: u64| {
            let g = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
            g.set(v as i64);
            g
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        registry.register("local_registrations_open", "Buffers registered on the local socket now", gauge(load(&l.registrations_open)));
        registry.register("local_registered_bytes", "Bytes of the buffers registered now", gauge(load(&l.registered_bytes)));
        registry.register("local_registrations", "Buffers registered since start", counter(load(&l.registrations_total)));
        registry.register("local_frame_errors", "Local connections closed for a framing error", counter(load(&l.frame_errors)));
        registry.register("local_peers_refused", "Local peers refused by the SO_PEERCRED uid/gid check", counter(load(&l.peers_refused)));
        registry.register(
            "local_sigbus_caught",
            "Copies that met a client's buffer file shrunk under the server's mapping (SIGBUS caught; that registration is lost)",
            counter(crate::local::guard::faults_caught()),
        );
    }

    if let Some(t) = trace {
        let g = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        g.set(i64::from(t.recording));
        registry.register("trace_recording", "1 while the trace recorder takes records (--trace-dir), else 0", g);
        registry.register("trace_records", "Block operations recorded since start", counter(t.records));
        registry.register(
            "trace_dropped_records",
            "Records dropped since start: the trace writer's queue was full or a write failed",
            counter(t.dropped_records),
        );
        registry.register("trace_written_bytes", "Bytes written to trace files since start", counter(t.bytes_written));
    }

    registry.register(
        "dma_chunks_leaked",
        "Chunks read from the log dropped away from the shard thread that read them with no way home, their DMA buffers leaked (a bug if not 0 while serving)",
        counter(kvtier_engine::stream::dma_chunks_leaked()),
    );
    registry.register(
        "dma_chunks_sent_home",
        "Chunks read from the log for a GET forwarded from another shard, sent by that shard from the owner's DMA buffers and returned to the owner to be freed",
        counter(kvtier_engine::stream::dma_chunks_sent_home()),
    );

    // Engine, per shard.
    shard_gauge(&mut registry, "shard_blocks", "Blocks stored", engine, |s| s.blocks as f64);
    shard_gauge(&mut registry, "shard_capacity_blocks", "Blocks the shard's disk share holds", engine, |s| s.capacity_blocks as f64);
    shard_gauge(&mut registry, "shard_disk_bytes", "Bytes of segment files", engine, |s| s.disk_bytes as f64);
    shard_gauge(&mut registry, "shard_index_bytes", "Heap bytes of the index", engine, |s| s.index_bytes as f64);
    shard_gauge(&mut registry, "shard_io_in_flight", "Block reads and writes in flight", engine, |s| s.io_in_flight as f64);
    shard_gauge(&mut registry, "shard_io_queued", "Block reads and writes waiting for an I/O slot", engine, |s| s.io_queued as f64);
    shard_counter(
        &mut registry,
        "shard_io_queue_refusals",
        "Block operations refused with 503 because --io-queue-max I/Os were already waiting",
        engine,
        |s| s.io_queue_refusals,
    );
    shard_gauge(&mut registry, "shard_reactor_utilization", "Executor busy time over wall time since start", engine, |s| {
        s.reactor_utilization
    });
    shard_counter(&mut registry, "shard_puts", "Blocks stored", engine, |s| s.puts);
    shard_counter(&mut registry, "shard_gets", "Block reads", engine, |s| s.gets);
    shard_counter(&mut registry, "shard_hits", "Block reads that found the block", engine, |s| s.hits);
    shard_counter(&mut registry, "shard_misses", "Block reads that did not", engine, |s| s.misses);
    shard_counter(&mut registry, "shard_deletes", "Blocks deleted", engine, |s| s.deletes);
    shard_counter(&mut registry, "shard_corrupt_blocks", "Blocks that failed their CRC-32 and were dropped", engine, |s| s.corrupt_blocks);
    shard_counter(
        &mut registry,
        "shard_disk_full_refusals",
        "Writes refused (507) because the filesystem had no room for a new segment",
        engine,
        |s| s.disk_full_refusals,
    );
    shard_counter(&mut registry, "shard_evicted_blocks", "Blocks dropped by reclaim", engine, |s| s.evicted_blocks);
    shard_counter(&mut registry, "shard_second_chance_blocks", "Blocks kept by reclaim because they were read", engine, |s| {
        s.second_chance_blocks
    });
    shard_counter(&mut registry, "shard_reclaimed_segments", "Segments reclaimed", engine, |s| s.reclaimed_segments);
    shard_counter(&mut registry, "shard_bytes_read", "Bytes read from segments", engine, |s| s.bytes_read);
    shard_counter(&mut registry, "shard_bytes_written", "Bytes written to segments", engine, |s| s.bytes_written);
    shard_counter(&mut registry, "shard_forwarded_requests", "Operations sent to the shard owning the key", engine, |s| {
        s.forwarded_requests
    });
    shard_counter(&mut registry, "shard_transit_hits", "GETs served from a block on its way into a memory tier", engine, |s| {
        s.transit_hits
    });
    let io_latency = Family::<ShardQuantileLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    let io_write = Family::<ShardQuantileLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    for s in engine {
        for (q, r, w) in [("0.5", s.read_us_p50, s.write_us_p50), ("0.99", s.read_us_p99, s.write_us_p99)] {
            let label = ShardQuantileLabel { shard: s.shard.to_string(), quantile: q.into() };
            io_latency.get_or_create(&label).set(r as i64);
            io_write.get_or_create(&label).set(w as i64);
        }
    }
    registry.register("shard_read_latency_us", "Block read latency percentiles in microseconds", io_latency);
    registry.register("shard_write_latency_us", "Block write latency percentiles in microseconds", io_write);

    // Per tier, summed over shards.
    let tiers = kvtier_engine::shard::tier_totals(engine);
    type TierField = fn(&kvtier_engine::TierStats) -> u64;
    let gauges: [(&str, &str, TierField); 2] = [
        ("tier_capacity_blocks", "Blocks the tier can hold", |t| t.capacity_blocks),
        ("tier_used_blocks", "Blocks the tier holds", |t| t.used_blocks),
    ];
    for (name, help, f) in gauges {
        let family = Family::<TierLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
        for t in &tiers {
            family.get_or_create(&TierLabel { tier: t.tier.as_str().into() }).set(f(t) as i64);
        }
        registry.register(name, help, family);
    }
    let counters: [(&str, &str, TierField); 7] = [
        ("tier_hits", "Reads the tier served", |t| t.hits),
        ("tier_misses", "Reads that looked in the tier and went on", |t| t.misses),
        ("tier_promotions", "Blocks moved up into the tier", |t| t.promotions),
        ("tier_demotions", "Blocks moved down out of the tier", |t| t.demotions),
        ("tier_evictions", "Blocks that left the store from the tier", |t| t.evictions),
        ("tier_bytes_in", "Block bytes written into the tier", |t| t.bytes_in),
        ("tier_bytes_out", "Block bytes served from the tier", |t| t.bytes_out),
    ];
    for (name, help, f) in counters {
        let family = Family::<TierLabel, Counter>::default();
        for t in &tiers {
            family.get_or_create(&TierLabel { tier: t.tier.as_str().into() }).inc_by(f(t));
        }
        registry.register(name, help, family);
    }
    let tier_latency = Family::<TierOpQuantileLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    for t in &tiers {
        for (op, q, v) in [
            ("read", "0.5", t.read_us_p50),
            ("read", "0.99", t.read_us_p99),
            ("write", "0.5", t.write_us_p50),
            ("write", "0.99", t.write_us_p99),
        ] {
            tier_latency
                .get_or_create(&TierOpQuantileLabel { tier: t.tier.as_str().into(), op: op.into(), quantile: q.into() })
                .set(v as i64);
        }
    }
    registry.register("tier_latency_us", "Tier read and write latency percentiles in microseconds (largest shard's)", tier_latency);
    if let Some(remote) = remote {
        remote.register_metrics(&mut registry);
    }
    register_health(&mut registry, health);
    crate::gpu::register_metrics(&mut registry, &tiers);

    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String cannot fail");
    out
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierKindLabel {
    tier: String,
    kind: String,
}

/// `kvtier_tier_up{tier}` (1 unless down), `kvtier_tier_degraded{tier}` (1
/// when degraded) and `kvtier_tier_errors_total{tier,kind}`, from the health
/// table ([`kvtier_engine::health`]).
fn register_health(registry: &mut Registry, health: &[TierHealth]) {
    let up = Family::<TierLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    let degraded = Family::<TierLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    let errors = Family::<TierKindLabel, Counter>::default();
    for h in health {
        let label = TierLabel { tier: h.tier.clone() };
        up.get_or_create(&label).set((h.state != HealthState::Down) as i64);
        degraded.get_or_create(&label).set((h.state == HealthState::Degraded) as i64);
        for (kind, n) in &h.errors {
            errors.get_or_create(&TierKindLabel { tier: h.tier.clone(), kind: kind.clone() }).inc_by(*n);
        }
    }
    registry.register("tier_up", "1 while the tier serves (ok or degraded), 0 while it is down", up);
    registry.register("tier_degraded", "1 while the tier is degraded (recent errors or a standing condition)", degraded);
    registry.register("tier_errors", "Errors each tier met since start, by kind", errors);
}
