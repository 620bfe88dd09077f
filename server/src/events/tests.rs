//! The publisher end to end in one process: events fed to it as the
//! engine would, read back through zmq.rs SUB and DEALER sockets (pyzmq
//! and vLLM's own classes read them in clients/python/tests/test_kv_events.py).

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use kvtier_engine::events::{BlockTag, EventSink, Medium, TierEvent};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::encode::{Encoding, HashFormat};
use super::{endpoint, Publisher, Settings};

const WAIT: Duration = Duration::from_secs(10);

fn settings(queue_events: usize) -> Settings {
    Settings {
        endpoint: "127.0.0.1:0".parse().unwrap(),
        replay: Some("127.0.0.1:0".parse().unwrap()),
        topic: "kv".into(),
        interval: Duration::from_millis(10),
        queue_events,
        replay_batches: 100,
        encoding: Encoding { hash: HashFormat::Int, ownership: Some("kvtier".into()) },
    }
}

fn start(queue_events: usize) -> std::sync::Arc<Publisher> {
    let s = settings(queue_events);
    let listeners =
        (endpoint::bind("--kv-events", s.endpoint).unwrap(), Some(endpoint::bind("--kv-events-replay", s.replay.unwrap()).unwrap()));
    Publisher::start(s, listeners).unwrap()
}

fn stored(first_hash: u8) -> TierEvent {
    let tag = BlockTag { block_hashes: vec![vec![first_hash; 8]], parent_hash: None, block_size: 2, token_ids: vec![1, 2] };
    TierEvent::Stored { medium: Medium::Nvme, tag: tag.encode() }
}

/// The payload with its timestamp (bytes 2..10, a float64) zeroed.
fn without_ts(payload: &[u8]) -> Vec<u8> {
    assert_eq!(&payload[..2], &[0x93, 0xcb], "[ts as float64, ...]");
    let mut p = payload.to_vec();
    p[2..10].fill(0);
    p
}

fn expected(events: Vec<TierEvent>) -> Vec<u8> {
    without_ts(&settings(1).encoding.batch(0.0, events).payload)
}

fn seq_of(frame: &Bytes) -> u64 {
    u64::from_be_bytes(frame.as_ref().try_into().expect("8-byte sequence number"))
}

async fn recv(socket: &mut impl SocketRecv) -> Vec<Bytes> {
    tokio::time::timeout(WAIT, socket.recv()).await.expect("a message in time").expect("recv").into_vec()
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_carry_vllms_frames_drops_show_as_gaps_and_replay_fills_the_rest() {
    let publisher = start(4);
    let c = publisher.counters();
    assert_eq!((c.batches_published.load(Ordering::Relaxed), c.last_seq.load(Ordering::Relaxed)), (1, 0), "batch 0 at start");

    let mut sub = SubSocket::new();
    sub.subscribe("").await.unwrap();
    sub.connect(&format!("tcp://{}", publisher.endpoint())).await.unwrap();
    until("the subscriber", || c.subscribers.load(Ordering::Relaxed) == 1).await;
    // The subscription travels after the connection: until it arrives the
    // PUB socket sends this subscriber nothing, so probe until a batch lands.
    let mut probes = 0u8;
    let first = loop {
        publisher.submit(0, vec![stored(200 + probes)]);
        probes += 1;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            break m.into_vec();
        }
    };
    assert_eq!(first.len(), 3, "[topic, seq, payload]");
    assert_eq!(first[0], Bytes::from_static(b"kv"));
    // Probe k went out alone as batch k (batch 0 came before any).
    let seq = seq_of(&first[1]);
    assert!((1..=u64::from(probes)).contains(&seq), "seq {seq} of {probes} probes");
    assert_eq!(without_ts(&first[2]), expected(vec![stored(200 + seq as u8 - 1)]));
    let probe_seq = u64::from(probes);

    // Six events into a queue of four: the two oldest dropped, and the
    // batch carrying the rest skips a sequence number.
    publisher.submit(1, (0..6).map(stored).collect());
    let batch = loop {
        let m = recv(&mut sub).await;
        if seq_of(&m[1]) > probe_seq {
            break m;
        }
    };
    assert_eq!(seq_of(&batch[1]), probe_seq + 2, "a gap for the dropped events");
    assert_eq!(without_ts(&batch[2]), expected((2..6).map(stored).collect()));
    assert_eq!(c.events_dropped.load(Ordering::Relaxed), 2);
    assert_eq!(c.events_published.load(Ordering::Relaxed), u64::from(probes) + 4);

    // Replay from 0 (a DEALER sends the empty delimiter itself): every
    // batch kept, the gap left a gap, then the end marker.
    let mut dealer = DealerSocket::new();
    dealer.connect(&format!("tcp://{}", publisher.replay_endpoint().unwrap())).await.unwrap();
    dealer.send(ZmqMessage::from("not a request")).await.unwrap();
    let request = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())]).unwrap();
    dealer.send(request).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let m = recv(&mut dealer).await;
        assert_eq!(m.len(), 4, "[empty, topic, seq, payload]: {m:?}");
        assert!(m[0].is_empty());
        if m[2].as_ref() == (-1i64).to_be_bytes() {
            assert!(m[1].is_empty() && m[3].is_empty(), "the end marker: {m:?}");
            break;
        }
        assert_eq!(m[1], Bytes::from_static(b"kv"));
        if seq_of(&m[2]) == 0 {
            assert_eq!(without_ts(&m[3]), without_ts(&Encoding { hash: HashFormat::Int, ownership: None }.cleared(0.0)));
        }
        seqs.push(seq_of(&m[2]));
    }
    let mut want: Vec<u64> = (0..=probe_seq).collect();
    want.push(probe_seq + 2);
    assert_eq!(seqs, want);
    assert_eq!(c.replay_requests.load(Ordering::Relaxed), 1);
    assert_eq!(c.replay_requests_malformed.load(Ordering::Relaxed), 1);
    assert_eq!(c.batches_replayed.load(Ordering::Relaxed), want.len() as u64);

    // A clean stop sends what is queued, then ends the thread.
    publisher.submit(0, vec![stored(99)]);
    publisher.stop();
    let last = recv(&mut sub).await;
    assert_eq!(without_ts(&last[2]), expected(vec![stored(99)]));
    publisher.stop();
}

#[test]
fn a_submit_never_waits_for_the_publisher() {
    // A publisher whose thread is busy elsewhere: submits only queue.
    let publisher = start(1000);
    let started = std::time::Instant::now();
    for i in 0..10_000u32 {
        publisher.submit(0, vec![stored(i as u8)]);
    }
    assert!(started.elapsed() < Duration::from_secs(2), "10,000 submits took {:?}", started.elapsed());
    publisher.stop();
    let c = publisher.counters();
    assert_eq!(c.events_submitted.load(Ordering::Relaxed), 10_000);
    let (published, dropped) = (c.events_published.load(Ordering::Relaxed), c.events_dropped.load(Ordering::Relaxed));
    // No subscriber: the PUB socket takes and discards every batch.
    assert_eq!(published + dropped, 10_000, "published {published}, dropped {dropped}");
}
