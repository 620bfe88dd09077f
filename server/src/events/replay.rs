//! The replay ring and its protocol, vLLM's `ZmqEventPublisher._service_replay`:
//!
//! ```text
//! request (ROUTER in)    [identity, b"", start_seq: 8 bytes big-endian]
//! answer, per batch      [identity, b"", topic, seq: 8 bytes BE, payload]   every kept batch with seq >= start_seq, in order
//! end marker             [identity, b"", b"", (-1i64) 8 bytes BE, b""]
//! ```
//!
//! A DEALER client sends `[b"", start_seq]`; a REQ client sends
//! `start_seq` (its socket adds the empty frame) but takes only the first
//! answer. A request of another shape is counted and ignored, as vLLM
//! ignores it (vLLM also reads a start of any width; kvtier wants 8 bytes).
//!
//! The ring keeps the newest `--kv-events-replay-batches` batches and at
//! most [`RING_BYTES_MAX`] bytes of them: a batch holds everything queued
//! in one interval, so after a stall one batch can be large, and the count
//! alone would not bound the memory.

use std::collections::VecDeque;

use bytes::Bytes;

/// Most payload bytes the ring keeps, over all its batches (256 MiB: ten
/// thousand batches of 25 KiB, about 100 events each).
pub const RING_BYTES_MAX: usize = 256 << 20;

/// The sequence number of the end marker: -1 as a signed 8-byte
/// big-endian integer.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The newest batches sent, for replay.
#[derive(Debug)]
pub struct Ring {
    batches: VecDeque<(u64, Bytes)>,
    batches_max: usize,
    bytes: usize,
    bytes_max: usize,
}

impl Ring {
    /// A ring of at most `batches_max` batches (at least 1) and `bytes_max`
    /// payload bytes; the newest batch is kept even when larger.
    pub fn new(batches_max: usize, bytes_max: usize) -> Ring {
        assert!(batches_max > 0, "a replay ring keeps at least one batch");
        Ring { batches: VecDeque::new(), batches_max, bytes: 0, bytes_max }
    }

    /// Keeps batch `seq` (sequence numbers rise), dropping the oldest to
    /// stay within the bounds.
    pub fn push(&mut self, seq: u64, payload: Bytes) {
        debug_assert!(self.batches.back().is_none_or(|(last, _)| *last < seq), "sequence numbers rise");
        self.bytes += payload.len();
        self.batches.push_back((seq, payload));
        while self.batches.len() > self.batches_max || (self.bytes > self.bytes_max && self.batches.len() > 1) {
            let (_, old) = self.batches.pop_front().expect("more than one batch kept");
            self.bytes -= old.len();
        }
    }

    /// Every kept batch with a sequence number from `start` on, oldest
    /// first (the payloads are shared, not copied).
    pub fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        let first = self.batches.partition_point(|(seq, _)| *seq < start);
        self.batches.range(first..).cloned().collect()
    }

    /// Batches kept.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// No batch kept.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Payload bytes kept.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// A replay request read off the ROUTER socket.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    /// The client's identity frame (the answer's first frame).
    pub identity: Bytes,
    /// The first sequence number it asks for.
    pub start: u64,
}

/// Reads `frames` (as the ROUTER socket hands them: identity first) as a
/// replay request; `None` for any other shape.
pub fn parse_request(frames: &[Bytes]) -> Option<Request> {
    let [identity, delimiter, start] = frames else { return None };
    if !delimiter.is_empty() {
        return None;
    }
    let start: [u8; 8] = start.as_ref().try_into().ok()?;
    Some(Request { identity: identity.clone(), start: u64::from_be_bytes(start) })
}

/// The frames of one answer message carrying batch `seq`.
pub fn answer(identity: &Bytes, topic: &Bytes, seq: u64, payload: &Bytes) -> Vec<Bytes> {
    vec![identity.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]
}

/// The frames of the end marker that closes an answer.
pub fn end_marker(identity: &Bytes) -> Vec<Bytes> {
    vec![identity.clone(), Bytes::new(), Bytes::new(), Bytes::from_static(&END_SEQ), Bytes::new()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_of(seqs: std::ops::Range<u64>, batches_max: usize) -> Ring {
        let mut ring = Ring::new(batches_max, RING_BYTES_MAX);
        for seq in seqs {
            ring.push(seq, Bytes::from(format!("batch {seq}")));
        }
        ring
    }

    fn seqs(batches: &[(u64, Bytes)]) -> Vec<u64> {
        batches.iter().map(|(s, _)| *s).collect()
    }

    #[test]
    fn replay_answers_every_kept_batch_from_the_start() {
        let ring = ring_of(0..10, 4);
        assert_eq!(ring.len(), 4);
        assert_eq!(seqs(&ring.since(0)), [6, 7, 8, 9]);
        assert_eq!(seqs(&ring.since(8)), [8, 9]);
        assert!(ring.since(10).is_empty());
        assert_eq!(ring.since(9)[0].1, Bytes::from("batch 9"));
    }

    #[test]
    fn gaps_in_the_sequence_are_kept_as_gaps() {
        let mut ring = Ring::new(10, RING_BYTES_MAX);
        for seq in [0, 1, 3, 4] {
            ring.push(seq, Bytes::from_static(b"x"));
        }
        assert_eq!(seqs(&ring.since(2)), [3, 4]);
    }

    #[test]
    fn the_byte_bound_drops_the_oldest_but_keeps_the_newest() {
        let mut ring = Ring::new(100, 10);
        ring.push(0, Bytes::from_static(b"12345"));
        ring.push(1, Bytes::from_static(b"12345"));
        assert_eq!((ring.len(), ring.bytes()), (2, 10));
        ring.push(2, Bytes::from_static(b"1"));
        assert_eq!(seqs(&ring.since(0)), [1, 2]);
        ring.push(3, Bytes::from(vec![0u8; 50]));
        assert_eq!((seqs(&ring.since(0)), ring.bytes()), (vec![3], 50));
    }

    #[test]
    fn requests_are_identity_empty_and_eight_bytes() {
        let id = Bytes::from_static(b"\x00peer");
        let start = Bytes::copy_from_slice(&7u64.to_be_bytes());
        assert_eq!(parse_request(&[id.clone(), Bytes::new(), start.clone()]), Some(Request { identity: id.clone(), start: 7 }));
        // Malformed: no delimiter, a non-empty delimiter, a short start, extra frames.
        assert_eq!(parse_request(&[id.clone(), start.clone()]), None);
        assert_eq!(parse_request(&[id.clone(), Bytes::from_static(b"x"), start.clone()]), None);
        assert_eq!(parse_request(&[id.clone(), Bytes::new(), Bytes::from_static(b"\x07")]), None);
        assert_eq!(parse_request(&[id.clone(), Bytes::new(), start.clone(), Bytes::new()]), None);
        assert_eq!(parse_request(&[]), None);
    }

    #[test]
    fn answers_and_the_end_marker_are_vllms_frames() {
        let (id, topic) = (Bytes::from_static(b"id"), Bytes::from_static(b"kv"));
        let a = answer(&id, &topic, 258, &Bytes::from_static(b"payload"));
        assert_eq!(a, [&b"id"[..], b"", b"kv", &[0, 0, 0, 0, 0, 0, 1, 2], b"payload"].map(Bytes::copy_from_slice));
        let end = end_marker(&id);
        assert_eq!(end, [&b"id"[..], b"", b"", &[0xff; 8], b""].map(Bytes::copy_from_slice));
    }
}
