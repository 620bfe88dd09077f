//! The loadgen over kvtier's same-host local socket (`--target unix://`,
//! docs/LOCAL.md) against a real `kvtier serve`: byte-exact block round trips
//! (also across transports), a replay, and a replay the policy oracle
//! predicts block for block, as the HTTP replay is checked in
//! server/tests/replay.rs.
//!
//! The server is the `kvtier` binary beside this test's executable
//! (`target/debug/kvtier`, which `cargo test --workspace` builds), or
//! `KVTIER_BIN`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvtier_loadgen::blocks::{self, BlockOp};
use kvtier_loadgen::payload::Payloads;
use kvtier_loadgen::server_process::ServerProcess;
use kvtier_loadgen::target::Target;
use kvtier_loadgen::{replay, sharegpt};
use kvtier_test_support::server_args::{kvtier_bin, set_flag, test_args, BLOCK_BYTES};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A test server on `dir` ([`test_args`]: 2 shards, 64 KiB blocks) with a
/// RAM tier of `ram_blocks` blocks, its socket at `dir/kvtier.sock`, and
/// `extra` flags.
struct Server {
    process: ServerProcess,
    socket: String,
    _log: tempfile::NamedTempFile,
}

impl Server {
    fn start(dir: &Path, ram_blocks: u64, extra: &[&str]) -> Server {
        let ram_gb = (ram_blocks * BLOCK_BYTES) as f64 / (1u64 << 30) as f64;
        let mut args = test_args(dir);
        set_flag(&mut args, "--ram-gb", &ram_gb.to_string());
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = tempfile::NamedTempFile::new().unwrap();
        let process = ServerProcess::start(&kvtier_bin(), &args, log.path()).unwrap_or_else(|e| panic!("{e}"));
        let socket = dir.join("kvtier.sock").display().to_string();
        for _ in 0..100 {
            if Path::new(&socket).exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Server { process, socket, _log: log }
    }

    fn unix(&self) -> String {
        format!("unix://{}", self.socket)
    }

    fn unix_with_http(&self) -> String {
        format!("unix://{}?http={}", self.socket, self.process.url())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_round_trip_byte_exact_over_the_socket_and_across_transports() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 64, &[]);
    let local = Arc::new(Target::open(&server.unix(), false, 0, 4).await.unwrap());
    assert_eq!((local.transport(), local.protocol(), local.kind(), local.connections()), ("unix", "unix", "kvtier", 4));
    let Target::Local(l) = &*local else { unreachable!() };
    assert_eq!((l.slots(), l.access()), (4, vec![1; 4]), "sealed memfds are mapped");
    assert_eq!(local.geometry().await.unwrap().unwrap().0, BLOCK_BYTES);

    for op in [BlockOp::Put, BlockOp::Get] {
        let r = blocks::run(local.clone(), op, 4, Duration::from_millis(700), BLOCK_BYTES, true).await.unwrap();
        assert_eq!((r.errors, r.transport.as_str(), r.connections), (0, "unix", 4), "{op:?}: {:?}", r.first_error);
        assert!(r.requests > 10 && r.bytes_per_s > 0.0, "{r:?}");
    }

    // Written over the socket, read over HTTP, and the reverse: every byte.
    let http = Target::open(server.process.url(), false, 1, 1).await.unwrap();
    let p = Payloads::new(BLOCK_BYTES as usize, 3);
    for i in 0..8 {
        let (a, b) = (format!("via-unix-{i}"), format!("via-http-{i}"));
        local.put(&a, p.chunks(&a)).await.unwrap();
        http.put(&b, p.chunks(&b)).await.unwrap();
        let got = http.get(&a).await.unwrap().expect("stored over the socket");
        assert!(p.verify_body(&a, &got.body, true), "{a} over HTTP");
        let got = local.get(&b).await.unwrap().expect("stored over HTTP");
        assert!(p.verify_body(&b, &got.body, true), "{b} over the socket");
        assert_eq!(got.tier, "ram");
    }
    assert!(local.get("never-stored").await.unwrap().is_none(), "NOT_FOUND is a miss");
    assert_eq!(local.lookup(&["via-unix-0".to_string(), "via-http-1".into(), "nope".into(), "via-unix-2".into()]).await.unwrap(), 2);
    assert_eq!(l.exists(&["via-unix-3", "nope"]).await.unwrap(), vec![Some("ram"), None]);

    // A wrong-size block is refused before it is sent; a bad key is an
    // error naming its code.
    let e = local.put("short", vec![bytes::Bytes::from_static(b"x")]).await.unwrap_err().to_string();
    assert!(e.contains("1-byte block") && e.contains("65536"), "{e}");
    let bad = "k".repeat(300);
    let e = local.get(&bad).await.err().unwrap().to_string();
    assert!(e.contains("INVALID_KEY") && e.contains("(-3)"), "{e}");

    // The binary: `blocks --target unix://`, results say the transport.
    let out = dir.path().join("blocks-out");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier-loadgen"))
        .args(["blocks", "--target", &server.unix(), "--op", "get", "--concurrency", "2", "--duration-s", "0.5", "--verify-full"])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("blocks: unix (unix) get x2 of 65536 bytes"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!((r["transport"].as_str(), r["errors"].as_u64()), (Some("unix"), Some(0)), "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_over_the_socket_round_trips_and_hits_on_the_second_pass() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), 0, &[]);
    let path = repo_root().join("tests/data/sharegpt_sample.json");
    let dataset = Arc::new(sharegpt::load(&path).unwrap().conversations);
    let cfg = replay::ReplayConfig {
        users: 4,
        duration: Duration::from_secs(120),
        seed: 7,
        passes: Some(1),
        max_context_tokens: 8192,
        verify_full: true,
        generation: replay::GenerationMode::None,
        progress: false,
        oracle: None,
        trace_out: None,
    };
    let target = Arc::new(Target::open(&server.unix(), false, 0, 4).await.unwrap());
    let geometry = target.geometry().await.unwrap().unwrap();
    let first = replay::run(target.clone(), dataset.clone(), path.clone(), geometry.clone(), cfg.clone()).await;
    let second = replay::run(target, dataset, path, geometry, cfg).await;
    for r in [&first, &second] {
        assert_eq!((r.errors, r.wrong_bytes), (0, 0), "{:?}", r.first_error);
        assert_eq!((r.transport.as_str(), r.protocol.as_str()), ("unix", "unix"));
        assert!(r.puts > 0 && r.lookups > 0, "{r:?}");
    }
    assert_eq!(second.prefix_hit_rate, 1.0, "every block the first pass wrote is found");
    assert!(second.blocks_read > 0);
    assert_eq!(second.get_latency_by_tier["nvme"].count, second.blocks_read, "no RAM tier: {:?}", second.get_latency_by_tier);
}

/// As server/tests/replay.rs checks the HTTP replay: a working set several
/// times a small RAM tier, and the policy oracle, fed the same operations,
/// predicts every lookup and the tier of every GET served through the
/// socket (`?http=` gives it the server's capacities from /v1/stats).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_over_the_socket_matches_the_oracle_block_for_block() {
    for policy in ["through", "back"] {
        let dir = tempfile::tempdir().unwrap();
        // 16 blocks over 2 shards: 8 slots each.
        let server = Server::start(dir.path(), 16, &["--write-policy", policy]);
        let path = repo_root().join("tests/data/sharegpt_sample.json");
        let dataset = Arc::new(sharegpt::load(&path).unwrap().conversations);
        let target = Arc::new(Target::open(&server.unix_with_http(), false, 0, 1).await.unwrap());
        let oracle = replay::OracleConfig::from_server(&target).await.unwrap();
        assert_eq!((oracle.shards, oracle.ram_blocks_per_shard, oracle.write_back), (2, 8, policy == "back"));
        let cfg = replay::ReplayConfig {
            users: 1,
            duration: Duration::from_secs(300),
            seed: 11,
            passes: Some(2),
            max_context_tokens: 8192,
            verify_full: true,
            generation: replay::GenerationMode::None,
            progress: false,
            oracle: Some(oracle),
            trace_out: None,
        };
        let geometry = target.geometry().await.unwrap().unwrap();
        let r = replay::run(target.clone(), dataset, path, geometry, cfg).await;
        assert_eq!((r.errors, r.wrong_bytes), (0, 0), "{policy}: {:?}", r.first_error);
        assert_eq!(r.transport, "unix");
        let o = r.oracle.as_ref().unwrap();
        assert!(o.gets_checked > 0 && o.lookups_checked > 0, "{o:?}");
        assert_eq!((o.lookup_mismatches, o.get_mismatches), (0, 0), "{policy}: {:?}", o.first_mismatch);
        assert_eq!(o.predicted_hit_rate, o.measured_hit_rate);
        assert_eq!(o.measured_gets_by_tier.get("miss"), None, "{policy}: nothing stored and not evicted is missed");
        assert!(r.blocks_written >= 3 * 16, "working set {} blocks is not several times the RAM tier", r.blocks_written);
        assert!(o.measured_gets_by_tier.get("ram").is_some_and(|&n| n > 0), "{o:?}");
        assert!(o.measured_gets_by_tier.get("nvme").is_some_and(|&n| n > 0), "{o:?}");
        let stats = target.stats().await.unwrap();
        let nvme = stats["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == "nvme").unwrap().clone();
        assert_eq!(nvme["evictions"], 0, "the log held the whole run, as the oracle assumes");
        // Every GET and PUT went through the socket, none over HTTP.
        assert_eq!(stats["local"]["routes"]["get_into"]["requests"].as_u64(), Some(r.gets), "{}", stats["local"]["routes"]);
        assert_eq!(stats["local"]["routes"]["put_from"]["requests"].as_u64(), Some(r.puts));
        assert_eq!(stats["http"]["routes"]["get_block"]["requests"].as_u64().unwrap_or(0), 0, "{}", stats["http"]["routes"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_socket_or_http_address_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let missing = format!("unix://{}/no.sock", dir.path().display());
    let e = Target::open(&missing, false, 0, 1).await.err().unwrap().to_string();
    assert!(e.contains("no.sock") && e.contains("cannot connect"), "{e}");
    let e = Target::open("unix://", false, 0, 1).await.err().unwrap().to_string();
    assert!(e.contains("expected unix:///PATH"), "{e}");
    let server = Server::start(dir.path(), 0, &[]);
    // Without `?http=`, the HELLO's HTTP address serves /v1/stats.
    let t = Target::open(&server.unix(), false, 0, 1).await.unwrap();
    replay::OracleConfig::from_server(&t).await.expect("stats at the HELLO's HTTP address");
    // Another server's HTTP address is refused (epochs differ).
    let dir2 = tempfile::tempdir().unwrap();
    let other = Server::start(dir2.path(), 0, &[]);
    let e = Target::open(&format!("unix://{}?http={}", server.socket, other.process.url()), false, 0, 1).await.err().unwrap().to_string();
    assert!(e.contains("another server"), "{e}");
}
