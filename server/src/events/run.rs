//! The thread `kvtier-events`: a tokio current-thread runtime (zmq.rs
//! runs on tokio; the shards run glommio, which it cannot share) with
//! three tasks: the batch loop (below), the replay server and the
//! subscriber count.
//!
//! The batch loop sends batch 0, `[AllBlocksCleared]`, before the store
//! opens (a router forgets what an earlier run of this node published;
//! the blocks recovery finds are then published as stored), then every
//! interval swaps the queue out and sends all of it as one batch. A batch
//! after dropped events skips one sequence number, so a subscriber sees
//! the loss as a gap, as it would a batch lost on the wire.

use std::collections::{HashSet, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use kvtier_engine::events::TierEvent;
use zeromq::{PubSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::replay::{self, Request};
use super::{Counters, Shared, PUB_SEND_TIMEOUT, REPLAY_SEND_TIMEOUT, STOP_LINGER};

/// What the thread reports once its sockets accept: their addresses, or
/// why it cannot run.
type Ready = Result<(SocketAddr, Option<SocketAddr>), String>;

/// Replay answers yield to the batch loop every this many batches.
const REPLAY_YIELD_EVERY: usize = 256;

/// The thread's body: builds the runtime and runs the publisher until
/// `stop` is notified.
pub(super) fn thread_main(
    shared: Arc<Shared>,
    listeners: (TcpListener, Option<TcpListener>),
    stop: Arc<tokio::sync::Notify>,
    ready: Sender<Ready>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(format!("--kv-events: cannot start the publisher's runtime: {e}")));
            return;
        }
    };
    runtime.block_on(publish(shared, listeners, stop, ready));
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

async fn publish(shared: Arc<Shared>, listeners: (TcpListener, Option<TcpListener>), stop: Arc<tokio::sync::Notify>, ready: Sender<Ready>) {
    let (pub_listener, replay_listener) = listeners;
    let addr = |l: &TcpListener| l.local_addr().map_err(|e| format!("--kv-events: the bound socket has no address: {e}"));
    let bound = match (addr(&pub_listener), replay_listener.as_ref().map(addr).transpose()) {
        (Ok(p), Ok(r)) => (p, r),
        (Err(e), _) | (_, Err(e)) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut socket = PubSocket::new();
    // Taken before the bind, so no connection's Accepted is missed.
    tokio::spawn(count_subscribers(socket.monitor(), shared.clone()));
    if let Err(e) = socket.bind_listener(pub_listener).await {
        let _ = ready.send(Err(format!("--kv-events: the PUB socket cannot take its listener: {e}")));
        return;
    }
    let topic = Bytes::from(shared.settings.topic.clone().into_bytes());
    if let Some(listener) = replay_listener {
        let mut router = RouterSocket::new();
        if let Err(e) = router.bind_listener(listener).await {
            let _ = ready.send(Err(format!("--kv-events-replay: the ROUTER socket cannot take its listener: {e}")));
            return;
        }
        tokio::spawn(serve_replays(router, shared.clone(), topic.clone()));
    }
    let mut batches = Batches { socket, shared: shared.clone(), topic, next_seq: 0 };
    let cleared = shared.settings.encoding.cleared(unix_seconds());
    batches.send(cleared, 0).await;
    if ready.send(Ok(bound)).is_err() {
        return;
    }
    let mut tick = tokio::time::interval(shared.settings.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut spare = VecDeque::new();
    loop {
        let stopping = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.notified() => true,
        };
        batches.flush(&mut spare).await;
        if stopping {
            break;
        }
    }
    if shared.counters.subscribers.load(Ordering::Relaxed) > 0 {
        tokio::time::sleep(STOP_LINGER).await;
    }
}

/// The batch loop's state: the PUB socket and the next sequence number.
struct Batches {
    socket: PubSocket,
    shared: Arc<Shared>,
    topic: Bytes,
    next_seq: u64,
}

impl Batches {
    /// Sends everything queued as one batch, if anything is.
    async fn flush(&mut self, spare: &mut VecDeque<TierEvent>) {
        let dropped = self.shared.queue.take_into(spare);
        if dropped > 0 {
            // The number this batch would have had stands for the events
            // dropped: subscribers see a gap no replay fills.
            self.next_seq += 1;
        }
        if spare.is_empty() {
            return;
        }
        let encoded = self.shared.settings.encoding.batch(unix_seconds(), spare.drain(..));
        Counters::add(&self.shared.counters.tags_undecodable, encoded.undecodable);
        self.send(encoded.payload, encoded.events).await;
    }

    /// Sends `payload` (a batch of `events`) under the next sequence
    /// number, and keeps it for replay.
    async fn send(&mut self, payload: Vec<u8>, events: u64) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(payload);
        self.shared.ring.lock().expect("replay ring lock").push(seq, payload.clone());
        let frames = vec![self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
        let message = ZmqMessage::try_from(frames).expect("three frames");
        let c = &self.shared.counters;
        match tokio::time::timeout(PUB_SEND_TIMEOUT, self.socket.send(message)).await {
            Ok(Ok(())) => {
                Counters::add(&c.batches_published, 1);
                Counters::add(&c.events_published, events);
            }
            Ok(Err(e)) => {
                tracing::debug!("KV event batch {seq} not sent: {e}");
                Counters::add(&c.batches_unsent, 1);
            }
            Err(_) => Counters::add(&c.batches_unsent, 1),
        }
        c.last_seq.store(seq, Ordering::Relaxed);
    }
}

/// Answers replay requests on `router` until the runtime stops.
async fn serve_replays(mut router: RouterSocket, shared: Arc<Shared>, topic: Bytes) {
    let c = &shared.counters;
    loop {
        let message = match router.recv().await {
            Ok(m) => m,
            Err(e) => {
                // Not expected (the socket waits for peers); no busy loop if it happens.
                tracing::debug!("replay socket: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let frames = message.into_vec();
        let Some(Request { identity, start }) = replay::parse_request(&frames) else {
            Counters::add(&c.replay_requests_malformed, 1);
            continue;
        };
        Counters::add(&c.replay_requests, 1);
        let batches = shared.ring.lock().expect("replay ring lock").since(start);
        let mut answered = true;
        for (i, (seq, payload)) in batches.iter().enumerate() {
            if !send_replay(&mut router, replay::answer(&identity, &topic, *seq, payload)).await {
                answered = false;
                break;
            }
            Counters::add(&c.batches_replayed, 1);
            if i % REPLAY_YIELD_EVERY == REPLAY_YIELD_EVERY - 1 {
                tokio::task::yield_now().await;
            }
        }
        if !answered || !send_replay(&mut router, replay::end_marker(&identity)).await {
            Counters::add(&c.replays_abandoned, 1);
        }
    }
}

/// Sends one answer message; false when the client did not take it
/// within [`REPLAY_SEND_TIMEOUT`] or is gone.
async fn send_replay(router: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    let message = ZmqMessage::try_from(frames).expect("five frames");
    matches!(tokio::time::timeout(REPLAY_SEND_TIMEOUT, router.send(message)).await, Ok(Ok(())))
}

/// Keeps [`super::Counters::subscribers`] at the number of connections the
/// PUB socket holds, from its monitor's events.
async fn count_subscribers(mut events: futures::channel::mpsc::Receiver<SocketEvent>, shared: Arc<Shared>) {
    let mut peers = HashSet::new();
    while let Some(event) = events.next().await {
        match event {
            SocketEvent::Accepted(_, peer) => {
                peers.insert(peer);
            }
            SocketEvent::Disconnected(peer) => {
                peers.remove(&peer);
            }
            _ => continue,
        }
        shared.counters.subscribers.store(peers.len() as u64, Ordering::Relaxed);
    }
}
