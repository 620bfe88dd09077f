//! Metrics: the front doors' request counters ([`requests`]) and the
//! rendering of every part's counters as `/v1/stats` JSON and Prometheus
//! text (`GET /metrics`, through prometheus-client).
//!
//! The Prometheus registry is built once ([`Metrics::new`]); one collector
//! reads, at each scrape, the request counters (lock-free atomics each
//! shard records into) and the engine's per-shard stats the scrape fetched.
//! Latencies are histograms (`_bucket`/`_sum`/`_count`, seconds, buckets
//! from 10 µs to 10 s: [`kvtier_engine::latency`]), which sum across
//! shards and instances; `/v1/stats` keeps percentiles. Metric names follow
//! `kvtier_<layer>_<what>` (docs/API.md).

mod requests;

pub use requests::{RequestStats, ShardRequestStats};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvtier_engine::health::{HealthState, TierHealth};
use kvtier_engine::latency::{HistogramFamily, Scrape};
use kvtier_engine::{Geometry, ShardStats};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierOpLabel {
    tier: String,
    op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: String,
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
fn register_tenants(registry: &mut Scrape<'_>, engine: &[ShardStats], block_bytes: u64, tenancy: Option<&crate::tenants::Tenancy>) {
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

fn shard_counter(registry: &mut Scrape<'_>, name: &str, help: &str, engine: &[ShardStats], value: fn(&ShardStats) -> u64) {
    let family = Family::<ShardLabel, Counter>::default();
    for s in engine {
        family.get_or_create(&ShardLabel { shard: s.shard.to_string() }).inc_by(value(s));
    }
    registry.register(name, help, family);
}

fn shard_gauge(registry: &mut Scrape<'_>, name: &str, help: &str, engine: &[ShardStats], value: fn(&ShardStats) -> f64) {
    let family = Family::<ShardLabel, Gauge<f64, AtomicU64>>::default();
    for s in engine {
        family.get_or_create(&ShardLabel { shard: s.shard.to_string() }).set(value(s));
    }
    registry.register(name, help, family);
}

/// The engine's state for one scrape, fetched by the route that serves it.
pub struct EngineSnapshot {
    /// Every shard's stats.
    pub engine: Vec<ShardStats>,
    /// Each tier's health.
    pub health: Vec<TierHealth>,
    /// The trace recorder's state, with `--trace-dir`.
    pub trace: Option<kvtier_engine::trace::TraceStatus>,
}

/// What lives as long as the server and is read at each scrape.
pub struct Parts {
    /// HTTP request counters.
    pub http: Arc<RequestStats>,
    /// The local socket's state, when it is on.
    pub local: Option<Arc<crate::local::LocalShared>>,
    /// The store's geometry.
    pub geometry: Geometry,
    /// The remote tier, when there is one.
    pub remote: Option<Arc<dyn kvtier_engine::remote::Remote>>,
    /// The tenants, with `--tenants`.
    pub tenancy: Option<Arc<crate::tenants::Tenancy>>,
}

/// The process's Prometheus registry, built once at start and shared by
/// every shard: [`Metrics::render`] encodes it for one scrape.
pub struct Metrics {
    registry: prometheus_client::registry::Registry,
    collector: Arc<Collector>,
}

/// The one collector in [`Metrics`]'s registry: reads [`Parts`] and the
/// snapshot of the scrape being encoded.
struct Collector {
    parts: Parts,
    /// Set for the duration of one [`Metrics::render`]; the lock is taken
    /// by scrapes only, never on the request path.
    snapshot: Mutex<Option<EngineSnapshot>>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("kvtier metrics collector")
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let snapshot = self.snapshot.lock().expect("metrics snapshot lock");
        let Some(snapshot) = snapshot.as_ref() else { return Ok(()) };
        let mut scrape = Scrape::new(encoder);
        write_metrics(&mut scrape, &self.parts, snapshot);
        scrape.finish()
    }
}

impl Metrics {
    /// The registry (prefix `kvtier`) with its collector over `parts`.
    pub fn new(parts: Parts) -> Arc<Self> {
        let collector = Arc::new(Collector { parts, snapshot: Mutex::new(None) });
        let mut registry = prometheus_client::registry::Registry::with_prefix("kvtier");
        registry.register_collector(Box::new(collector.clone()));
        Arc::new(Metrics { registry, collector })
    }

    /// The parts the registry reads.
    pub fn parts(&self) -> &Parts {
        &self.collector.parts
    }

    /// Every metric in the Prometheus (OpenMetrics) text format, the
    /// engine's as in `snapshot`. Scrapes on several shards at once are
    /// encoded one after the other.
    pub fn render(&self, snapshot: EngineSnapshot) -> String {
        // Held across the encode: a concurrent scrape waits here, not on
        // a request's counters.
        let mut slot = self.collector.snapshot.lock().expect("metrics snapshot lock");
        *slot = Some(snapshot);
        drop(slot);
        let mut out = String::new();
        let encoded = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        *self.collector.snapshot.lock().expect("metrics snapshot lock") = None;
        encoded.expect("writing to a String cannot fail");
        out
    }
}

/// The same metrics in Prometheus' text exposition format 0.0.4, from
/// prometheus-client's OpenMetrics text (which is all it writes). The two
/// differ, for what kvtier exports, only in metadata: OpenMetrics names a
/// counter family without its `_total` suffix in `# HELP` and `# TYPE`
/// (0.0.4 names the sample, `_total` included), and ends with `# EOF`
/// (0.0.4 has no end marker; `# UNIT` lines do not exist there). Samples,
/// labels and histogram series are written alike by both.
pub fn openmetrics_to_text_0_0_4(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Writes every metric of one scrape.
fn write_metrics(registry: &mut Scrape<'_>, parts: &Parts, snapshot: &EngineSnapshot) {
    let Parts { http, local, geometry, remote, tenancy } = parts;
    let EngineSnapshot { engine, health, trace } = snapshot;
    register_tenants(registry, engine, geometry.block_bytes, tenancy.as_deref());
    let block = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    block.set(geometry.block_bytes as i64);
    registry.register("block_bytes", "Payload bytes of one block (fixed per store)", block);

    // Each front door, per route (summed over shards) and per shard; the
    // latencies of both in one family.
    let mut durations = HistogramFamily::<requests::DurationLabel>::default();
    http.write_metrics(registry, &mut durations, "http", "HTTP requests", "Request body bytes", "PUTs refused with 503");
    let counter = |v: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        c
    };
    if let Some(l) = local {
        l.stats.write_metrics(
            registry,
            &mut durations,
            "local",
            "Local-socket requests",
            "Block bytes",
            "PUT_FROM items refused OVERLOADED",
        );
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
    shard_gauge(registry, "shard_blocks", "Blocks stored", engine, |s| s.blocks as f64);
    shard_gauge(registry, "shard_capacity_blocks", "Blocks the shard's disk share holds", engine, |s| s.capacity_blocks as f64);
    shard_gauge(registry, "shard_disk_bytes", "Bytes of segment files", engine, |s| s.disk_bytes as f64);
    shard_gauge(registry, "shard_index_bytes", "Heap bytes of the index", engine, |s| s.index_bytes as f64);
    shard_gauge(registry, "shard_io_in_flight", "Block reads and writes in flight", engine, |s| s.io_in_flight as f64);
    shard_gauge(registry, "shard_io_queued", "Block reads and writes waiting for an I/O slot", engine, |s| s.io_queued as f64);
    shard_counter(
        registry,
        "shard_io_queue_refusals",
        "Block operations refused with 503 because --io-queue-max I/Os were already waiting",
        engine,
        |s| s.io_queue_refusals,
    );
    shard_gauge(registry, "shard_reactor_utilization", "Executor busy time over wall time since start", engine, |s| s.reactor_utilization);
    shard_counter(registry, "shard_puts", "Blocks stored", engine, |s| s.puts);
    shard_counter(registry, "shard_gets", "Block reads", engine, |s| s.gets);
    shard_counter(registry, "shard_hits", "Block reads that found the block", engine, |s| s.hits);
    shard_counter(registry, "shard_misses", "Block reads that did not", engine, |s| s.misses);
    shard_counter(registry, "shard_deletes", "Blocks deleted", engine, |s| s.deletes);
    shard_counter(registry, "shard_corrupt_blocks", "Blocks that failed their CRC-32 and were dropped", engine, |s| s.corrupt_blocks);
    shard_counter(
        registry,
        "shard_disk_full_refusals",
        "Writes refused (507) because the filesystem had no room for a new segment",
        engine,
        |s| s.disk_full_refusals,
    );
    shard_counter(registry, "shard_evicted_blocks", "Blocks dropped by reclaim", engine, |s| s.evicted_blocks);
    shard_counter(registry, "shard_second_chance_blocks", "Blocks kept by reclaim because they were read", engine, |s| {
        s.second_chance_blocks
    });
    shard_counter(registry, "shard_reclaimed_segments", "Segments reclaimed", engine, |s| s.reclaimed_segments);
    shard_counter(registry, "shard_bytes_read", "Bytes read from segments", engine, |s| s.bytes_read);
    shard_counter(registry, "shard_bytes_written", "Bytes written to segments", engine, |s| s.bytes_written);
    shard_counter(registry, "shard_forwarded_requests", "Operations sent to the shard owning the key", engine, |s| s.forwarded_requests);
    shard_counter(registry, "shard_transit_hits", "GETs served from a block on its way into a memory tier", engine, |s| s.transit_hits);
    registry.register(
        "request_duration_seconds",
        "Time from a request's arrival to its answer, in seconds, by front door (http, local) and route",
        durations,
    );

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
    let mut tier_latency = HistogramFamily::default();
    for t in &tiers {
        for (op, buckets) in [("read", &t.read_latency), ("write", &t.write_latency)] {
            tier_latency.series.push((TierOpLabel { tier: t.tier.as_str().into(), op: op.into() }, buckets.clone()));
        }
    }
    registry.register(
        "tier_service_duration_seconds",
        "Engine-side time of a tier's block reads and writes, in seconds, summed over shards",
        tier_latency,
    );
    if let Some(remote) = remote {
        remote.register_metrics(registry);
    }
    register_health(registry, health);
    crate::gpu::register_metrics(registry, &tiers);
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierKindLabel {
    tier: String,
    kind: String,
}

/// `kvtier_tier_up{tier}` (1 unless down), `kvtier_tier_degraded{tier}` (1
/// when degraded) and `kvtier_tier_errors_total{tier,kind}`, from the health
/// table ([`kvtier_engine::health`]).
fn register_health(registry: &mut Scrape<'_>, health: &[TierHealth]) {
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
