//! The bounded queue between the shards and the publisher thread.
//!
//! A shard hands its events of one interval to [`EventQueue::push`] and
//! goes on: the lock is held for a copy of pointers (a `TierEvent` is a
//! medium and a `Bytes` handle), never across I/O, and the publisher
//! thread holds it only to swap the whole queue out. When events arrive
//! faster than the publisher sends them (a stalled publisher thread; the
//! PUB socket itself never waits for subscribers), the queue keeps the
//! newest `capacity` events and drops the oldest, counted: a router that
//! missed a block's arrival learns of the block at its next move, whereas
//! dropping the newest would keep stale history and lose the present.

use std::collections::VecDeque;
use std::sync::Mutex;

use kvtier_engine::events::TierEvent;

/// Events waiting for the next batch, at most `capacity`.
#[derive(Debug)]
pub struct EventQueue {
    capacity: usize,
    inner: Mutex<Waiting>,
}

#[derive(Debug, Default)]
struct Waiting {
    events: VecDeque<TierEvent>,
    /// Dropped since the last [`EventQueue::take_into`].
    dropped: u64,
}

impl EventQueue {
    /// An empty queue holding up to `capacity` events (at least 1). Its
    /// memory grows with use, not at start: most intervals hold a few
    /// events, and the bound is for a stall.
    pub fn new(capacity: usize) -> EventQueue {
        assert!(capacity > 0, "an event queue holds at least one event");
        EventQueue { capacity, inner: Mutex::new(Waiting::default()) }
    }

    /// Appends `events` in order, dropping the oldest waiting ones (and, if
    /// `events` alone is over capacity, its own oldest) to stay within
    /// capacity. Returns how many were dropped.
    pub fn push(&self, events: Vec<TierEvent>) -> u64 {
        let mut waiting = self.inner.lock().expect("event queue lock");
        let mut dropped = 0usize;
        let over = (waiting.events.len() + events.len()).saturating_sub(self.capacity);
        let from_waiting = over.min(waiting.events.len());
        waiting.events.drain(..from_waiting);
        dropped += from_waiting;
        let skip = events.len().saturating_sub(self.capacity);
        dropped += skip;
        waiting.events.extend(events.into_iter().skip(skip));
        debug_assert!(waiting.events.len() <= self.capacity);
        waiting.dropped += dropped as u64;
        dropped as u64
    }

    /// Swaps everything waiting into `spare` (which must be empty, and
    /// whose allocation the queue then reuses) and returns how many events
    /// were dropped since the last take.
    pub fn take_into(&self, spare: &mut VecDeque<TierEvent>) -> u64 {
        assert!(spare.is_empty(), "the spare deque is drained before it is swapped back in");
        let mut waiting = self.inner.lock().expect("event queue lock");
        std::mem::swap(&mut waiting.events, spare);
        std::mem::take(&mut waiting.dropped)
    }

    /// Events waiting now.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("event queue lock").events.len()
    }

    /// No event waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use kvtier_engine::events::Medium;

    fn events(range: std::ops::Range<u8>) -> Vec<TierEvent> {
        range.map(|i| TierEvent::Stored { medium: Medium::Ram, tag: Bytes::from(vec![i]) }).collect()
    }

    fn ids(deque: &VecDeque<TierEvent>) -> Vec<u8> {
        deque
            .iter()
            .map(|e| match e {
                TierEvent::Stored { tag, .. } | TierEvent::Removed { tag, .. } => tag[0],
            })
            .collect()
    }

    #[test]
    fn overflow_drops_the_oldest_and_counts_them() {
        let q = EventQueue::new(4);
        assert_eq!(q.push(events(0..3)), 0);
        assert_eq!(q.push(events(3..6)), 2);
        assert_eq!(q.len(), 4);
        let mut spare = VecDeque::new();
        assert_eq!(q.take_into(&mut spare), 2);
        assert_eq!(ids(&spare), [2, 3, 4, 5]);
        assert!(q.is_empty());
        // The count starts over after a take.
        spare.clear();
        assert_eq!(q.take_into(&mut spare), 0);
    }

    #[test]
    fn a_push_over_capacity_keeps_its_own_newest() {
        let q = EventQueue::new(3);
        q.push(events(0..2));
        assert_eq!(q.push(events(10..15)), 4);
        let mut spare = VecDeque::new();
        assert_eq!(q.take_into(&mut spare), 4);
        assert_eq!(ids(&spare), [12, 13, 14]);
    }

    #[test]
    fn the_spare_allocation_is_reused() {
        let q = EventQueue::new(100);
        let mut spare = VecDeque::with_capacity(64);
        let allocated = spare.capacity();
        q.push(events(0..5));
        q.take_into(&mut spare);
        spare.clear();
        q.push(events(5..6));
        let mut next = VecDeque::new();
        q.take_into(&mut next);
        assert_eq!(ids(&next), [5]);
        // The queue took the first spare's allocation and handed it back.
        assert!(next.capacity() >= allocated);
    }
}
