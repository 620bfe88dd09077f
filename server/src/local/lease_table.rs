//! One connection's leases (docs/LOCAL.md, "Leases"): each a pin of a
//! RAM-tier slot, by id and by when it ends (`lease.rs` grants, releases
//! and expires them).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use bytes::Bytes;

/// One connection's leases.
#[derive(Default)]
pub(super) struct Leases {
    next_id: u64,
    held: HashMap<u64, Held>,
    /// Lease ids by when they end, for the expiry task.
    by_deadline: BTreeMap<(Instant, u64), ()>,
    /// The expiry task is running.
    pub(super) sweeping: bool,
}

struct Held {
    /// The pin: the slot is not written while this lives.
    _bytes: Bytes,
    deadline: Instant,
}

impl Leases {
    pub(super) fn hold(&mut self, bytes: Bytes, deadline: Instant) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        self.held.insert(id, Held { _bytes: bytes, deadline });
        self.by_deadline.insert((deadline, id), ());
        id
    }

    pub(super) fn end(&mut self, id: u64) -> bool {
        match self.held.remove(&id) {
            Some(h) => {
                self.by_deadline.remove(&(h.deadline, id));
                true
            }
            None => false,
        }
    }

    /// Ends the leases whose time is up at `now`; returns how many, and
    /// when the next one ends.
    pub(super) fn expire(&mut self, now: Instant) -> (u64, Option<Instant>) {
        let mut ended = 0;
        while let Some((&(deadline, id), _)) = self.by_deadline.first_key_value() {
            if deadline > now {
                return (ended, Some(deadline));
            }
            self.by_deadline.pop_first();
            self.held.remove(&id);
            ended += 1;
        }
        (ended, None)
    }

    /// Leases held.
    pub(super) fn len(&self) -> usize {
        self.held.len()
    }

    /// Ends every lease (the connection closed); returns how many.
    pub(super) fn clear(&mut self) -> u64 {
        let n = self.held.len() as u64;
        self.held.clear();
        self.by_deadline.clear();
        n
    }
}
