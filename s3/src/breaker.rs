//! The circuit breaker: after [`DOWN_AFTER_FAILURES`] consecutive failures
//! the tier is taken as down for [`DOWN_COOLDOWN`], so a dead or
//! black-holed S3 costs each request nothing rather than `--s3-timeout-ms`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Consecutive S3 failures (errors or timeouts, not "absent") after which
/// the tier is taken as down for [`DOWN_COOLDOWN`].
pub const DOWN_AFTER_FAILURES: u32 = 3;

/// While down, S3 reads, existence checks, deletes and uploads are not
/// sent: they answer as misses or failures at once (`skipped_down`). After
/// it, requests go out again; [`DOWN_AFTER_FAILURES`] more failures take
/// the tier down again.
pub const DOWN_COOLDOWN: Duration = Duration::from_secs(1);

/// Shared by every shard and the runtime's threads.
pub(crate) struct Breaker {
    epoch: Instant,
    failures: AtomicU32,
    /// Milliseconds since `epoch` until which the tier is down.
    down_until_ms: AtomicU64,
    /// Times the breaker opened since start.
    pub trips: AtomicU64,
}

impl Breaker {
    pub(crate) fn new() -> Self {
        Breaker { epoch: Instant::now(), failures: AtomicU32::new(0), down_until_ms: AtomicU64::new(0), trips: AtomicU64::new(0) }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether requests may go to S3 now.
    pub(crate) fn allows(&self) -> bool {
        self.now_ms() >= self.down_until_ms.load(Ordering::Relaxed)
    }

    /// A request answered (an object, or "absent"): the failure run ends.
    pub(crate) fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// A request failed or timed out; the [`DOWN_AFTER_FAILURES`]th in a
    /// row opens the breaker.
    pub(crate) fn failure(&self) {
        if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= DOWN_AFTER_FAILURES {
            self.failures.store(0, Ordering::Relaxed);
            self.down_until_ms.store(self.now_ms() + DOWN_COOLDOWN.as_millis() as u64, Ordering::Relaxed);
            self.trips.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "S3 failed {DOWN_AFTER_FAILURES} times in a row: taken as down for {DOWN_COOLDOWN:?} (reads miss, uploads fail at once)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_after_consecutive_failures_only() {
        let b = Breaker::new();
        b.failure();
        b.failure();
        b.success();
        b.failure();
        b.failure();
        assert!(b.allows(), "a success ends the run");
        b.failure();
        assert!(!b.allows());
        assert_eq!(b.trips.load(Ordering::Relaxed), 1);
    }
}
