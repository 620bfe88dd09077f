//! Backpressure (issue 17, item 4): a shard past `--put-inflight-mib`
//! answers 503 with `Retry-After` instead of queueing, counts the refusal
//! in `/v1/stats` and `/metrics`, and the loadgen's client waits as told and
//! retries. (The I/O-queue limit, `--io-queue-max`, is checked in the
//! engine's tests, where the order of operations is deterministic.)

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{read_until_quiet, status_of};

/// 1 MiB blocks, so `--put-inflight-mib 2` admits exactly two PUTs.
const BLOCK_BYTES: usize = 1 << 20;

fn start(dir: &std::path::Path) -> common::Server {
    let mut args = common::test_args(dir);
    // One shard: every connection lands on the shard whose limit is being
    // filled.
    for (flag, value) in [
        ("--shards", "1"),
        ("--block-bytes", &BLOCK_BYTES.to_string()),
        ("--disk-gb", "0.125"),
        ("--segment-mib", "16"),
        ("--put-inflight-mib", "2"),
    ] {
        common::set_flag(&mut args, flag, value);
    }
    common::start(&args)
}

/// An HTTP/1.1 PUT of one block whose headers and first `sent` body bytes
/// are on the wire; the rest is sent by [`finish`].
fn stalled_put(addr: &str, key: &str, sent: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "PUT /v1/blocks/{key} HTTP/1.1\r\nHost: t\r\nContent-Length: {BLOCK_BYTES}\r\n\r\n").unwrap();
    s.write_all(&vec![7u8; sent]).unwrap();
    s
}

fn finish(mut s: TcpStream, sent: usize) -> u16 {
    s.write_all(&vec![7u8; BLOCK_BYTES - sent]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).unwrap();
    status_of(&String::from_utf8_lossy(&head))
}

fn get_text(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    read_until_quiet(&mut s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_past_the_inflight_limit_get_503_with_retry_after_and_the_loadgen_retries() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path());
    let addr = server.url.trim_start_matches("http://").to_string();
    const SENT: usize = 100_000;

    // Two PUTs mid-body hold the shard's 2 MiB.
    let a = stalled_put(&addr, "a", SENT);
    let b = stalled_put(&addr, "b", SENT);
    std::thread::sleep(Duration::from_millis(200));
    // A third is refused before its body is read.
    let mut c = TcpStream::connect(&addr).unwrap();
    write!(c, "PUT /v1/blocks/c HTTP/1.1\r\nHost: t\r\nContent-Length: {BLOCK_BYTES}\r\n\r\n").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let reply = read_until_quiet(&mut c);
    assert_eq!(status_of(&reply), 503, "{reply}");
    assert!(reply.to_ascii_lowercase().contains("retry-after: 1\r\n"), "{reply}");
    assert!(reply.contains("\"overloaded\"") && reply.contains("--put-inflight-mib 2"), "{reply}");

    // The loadgen's client is refused too, waits the second it was told, and
    // gets in once the stalled PUTs finish.
    let client = std::sync::Arc::new(common::client(&server, false));
    let retrying = {
        let client = client.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let status = client.put("d", vec![Bytes::from(vec![9u8; BLOCK_BYTES])]).await;
            (status, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(client.refusals(), 1, "the client saw the 503");
    assert_eq!(finish(a, SENT), 201);
    // A PUT whose client goes away mid-body gives its admission back.
    drop(b);
    let (status, took) = retrying.await.unwrap();
    assert_eq!(status.unwrap().as_u16(), 201);
    assert!(took >= Duration::from_millis(900), "retried after Retry-After, not at once: {took:?}");
    assert_eq!(client.refusals(), 1);
    // Both slots are free again: two PUTs in flight together are admitted.
    let (e, f) = (stalled_put(&addr, "e", SENT), stalled_put(&addr, "f", SENT));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!((finish(e, SENT), finish(f, SENT)), (201, 201));

    let stats: serde_json::Value = client.stats().await.unwrap();
    assert_eq!(stats["totals"]["put_bytes_refusals"], 2, "{}", stats["totals"]);
    assert_eq!(stats["http"]["per_shard"][0]["put_bytes_refusals"], 2);
    assert_eq!(stats["totals"]["io_queue_refusals"], 0);
    assert_eq!(stats["per_shard"][0]["io_queued"], 0);
    let metrics = get_text(&addr, "/metrics");
    assert!(metrics.contains("kvtier_http_put_bytes_refusals_total{shard=\"0\"} 2"), "{metrics}");
    assert!(metrics.contains("kvtier_shard_io_queue_refusals_total{shard=\"0\"} 0"), "{metrics}");
    // Nothing refused was stored; what got in was.
    assert!(client.get("c").await.unwrap().is_none());
    assert!(client.get("b").await.unwrap().is_none());
    for key in ["a", "d", "e", "f"] {
        assert!(client.get(key).await.unwrap().is_some(), "{key}");
    }
    assert!(server.stop().success());
}
