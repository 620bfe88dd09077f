//! Named waits. A task that waits for a shard's state to change waits on
//! the [`Signal`] of that change, and the code that makes the change fires
//! it: a reclaim waiting for a segment's writers to finish is woken by the
//! last writer leaving ([`InFlightCount`]), a write into a slot a survivor
//! still holds by the copy moving past it, a DELETE by the end of the
//! demotion or transit it waits out. No wait polls a counter on a timer,
//! so none adds a latency floor or wakes for nothing, and each says what it
//! waits for (`Signal::what`, in the trace log when a wait begins).

use std::cell::Cell;

use event_listener::Event;

/// A change other tasks of the shard can wait for.
pub(crate) struct Signal {
    event: Event,
    what: &'static str,
}

impl std::fmt::Debug for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Signal({:?})", self.what)
    }
}

impl Signal {
    /// A signal for the change `what` (e.g. "a segment's writers finished").
    pub(crate) fn new(what: &'static str) -> Self {
        Signal { event: Event::new(), what }
    }

    /// Wakes every task waiting in [`Signal::until`]; each checks its own
    /// condition again.
    pub(crate) fn notify(&self) {
        self.event.notify(usize::MAX);
    }

    /// Resolves once `done()` holds: checked now, then after each
    /// [`Signal::notify`] (the condition is checked again after the
    /// listener is registered, so a change in between is not missed).
    pub(crate) async fn until(&self, mut done: impl FnMut() -> bool) {
        if done() {
            return;
        }
        tracing::trace!(waits_for = self.what, "waiting");
        loop {
            let listener = self.event.listen();
            if done() {
                return;
            }
            listener.await;
            if done() {
                return;
            }
        }
    }
}

/// Operations in flight on something (a segment's readers or writers),
/// which a task can wait to see drop to zero ([`InFlightCount::idle`]).
#[derive(Debug)]
pub(crate) struct InFlightCount {
    count: Cell<u32>,
    idle: Signal,
}

impl InFlightCount {
    /// Zero operations; `what` names the wait for zero.
    pub(crate) fn new(what: &'static str) -> Self {
        InFlightCount { count: Cell::new(0), idle: Signal::new(what) }
    }

    /// Operations in flight now.
    pub(crate) fn get(&self) -> u32 {
        self.count.get()
    }

    /// Counts one more, to be handed to [`InFlight::adopt`].
    pub(crate) fn add(&self) {
        self.count.set(self.count.get() + 1);
    }

    /// Counts one fewer (what an [`InFlight`] does when dropped, for
    /// holders that own their count rather than borrow it); the last one
    /// out wakes the tasks waiting for zero.
    pub(crate) fn remove(&self) {
        let c = &self.count;
        debug_assert!(c.get() > 0);
        c.set(c.get() - 1);
        if c.get() == 0 {
            self.idle.notify();
        }
    }

    /// Resolves once none is in flight.
    pub(crate) async fn idle(&self) {
        self.idle.until(|| self.count.get() == 0).await
    }
}

/// One operation counted in an [`InFlightCount`] until dropped (on every
/// exit path); the last one out wakes the tasks waiting for zero.
pub(crate) struct InFlight<'a> {
    counter: &'a InFlightCount,
}

impl<'a> InFlight<'a> {
    /// Counts one operation from now.
    pub(crate) fn enter(counter: &'a InFlightCount) -> Self {
        counter.add();
        InFlight { counter }
    }

    /// Takes over a count the caller already added ([`InFlightCount::add`]).
    pub(crate) fn adopt(counter: &'a InFlightCount) -> Self {
        debug_assert!(counter.get() > 0);
        InFlight { counter }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.counter.remove();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    #[test]
    fn the_last_operation_out_wakes_the_wait_for_zero_and_not_before() {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| async {
                let count = Rc::new(InFlightCount::new("test operations finished"));
                let (a, b) = (InFlight::enter(&count), InFlight::enter(&count));
                let woke = Rc::new(Cell::new(false));
                let waiter = {
                    let (count, woke) = (count.clone(), woke.clone());
                    glommio::spawn_local(async move {
                        count.idle().await;
                        woke.set(true);
                    })
                };
                glommio::executor().yield_task_queue_now().await;
                drop(a);
                glommio::executor().yield_task_queue_now().await;
                assert!(!woke.get(), "woken with one operation still in flight");
                drop(b);
                waiter.await;
                assert!(woke.get());
                // Already at zero: returns at once.
                count.idle().await;
            })
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn a_signal_wakes_waiters_whose_condition_then_holds() {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| async {
                let signal = Rc::new(Signal::new("test flag set"));
                let flag = Rc::new(Cell::new(false));
                let waiter = {
                    let (signal, flag) = (signal.clone(), flag.clone());
                    glommio::spawn_local(async move { signal.until(|| flag.get()).await })
                };
                glommio::executor().yield_task_queue_now().await;
                signal.notify(); // the condition does not hold yet: waits on
                glommio::executor().yield_task_queue_now().await;
                flag.set(true);
                signal.notify();
                waiter.await;
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
