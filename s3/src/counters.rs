//! The shared tier's counters and latency histograms, one set per owning
//! shard, and how `/v1/stats` (`s3`) and `/metrics` (`kvtier_s3_*`) show
//! them. Atomics: uploads finish on the S3 runtime's threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use hdrhistogram::Histogram;
use kvtier_engine::latency::{AtomicLatencyBuckets, HistogramFamily, LatencyBuckets, Scrape};
use serde_json::{json, Value};

/// Counters of one shard's use of the shared tier. Atomics: uploads finish
/// on the runtime's threads.
#[derive(Default)]
pub(crate) struct Counters {
    /// Write-behind uploads handed to the queue and not yet in flight
    /// (for the drain at stop; the `uploads_queued` gauge is the channel's
    /// length, exact).
    pub uploads_pending: AtomicU64,
    pub uploads_queued_max: AtomicU64,
    pub uploads_inflight: AtomicU64,
    pub uploads_done: AtomicU64,
    pub uploads_present: AtomicU64,
    pub uploads_dropped: AtomicU64,
    pub uploads_failed: AtomicU64,
    pub upload_bytes: AtomicU64,
    pub reads: AtomicU64,
    pub read_hits: AtomicU64,
    pub read_misses: AtomicU64,
    pub read_errors: AtomicU64,
    pub read_corrupt: AtomicU64,
    pub read_bytes: AtomicU64,
    pub reads_joined: AtomicU64,
    pub installs: AtomicU64,
    pub install_failures: AtomicU64,
    pub install_superseded: AtomicU64,
    pub exists_checks: AtomicU64,
    pub exists_errors: AtomicU64,
    pub presence_cache_hits: AtomicU64,
    pub prefetched: AtomicU64,
    pub deletes: AtomicU64,
    pub delete_errors: AtomicU64,
    pub timeouts: AtomicU64,
    pub skipped_down: AtomicU64,
}

pub(crate) fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 2).expect("histogram bounds are valid")
}

/// Latencies of one kind of S3 operation on one shard, in µs: percentiles
/// for `/v1/stats`, Prometheus buckets for `/metrics`.
pub(crate) struct OpLatency {
    pub hdr: Mutex<Histogram<u64>>,
    pub buckets: AtomicLatencyBuckets,
}

impl OpLatency {
    fn new() -> Self {
        OpLatency { hdr: Mutex::new(latency_histogram()), buckets: AtomicLatencyBuckets::default() }
    }
}

/// One shard's counters and latency histograms (µs).
pub(crate) struct ShardCounters {
    pub c: Counters,
    pub read_us: OpLatency,
    pub upload_us: OpLatency,
    pub exists_us: OpLatency,
}

impl ShardCounters {
    pub(crate) fn new() -> Self {
        ShardCounters { c: Counters::default(), read_us: OpLatency::new(), upload_us: OpLatency::new(), exists_us: OpLatency::new() }
    }
}

/// Records the time since `since` (at least 1 µs).
pub(crate) fn record(h: &OpLatency, since: Instant) {
    let us = since.elapsed().as_micros().max(1) as u64;
    h.buckets.record(us);
    let _ = h.hdr.lock().expect("histogram lock").record(us);
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ShardLabel {
    shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct OpLabel {
    op: String,
}

pub(crate) fn shard_json(i: usize, s: &ShardCounters, queued: u64) -> Value {
    let c = &s.c;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let pct = |h: &OpLatency, q: f64| {
        let h = h.hdr.lock().expect("histogram lock");
        if h.is_empty() {
            0
        } else {
            h.value_at_quantile(q)
        }
    };
    json!({
        "shard": i,
        "uploads_queued": queued,
        "uploads_unfinished": g(&c.uploads_pending) + g(&c.uploads_inflight),
        "uploads_queued_max": g(&c.uploads_queued_max),
        "uploads_inflight": g(&c.uploads_inflight),
        "uploads_done": g(&c.uploads_done),
        "uploads_present": g(&c.uploads_present),
        "uploads_dropped": g(&c.uploads_dropped),
        "uploads_failed": g(&c.uploads_failed),
        "upload_bytes": g(&c.upload_bytes),
        "reads": g(&c.reads),
        "read_hits": g(&c.read_hits),
        "read_misses": g(&c.read_misses),
        "read_errors": g(&c.read_errors),
        "read_corrupt": g(&c.read_corrupt),
        "read_bytes": g(&c.read_bytes),
        "reads_joined": g(&c.reads_joined),
        "installs": g(&c.installs),
        "install_failures": g(&c.install_failures),
        "install_superseded": g(&c.install_superseded),
        "exists_checks": g(&c.exists_checks),
        "exists_errors": g(&c.exists_errors),
        "presence_cache_hits": g(&c.presence_cache_hits),
        "prefetched": g(&c.prefetched),
        "deletes": g(&c.deletes),
        "delete_errors": g(&c.delete_errors),
        "timeouts": g(&c.timeouts),
        "skipped_down": g(&c.skipped_down),
        "read_us_p50": pct(&s.read_us, 0.5),
        "read_us_p99": pct(&s.read_us, 0.99),
        "upload_us_p50": pct(&s.upload_us, 0.5),
        "upload_us_p99": pct(&s.upload_us, 0.99),
        "exists_us_p50": pct(&s.exists_us, 0.5),
        "exists_us_p99": pct(&s.exists_us, 0.99),
    })
}

/// `totals` of `/v1/stats` `"s3"`: every shard's counters summed; latency
/// percentiles and maxima are the largest shard's.
pub(crate) fn totals(per_shard: &[Value]) -> Value {
    let mut totals = serde_json::Map::new();
    for s in per_shard {
        for (k, v) in s.as_object().expect("object") {
            if k == "shard" {
                continue;
            }
            let n = v.as_u64().unwrap_or(0);
            let entry = totals.entry(k.clone()).or_insert(json!(0));
            let merged = if k.ends_with("_us_p50") || k.ends_with("_us_p99") || k.ends_with("_max") {
                entry.as_u64().unwrap_or(0).max(n)
            } else {
                entry.as_u64().unwrap_or(0) + n
            };
            *entry = json!(merged);
        }
    }
    Value::Object(totals)
}

/// Writes the `kvtier_s3_*` metrics (per shard) of `shards` into a
/// scrape; `queued(i)` is shard `i`'s write-behind queue length now.
pub(crate) fn register_metrics(shards: &[std::sync::Arc<ShardCounters>], queued: &dyn Fn(usize) -> u64, registry: &mut Scrape<'_>) {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    type Field = fn(&Counters) -> &AtomicU64;
    let queued_family = Family::<ShardLabel, Gauge>::default();
    for i in 0..shards.len() {
        queued_family.get_or_create(&ShardLabel { shard: i.to_string() }).set(queued(i) as i64);
    }
    registry.register("s3_uploads_queued", "Uploads waiting in the write-behind queue", queued_family);
    let gauges: [(&str, &str, Field); 2] = [
        ("s3_uploads_queued_max", "Most uploads the write-behind queue held at once since start", |c| &c.uploads_queued_max),
        ("s3_uploads_inflight", "Uploads in flight", |c| &c.uploads_inflight),
    ];
    for (name, help, f) in gauges {
        let family = Family::<ShardLabel, Gauge>::default();
        for (i, s) in shards.iter().enumerate() {
            family.get_or_create(&ShardLabel { shard: i.to_string() }).set(f(&s.c).load(Ordering::Relaxed) as i64);
        }
        registry.register(name, help, family);
    }
    let counters: [(&str, &str, Field); 22] = [
        ("s3_uploads_done", "Blocks uploaded", |c| &c.uploads_done),
        ("s3_uploads_present", "Uploads not needed: the object was already there", |c| &c.uploads_present),
        ("s3_uploads_dropped", "Write-behind uploads dropped because the queue was full", |c| &c.uploads_dropped),
        ("s3_uploads_failed", "Uploads that failed or timed out", |c| &c.uploads_failed),
        ("s3_upload_bytes", "Object bytes uploaded", |c| &c.upload_bytes),
        ("s3_reads", "Local misses looked up in S3", |c| &c.reads),
        ("s3_read_hits", "S3 reads that returned a valid block", |c| &c.read_hits),
        ("s3_read_misses", "S3 reads that found no object", |c| &c.read_misses),
        ("s3_read_errors", "S3 reads that failed or timed out (answered as misses)", |c| &c.read_errors),
        ("s3_read_corrupt", "S3 objects that failed their checks (never served)", |c| &c.read_corrupt),
        ("s3_read_bytes", "Object bytes read", |c| &c.read_bytes),
        ("s3_reads_joined", "Local misses that joined a read of the same key already in progress", |c| &c.reads_joined),
        ("s3_installs", "Blocks read from S3 and stored in the local tiers", |c| &c.installs),
        ("s3_install_failures", "Blocks read from S3 that the local tiers refused", |c| &c.install_failures),
        ("s3_install_superseded", "Blocks read from S3 not stored locally because a newer PUT or DELETE of the key came", |c| {
            &c.install_superseded
        }),
        ("s3_exists_checks", "Existence checks (HEAD) sent for lookups", |c| &c.exists_checks),
        ("s3_exists_errors", "Existence checks that failed or timed out", |c| &c.exists_errors),
        ("s3_presence_cache_hits", "Lookups answered from the presence cache", |c| &c.presence_cache_hits),
        ("s3_prefetched", "Blocks a prefetch copied from S3 into the local tiers", |c| &c.prefetched),
        ("s3_deletes", "Objects deleted by DELETE", |c| &c.deletes),
        ("s3_timeouts", "S3 operations abandoned at their timeout", |c| &c.timeouts),
        ("s3_skipped_down", "S3 operations not sent because S3 was taken as down", |c| &c.skipped_down),
    ];
    for (name, help, f) in counters {
        let family = Family::<ShardLabel, Counter>::default();
        for (i, s) in shards.iter().enumerate() {
            family.get_or_create(&ShardLabel { shard: i.to_string() }).inc_by(f(&s.c).load(Ordering::Relaxed));
        }
        registry.register(name, help, family);
    }
    let mut latency = HistogramFamily::default();
    for (op, h) in [("read", 0), ("upload", 1), ("exists", 2)] {
        let mut merged = LatencyBuckets::default();
        for s in shards {
            merged.add(&[&s.read_us, &s.upload_us, &s.exists_us][h].buckets.load());
        }
        latency.series.push((OpLabel { op: op.into() }, merged));
    }
    registry.register("s3_request_duration_seconds", "S3 read, upload and existence-check latency, in seconds, by op", latency);
}
