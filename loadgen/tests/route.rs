//! `kvtier-loadgen route` end to end: two real `kvtier serve --kv-events`
//! nodes, the sample ShareGPT conversations routed over them by the
//! router in each mode, its indexes filled from the nodes' real event
//! streams.
//!
//! The nodes share no bucket here (that needs an S3 server; `make
//! bench-router` has one) and are roomy (the test store, nothing evicted),
//! so what the test holds is what must hold whatever the timing: the
//! router learned blocks from the events, a router following every event
//! never believed a node held a block it did not serve locally, and the
//! figures add up.
//!
//! The server is the `kvtier` binary beside this test's executable
//! (`target/debug/kvtier`, which `cargo test --workspace` builds), or
//! `KVTIER_BIN`.

use std::path::Path;
use std::process::Command;

use kvtier_loadgen::server_process::ServerProcess;
use kvtier_test_support::server_args::{kvtier_bin, set_flag, test_args, BLOCK_BYTES};

/// A test node with a RAM tier of 64 blocks and KV events on a free port.
fn node(dir: &Path) -> (ServerProcess, tempfile::NamedTempFile) {
    let mut args = test_args(dir);
    set_flag(&mut args, "--ram-gb", &((64 * BLOCK_BYTES) as f64 / (1u64 << 30) as f64).to_string());
    set_flag(&mut args, "--block-tokens", "64");
    set_flag(&mut args, "--kv-events", "tcp://127.0.0.1:0");
    let log = tempfile::NamedTempFile::new().unwrap();
    let process = ServerProcess::start(&kvtier_bin(), &args, log.path()).unwrap_or_else(|e| panic!("{e}"));
    (process, log)
}

fn route(nodes: &[&str], mode: &str, out: &Path) -> serde_json::Value {
    route_with(nodes, mode, out, &[])
}

/// [`route`] with `extra` flags.
fn route_with(nodes: &[&str], mode: &str, out: &Path, extra: &[&str]) -> serde_json::Value {
    let dataset = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/sharegpt_sample.json");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-loadgen"));
    cmd.arg("route");
    for n in nodes {
        cmd.args(["--node", n]);
    }
    let o = cmd
        .args(["--mode", mode, "--users", "2", "--conversations", "4", "--passes", "1", "--duration-s", "120"])
        .args(["--generation-mode", "fast", "--seed", "5"])
        .args(extra)
        .arg("--dataset-path")
        .arg(&dataset)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "route --mode {mode}: {stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.starts_with(&format!("route ({mode}): ")), "{stdout}");
    serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap()
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{v} is not a count"))
}

#[test]
fn the_router_learns_from_both_nodes_events_and_its_figures_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut turns_by_mode = Vec::new();
    for mode in ["events", "store-only", "round-robin"] {
        // Fresh nodes per mode, as the benchmark runs them.
        let (a, _la) = node(&dir.path().join(format!("{mode}-a")));
        let (b, _lb) = node(&dir.path().join(format!("{mode}-b")));
        let r = route(&[a.url(), b.url()], mode, &dir.path().join(mode));
        assert_eq!((r["mode"].as_str(), r["config"]["mode"].as_str()), (Some("route"), Some(mode)), "{r}");
        assert_eq!((u(&r["errors"]), u(&r["wrong_bytes"])), (0, 0), "{r}");
        let turns = u(&r["turns"]);
        assert!(turns > 0, "{r}");
        let per_node: Vec<u64> = r["turns_per_node"].as_array().unwrap().iter().map(u).collect();
        assert_eq!(per_node.len(), 2);
        assert!(per_node.iter().sum::<u64>() >= turns, "every turn went to a node: {r}");

        // Both event streams reached the router, and it indexed them.
        for s in r["subscribers"].as_array().unwrap() {
            assert!(u(&s["events"]) > 0 && u(&s["stored"]) > 0, "{s}");
            assert_eq!(u(&s["malformed"]), 0, "{s}");
        }
        assert!(r["index_blocks"].as_array().unwrap().iter().map(u).sum::<u64>() > 0, "{r}");

        // Prefix tokens: served locally or from S3 (none here), within the hits.
        let block_tokens = u(&r["config"]["block_tokens"]);
        assert_eq!(block_tokens, 64);
        let (hit, local, s3) = (u(&r["tokens_hit"]), u(&r["tokens_local"]), u(&r["tokens_s3"]));
        assert_eq!(s3, 0, "no bucket: {r}");
        assert!(local + s3 <= hit && hit <= u(&r["tokens_looked_up"]), "{r}");
        let gets: u64 = r["gets_by_tier"].as_object().unwrap().values().map(u).sum();
        assert_eq!(gets, u(&r["blocks_read"]), "{r}");
        assert_eq!(local, gets * block_tokens, "every block read was the node's own: {r}");
        assert!(u(&r["served_local_prefix_blocks"]) * block_tokens <= local, "{r}");
        match mode {
            "round-robin" => assert_eq!(u(&r["predicted_local_blocks"]), 0, "no index: {r}"),
            _ => {
                // Later turns of a conversation found its blocks in the index.
                assert!(u(&r["predicted_local_blocks"]) > 0, "{r}");
                assert!(local > 0, "{r}");
                // Nothing was evicted, so nothing either router believed was stale.
                assert_eq!(u(&r["turns_overpredicted"]), 0, "{r}");
            }
        }
        turns_by_mode.push(turns);
    }
    assert!(turns_by_mode.iter().all(|&t| t == turns_by_mode[0]), "one pass over the same conversations: {turns_by_mode:?}");
}

/// With a think time longer than a node's publishing interval the router
/// has every event of a conversation's last reply before its next turn: on
/// nodes that evict nothing, with conversations kept where they are (a
/// large overlap weight), it predicts exactly the blocks the node serves.
#[test]
fn with_think_time_the_router_sees_the_last_replys_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _la) = node(&dir.path().join("a"));
    let (b, _lb) = node(&dir.path().join("b"));
    let r = route_with(&[a.url(), b.url()], "events", &dir.path().join("out"), &["--think-ms", "200", "--overlap-weight", "1000000"]);
    assert_eq!(u(&r["config"]["think_ms"]), 200, "{r}");
    assert_eq!((u(&r["errors"]), u(&r["wrong_bytes"])), (0, 0), "{r}");
    let (predicted, served) = (u(&r["predicted_local_blocks"]), u(&r["served_local_prefix_blocks"]));
    assert!(served > 0, "later turns read their prefix: {r}");
    assert_eq!(predicted, served, "the router saw every block the chosen node served: {r}");
}

/// The cost benchmark's two halves in small: `sweep --kv-tags` stores
/// tagged blocks, and `subscribe` reads every event they publish.
#[test]
fn a_tagged_sweep_publishes_what_subscribe_reads() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _log) = node(&dir.path().join("node"));
    let stop = dir.path().join("stop");
    let sub_out = dir.path().join("subscribe");
    let mut subscriber = Command::new(env!("CARGO_BIN_EXE_kvtier-loadgen"))
        .args(["subscribe", "--node", server.url(), "--duration-s", "120", "--stop-file"])
        .arg(&stop)
        .arg("--out")
        .arg(&sub_out)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until the node counts the subscriber, and its subscription has arrived.
    let stats = || -> serde_json::Value {
        let o = Command::new("curl").args(["-sf", &format!("{}/v1/stats", server.url())]).output().unwrap();
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let waited = std::time::Instant::now();
    while u(&stats()["kv_events"]["subscribers"]) == 0 {
        assert!(waited.elapsed().as_secs() < 30, "the subscriber never connected");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));

    // 1 MiB of 64 KiB blocks: 16 blocks, 2 chains of 8.
    let sweep_out = dir.path().join("sweep");
    let o = Command::new(env!("CARGO_BIN_EXE_kvtier-loadgen"))
        .args(["sweep", "--target", server.url(), "--kv-tags", "--concurrency", "1", "--warmup-s", "0.2", "--duration-s", "0.5"])
        .args(["--working-set-mib", "1", "--link-gbps", "1", "--out"])
        .arg(&sweep_out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("16 blocks of 65536 bytes, tagged"), "{}", String::from_utf8_lossy(&o.stderr));
    let published = |s: &serde_json::Value| u(&s["kv_events"]["events_published"]);
    let waited = std::time::Instant::now();
    while published(&stats()) < 16 {
        assert!(waited.elapsed().as_secs() < 30, "the node published {} events", published(&stats()));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    std::fs::write(&stop, b"").unwrap();
    assert!(subscriber.wait().unwrap().success());
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(sub_out.join("results.json")).unwrap()).unwrap();
    let e = &r["events"];
    assert_eq!((u(&e["malformed"]), u(&e["missed_batches"])), (0, 0), "{r}");
    assert!(u(&e["stored"]) >= 16, "every block of the working set stored at least once: {r}");
    assert_eq!(u(&r["index_blocks"]), 16, "one engine hash per block: {r}");
    assert_eq!(u(&e["events"]), published(&stats()), "the subscriber read everything the node published: {r}");

    // Tags go over HTTP only.
    let o = Command::new(env!("CARGO_BIN_EXE_kvtier-loadgen"))
        .args(["sweep", "--target", "redis://127.0.0.1:1", "--kv-tags", "--out"])
        .arg(dir.path().join("redis"))
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("over HTTP only"), "{}", String::from_utf8_lossy(&o.stderr));
}
