//! Who holds a shard, and the wait for them all to let go before it closes
//! its files: the work it runs in tasks of their own (a reclaim's survivor
//! copy, a streamed read, an S3 read and its install, a tenant limit's
//! evictions, a peer's request, a prefetch) and its executor's `Store`,
//! which the front doors' connections hold.

use std::future::Future;
use std::rc::Rc;

use glommio::task::JoinHandle;

use super::Shard;

/// A hold on a shard: the shard, and one count in [`Shard::tasks`] until
/// dropped (a task ending, completed or cancelled; the `Store` dropped),
/// when the last one out wakes the close waiting in [`Shard::tasks_ended`].
pub(crate) struct Hold(Rc<Shard>);

impl Hold {
    /// A counted hold on `shard`.
    pub(crate) fn new(shard: &Rc<Shard>) -> Hold {
        shard.tasks.add();
        Hold(shard.clone())
    }
}

impl std::ops::Deref for Hold {
    type Target = Rc<Shard>;

    fn deref(&self) -> &Rc<Shard> {
        &self.0
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.tasks.remove();
    }
}

impl Shard {
    /// Runs `work(shard)` in a detached task of its own that holds the
    /// shard; a close waits for it ([`Shard::tasks_ended`]). The handle
    /// resolves to the work's output (`None` if the task was cancelled).
    pub(crate) fn spawn_holding<T, F>(self: &Rc<Self>, work: impl FnOnce(Rc<Shard>) -> F) -> JoinHandle<T>
    where
        T: 'static,
        F: Future<Output = T> + 'static,
    {
        let hold = Hold::new(self);
        let work = work(self.clone());
        glommio::spawn_local(async move {
            let out = work.await;
            drop(hold);
            out
        })
        .detach()
    }

    /// Resolves once every [`Hold`] is gone (the tasks started by
    /// [`Shard::spawn_holding`] ended, the `Store` dropped by the last
    /// connection holding it): then nothing but the caller holds the
    /// shard and its files can close. Woken by the last hold dropping,
    /// not by a timer.
    pub(crate) async fn tasks_ended(self: &Rc<Self>) {
        self.tasks.idle().await;
        if Rc::strong_count(self) > 1 {
            // A holder outside any task: a bug, but its files are closed
            // anyway rather than waiting on a holder that wakes no one.
            tracing::error!(shard = self.id(), holders = Rc::strong_count(self) - 1, "shard still held at close, outside any hold");
            debug_assert!(false, "shard still held at close outside any hold");
        }
    }
}
