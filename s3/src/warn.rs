//! Rate-limited warnings, one limiter per kind of S3 failure, so that a
//! flood of one kind (failed uploads, say) never mutes the first warning of
//! another (a failed read).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one warning per this interval per kind; the others are counted
/// and summarized in the next one.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// The kinds of warning, each with its own limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A GET failed or timed out.
    Read,
    /// A HEAD (existence check) failed or timed out.
    Exists,
    /// An upload failed or timed out.
    Upload,
    /// The write-behind queue was full.
    QueueFull,
    /// A block read from S3 could not be stored locally.
    Install,
    /// A DELETE failed or timed out.
    Delete,
}

const KINDS: usize = 6;

impl Kind {
    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Read => "read",
            Kind::Exists => "existence check",
            Kind::Upload => "upload",
            Kind::QueueFull => "write-behind queue full",
            Kind::Install => "install",
            Kind::Delete => "delete",
        }
    }
}

/// At most one warning per [`LOG_EVERY`], saying how many were held back.
struct Limiter {
    last: Mutex<Option<Instant>>,
    held_back: AtomicU64,
}

/// One [`Limiter`] per [`Kind`]; shared by every shard and the runtime's
/// threads.
pub(crate) struct Warnings {
    limiters: [Limiter; KINDS],
}

impl Warnings {
    pub(crate) fn new() -> Warnings {
        Warnings { limiters: std::array::from_fn(|_| Limiter { last: Mutex::new(None), held_back: AtomicU64::new(0) }) }
    }

    /// Logs `detail` as a warning of `kind`, unless one of that kind was
    /// logged in the last [`LOG_EVERY`]; returns whether it was logged.
    pub(crate) fn warn(&self, kind: Kind, detail: &dyn std::fmt::Display) -> bool {
        let l = &self.limiters[kind.index()];
        let mut last = l.last.lock().expect("log limiter lock");
        if last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            l.held_back.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        *last = Some(Instant::now());
        let held = l.held_back.swap(0, Ordering::Relaxed);
        tracing::warn!(held_back = held, "S3 {}: {detail} ({held} similar warnings held back in the last {LOG_EVERY:?})", kind.name());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_own_limit() {
        let w = Warnings::new();
        assert!(w.warn(Kind::Upload, &"first upload failure"));
        assert!(!w.warn(Kind::Upload, &"second upload failure"), "held back");
        assert!(w.warn(Kind::Read, &"a read failure is not muted by uploads"));
        assert!(w.warn(Kind::QueueFull, &"nor is a full queue"));
        assert!(w.warn(Kind::Delete, &"nor a delete"));
    }
}
