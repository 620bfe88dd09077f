//! Request counters of one front door (HTTP or the same-host socket): per
//! shard and route, counts, 4xx/5xx-class errors and latencies, plus body
//! bytes, connections and PUT refusals per shard.
//!
//! Recording is lock-free: a shard adds to its own counters with relaxed
//! atomic adds (and a lock-free log-linear histogram for the percentiles
//! of `/v1/stats`), so a scrape on another shard, which reads and merges
//! every shard's counters, never holds anything a request waits for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvtier_engine::latency::{AtomicLatencyBuckets, HistogramFamily, LatencyBuckets, Scrape};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{json, Value};

/// Grouping power of the percentile histograms: 2^7 buckets per power of
/// two, a relative error under 0.8 % (hdrhistogram's 2 significant digits).
const GROUPING_POWER: u8 = 7;
/// Largest latency the percentile histograms hold: 2^30 µs (about 18
/// minutes); longer ones count as that.
const MAX_VALUE_POWER: u8 = 30;

/// One route's counters on one shard.
struct RouteCell {
    requests: AtomicU64,
    client_errors: AtomicU64,
    server_errors: AtomicU64,
    /// Prometheus buckets (exact counts per bucket, sum in µs).
    buckets: AtomicLatencyBuckets,
    /// For the percentiles of `/v1/stats` (about 24 KiB per route).
    percentiles: histogram::AtomicHistogram,
}

impl RouteCell {
    fn new() -> Self {
        RouteCell {
            requests: AtomicU64::new(0),
            client_errors: AtomicU64::new(0),
            server_errors: AtomicU64::new(0),
            buckets: AtomicLatencyBuckets::default(),
            percentiles: histogram::AtomicHistogram::new(GROUPING_POWER, MAX_VALUE_POWER).expect("valid histogram configuration"),
        }
    }
}

/// One shard's request counters.
pub struct ShardRequestStats {
    routes: Vec<RouteCell>,
    /// Request body bytes received (declared Content-Length of requests).
    pub bytes_in: AtomicU64,
    /// Response body bytes sent.
    pub bytes_out: AtomicU64,
    /// Connections open now.
    pub connections_open: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// PUTs refused because the shard's PUT bytes in flight were at
    /// `--put-inflight-mib` (HTTP: 503; the socket: `OVERLOADED`).
    pub put_bytes_refusals: AtomicU64,
}

/// Every shard's request counters of one front door.
pub struct RequestStats {
    names: &'static [&'static str],
    shards: Vec<ShardRequestStats>,
}

/// A route's counters summed over shards.
struct Merged {
    requests: u64,
    client_errors: u64,
    server_errors: u64,
    buckets: LatencyBuckets,
    percentiles: histogram::Histogram,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: String,
}

impl RequestStats {
    /// Counters for `shards` shards and the routes `names` (indexed as
    /// [`RequestStats::record`]'s `route`): the HTTP routes' names for
    /// HTTP, the local socket's ops for it.
    pub fn new(shards: usize, names: &'static [&'static str]) -> Arc<Self> {
        Arc::new(RequestStats {
            names,
            shards: (0..shards)
                .map(|_| ShardRequestStats {
                    routes: names.iter().map(|_| RouteCell::new()).collect(),
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
    /// equivalent (4xx the client's fault, 5xx the server's). Lock-free.
    pub fn record(&self, shard: usize, route: usize, status: u16, latency_us: u64, bytes_in: u64, bytes_out: u64) {
        let s = &self.shards[shard];
        s.bytes_in.fetch_add(bytes_in, Ordering::Relaxed);
        s.bytes_out.fetch_add(bytes_out, Ordering::Relaxed);
        let r = &s.routes[route];
        r.requests.fetch_add(1, Ordering::Relaxed);
        match status {
            400..=499 => r.client_errors.fetch_add(1, Ordering::Relaxed),
            500..=599 => r.server_errors.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        let us = latency_us.max(1);
        r.buckets.record(us);
        let _ = r.percentiles.increment(us.min((1 << MAX_VALUE_POWER) - 1));
    }

    /// Counters of each route summed over shards.
    fn merged(&self) -> Vec<Merged> {
        let mut total: Vec<Merged> = self
            .names
            .iter()
            .map(|_| Merged {
                requests: 0,
                client_errors: 0,
                server_errors: 0,
                buckets: LatencyBuckets::default(),
                percentiles: histogram::Histogram::new(GROUPING_POWER, MAX_VALUE_POWER).expect("valid histogram configuration"),
            })
            .collect();
        for s in &self.shards {
            for (t, r) in total.iter_mut().zip(&s.routes) {
                t.requests += r.requests.load(Ordering::Relaxed);
                t.client_errors += r.client_errors.load(Ordering::Relaxed);
                t.server_errors += r.server_errors.load(Ordering::Relaxed);
                t.buckets.add(&r.buckets.load());
                t.percentiles = t.percentiles.wrapping_add(&r.percentiles.load()).expect("same configuration");
            }
        }
        total
    }

    /// Per-route JSON for `/v1/stats`: requests, errors, latency
    /// percentiles in µs (the upper end of the bucket holding the
    /// percentile, within 0.8 %; 0 before any request).
    pub fn routes_json(&self) -> Value {
        let merged = self.merged();
        let mut out = serde_json::Map::new();
        for (route, r) in self.names.iter().zip(&merged) {
            let q = |p: f64| r.percentiles.quantile_bucket(p).ok().flatten().map_or(0, |b| b.end());
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
                let requests: u64 = s.routes.iter().map(|r| r.requests.load(Ordering::Relaxed)).sum();
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

    /// Writes this front door's metrics as `kvtier_{transport}_*`: per route
    /// (summed over shards) requests and 4xx/5xx-class errors; per shard
    /// bytes, connections and PUT refusals. Latency goes to `durations`,
    /// the one `kvtier_request_duration_seconds` family of every transport.
    pub fn write_metrics(
        &self,
        registry: &mut Scrape<'_>,
        durations: &mut HistogramFamily<DurationLabel>,
        transport: &'static str,
        what: &str,
        bytes: &str,
        refused: &str,
    ) {
        let merged = self.merged();
        let requests = Family::<RouteLabel, Counter>::default();
        let client_errors = Family::<RouteLabel, Counter>::default();
        let server_errors = Family::<RouteLabel, Counter>::default();
        for (route, r) in self.names.iter().zip(merged) {
            let label = RouteLabel { route: (*route).into() };
            requests.get_or_create(&label).inc_by(r.requests);
            client_errors.get_or_create(&label).inc_by(r.client_errors);
            server_errors.get_or_create(&label).inc_by(r.server_errors);
            durations.series.push(((transport, *route).into(), r.buckets));
        }
        registry.register(format!("{transport}_requests"), format!("{what} answered, by route"), requests);
        registry.register(
            format!("{transport}_client_errors"),
            format!("{what} failed by the client's fault (HTTP 4xx), by route"),
            client_errors,
        );
        registry.register(
            format!("{transport}_server_errors"),
            format!("{what} failed by the server's fault (HTTP 5xx), by route"),
            server_errors,
        );
        let bytes_in = Family::<ShardLabel, Counter>::default();
        let bytes_out = Family::<ShardLabel, Counter>::default();
        let open = Family::<ShardLabel, Gauge>::default();
        let accepted = Family::<ShardLabel, Counter>::default();
        let put_refusals = Family::<ShardLabel, Counter>::default();
        for (i, s) in self.shards.iter().enumerate() {
            let label = ShardLabel { shard: i.to_string() };
            bytes_in.get_or_create(&label).inc_by(s.bytes_in.load(Ordering::Relaxed));
            bytes_out.get_or_create(&label).inc_by(s.bytes_out.load(Ordering::Relaxed));
            open.get_or_create(&label).set(s.connections_open.load(Ordering::Relaxed) as i64);
            accepted.get_or_create(&label).inc_by(s.connections_total.load(Ordering::Relaxed));
            put_refusals.get_or_create(&label).inc_by(s.put_bytes_refusals.load(Ordering::Relaxed));
        }
        registry.register(format!("{transport}_body_bytes_in"), format!("{bytes} received"), bytes_in);
        registry.register(format!("{transport}_body_bytes_out"), format!("{bytes} sent"), bytes_out);
        registry.register(format!("{transport}_connections_open"), "Connections open now", open);
        registry.register(format!("{transport}_connections_accepted"), "Connections accepted", accepted);
        registry.register(
            format!("{transport}_put_bytes_refusals"),
            format!("{refused} because the shard held --put-inflight-mib of PUT bodies"),
            put_refusals,
        );
    }
}

/// Labels of `kvtier_request_duration_seconds`: the front door and its route.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DurationLabel {
    transport: String,
    route: String,
}

impl From<(&'static str, &'static str)> for DurationLabel {
    fn from((transport, route): (&'static str, &'static str)) -> Self {
        DurationLabel { transport: transport.into(), route: route.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_merge_over_shards_into_counts_buckets_and_percentiles() {
        let stats = RequestStats::new(2, &["get", "put"]);
        for us in 1..=100 {
            stats.record((us % 2) as usize, 0, 200, us, 10, 20);
        }
        stats.record(1, 1, 404, 50, 0, 0);
        stats.record(0, 1, 503, 20_000_000, 0, 0);
        let merged = stats.merged();
        assert_eq!((merged[0].requests, merged[0].buckets.count(), merged[0].buckets.sum_us), (100, 100, 5050));
        assert_eq!((merged[1].client_errors, merged[1].server_errors), (1, 1));
        // Beyond the last finite bound (10 s): the +Inf bucket.
        assert_eq!(merged[1].buckets.counts[kvtier_engine::latency::BUCKETS - 1], 1);
        let json = stats.routes_json();
        let p50 = json["get"]["latency_us_p50"].as_u64().unwrap();
        assert!((50..=51).contains(&p50), "p50 {p50}");
        assert_eq!(json["get"]["latency_us_p99"].as_u64().unwrap(), 99);
        assert_eq!(stats.shards_json()[0]["bytes_in"], 500);
    }
}
