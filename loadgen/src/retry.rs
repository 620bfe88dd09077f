//! Sending a request again when the server refuses it for overload: the
//! one retry policy of both of the loadgen's kvtier clients, HTTP
//! ([`crate::client::Client`]: a 503 with `Retry-After`) and the same-host
//! socket ([`crate::local::LocalTarget`]: an item answered `OVERLOADED`
//! with `retry_after_ms`). Each waits the delay the server asked for, cut
//! to [`RETRY_AFTER_MAX`], and gives up after [`OVERLOAD_RETRIES_MAX`]
//! retries.

use std::time::Duration;

/// Times a request refused for overload (a 503 with `Retry-After`, an
/// `OVERLOADED` item) is sent again, after the delay the server asked for,
/// before the refusal is returned.
pub const OVERLOAD_RETRIES_MAX: u32 = 8;

/// Longest delay honoured; a longer one is cut to this.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(10);

/// The retries of one request refused for overload: how many were made,
/// and the wait before each.
#[derive(Debug, Default)]
pub struct OverloadRetry {
    retries: u32,
}

impl OverloadRetry {
    /// A request not retried yet.
    pub fn new() -> OverloadRetry {
        OverloadRetry::default()
    }

    /// After a refusal that asked for `delay`: `false` at once when
    /// [`OVERLOAD_RETRIES_MAX`] retries were made already (the refusal
    /// stands); else sleeps [`OverloadRetry::delay`] and returns `true`:
    /// send the request again.
    pub async fn wait(&mut self, delay: Duration) -> bool {
        if self.exhausted() {
            return false;
        }
        self.retries += 1;
        tokio::time::sleep(Self::delay(delay)).await;
        true
    }

    /// The wait before a retry the server asked to delay by `asked`: that,
    /// at most [`RETRY_AFTER_MAX`].
    pub fn delay(asked: Duration) -> Duration {
        asked.min(RETRY_AFTER_MAX)
    }

    /// Retries made so far.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Whether [`OVERLOAD_RETRIES_MAX`] retries were made: the next
    /// refusal stands.
    pub fn exhausted(&self) -> bool {
        self.retries >= OVERLOAD_RETRIES_MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn retries_stop_at_the_limit_without_waiting_once_there() {
        let mut r = OverloadRetry::new();
        for i in 1..=OVERLOAD_RETRIES_MAX {
            assert!(!r.exhausted());
            assert!(r.wait(Duration::ZERO).await, "retry {i}");
            assert_eq!(r.retries(), i);
        }
        assert!(r.exhausted());
        let start = std::time::Instant::now();
        assert!(!r.wait(Duration::from_secs(5)).await, "no retry past the limit");
        assert!(start.elapsed() < Duration::from_secs(1), "and no wait: {:?}", start.elapsed());
        assert_eq!(r.retries(), OVERLOAD_RETRIES_MAX);
    }

    #[tokio::test]
    async fn the_delay_asked_is_waited_up_to_the_cap() {
        assert_eq!(OverloadRetry::delay(Duration::from_millis(3)), Duration::from_millis(3));
        assert_eq!(OverloadRetry::delay(Duration::from_secs(60)), RETRY_AFTER_MAX);
        let mut r = OverloadRetry::new();
        let start = std::time::Instant::now();
        assert!(r.wait(Duration::from_millis(30)).await);
        assert!(start.elapsed() >= Duration::from_millis(30), "{:?}", start.elapsed());
    }
}
