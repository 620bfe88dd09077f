//! The trace recorder (`--trace-dir`) on a real server, and tier sizing
//! from its trace (`kvtier-loadgen size`): the curve computed from one
//! run's trace predicts the RAM hit ratio measured at other RAM sizes.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use kvtier_engine::key::BlockHash;
use kvtier_engine::trace::{self, TraceOp, TraceTier};
use kvtier_engine::Tier;
use kvtier_loadgen::client::{ChunkedBody, Client};
use kvtier_loadgen::target::Target;
use kvtier_loadgen::{replay, sharegpt, size};

async fn admin(c: &Client, path: &str, method: Method) -> (StatusCode, serde_json::Value) {
    common::json_call(c, method, path, None).await
}

fn post(keys: &[&str]) -> Vec<Bytes> {
    vec![Bytes::from(serde_json::to_vec(&serde_json::json!({ "keys": keys })).unwrap())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorder_takes_every_operation_and_the_admin_route_stops_and_starts_it() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces");
    let mut args = common::test_args(&dir.path().join("data"));
    common::set_flag(&mut args, "--trace-dir", traces.to_str().unwrap());
    common::set_flag(&mut args, "--ram-gb", &((8 * common::BLOCK_BYTES) as f64 / (1u64 << 30) as f64).to_string());
    let server = common::start(&args);
    assert!(server.listening_line().contains("kvtier listening"));
    assert!(server.log().is_empty() || !server.log().contains("ERROR"), "{}", server.log());
    let c = common::client(&server, false);
    let (status, state) = admin(&c, "/v1/admin/trace", Method::GET).await;
    assert_eq!((status, state["recording"].as_bool()), (StatusCode::OK, Some(true)), "{state}");

    // One call of each operation, over both shards.
    for k in ["a", "b"] {
        c.put(k, vec![common::payload(k)]).await.unwrap();
    }
    assert!(c.get("a").await.unwrap().is_some());
    assert!(c.get("absent").await.unwrap().is_none());
    let head = c.send(Method::HEAD, "/v1/blocks/b", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(c.lookup(&["a".into(), "zz".into(), "b".into()]).await.unwrap(), 1);
    let del = c.send(Method::DELETE, "/v1/blocks/b", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(del.status, StatusCode::NO_CONTENT);
    let pre = c.send(Method::POST, "/v1/prefetch", ChunkedBody::new(post(&["a"])), Some("application/json")).await.unwrap();
    assert_eq!(pre.status, StatusCode::ACCEPTED);

    let (status, stopped) = admin(&c, "/v1/admin/trace/stop", Method::POST).await;
    assert_eq!((status, stopped["recording"].as_bool()), (StatusCode::OK, Some(false)), "{stopped}");
    assert_eq!(stopped["records"], 10, "{stopped}");
    assert_eq!(stopped["dropped_records"], 0);
    let files: Vec<PathBuf> = stopped["files"].as_array().unwrap().iter().map(|f| PathBuf::from(f.as_str().unwrap())).collect();
    assert_eq!(files.len(), 1);
    let t = trace::read(&files[0]).unwrap();
    assert_eq!((t.header.source.as_str(), t.header.shards, t.header.block_bytes), ("kvtier serve", 2, common::BLOCK_BYTES));
    assert_eq!(t.header.ram_blocks_per_shard, 4);
    let h = |k: &str| BlockHash::of(k.as_bytes());
    let got: Vec<(TraceOp, BlockHash, TraceTier, u32)> = t.records.iter().map(|r| (r.op, r.hash, r.tier, r.pos)).collect();
    let ram = TraceTier::In(Tier::Ram);
    assert_eq!(
        got,
        [
            (TraceOp::Put, h("a"), TraceTier::None, 0),
            (TraceOp::Put, h("b"), TraceTier::None, 0),
            (TraceOp::Get, h("a"), ram, 0),
            (TraceOp::Get, h("absent"), TraceTier::Miss, 0),
            (TraceOp::Head, h("b"), ram, 0),
            (TraceOp::Lookup, h("a"), ram, 0),
            (TraceOp::Lookup, h("zz"), TraceTier::Miss, 1),
            (TraceOp::Lookup, h("b"), TraceTier::Miss, 2),
            (TraceOp::Delete, h("b"), TraceTier::None, 0),
            (TraceOp::Prefetch, h("a"), TraceTier::None, 0),
        ]
    );
    assert!(t.records.iter().all(|r| usize::from(r.shard) == r.hash.shard(2)));
    // Never a key or a byte of a block in the file.
    let bytes = std::fs::read(&files[0]).unwrap();
    assert!(!bytes.windows(6).any(|w| w == b"absent"));

    // Stopped: nothing is taken; started again: a new file.
    assert!(c.get("a").await.unwrap().is_some());
    let (_, state) = admin(&c, "/v1/admin/trace", Method::GET).await;
    assert_eq!(state["records"], 10);
    std::thread::sleep(Duration::from_millis(5));
    let (status, started) = admin(&c, "/v1/admin/trace/start", Method::POST).await;
    assert_eq!((status, started["recording"].as_bool()), (StatusCode::OK, Some(true)), "{started}");
    assert!(c.get("a").await.unwrap().is_some());
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["trace"]["records"], 11, "{}", stats["trace"]);
    let metrics =
        String::from_utf8(c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap().body.to_bytes().to_vec()).unwrap();
    assert!(metrics.contains("kvtier_trace_records_total 11") && metrics.contains("kvtier_trace_recording 1"), "{metrics}");
    // A clean stop closes the second file with its record.
    server.stop();
    let mut names: Vec<PathBuf> = std::fs::read_dir(&traces).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    let second = trace::read(&names[1]).unwrap();
    assert_eq!(second.records.iter().map(|r| (r.op, r.hash)).collect::<Vec<_>>(), [(TraceOp::Get, h("a"))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_trace_dir_the_admin_route_says_how_to_turn_it_on() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::start(&common::test_args(dir.path()));
    let c = common::client(&server, true);
    for (path, method) in
        [("/v1/admin/trace", Method::GET), ("/v1/admin/trace/start", Method::POST), ("/v1/admin/trace/stop", Method::POST)]
    {
        let (status, body) = admin(&c, path, method).await;
        assert_eq!(status, StatusCode::CONFLICT, "{path}");
        assert_eq!(body["error"]["code"], "trace_not_configured");
        assert!(body["error"]["message"].as_str().unwrap().contains("--trace-dir"), "{body}");
    }
    let wrong = c.send(Method::GET, "/v1/admin/trace/start", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(c.stats().await.unwrap()["trace"].is_null());
    server.stop();
    // A bound too small to rotate is refused at start, naming the flag.
    let mut args = common::test_args(&dir.path().join("d2"));
    common::set_flag(&mut args, "--trace-dir", dir.path().join("t").to_str().unwrap());
    common::set_flag(&mut args, "--trace-max-mb", "1");
    let (_, stderr) = common::try_start(&args).err().expect("refused");
    assert!(stderr.contains("--trace-max-mb must be at least 2"), "{stderr}");
}

/// Replays the sample conversations (4 users, 3 passes) against a server
/// with `ram_blocks` RAM slots per shard and the recorder on; returns the
/// share of GETs served from RAM and the trace files.
async fn replay_at(dir: &Path, ram_blocks: u64) -> (f64, Vec<PathBuf>) {
    let traces = dir.join(format!("traces-{ram_blocks}"));
    let mut args = common::test_args(&dir.join(format!("data-{ram_blocks}")));
    common::set_flag(&mut args, "--trace-dir", traces.to_str().unwrap());
    let ram_bytes = 2 * ram_blocks * common::BLOCK_BYTES;
    common::set_flag(&mut args, "--ram-gb", &(ram_bytes as f64 / (1u64 << 30) as f64).to_string());
    let server = common::start(&args);
    let path = common::repo_root().join("tests/data/sharegpt_sample.json");
    let dataset = Arc::new(sharegpt::load(&path).unwrap().conversations);
    let target = Arc::new(Target::open(&server.url, false, 1, 4).await.unwrap());
    let cfg = replay::ReplayConfig {
        users: 4,
        duration: Duration::from_secs(300),
        seed: 5,
        passes: Some(3),
        max_context_tokens: 8192,
        verify_full: false,
        generation: replay::GenerationMode::None,
        progress: false,
        oracle: None,
        trace_out: None,
    };
    let geometry = target.geometry().await.unwrap().unwrap();
    let r = replay::run(target, dataset, path, geometry, cfg).await;
    assert_eq!((r.errors, r.wrong_bytes, r.get_misses), (0, 0, 0), "{:?}", r.first_error);
    server.stop();
    let ram = r.get_latency_by_tier.get("ram").map_or(0, |l| l.count);
    let files = std::fs::read_dir(&traces).unwrap().map(|e| e.unwrap().path()).collect();
    (ram as f64 / r.gets as f64, files)
}

/// The check, at test scale: the exact curve from the trace of the
/// run at one RAM size predicts the RAM hit ratio measured at two others
/// within 2 percentage points (docs/BENCHMARKS.md has the figures at
/// benchmark scale).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_curve_from_one_runs_trace_predicts_the_ram_hit_ratio_of_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = [16u64, 48, 160];
    let (small, files) = replay_at(dir.path(), sizes[0]).await;
    let w = size::load(&files, Some(common::BLOCK_BYTES)).unwrap();
    let report = size::size(&w, &size::SizeOptions { policy_sizes: 0, ..Default::default() });
    let memory = report.memory.as_ref().unwrap();
    let curve_at = |blocks: u64| {
        // The exact curve at that size: GETs served from RAM of `blocks`
        // slots per shard (no GPU tier).
        let pass_point =
            size::size(&w, &size::SizeOptions { policy_sizes: 0, ram_bytes: Some(blocks * 2 * common::BLOCK_BYTES), ..Default::default() });
        pass_point.tiers.iter().find(|t| t.tier == "ram").unwrap().configured.hit_ratio
    };
    assert!((curve_at(sizes[0]) - small).abs() < 0.02, "its own run: curve {} measured {small}", curve_at(sizes[0]));
    for &blocks in &sizes[1..] {
        let (measured, _) = replay_at(dir.path(), blocks).await;
        let predicted = curve_at(blocks);
        eprintln!("{blocks} RAM slots per shard: predicted {predicted:.4}, measured {measured:.4}");
        assert!((predicted - measured).abs() <= 0.02, "{blocks} slots/shard: predicted {predicted:.4}, measured {measured:.4}");
    }
    assert!(memory.unbounded_hit_ratio > curve_at(sizes[0]), "the small RAM tier misses: the check is not trivial");
    // The report as a person sees it.
    let html = kvtier_loadgen::report::size_html(&report);
    assert!(html.contains("GETs served from memory") && html.contains("knee"));
    common::browser::assert_report_renders(&html, dir.path(), "size");
}
