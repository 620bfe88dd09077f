//! Latency histograms as Prometheus aggregates them: fixed buckets from
//! 10 µs to 10 s, a sum and a count, exported as `_bucket`, `_sum` and
//! `_count` series in seconds (the Prometheus base unit), which can be
//! summed across shards and instances and rated over any window, unlike a
//! percentile accumulated since start.
//!
//! Two forms: [`LatencyBuckets`], plain counts for a single thread (a
//! shard's tier counters) and for snapshots, and [`AtomicLatencyBuckets`],
//! recorded with relaxed atomic adds from the thread that serves a request
//! and read by a scrape on any other thread, with no lock either can hold.
//! [`HistogramFamily`] encodes labelled snapshots through prometheus-client;
//! [`Scrape`] is where per-scrape series are written.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// Upper bounds of the finite buckets in microseconds: 1, 2.5 and 5 per
/// decade from 10 µs to 10 s (a RAM hit over the same-host socket is tens
/// of µs; an S3 fetch under load can take seconds). One more bucket, `+Inf`,
/// takes everything above.
pub const BUCKET_BOUNDS_US: [u64; 19] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000,
];

/// Buckets counted: [`BUCKET_BOUNDS_US`] and `+Inf`.
pub const BUCKETS: usize = BUCKET_BOUNDS_US.len() + 1;

/// The bucket a latency of `us` falls in: the first whose bound is at
/// least `us`, else `+Inf` (`BUCKETS - 1`).
pub fn bucket_of(us: u64) -> usize {
    BUCKET_BOUNDS_US.partition_point(|&bound| bound < us)
}

/// Counts per bucket (not cumulative) and the sum of the latencies, in µs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencyBuckets {
    /// Observations per bucket, indexed as [`bucket_of`].
    pub counts: [u64; BUCKETS],
    /// Sum of every observation, in microseconds.
    pub sum_us: u64,
}

impl Default for LatencyBuckets {
    fn default() -> Self {
        LatencyBuckets { counts: [0; BUCKETS], sum_us: 0 }
    }
}

impl LatencyBuckets {
    /// Counts one observation of `us` microseconds.
    pub fn record(&mut self, us: u64) {
        self.counts[bucket_of(us)] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }

    /// Adds another histogram's counts (another shard's, to sum a tier).
    pub fn add(&mut self, other: &LatencyBuckets) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
    }

    /// Observations counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// `(upper bound in seconds, count)` per bucket, the last `+Inf`: what
    /// prometheus-client's encoder takes (it makes them cumulative).
    fn seconds_buckets(&self) -> [(f64, u64); BUCKETS] {
        let mut out = [(f64::INFINITY, 0); BUCKETS];
        for (i, slot) in out.iter_mut().enumerate() {
            let bound = BUCKET_BOUNDS_US.get(i).map_or(f64::INFINITY, |&us| us as f64 / 1e6);
            *slot = (bound, self.counts[i]);
        }
        out
    }

    fn encode_into(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        encoder.encode_histogram::<NoLabelSet>(self.sum_us as f64 / 1e6, self.count(), &self.seconds_buckets(), None)
    }
}

impl EncodeMetric for LatencyBuckets {
    fn encode(&self, encoder: MetricEncoder) -> std::fmt::Result {
        self.encode_into(encoder)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// [`LatencyBuckets`] recorded from one thread and read from any: each
/// count a relaxed atomic add, so recording never waits and a scrape never
/// blocks a request. A snapshot taken during recording may be one
/// observation behind in the sum or a bucket; the next is exact.
#[derive(Debug)]
pub struct AtomicLatencyBuckets {
    counts: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

impl Default for AtomicLatencyBuckets {
    fn default() -> Self {
        AtomicLatencyBuckets { counts: std::array::from_fn(|_| AtomicU64::new(0)), sum_us: AtomicU64::new(0) }
    }
}

impl AtomicLatencyBuckets {
    /// Counts one observation of `us` microseconds.
    pub fn record(&self, us: u64) {
        self.counts[bucket_of(us)].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn load(&self) -> LatencyBuckets {
        LatencyBuckets {
            counts: std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed)),
            sum_us: self.sum_us.load(Ordering::Relaxed),
        }
    }
}

/// One histogram per label set, encoded as one Prometheus histogram family.
#[derive(Debug)]
pub struct HistogramFamily<S> {
    /// Each label set with its counts.
    pub series: Vec<(S, LatencyBuckets)>,
}

impl<S> Default for HistogramFamily<S> {
    fn default() -> Self {
        HistogramFamily { series: Vec::new() }
    }
}

impl<S: EncodeLabelSet + std::fmt::Debug> EncodeMetric for HistogramFamily<S> {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        for (labels, buckets) in &self.series {
            buckets.encode_into(encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Where the series of one scrape are written: a prometheus-client
/// collector's encoder, with [`prometheus_client::registry::Registry`]'s
/// `register` call shape, so code that describes metrics reads the same
/// whether it registers long-lived metrics or writes a scrape's. The first
/// encoding error is kept and returned by [`Scrape::finish`].
pub struct Scrape<'a> {
    encoder: DescriptorEncoder<'a>,
    result: std::fmt::Result,
}

impl<'a> Scrape<'a> {
    /// Writes through `encoder` (a [`prometheus_client::collector::Collector`]'s).
    pub fn new(encoder: DescriptorEncoder<'a>) -> Self {
        Scrape { encoder, result: Ok(()) }
    }

    /// Writes `metric` as `name` (after the registry's prefix; a counter
    /// gets `_total`) with `help`.
    pub fn register(&mut self, name: impl AsRef<str>, help: impl AsRef<str>, metric: impl EncodeMetric) {
        if self.result.is_err() {
            return;
        }
        self.result =
            self.encoder.encode_descriptor(name.as_ref(), help.as_ref(), None, metric.metric_type()).and_then(|m| metric.encode(m));
    }

    /// The first error met, if any.
    ///
    /// # Errors
    /// The encoder's (writing into a `String` cannot fail).
    pub fn finish(self) -> std::fmt::Result {
        self.result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_the_last_bucket_takes_the_rest() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(10), 0);
        assert_eq!(bucket_of(11), 1);
        assert_eq!(bucket_of(10_000_000), BUCKETS - 2);
        assert_eq!(bucket_of(10_000_001), BUCKETS - 1);
        assert!(BUCKET_BOUNDS_US.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn atomic_and_plain_count_alike_and_add() {
        let (a, mut p) = (AtomicLatencyBuckets::default(), LatencyBuckets::default());
        for us in [3, 10, 400, 2_000_000, 99_000_000] {
            a.record(us);
            p.record(us);
        }
        assert_eq!(a.load(), p);
        assert_eq!(p.count(), 5);
        let mut twice = p.clone();
        twice.add(&p);
        assert_eq!((twice.count(), twice.sum_us), (10, 2 * p.sum_us));
    }
}
