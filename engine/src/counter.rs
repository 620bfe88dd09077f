//! Counters kept as plain cells on a shard's thread, and latency
//! histograms: the bottom floor every tier and the shard count with.

use std::cell::{Cell, RefCell};

use hdrhistogram::Histogram;

use crate::latency::LatencyBuckets;

/// Adds `by` to a counter.
pub(crate) fn bump(c: &Cell<u64>, by: u64) {
    c.set(c.get() + by);
}

/// Latencies of one operation of one tier on one shard, in µs: an
/// hdrhistogram for the percentiles of `/v1/stats`, and Prometheus buckets
/// for `/metrics` ([`LatencyBuckets`]), which sum across shards exactly.
pub(crate) struct Latency {
    pub hdr: Histogram<u64>,
    pub buckets: LatencyBuckets,
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            hdr: Histogram::new_with_bounds(1, 60_000_000, 2).expect("histogram bounds are valid"),
            buckets: LatencyBuckets::default(),
        }
    }
}

/// Records a latency of `us` microseconds (at least 1).
pub(crate) fn record_us(h: &RefCell<Latency>, us: u128) {
    let us = us.max(1) as u64;
    let mut h = h.borrow_mut();
    let _ = h.hdr.record(us);
    h.buckets.record(us);
}
