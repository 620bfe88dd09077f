//! The loadgen's ShareGPT replay against a real server: a second pass over
//! the same conversations finds their blocks.

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvtier_loadgen::client::Client;
use kvtier_loadgen::target::Target;
use kvtier_loadgen::{replay, sharegpt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_sample_hits_on_second_pass() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::start(&common::test_args(dir.path()));
    let path = common::repo_root().join("tests/data/sharegpt_sample.json");
    let dataset = Arc::new(sharegpt::load(&path).unwrap().conversations);
    assert!(dataset.len() >= 10);
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
    let mut passes = Vec::new();
    for http1 in [false, true] {
        let client = Arc::new(Target::open(&server.url, http1, 1, 4).await.unwrap());
        let geometry = client.geometry().await.unwrap().expect("kvtier has a geometry");
        assert_eq!(geometry.0, common::BLOCK_BYTES);
        passes.push(replay::run(client, dataset.clone(), path.clone(), geometry, cfg.clone()).await);
    }
    let (first, second) = (&passes[0], &passes[1]);
    for r in &passes {
        assert_eq!(r.errors, 0, "{:?}", r.first_error);
        assert_eq!(r.wrong_bytes, 0);
        assert!(r.puts > 0 && r.lookups > 0 && r.tokens_per_s > 0.0, "{r:?}");
    }
    assert!(second.prefix_hit_rate > 0.0, "{second:?}");
    assert!(second.prefix_hit_rate > first.prefix_hit_rate, "first {} second {}", first.prefix_hit_rate, second.prefix_hit_rate);
    // Every block the first pass wrote is found: the store is big enough.
    assert_eq!(second.prefix_hit_rate, 1.0);
    assert!(second.gets > 0 && second.get_latency.p50_us > 0);
    // Per tier, per QoS class, over time, and the report.
    assert_eq!(second.get_latency_by_tier["nvme"].count, second.blocks_read, "{:?}", second.get_latency_by_tier);
    let classes: Vec<_> = second.qos.iter().map(|q| (q.class.name(), q.users)).collect();
    assert_eq!(classes, [("interactive", 2), ("responsive", 1), ("batch", 1)]);
    let turns: u64 = second.qos.iter().map(|q| q.turn_latency.count).sum();
    assert!(turns > 0 && turns <= second.turns, "{turns} turn latencies for {} turns", second.turns);
    assert!(second.qos.iter().all(|q| (0.0..=1.0).contains(&q.within_sla)));
    assert!(!second.timeline.is_empty());
    assert_eq!(second.timeline.iter().map(|p| p.tokens_looked_up).sum::<u64>(), second.tokens_looked_up);
    assert_eq!(second.timeline.iter().map(|p| p.blocks_read).sum::<u64>(), second.blocks_read);
    let html = kvtier_loadgen::report::replay_html(second);
    assert!(html.matches("<svg").count() >= 4 && html.contains("interactive") && html.contains("GET from nvme"));
    common::browser::assert_report_renders(&html, dir.path(), "replay");
    server.stop();
}

/// A replay whose working set is several times the RAM tier: the policy
/// oracle, fed the same operations, predicts every lookup and the tier of
/// every GET, under both write policies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_through_a_small_ram_tier_matches_the_oracle_block_for_block() {
    for policy in ["through", "back"] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = common::test_args(dir.path());
        // 16 blocks of 64 KiB over 2 shards: 8 slots each.
        common::set_flag(&mut args, "--ram-gb", &((16 * common::BLOCK_BYTES) as f64 / (1u64 << 30) as f64).to_string());
        common::set_flag(&mut args, "--write-policy", policy);
        let server = common::start(&args);
        let (oracle, r) = common::replay_matching_the_oracle(&server.url, policy).await;
        assert_eq!((oracle.shards, oracle.ram_blocks_per_shard, oracle.write_back), (2, 8, policy == "back"));
        assert!(r.blocks_written >= 3 * 16, "working set {} blocks is not several times the RAM tier", r.blocks_written);
        let o = r.oracle.as_ref().unwrap();
        assert!(o.measured_gets_by_tier.get("ram").is_some_and(|&n| n > 0), "{o:?}");
        assert!(o.measured_gets_by_tier.get("nvme").is_some_and(|&n| n > 0), "{o:?}");
        let stats = Client::new(&server.url, false, 1).unwrap().stats().await.unwrap();
        let nvme = stats["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == "nvme").unwrap().clone();
        assert_eq!(nvme["evictions"], 0, "the log held the whole run, as the oracle assumes");
        server.stop();
    }
}
