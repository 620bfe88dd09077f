//! A ZeroMQ SUB socket on one node's KV event stream (`kvtier serve
//! --kv-events`), read by a tokio task that decodes every batch
//! ([`super::wire`]) into the node's [`NodeIndex`] and counts what came.
//!
//! Delivery is at most once (docs/OPERATIONS.md, "KV events for routers"):
//! the task notes the batches a gap in the sequence numbers says it missed
//! and goes on; it does not ask the replay socket for them, so a run with
//! `missed_batches > 0` routed on an index that lacks those events.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use zeromq::{Socket, SocketRecv, SubSocket};

use super::index::NodeIndex;
use super::wire::{decode_batch, sequence, KvEvent};

/// How long [`Subscriber::connect`] tries to reach the PUB socket.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What one subscriber received.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SubscriberStats {
    /// The node's event endpoint.
    pub endpoint: String,
    /// Batches received.
    pub batches: u64,
    /// Events decoded (of the types and media a router uses).
    pub events: u64,
    /// `BlockStored` events.
    pub stored: u64,
    /// `BlockRemoved` events.
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Batches the sequence numbers say were missed (sent before the
    /// subscription reached the node are not counted: the count starts at
    /// the first batch received).
    pub missed_batches: u64,
    /// Messages that were not `[topic, seq, payload]` or did not decode.
    pub malformed: u64,
    /// The first error decoding one, if any.
    pub first_malformed: Option<String>,
    /// Sequence number of the last batch received.
    pub last_seq: Option<u64>,
}

impl SubscriberStats {
    /// Counts one message's frames into `index`.
    pub fn receive(&mut self, frames: &[bytes::Bytes], index: &Mutex<NodeIndex>) {
        let parsed = match frames {
            [_topic, seq, payload] => sequence(seq).ok_or_else(|| format!("a {}-byte sequence number", seq.len())).and_then(|s| {
                let events = decode_batch(payload).map_err(|e| e.to_string())?;
                Ok((s, events))
            }),
            _ => Err(format!("{} frames, not 3", frames.len())),
        };
        let (seq, events) = match parsed {
            Ok(p) => p,
            Err(e) => {
                self.malformed += 1;
                self.first_malformed.get_or_insert(e);
                return;
            }
        };
        if let Some(last) = self.last_seq {
            // A node that restarts begins again at 0: not a gap.
            self.missed_batches += seq.saturating_sub(last + 1);
        }
        self.last_seq = Some(seq);
        self.batches += 1;
        self.events += events.len() as u64;
        for e in &events {
            match e {
                KvEvent::Stored { .. } => self.stored += 1,
                KvEvent::Removed { .. } => self.removed += 1,
                KvEvent::Cleared => self.cleared += 1,
            }
        }
        let mut index = index.lock().expect("index lock");
        for e in &events {
            index.apply(e);
        }
    }
}

/// A running subscription: the index it fills and its counts.
pub struct Subscriber {
    /// The node's blocks as its events said.
    pub index: Arc<Mutex<NodeIndex>>,
    /// What came so far.
    pub stats: Arc<Mutex<SubscriberStats>>,
    task: tokio::task::JoinHandle<()>,
}

impl Subscriber {
    /// Subscribes to every topic at `endpoint` (`tcp://HOST:PORT`) and
    /// starts reading into a new index (`follows_removals`: as
    /// [`NodeIndex::new`]). The subscription reaches the node a moment
    /// after the connection: wait for the node to count the subscriber
    /// (`/v1/stats` `kv_events.subscribers`) before relying on it.
    ///
    /// # Errors
    /// The endpoint cannot be reached within [`CONNECT_TIMEOUT`].
    pub async fn connect(endpoint: &str, follows_removals: bool) -> Result<Subscriber, String> {
        let mut socket = SubSocket::new();
        socket.subscribe("").await.map_err(|e| format!("cannot subscribe to {endpoint}: {e}"))?;
        match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("cannot connect to the KV events at {endpoint}: {e}")),
            Err(_) => return Err(format!("no KV events at {endpoint} within {} s", CONNECT_TIMEOUT.as_secs())),
        }
        let index = Arc::new(Mutex::new(NodeIndex::new(follows_removals)));
        let stats = Arc::new(Mutex::new(SubscriberStats { endpoint: endpoint.to_string(), ..Default::default() }));
        let task = {
            let (index, stats) = (index.clone(), stats.clone());
            tokio::spawn(async move {
                // Ends when the socket fails or the task is aborted.
                while let Ok(message) = socket.recv().await {
                    stats.lock().expect("stats lock").receive(&message.into_vec(), &index);
                }
            })
        };
        Ok(Subscriber { index, stats, task })
    }

    /// Stops reading and returns the counts.
    pub fn stop(self) -> SubscriberStats {
        self.task.abort();
        let stats = self.stats.lock().expect("stats lock").clone();
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn counts_batches_events_gaps_and_bad_messages() {
        let index = Mutex::new(NodeIndex::new(true));
        let mut s = SubscriberStats::default();
        // [ts 1.5, [AllBlocksCleared], 0], msgspec's bytes.
        let cleared: Vec<u8> = [0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x81, 0xa4]
            .iter()
            .copied()
            .chain(*b"type")
            .chain([0xb0])
            .chain(*b"AllBlocksCleared")
            .chain([0])
            .collect();
        let msg = |seq: u64| vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(cleared.clone())];
        s.receive(&msg(4), &index);
        s.receive(&msg(5), &index);
        s.receive(&msg(9), &index);
        s.receive(&msg(0), &index);
        s.receive(&[Bytes::new()], &index);
        s.receive(&[Bytes::new(), Bytes::from_static(b"x"), Bytes::new()], &index);
        assert_eq!((s.batches, s.events, s.cleared, s.missed_batches, s.malformed), (4, 4, 4, 3, 2));
        assert_eq!(s.last_seq, Some(0));
        assert!(s.first_malformed.unwrap().contains("1 frames"));
    }
}
