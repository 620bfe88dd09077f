//! Waiting on wakes that come from another shard's thread.
//!
//! glommio 0.9 delivers a wake from a foreign thread by queueing the waker
//! and writing the target executor's eventfd only if that executor said it
//! is about to sleep (`SleepNotifier::notify`). Both sides use relaxed
//! atomics with no fence between "publish" and "check" (`should_notify` is
//! stored, then the queue read; the waker is queued, then `should_notify`
//! read), so each side can miss the other's write and the executor sleeps
//! with the wake queued. Measured here: an HTTP/1.1 client streaming 16 MiB
//! blocks from two shards hung after ~1,000 GETs (never with one shard), and
//! stayed stuck until another event woke the executor.
//!
//! Everything that waits for an answer from another shard (the mesh's
//! replies, chunks streamed from the owning shard) therefore also arms a
//! local timer while it waits ([`Repoll`]): a lost wake costs at most
//! [`REPOLL_INTERVAL`], a delivered one nothing.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use glommio::timer::Timer;

/// Longest a task waits for a lost cross-shard wake before it polls again.
pub const REPOLL_INTERVAL: Duration = Duration::from_millis(2);

/// A local timer beside a wait whose wake may come from another thread.
/// Call [`Repoll::pending`] each time the wait returns `Pending` and
/// [`Repoll::ready`] when it makes progress. Must be used on a glommio
/// executor.
#[derive(Default)]
pub struct Repoll(Option<Timer>);

impl Repoll {
    /// The wait is pending: make sure the task is polled again within
    /// [`REPOLL_INTERVAL`] even if the wake it waits for is lost.
    pub fn pending(&mut self, cx: &mut Context<'_>) {
        let timer = self.0.get_or_insert_with(|| Timer::new(REPOLL_INTERVAL));
        if Pin::new(timer).poll(cx).is_ready() {
            self.0 = None;
            cx.waker().wake_by_ref();
        }
    }

    /// The wait made progress: the next pending wait starts a new interval.
    pub fn ready(&mut self) {
        self.0 = None;
    }
}

/// Awaits `fut`, whose wake comes from another shard, polling it again at
/// least every [`REPOLL_INTERVAL`].
pub async fn cross_shard<F: Future + Unpin>(mut fut: F) -> F::Output {
    let mut repoll = Repoll::default();
    std::future::poll_fn(|cx| match Pin::new(&mut fut).poll(cx) {
        Poll::Ready(v) => Poll::Ready(v),
        Poll::Pending => {
            repoll.pending(cx);
            Poll::Pending
        }
    })
    .await
}
