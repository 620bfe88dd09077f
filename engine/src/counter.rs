//! Counters kept as plain cells on a shard's thread, and latency
//! histograms: the bottom floor every tier and the shard count with.

use std::cell::{Cell, RefCell};

use hdrhistogram::Histogram;

/// Adds `by` to a counter.
pub(crate) fn bump(c: &Cell<u64>, by: u64) {
    c.set(c.get() + by);
}

/// Records a latency of `us` microseconds (at least 1).
pub(crate) fn record_us(h: &RefCell<Histogram<u64>>, us: u128) {
    let _ = h.borrow_mut().record(us.max(1) as u64);
}
