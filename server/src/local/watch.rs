//! Requests in flight on a shard's same-host connections, and the shard's
//! watch over them: any request still unanswered after [`SLOW_AFTER`] is
//! logged once with the stage it is in (in the store: its items on their
//! way to and from the shards that own them; or answered and queued for
//! the connection's writer), and once more when its answer is written.
//! With the stall detector (a shard's thread held) and the client's own
//! timeout message (what its socket holds), this tells where an unanswered
//! request waits.
//!
//! A request is tracked from the moment it is read (its in-flight permit
//! taken) until its answer is on the socket (the permit given back): an
//! [`Admitted`] holds both. The watch itself runs on the shard: a stalled
//! shard cannot log here, which is what the stall detector is for.

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use glommio::sync::StaticPermit;

use super::proto::Op;

/// A request unanswered this long is logged.
pub const SLOW_AFTER: Duration = Duration::from_secs(1);

/// How often the watch looks.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Read and handed to the store: its items wait on the shards that own
    /// their keys (this one or others, through the mesh), or on I/O.
    InStore,
    /// Answered, its response queued for the connection's writer.
    Queued,
}

impl Stage {
    fn describe(self) -> &'static str {
        match self {
            Stage::InStore => "read, in the store (its items on the shards owning their keys, or waiting for I/O)",
            Stage::Queued => "answered, queued for the connection's writer (the socket is not taking bytes)",
        }
    }
}

/// One request being served.
pub(super) struct Tracked {
    op: Option<Op>,
    request_id: u64,
    peer_uid: u32,
    started: Instant,
    stage: Cell<Stage>,
    reported: Cell<bool>,
}

impl Tracked {
    pub(super) fn set_stage(&self, stage: Stage) {
        self.stage.set(stage);
    }

    fn op_name(&self) -> &'static str {
        self.op.map_or("an unknown op", Op::name)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.reported.get() {
            tracing::warn!(
                "local {} request {} (peer uid {}) answered after {} ms",
                self.op_name(),
                self.request_id,
                self.peer_uid,
                self.started.elapsed().as_millis()
            );
        }
    }
}

/// A request's in-flight permit and its tracking: dropped once its answer
/// is written (or its connection is gone).
pub(super) struct Admitted {
    _permit: StaticPermit,
    tracked: Rc<Tracked>,
}

impl Admitted {
    /// Starts tracking a request just read, holding `permit`.
    pub(super) fn new(permit: StaticPermit, op: Option<Op>, request_id: u64, peer_uid: u32) -> Admitted {
        let tracked = Rc::new(Tracked {
            op,
            request_id,
            peer_uid,
            started: Instant::now(),
            stage: Cell::new(Stage::InStore),
            reported: Cell::new(false),
        });
        IN_FLIGHT.with(|all| all.borrow_mut().push(Rc::downgrade(&tracked)));
        Admitted { _permit: permit, tracked }
    }

    pub(super) fn tracked(&self) -> &Tracked {
        &self.tracked
    }
}

thread_local! {
    /// This shard's tracked requests (a shard is one thread).
    static IN_FLIGHT: RefCell<Vec<Weak<Tracked>>> = const { RefCell::new(Vec::new()) };
}

/// Logs each of this shard's requests unanswered after [`SLOW_AFTER`],
/// once, until the shard stops.
pub(super) async fn watch(shard: usize) {
    loop {
        glommio::timer::sleep(WATCH_EVERY).await;
        IN_FLIGHT.with(|all| {
            let mut all = all.borrow_mut();
            all.retain(|w| {
                let Some(t) = w.upgrade() else { return false };
                let waited = t.started.elapsed();
                if waited >= SLOW_AFTER && !t.reported.replace(true) {
                    tracing::warn!(
                        shard,
                        "local {} request {} (peer uid {}) unanswered after {} ms: {}",
                        t.op_name(),
                        t.request_id,
                        t.peer_uid,
                        waited.as_millis(),
                        t.stage.get().describe()
                    );
                }
                true
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_tracked_until_its_admission_drops() {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .spawn(|| async {
                let limit = Rc::new(glommio::sync::Semaphore::new(1));
                let admitted = Admitted::new(limit.try_acquire_static_permit(1).unwrap(), Some(Op::Exists), 7, 0);
                assert_eq!(IN_FLIGHT.with(|a| a.borrow().iter().filter(|w| w.upgrade().is_some()).count()), 1);
                admitted.tracked().set_stage(Stage::Queued);
                assert!(limit.try_acquire_permit(1).is_err(), "the permit is held while the request is");
                drop(admitted);
                assert_eq!(IN_FLIGHT.with(|a| a.borrow().iter().filter(|w| w.upgrade().is_some()).count()), 0);
                assert!(limit.try_acquire_permit(1).is_ok(), "and given back with it");
            })
            .unwrap()
            .join()
            .unwrap();
    }
}
