//! Latency recording per operation (hdrhistogram, microseconds), per
//! serving tier, and the bits of bookkeeping every workload shares.

use std::collections::BTreeMap;
use std::sync::Mutex;

use hdrhistogram::Histogram;
use serde::Serialize;

/// `num / den`, 0 when `den` is 0 (hit rates of runs without lookups).
pub fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Latencies of reads per serving tier (`x-kvtier-tier`; `redis` for Redis).
#[derive(Clone, Default)]
pub struct TierLatency(BTreeMap<String, OpLatency>);

impl TierLatency {
    /// Records one read served by `tier`.
    pub fn record(&mut self, tier: &str, us: u64) {
        match self.0.get_mut(tier) {
            Some(l) => l.record(us),
            None => self.0.entry(tier.to_string()).or_default().record(us),
        }
    }

    /// Adds another recorder's samples, tier by tier.
    pub fn merge(&mut self, other: &TierLatency) {
        for (tier, l) in &other.0 {
            self.0.entry(tier.clone()).or_default().merge(l);
        }
    }

    /// Percentiles per tier.
    pub fn summaries(&self) -> BTreeMap<String, LatencySummary> {
        self.0.iter().map(|(t, l)| (t.clone(), l.summary())).collect()
    }

    /// Chart buckets per tier (see [`OpLatency::buckets`]).
    pub fn buckets(&self) -> BTreeMap<String, Vec<(u64, u64)>> {
        self.0.iter().map(|(t, l)| (t.clone(), l.buckets())).collect()
    }
}

/// The first failure of a run, kept from whichever task saw it first.
#[derive(Default)]
pub struct FirstError(Mutex<Option<String>>);

impl FirstError {
    /// Keeps `message` if it is the first; returns whether it was.
    pub fn note(&self, message: String) -> bool {
        let mut first = self.0.lock().expect("first-error lock");
        let is_first = first.is_none();
        if is_first {
            *first = Some(message);
        }
        is_first
    }

    /// The first failure, if any.
    pub fn get(&self) -> Option<String> {
        self.0.lock().expect("first-error lock").clone()
    }
}

/// Latencies of one operation.
#[derive(Clone)]
pub struct OpLatency {
    hist: Histogram<u64>,
    /// Total time spent in this operation, in microseconds.
    pub total_us: u64,
}

impl Default for OpLatency {
    fn default() -> Self {
        // 1 µs to 10 minutes at 3 significant digits.
        OpLatency { hist: Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"), total_us: 0 }
    }
}

impl OpLatency {
    /// Records one operation of `us` microseconds.
    pub fn record(&mut self, us: u64) {
        let us = us.max(1);
        self.hist.saturating_record(us);
        self.total_us += us;
    }

    /// Adds another recorder's samples.
    pub fn merge(&mut self, other: &OpLatency) {
        self.hist.add(&other.hist).expect("same bounds");
        self.total_us += other.total_us;
    }

    /// Operations recorded.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The distribution in log-spaced buckets for charts: `(upper_us, count)`
    /// with upper bounds 1, 2, 4, … µs (powers of two), empty buckets left
    /// out.
    pub fn buckets(&self) -> Vec<(u64, u64)> {
        if self.hist.is_empty() {
            return Vec::new();
        }
        self.hist
            .iter_log(1, 2.0)
            .filter(|v| v.count_since_last_iteration() > 0)
            .map(|v| (v.value_iterated_to(), v.count_since_last_iteration()))
            .collect()
    }

    /// Percentiles for reports.
    pub fn summary(&self) -> LatencySummary {
        let q = |p: f64| {
            if self.hist.is_empty() {
                0
            } else {
                self.hist.value_at_quantile(p)
            }
        };
        LatencySummary {
            count: self.hist.len(),
            p50_us: q(0.50),
            p95_us: q(0.95),
            p99_us: q(0.99),
            max_us: if self.hist.is_empty() { 0 } else { self.hist.max() },
            mean_us: if self.hist.is_empty() { 0.0 } else { self.hist.mean() },
        }
    }
}

/// Percentiles of one operation, in microseconds.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct LatencySummary {
    /// Operations measured.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 95th percentile.
    pub p95_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest.
    pub max_us: u64,
    /// Mean.
    pub mean_us: f64,
}
