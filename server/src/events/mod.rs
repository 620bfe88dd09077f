//! KV events for routers (docs/OPERATIONS.md, "KV events for routers"): a
//! front door that publishes every tier's block arrivals and departures
//! in vLLM's event format (vLLM 0.32.0, `vllm/distributed/kv_events.py`),
//! so a KV-aware router (Dynamo's KV router, llm-d's indexer, vLLM's own
//! consumers) follows what this node holds and sends a request to the
//! node with its prefix.
//!
//! ```text
//! shard threads ──submit──► EventQueue ──every --kv-events-interval-ms──► thread kvtier-events
//!  (engine's Residency::flush)  (bounded; drops oldest,                  (tokio, current thread)
//!                               counted)                                  encode one KVEventBatch
//!                                                                          ├─► PUB    [topic, seq BE, msgpack]
//!                                                                          └─► Ring ◄── ROUTER replay requests
//! ```
//!
//! - [`args`]: the flags; [`EventsArgs::open`] checks them, binds both
//!   ports and starts the thread, before the store opens.
//! - [`endpoint`]: `tcp://HOST:PORT`, loopback unless `--kv-events-public`.
//! - [`queue`]: the shards' side, never blocking a shard.
//! - [`encode`]: msgpack, byte for byte as msgspec writes vLLM's classes.
//! - [`replay`]: the ring and vLLM's replay protocol.
//! - `run.rs`: the publisher thread; `door.rs`: `/v1/stats` and `/metrics`.
//!
//! **Why zmq.rs** (`zeromq` 0.7, the ZeroMQ organisation's own Rust
//! implementation): it is maintained (0.7.0 is recent: it needs Rust
//! 1.89), pure Rust (no libzmq and no C++ build, where the `zmq` crate
//! binds libzmq), runs on tokio, and has the PUB and ROUTER sockets
//! vLLM's publisher uses, speaking ZMTP 3 to pyzmq and libzmq peers.
//!
//! **A slow subscriber never slows the server** (read in zeromq 0.7.0's
//! `src/pub.rs`): `PubSocket::send` only pushes the message onto a bounded
//! fan-out queue (100,000 messages; a full one drops it) and returns; a
//! fan-out task `try_send`s it into each subscriber's bounded queue
//! (100,000 messages) and drops it for a subscriber whose queue is full.
//! Nothing there waits for a subscriber. The cost: zmq.rs has no send
//! high-water mark to set, so a subscriber that stops reading holds up to
//! 100,000 batches in memory (shared with the replay ring, not copied;
//! about 17 minutes of batches at the default interval) until it
//! disconnects. The ROUTER socket's send, in contrast, waits when a
//! client's queue is full (`backend.rs`, `send_to_peer`), so every replay
//! send has a timeout ([`REPLAY_SEND_TIMEOUT`]) and an answer a client
//! does not take is abandoned and counted; the PUB send has one too, in
//! case a later zmq.rs changes.

pub mod args;
mod door;
pub mod encode;
pub mod endpoint;
pub mod queue;
pub mod replay;
mod run;
#[cfg(test)]
mod tests;

pub use args::EventsArgs;
pub use door::EventsOff;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvtier_engine::events::{EventSink, TierEvent};

/// How long one send to a replay client may wait for room in its queue
/// before the rest of its answer is abandoned (and counted).
pub const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// How long one PUB send may take: never more than a push onto a queue in
/// zeromq 0.7 (see the module docs); past this the batch counts as unsent.
pub const PUB_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// After the last batch at a clean stop, how long the sockets stay open
/// for their writer tasks to hand it to the kernel.
pub const STOP_LINGER: Duration = Duration::from_millis(200);

/// How long [`Publisher::stop`] waits for the thread to end.
pub const STOP_WAIT_MAX: Duration = Duration::from_secs(5);

/// What the publisher is asked to do, from the flags.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The PUB socket's address.
    pub endpoint: SocketAddr,
    /// The ROUTER socket's, for replay.
    pub replay: Option<SocketAddr>,
    /// The first frame of every message (`--kv-events-topic`).
    pub topic: String,
    /// How often queued events are sent as one batch.
    pub interval: Duration,
    /// Most events waiting between batches.
    pub queue_events: usize,
    /// Most batches kept for replay.
    pub replay_batches: usize,
    /// Hash format and ownership of every event.
    pub encoding: encode::Encoding,
}

/// The publisher's counters, read by `/v1/stats` and `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Events the shards handed over.
    pub events_submitted: AtomicU64,
    /// Events sent on the PUB socket, in batches.
    pub events_published: AtomicU64,
    /// Batches sent on the PUB socket (`[AllBlocksCleared]` at start
    /// included).
    pub batches_published: AtomicU64,
    /// Events dropped because the queue was full; each batch after a drop
    /// skips one sequence number, so subscribers see the gap.
    pub events_dropped: AtomicU64,
    /// Events left out because their tag did not decode (a bug if not 0).
    pub tags_undecodable: AtomicU64,
    /// Batches a PUB send did not take (an error, or past
    /// [`PUB_SEND_TIMEOUT`]); also in the ring.
    pub batches_unsent: AtomicU64,
    /// Replay requests answered (in full or not).
    pub replay_requests: AtomicU64,
    /// Batches sent in answer to replay requests.
    pub batches_replayed: AtomicU64,
    /// Replay requests of another shape than vLLM's, ignored.
    pub replay_requests_malformed: AtomicU64,
    /// Replay answers cut short: the client's queue stayed full past
    /// [`REPLAY_SEND_TIMEOUT`], or it went away.
    pub replays_abandoned: AtomicU64,
    /// Subscribers connected to the PUB socket now.
    pub subscribers: AtomicU64,
    /// The sequence number of the latest batch sent.
    pub last_seq: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// What the shards and the publisher thread share.
#[derive(Debug)]
struct Shared {
    settings: Settings,
    queue: queue::EventQueue,
    ring: Mutex<replay::Ring>,
    counters: Counters,
}

/// The KV event publisher: the engine's [`EventSink`], and the thread
/// `kvtier-events` sending batches on a PUB socket and answering replays.
#[derive(Debug)]
pub struct Publisher {
    shared: Arc<Shared>,
    /// Where the sockets listen (a port 0 in the flags resolved).
    bound: (SocketAddr, Option<SocketAddr>),
    stop: Arc<tokio::sync::Notify>,
    /// The thread, and the channel whose sender it holds until it ends (so
    /// a receive returns when the thread has ended, panicked or not).
    thread: Mutex<Option<(std::thread::JoinHandle<()>, std::sync::mpsc::Receiver<()>)>>,
}

impl Publisher {
    /// Starts the thread over the bound `listeners` (PUB, then replay) and
    /// returns once both sockets accept and batch 0 (`[AllBlocksCleared]`)
    /// has been sent.
    ///
    /// # Errors
    /// The thread or its runtime could not start, or a socket could not
    /// take its listener.
    pub fn start(settings: Settings, listeners: (TcpListener, Option<TcpListener>)) -> Result<Arc<Publisher>, String> {
        assert!(listeners.1.is_some() == settings.replay.is_some(), "a replay listener exactly when a replay endpoint");
        let shared = Arc::new(Shared {
            queue: queue::EventQueue::new(settings.queue_events),
            ring: Mutex::new(replay::Ring::new(settings.replay_batches, replay::RING_BYTES_MAX)),
            counters: Counters::default(),
            settings,
        });
        let stop = Arc::new(tokio::sync::Notify::new());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (ended_tx, ended_rx) = std::sync::mpsc::channel::<()>();
        let thread = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name("kvtier-events".into())
                .spawn(move || {
                    let _ended = ended_tx;
                    run::thread_main(shared, listeners, stop, ready_tx)
                })
                .map_err(|e| format!("--kv-events: starting the publisher thread: {e}"))?
        };
        let bound = match ready_rx.recv() {
            Ok(Ok(bound)) => bound,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err("--kv-events: the publisher thread stopped before it was ready".into()),
        };
        Ok(Arc::new(Publisher { shared, bound, stop, thread: Mutex::new(Some((thread, ended_rx))) }))
    }

    /// The PUB socket's address.
    pub fn endpoint(&self) -> SocketAddr {
        self.bound.0
    }

    /// The replay socket's address, with `--kv-events-replay`.
    pub fn replay_endpoint(&self) -> Option<SocketAddr> {
        self.bound.1
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Events waiting for the next batch.
    pub fn queued_events(&self) -> usize {
        self.shared.queue.len()
    }

    /// Sends what is queued as a last batch, closes the sockets and waits
    /// (at most [`STOP_WAIT_MAX`]) for the thread to end. Call after the
    /// engine has stopped, so its last events are in that batch. A second
    /// call does nothing.
    pub fn stop(&self) {
        let Some((thread, ended)) = self.thread.lock().expect("publisher thread lock").take() else { return };
        self.stop.notify_one();
        // Nothing is ever sent: the receive ends when the thread drops the
        // sender, that is when it ends.
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = ended.recv_timeout(STOP_WAIT_MAX) {
            tracing::warn!("the KV event publisher did not stop within {STOP_WAIT_MAX:?}; leaving it");
            return;
        }
        if thread.join().is_err() {
            tracing::error!("the KV event publisher thread panicked");
        }
    }
}

impl EventSink for Publisher {
    /// Queues a shard's events of one interval; never waits for the
    /// publisher or a subscriber (see [`queue`]).
    fn submit(&self, _shard: usize, events: Vec<TierEvent>) {
        let n = events.len() as u64;
        let dropped = self.shared.queue.push(events);
        let c = &self.shared.counters;
        Counters::add(&c.events_submitted, n);
        Counters::add(&c.events_dropped, dropped);
    }
}
