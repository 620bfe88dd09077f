//! Tier health: no tier fails silently.
//!
//! Each tier of each shard (and the process's remote tier) keeps a
//! [`HealthTracker`]: the errors it met, by kind, the last one and when.
//! [`HealthTracker::evaluate`] turns that and the tier's standing condition
//! (the disk share full, the GPU lost, the S3 circuit breaker open, the log
//! unwritable) into a [`TierHealth`]:
//!
//! - `ok`: no error in the last window ([`ERROR_WINDOW`] by default) and no
//!   standing condition;
//! - `degraded`: errors in the last window, or a condition that
//!   costs misses or refusals but leaves the rest of the store serving;
//! - `down`: the tier cannot do its job (the log's last write failed with an
//!   I/O error; a configured GPU that is not there).
//!
//! The state is what `/v1/stats` (`health`), `/readyz` and `/metrics`
//! (`kvtier_tier_up`, `kvtier_tier_errors_total`) read, and each change of
//! state is logged once, with its reason, not once per failed operation.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// A tier is `degraded` while its last error is younger than this, unless
/// configured otherwise (`kvtier serve --health-window-ms`).
pub const ERROR_WINDOW: Duration = Duration::from_secs(10);

/// A tier's state, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthState {
    /// Serving as configured.
    Ok,
    /// Serving, with errors or a standing condition that costs misses or
    /// refusals.
    Degraded,
    /// Not serving its part.
    Down,
}

impl HealthState {
    /// `ok`, `degraded` or `down`.
    pub fn as_str(&self) -> &'static str {
        match self {
            HealthState::Ok => "ok",
            HealthState::Degraded => "degraded",
            HealthState::Down => "down",
        }
    }
}

/// One tier's health, of one shard or merged over shards
/// ([`TierHealth::merge`]).
#[derive(Debug, Clone, Serialize)]
pub struct TierHealth {
    /// Tier name: `gpu`, `ram`, `nvme`, `s3`.
    pub tier: String,
    /// The state now.
    pub state: HealthState,
    /// Why the state is not `ok`: the standing condition, else the last
    /// error. `None` when `ok`.
    pub reason: Option<String>,
    /// Since when (Unix time, ms) the tier has been in this state.
    pub since_unix_ms: u64,
    /// The last error met, whatever the state now.
    pub last_error: Option<String>,
    /// When the last error was met (Unix time, ms).
    pub last_error_unix_ms: Option<u64>,
    /// Errors met since start, by kind (`read`, `write`, `copy`, ...).
    pub errors: BTreeMap<String, u64>,
}

impl TierHealth {
    /// Errors met since start, all kinds.
    pub fn errors_total(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Merges another shard's health of the same tier: the worse state (its
    /// reason and, among equals, the earlier `since`), the later last
    /// error, errors summed by kind.
    pub fn merge(&mut self, o: &TierHealth) {
        if o.state > self.state || (o.state == self.state && o.since_unix_ms < self.since_unix_ms && o.state != HealthState::Ok) {
            self.state = o.state;
            self.reason = o.reason.clone();
            self.since_unix_ms = o.since_unix_ms;
        }
        if o.last_error_unix_ms > self.last_error_unix_ms {
            self.last_error = o.last_error.clone();
            self.last_error_unix_ms = o.last_error_unix_ms;
        }
        for (k, n) in &o.errors {
            *self.errors.entry(k.clone()).or_default() += n;
        }
    }
}

/// Merges per-shard tier healths into one per tier, in first-seen order.
pub fn merge_by_tier<'a>(all: impl IntoIterator<Item = &'a TierHealth>) -> Vec<TierHealth> {
    let mut out: Vec<TierHealth> = Vec::new();
    for h in all {
        match out.iter_mut().find(|x| x.tier == h.tier) {
            Some(x) => x.merge(h),
            None => out.push(h.clone()),
        }
    }
    out
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

struct Inner {
    errors: BTreeMap<String, u64>,
    last_error: Option<(String, Instant, SystemTime)>,
    state: HealthState,
    reason: Option<String>,
    since: SystemTime,
}

/// The errors and state of one tier (of one shard, or of the process's
/// remote tier). Thread-safe: the remote tier records from its runtime's
/// threads; a shard's tiers only from the shard (the lock is uncontended).
pub struct HealthTracker {
    tier: &'static str,
    /// How long an error keeps the tier degraded.
    window: Duration,
    /// Shard id for log lines (`None`: a process-wide tier).
    shard: Option<u32>,
    inner: Mutex<Inner>,
}

impl HealthTracker {
    /// A tracker for `tier` (of `shard`), `ok` since now; an error keeps
    /// the tier degraded for `window`.
    pub fn new(tier: &'static str, shard: Option<u32>, window: Duration) -> HealthTracker {
        let inner = Inner { errors: BTreeMap::new(), last_error: None, state: HealthState::Ok, reason: None, since: SystemTime::now() };
        HealthTracker { tier, window, shard, inner: Mutex::new(inner) }
    }

    /// Records an error of `kind` (`read`, `write`, `copy`, `timeout`, ...)
    /// with the message an operator needs.
    pub fn error(&self, kind: &str, message: impl Into<String>) {
        let mut i = self.inner.lock().expect("health lock");
        *i.errors.entry(kind.to_string()).or_default() += 1;
        i.last_error = Some((message.into(), Instant::now(), SystemTime::now()));
    }

    /// Records `n` errors of `kind` found by a counter that rose (the GPU's
    /// fault counters), with `message`.
    pub fn errors(&self, kind: &str, n: u64, message: impl Into<String>) {
        if n == 0 {
            return;
        }
        let mut i = self.inner.lock().expect("health lock");
        *i.errors.entry(kind.to_string()).or_default() += n;
        i.last_error = Some((message.into(), Instant::now(), SystemTime::now()));
    }

    /// The health now, given the tier's standing `condition` (`None`: none;
    /// else its state and reason). Logs once when the state changes.
    pub fn evaluate(&self, condition: Option<(HealthState, String)>) -> TierHealth {
        let mut i = self.inner.lock().expect("health lock");
        let recent = i.last_error.as_ref().filter(|(_, at, _)| at.elapsed() < self.window).map(|(m, _, _)| m.clone());
        let (state, reason) = match (condition, recent) {
            (Some((s, why)), _) if s != HealthState::Ok => (s, Some(why)),
            (_, Some(m)) => (HealthState::Degraded, Some(format!("errors in the last {} ms: {m}", self.window.as_millis()))),
            _ => (HealthState::Ok, None),
        };
        if state != i.state {
            let shard = self.shard.map(|s| format!("shard {s} ")).unwrap_or_default();
            // The return to ok at the same level as the fault, so that a
            // log filtered to warnings shows both ends of an episode.
            match state {
                HealthState::Ok => {
                    tracing::warn!(tier = self.tier, "{shard}tier {} is ok again (was {})", self.tier, i.state.as_str())
                }
                _ => {
                    tracing::warn!(tier = self.tier, "{shard}tier {} is {}: {}", self.tier, state.as_str(), reason.as_deref().unwrap_or(""))
                }
            }
            i.state = state;
            i.since = SystemTime::now();
        }
        i.reason = reason;
        TierHealth {
            tier: self.tier.to_string(),
            state: i.state,
            reason: i.reason.clone(),
            since_unix_ms: unix_ms(i.since),
            last_error: i.last_error.as_ref().map(|(m, _, _)| m.clone()),
            last_error_unix_ms: i.last_error.as_ref().map(|(_, _, t)| unix_ms(*t)),
            errors: i.errors.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_degrade_a_tier_for_the_window_and_conditions_win() {
        let h = HealthTracker::new("nvme", Some(0), ERROR_WINDOW);
        assert_eq!(h.evaluate(None).state, HealthState::Ok);
        h.error("read", "reading segment 3 failed: EIO");
        let now = h.evaluate(None);
        assert_eq!(now.state, HealthState::Degraded);
        assert!(now.reason.as_deref().unwrap().contains("EIO"), "{now:?}");
        assert_eq!(now.errors["read"], 1);
        let down = h.evaluate(Some((HealthState::Down, "the log's last write failed".into())));
        assert_eq!((down.state, down.reason.as_deref()), (HealthState::Down, Some("the log's last write failed")));
        // A condition of Ok adds nothing; the recent error still counts.
        assert_eq!(h.evaluate(Some((HealthState::Ok, String::new()))).state, HealthState::Degraded);
    }

    #[test]
    fn a_tier_is_ok_again_once_its_last_error_is_older_than_the_window() {
        let h = HealthTracker::new("s3", None, Duration::from_millis(30));
        h.error("read", "GET failed");
        assert_eq!(h.evaluate(None).state, HealthState::Degraded);
        std::thread::sleep(Duration::from_millis(40));
        let now = h.evaluate(None);
        assert_eq!((now.state, now.reason), (HealthState::Ok, None));
        assert_eq!(now.last_error.as_deref(), Some("GET failed"), "the last error stays on record");
    }

    #[test]
    fn merging_keeps_the_worst_state_and_sums_errors() {
        let (a, b) = (HealthTracker::new("gpu", Some(0), ERROR_WINDOW), HealthTracker::new("gpu", Some(1), ERROR_WINDOW));
        b.errors("copy", 3, "copy failed");
        let merged = merge_by_tier([&a.evaluate(None), &b.evaluate(None)]);
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].state, HealthState::Degraded);
        assert_eq!(merged[0].errors_total(), 3);
        assert_eq!(merged[0].last_error.as_deref(), Some("copy failed"));
    }
}
