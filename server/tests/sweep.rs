//! The loadgen's concurrency sweep against a real server: every field of
//! results.json is filled, throughput is real, the report renders, and a
//! wrong block size is refused.

mod common;

use std::sync::Arc;

use kvtier_loadgen::sweep::{self, Mix, SweepConfig, SweepResults};
use kvtier_loadgen::target::{resolve_geometry, Target};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_sweep_fills_every_field_with_real_throughput() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::start(&common::test_args(dir.path()));
    let target = Arc::new(Target::open(&server.url, false, 1, 4).await.unwrap());
    let (block_bytes, block_tokens, model) = resolve_geometry(std::slice::from_ref(&target), None, None, 128).await.unwrap();
    assert_eq!(block_bytes, common::BLOCK_BYTES);
    let config = SweepConfig {
        concurrency: vec![1, 4],
        warmup_s: 0.5,
        duration_s: 2.0,
        mix: Mix { lookups: 7, reads: 6, writes: 3 },
        working_set_blocks: 64,
        chain_blocks: 8,
        lookup_extra_blocks: 2,
        block_bytes,
        block_tokens,
        model,
        seed: 3,
        sla_ms: 1000.0,
        target_tokens_per_s: 1e6,
        progress: false,
    };
    let workload = Arc::new(sweep::Workload::new(&config));
    let preload = sweep::preload(target.clone(), workload.clone(), false).await.unwrap();
    assert_eq!(preload.blocks, 64);
    let mut levels = Vec::new();
    for (i, &c) in config.concurrency.iter().enumerate() {
        levels.push(sweep::run_level(target.clone(), workload.clone(), c, i, Some(1e9)).await);
    }
    let analysis = sweep::analyze(&levels, config.sla_ms, config.target_tokens_per_s);
    let results = SweepResults {
        mode: "sweep".into(),
        started_unix_s: 0,
        config: config.clone(),
        link: sweep::Link { bytes_per_s: Some(1e9), source: "test".into() },
        targets: vec![sweep::TargetResult {
            target: server.url.clone(),
            kind: target.kind().into(),
            protocol: target.protocol().into(),
            connections: target.connections(),
            preload,
            levels,
            analysis,
            error: None,
        }],
        error: None,
    };
    assert_eq!(results.failures(), 0, "{:?}", results.targets[0].levels.iter().map(|l| &l.first_error).collect::<Vec<_>>());
    let json: serde_json::Value = serde_json::to_value(&results).unwrap();
    let t = &json["targets"][0];
    for l in t["levels"].as_array().unwrap() {
        for field in [
            "concurrency",
            "elapsed_s",
            "iterations",
            "iterations_per_s",
            "tokens_per_s",
            "lookups",
            "blocks_read",
            "read_misses",
            "blocks_written",
            "lookup_blocks",
            "lookup_hit_blocks",
            "prefix_hit_rate",
            "errors",
            "wrong_bytes",
            "latency",
            "read_latency_by_tier",
            "histograms",
            "server",
            "littles_law",
        ] {
            assert!(!l[field].is_null(), "level field {field} missing: {l}");
        }
        assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0 && l["iterations"].as_u64().unwrap() > 0, "{l}");
        for op in ["lookup", "read", "write", "iteration"] {
            assert!(l["latency"][op]["count"].as_u64().unwrap() > 0 && l["latency"][op]["p99_us"].as_u64().unwrap() > 0, "{op}: {l}");
        }
        // 8 stored blocks of the 10 looked up: the lookups return real prefix hits.
        assert!((l["prefix_hit_rate"].as_f64().unwrap() - 0.8).abs() < 1e-9, "{l}");
        assert_eq!(l["read_misses"], 0);
        assert!(l["read_latency_by_tier"].as_object().unwrap().contains_key("nvme"), "{l}");
        assert!(l["server"]["out_bytes_per_s"].as_f64().unwrap() > 0.0 && l["server"]["in_link_share"].as_f64().unwrap() > 0.0);
        // A closed loop obeys Little's law: L = X × W.
        let ratio = l["littles_law"]["ratio"].as_f64().unwrap();
        assert!((0.8..1.2).contains(&ratio), "Little's law ratio {ratio}: {l}");
        // Operations per iteration follow the 7:6:3 mix.
        let iterations = l["iterations"].as_f64().unwrap();
        let per_iteration = l["lookups"].as_f64().unwrap() / iterations;
        assert!((6.0..8.0).contains(&per_iteration), "{per_iteration} lookups per iteration");
    }
    let a = &t["analysis"];
    assert!(!a["saturation"].is_null() && !a["operating_point"].is_null() && a["capacity"]["instances"].as_u64().unwrap() >= 1, "{a}");
    let round_trip: SweepResults = serde_json::from_value(json).unwrap();
    assert_eq!(round_trip.targets[0].levels.len(), 2);

    let html = kvtier_loadgen::report::sweep_html(&results);
    assert!(html.contains("<svg") && html.contains(&server.url) && html.contains("tokens/s"));
    assert!(html.matches("<svg").count() >= 5, "throughput, three latency charts, bandwidth, histogram");
    common::browser::assert_report_renders(&html, dir.path(), "sweep");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_block_size_is_refused_before_any_load() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::start(&common::test_args(dir.path()));
    let target = Arc::new(Target::open(&server.url, false, 1, 1).await.unwrap());
    let e = resolve_geometry(std::slice::from_ref(&target), Some("llama3.1-8b"), None, 128).await.unwrap_err();
    assert!(e.contains("wrong block size") && e.contains("16777216") && e.contains("65536"), "{e}");
    let e = resolve_geometry(std::slice::from_ref(&target), None, Some(4096), 128).await.unwrap_err();
    assert!(e.contains("wrong block size"), "{e}");
    assert_eq!(resolve_geometry(&[target], None, Some(common::BLOCK_BYTES), 128).await.unwrap().0, common::BLOCK_BYTES);
    server.stop();
}
