//! Metrics: the front doors' request counters ([`RequestStats`]) and the
//! rendering of every part's counters as `/v1/stats` JSON (`stats.rs`) and
//! Prometheus text (`GET /metrics`, through prometheus-client:
//! `prometheus.rs`). Each front door exposes its counters as a [`Door`];
//! nothing here knows a door.
//!
//! Each scrape builds its own Prometheus registry ([`Metrics::render`]),
//! whose one collector reads the request counters (lock-free atomics each
//! shard records into) and the engine's per-shard stats the scrape fetched:
//! no lock a shard could wait on.
//! Latencies are histograms (`_bucket`/`_sum`/`_count`, seconds, buckets
//! from 10 µs to 10 s: [`kvtier_engine::latency`]), which sum across
//! shards and instances; `/v1/stats` keeps percentiles. Metric names follow
//! `kvtier_<layer>_<what>` (docs/API.md).

mod prometheus;
mod requests;
mod stats;

pub use prometheus::openmetrics_to_text_0_0_4;
pub use requests::{DurationLabel, RequestStats, ShardRequestStats};
pub use stats::owners_json;

use std::sync::Arc;

use kvtier_engine::health::TierHealth;
use kvtier_engine::latency::{HistogramFamily, Scrape};
use kvtier_engine::{Geometry, ShardStats};
use serde_json::Value;

/// The latencies of every front door: one histogram per door and route,
/// `kvtier_request_duration_seconds{transport,route}`.
pub type Durations = HistogramFamily<DurationLabel>;

/// A front door's part of `/metrics` and `/v1/stats`. Each door exposes
/// its counters through this, so the rendering reads them without knowing
/// the door: a new door adds one implementation and touches no other.
pub trait Door: Send + Sync {
    /// Its name: its key in `/v1/stats` and its `transport` label.
    fn name(&self) -> &'static str;
    /// PUTs it refused for the shard's PUT budget (summed in `/v1/stats`
    /// totals with every other door's).
    fn put_bytes_refusals(&self) -> u64;
    /// Writes its `kvtier_{name}_*` series, and its latencies into
    /// `durations`.
    fn write_metrics(&self, registry: &mut Scrape<'_>, durations: &mut Durations);
    /// Its `/v1/stats` object.
    fn stats_json(&self) -> Value;
}

/// The engine's state for one scrape, fetched by the route that serves it.
pub struct EngineSnapshot {
    /// Every shard's stats.
    pub engine: Vec<ShardStats>,
    /// Each tier's health.
    pub health: Vec<TierHealth>,
    /// The trace recorder's state, with `--trace-dir`.
    pub trace: Option<kvtier_engine::trace::TraceStatus>,
    /// Each device's state ([`kvtier_engine::devices`]).
    pub devices: Vec<kvtier_engine::devices::DeviceStats>,
}

/// What lives as long as the server and is read at each scrape.
pub struct Parts {
    /// The front doors, in the order they are shown.
    pub doors: Vec<Arc<dyn Door>>,
    /// The store's geometry.
    pub geometry: Geometry,
    /// The remote tier, when there is one.
    pub remote: Option<Arc<dyn kvtier_engine::remote::Remote>>,
    /// The tenants, with `--tenants`.
    pub tenancy: Option<Arc<crate::tenants::Tenancy>>,
    /// The shards' stall counters, unless `--stall-threshold-ms 0`: read
    /// here, not through the shards, so a stalled shard's are shown too.
    pub stalls: Option<Arc<kvtier_engine::stall::Stalls>>,
}

/// The process's metrics: the parts every scrape reads, built once at start
/// and shared by every shard; [`Metrics::render`] encodes them for one
/// scrape. Nothing here is locked: each scrape builds its own registry over
/// its own snapshot, so scrapes on several shards at once never wait for
/// each other (a shared registry's lock held one shard for 0.8 s while
/// another encoded).
pub struct Metrics {
    parts: Arc<Parts>,
}

/// The collector of one scrape's registry: the process's parts and the
/// engine's snapshot that scrape fetched.
struct Collector {
    parts: Arc<Parts>,
    snapshot: EngineSnapshot,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("kvtier metrics collector")
    }
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        let mut scrape = Scrape::new(encoder);
        prometheus::write_metrics(&mut scrape, &self.parts, &self.snapshot);
        scrape.finish()
    }
}

impl Metrics {
    /// The metrics over `parts`.
    pub fn new(parts: Parts) -> Arc<Self> {
        Arc::new(Metrics { parts: Arc::new(parts) })
    }

    /// The parts every scrape reads.
    pub fn parts(&self) -> &Parts {
        &self.parts
    }

    /// Every metric in the Prometheus (OpenMetrics) text format, the
    /// engine's as in `snapshot`, through a registry (prefix `kvtier`) of
    /// this scrape's own.
    pub fn render(&self, snapshot: EngineSnapshot) -> String {
        let mut registry = prometheus_client::registry::Registry::with_prefix("kvtier");
        registry.register_collector(Box::new(Collector { parts: self.parts.clone(), snapshot }));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String cannot fail");
        out
    }
}
