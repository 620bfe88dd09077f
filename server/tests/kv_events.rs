//! `--kv-events` (docs/OPERATIONS.md, "KV events for routers") on a real
//! server: flags that cannot work stop the start with a message naming the
//! flag, before the store opens; a running publisher shows in `/v1/stats`
//! and `/metrics`. What subscribers receive is tested with vLLM's own
//! classes in clients/python/tests/test_kv_events.py and in-process in
//! server/src/events/tests.rs.

mod common;

use std::time::Duration;

use common::{client, json_call, promtool_check, set_flag, start, test_args, try_start};

/// Starts a server with `flags` added, expects it to refuse, and returns
/// its stderr; the store was never opened (no shard directory).
fn refused(flags: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut args = test_args(&data);
    args.extend(flags.iter().map(|s| s.to_string()));
    let (status, stderr) = try_start(&args).err().unwrap_or_else(|| panic!("{flags:?} must be refused"));
    assert!(!status.expect("exited").success(), "{flags:?}: {stderr}");
    assert!(!data.join("shard-000").exists(), "{flags:?}: the store opened before the refusal");
    stderr
}

#[test]
fn a_malformed_endpoint_is_refused_naming_the_flag() {
    let e = refused(&["--kv-events", "127.0.0.1:5557"]);
    assert!(e.contains("--kv-events \"127.0.0.1:5557\"") && e.contains("tcp://HOST:PORT"), "{e}");
    let e = refused(&["--kv-events", "tcp://127.0.0.1:1", "--kv-events-replay", "tcp://127.0.0.1:nope"]);
    assert!(e.contains("--kv-events-replay") && e.contains("not a number"), "{e}");
}

#[test]
fn a_non_loopback_endpoint_needs_kv_events_public() {
    let e = refused(&["--kv-events", "tcp://0.0.0.0:0"]);
    assert!(e.contains("not a loopback address") && e.contains("--kv-events-public"), "{e}");
    let e = refused(&["--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://*:0"]);
    assert!(e.contains("--kv-events-replay") && e.contains("--kv-events-public"), "{e}");
}

#[test]
fn replay_without_kv_events_is_refused() {
    let e = refused(&["--kv-events-replay", "tcp://127.0.0.1:5558"]);
    assert!(e.contains("--kv-events <tcp://HOST:PORT>"), "{e}");
}

#[test]
fn a_port_in_use_is_refused_naming_the_flag() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let e = refused(&["--kv-events", &format!("tcp://127.0.0.1:{port}")]);
    assert!(e.contains(&format!("--kv-events tcp://127.0.0.1:{port}: cannot listen")) && e.contains("in use"), "{e}");
    // The replay port in use, and the two flags naming one port.
    let e = refused(&["--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", &format!("tcp://127.0.0.1:{port}")]);
    assert!(e.contains("--kv-events-replay tcp://") && e.contains("in use"), "{e}");
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let same = format!("tcp://127.0.0.1:{free}");
    let e = refused(&["--kv-events", &same, "--kv-events-replay", &same]);
    assert!(e.contains("--kv-events-replay") && e.contains("in use"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_publisher_shows_in_stats_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    // Off: the section says so, and no series.
    let server = start(&test_args(&dir.path().join("off")));
    let (_, stats) = json_call(&client(&server, false), http::Method::GET, "/v1/stats", None).await;
    assert_eq!(stats["kv_events"], serde_json::json!({ "endpoint": null }));
    let metrics = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    );
    assert!(!metrics.contains("kvtier_kv_event"), "no KV event series when off");
    server.stop();

    let mut args = test_args(&dir.path().join("on"));
    set_flag(&mut args, "--kv-events", "tcp://127.0.0.1:0");
    set_flag(&mut args, "--kv-events-replay", "tcp://127.0.0.1:0");
    set_flag(&mut args, "--kv-events-topic", "node-a");
    let server = start(&args);
    let (_, stats) = json_call(&client(&server, false), http::Method::GET, "/v1/stats", None).await;
    let ev = &stats["kv_events"];
    let endpoint = ev["endpoint"].as_str().unwrap();
    assert!(endpoint.starts_with("tcp://127.0.0.1:") && !endpoint.ends_with(":0"), "{ev}");
    assert!(ev["replay_endpoint"].as_str().unwrap().starts_with("tcp://127.0.0.1:"), "{ev}");
    assert_eq!((ev["topic"].as_str(), ev["hash"].as_str(), ev["ownership"].as_str()), (Some("node-a"), Some("int"), Some("kvtier")));
    // Batch 0, [AllBlocksCleared], went out at start and is kept for replay.
    assert_eq!(
        (ev["batches_published"].as_u64(), ev["last_seq"].as_u64(), ev["replay_batches_kept"].as_u64()),
        (Some(1), Some(0), Some(1))
    );
    assert_eq!(ev["events_dropped"].as_u64(), Some(0));

    let text = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    );
    let (_, body) = text.split_once("\r\n\r\n").unwrap();
    for series in [
        "kvtier_kv_events_published_total 0",
        "kvtier_kv_event_batches_total 1",
        "kvtier_kv_events_dropped_total 0",
        "kvtier_kv_event_replays_total 0",
        "kvtier_kv_event_batches_replayed_total 0",
        "kvtier_kv_event_subscribers 0",
    ] {
        assert!(body.lines().any(|l| l == series), "no {series:?} in /metrics");
    }
    let (ok, said) = promtool_check(body);
    assert!(ok, "promtool: {said}");
    let listening = server.listening_line();
    assert!(listening.contains("kvtier listening"), "{listening}");
    assert!(server.stop().success());
}
