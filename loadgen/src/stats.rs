//! Latency recording per operation (hdrhistogram, microseconds).

use hdrhistogram::Histogram;
use serde::Serialize;

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
