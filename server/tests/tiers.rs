//! The RAM tier above the NVMe log, end to end: LRU order, the demotion
//! chain RAM → NVMe → gone, promotion on read, prefetch, write policies
//! across a crash, capacity under concurrent PUTs, per-tier stats.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{client, payload, read_tier, start, test_args, tiers_of, BLOCK_BYTES};
use http::{Method, StatusCode};
use kvtier_engine::key::BlockHash;
use kvtier_loadgen::client::ChunkedBody;
use serde_json::{json, Value};

/// Test arguments with `shards` shards, a RAM tier of `ram_blocks` blocks in
/// all, and `extra` flags replacing or adding to the defaults.
fn tier_args(dir: &std::path::Path, shards: usize, ram_blocks: u64, extra: &[&str]) -> Vec<String> {
    let mut args = test_args(dir);
    let ram_gb = (ram_blocks * BLOCK_BYTES) as f64 / (1u64 << 30) as f64;
    common::set_flag(&mut args, "--shards", &shards.to_string());
    common::set_flag(&mut args, "--ram-gb", &ram_gb.to_string());
    for pair in extra.chunks(2) {
        common::set_flag(&mut args, pair[0], pair[1]);
    }
    args
}

fn tier<'a>(stats: &'a Value, name: &str) -> &'a Value {
    stats["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == name).unwrap_or_else(|| panic!("no {name} tier in {stats}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lru_order_demotion_and_promotion() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&tier_args(dir.path(), 1, 4, &[]));
    let c = client(&server, false);
    for k in ["k0", "k1", "k2", "k3"] {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    assert_eq!(tiers_of(&c, &["k0", "k1", "k2", "k3"]).await, ["ram"; 4]);
    assert_eq!(read_tier(&c, "k0").await, "ram");
    // RAM is full; k1 is least recently used (k0 was just read).
    c.put("k4", vec![payload("k4")]).await.unwrap();
    assert_eq!(tiers_of(&c, &["k0", "k1"]).await, ["ram", "nvme"]);
    // A read from NVMe promotes k1, which pushes out k2, now the LRU block.
    assert_eq!(read_tier(&c, "k1").await, "nvme");
    assert_eq!(read_tier(&c, "k1").await, "ram");
    assert_eq!(tiers_of(&c, &["k2"]).await, ["nvme"]);
    assert_eq!(tiers_of(&c, &["k3", "k4", "k0", "k1"]).await, ["ram"; 4]);

    let stats = c.stats().await.unwrap();
    assert_eq!(stats["write_policy"], "through");
    let ram = tier(&stats, "ram");
    assert_eq!((ram["capacity_blocks"].as_u64(), ram["used_blocks"].as_u64()), (Some(4), Some(4)), "{ram}");
    assert_eq!((ram["hits"].as_u64(), ram["misses"].as_u64()), (Some(2), Some(1)), "{ram}");
    assert_eq!((ram["promotions"].as_u64(), ram["demotions"].as_u64()), (Some(1), Some(2)), "{ram}");
    assert_eq!(ram["bytes_out"].as_u64(), Some(2 * BLOCK_BYTES));
    assert_eq!(ram["bytes_in"].as_u64(), Some(6 * BLOCK_BYTES), "5 PUTs and 1 promotion copied in");
    let nvme = tier(&stats, "nvme");
    assert_eq!((nvme["used_blocks"].as_u64(), nvme["hits"].as_u64()), (Some(5), Some(1)), "write-through keeps every block on NVMe");
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body.to_bytes()).into_owned();
    assert!(text.contains("kvtier_tier_hits_total{tier=\"ram\"} 2"), "{text}");
    assert!(text.contains("kvtier_tier_used_blocks{tier=\"nvme\"} 5"), "{text}");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demotion_chain_ends_when_the_log_drops_the_block() {
    let dir = tempfile::tempdir().unwrap();
    // 2 segments of 8 MiB: ~240 slots of 68 KiB on the log, 2 blocks of RAM.
    let server = start(&tier_args(dir.path(), 1, 2, &["--promote", "off", "--disk-gb", "0.015625", "--segment-mib", "8"]));
    let c = client(&server, false);
    c.put("first", vec![payload("first")]).await.unwrap();
    assert_eq!(read_tier(&c, "first").await, "ram");
    for i in 0..2 {
        let k = format!("next-{i}");
        c.put(&k, vec![payload(&k)]).await.unwrap();
    }
    assert_eq!(read_tier(&c, "first").await, "nvme", "RAM → NVMe");
    assert_eq!(read_tier(&c, "first").await, "nvme", "--promote off keeps it there");
    for i in 2..600 {
        let k = format!("next-{i}");
        c.put(&k, vec![payload(&k)]).await.unwrap();
    }
    assert!(c.get("first").await.unwrap().is_none(), "NVMe → gone");
    let stats = c.stats().await.unwrap();
    assert!(tier(&stats, "nvme")["evictions"].as_u64().unwrap() > 0, "{stats}");
    assert_eq!(tier(&stats, "ram")["promotions"], 0);
    assert_eq!(read_tier(&c, "next-599").await, "ram");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_back_loses_only_memory_blocks_on_a_crash_and_write_through_none() {
    let keys: Vec<String> = (0..20).map(|i| format!("wb-{i:02}")).collect();
    for policy in ["through", "back"] {
        let dir = tempfile::tempdir().unwrap();
        let args = tier_args(dir.path(), 1, 8, &["--write-policy", policy]);
        let server = start(&args);
        let c = client(&server, false);
        for k in &keys {
            c.put(k, vec![payload(k)]).await.unwrap();
        }
        // 8 slots: the last 8 blocks are in RAM, the first 12 were demoted
        // (written to the log first under write-back). Lookups do not move
        // blocks; reads of RAM blocks demote nothing.
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut expected_tiers = vec!["nvme"; 12];
        expected_tiers.extend(["ram"; 8]);
        assert_eq!(tiers_of(&c, &key_refs).await, expected_tiers, "{policy}");
        for k in &keys[12..] {
            assert_eq!(read_tier(&c, k).await, "ram");
        }
        // Every log write came straight from a RAM slot: write-through's
        // 20 PUTs, write-back's 12 demotions (shard/append.rs).
        let from_ram = if policy == "through" { 20 } else { 12 };
        assert_eq!(c.stats().await.unwrap()["totals"]["writes_from_ram"], from_ram, "{policy}");
        server.crash();
        let server = start(&args);
        let c = client(&server, true);
        let mut found = Vec::new();
        for k in &keys {
            if let Some((body, _)) = c.get(k).await.unwrap() {
                assert_eq!(body.to_bytes(), payload(k), "{policy}: {k}");
                found.push(k.clone());
            }
        }
        match policy {
            "through" => assert_eq!(found, keys, "write-through loses nothing acknowledged"),
            _ => {
                // The 8 blocks only in RAM are gone.
                assert_eq!(found, keys[..12], "write-back loses exactly the RAM-only blocks");
            }
        }
        server.stop();
    }
    // A clean stop in write-back writes RAM-only blocks to the log first.
    let dir = tempfile::tempdir().unwrap();
    let args = tier_args(dir.path(), 1, 8, &["--write-policy", "back"]);
    let server = start(&args);
    let c = client(&server, false);
    for k in &keys {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    let stats = c.stats().await.unwrap();
    assert_eq!(tier(&stats, "nvme")["used_blocks"], 12, "only demoted blocks reached NVMe: {stats}");
    assert_eq!(tier(&stats, "nvme")["promotions"], 12, "{stats}");
    assert!(server.stop().success());
    let server = start(&args);
    let c = client(&server, false);
    for k in &keys {
        assert_eq!(read_tier(&c, k).await, "nvme");
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_holds_under_concurrent_puts() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&tier_args(dir.path(), 2, 32, &[]));
    let c = std::sync::Arc::new(client(&server, false));
    let keys: Vec<String> = (0..64).map(|i| format!("cc-{i}")).collect();
    let puts = keys.iter().map(|k| {
        let (c, k) = (c.clone(), k.clone());
        tokio::spawn(async move { c.put(&k, vec![payload(&k)]).await.unwrap() })
    });
    for p in futures::future::join_all(puts).await {
        p.unwrap();
    }
    // 16 slots per shard; each shard holds min(its keys, 16).
    let per_shard = |s: usize| keys.iter().filter(|k| BlockHash::of(k.as_bytes()).shard(2) == s).count() as u64;
    let expected = per_shard(0).min(16) + per_shard(1).min(16);
    let stats = c.stats().await.unwrap();
    let ram = tier(&stats, "ram");
    assert_eq!((ram["capacity_blocks"].as_u64(), ram["used_blocks"].as_u64()), (Some(32), Some(expected)), "{ram}");
    assert_eq!(tier(&stats, "nvme")["used_blocks"], 64);
    for shard in stats["per_shard"].as_array().unwrap() {
        let t = &shard["tiers"][0];
        assert!(t["used_blocks"].as_u64() <= t["capacity_blocks"].as_u64(), "{t}");
    }
    for k in &keys {
        read_tier(&c, k).await;
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_promotes_stored_blocks_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&tier_args(dir.path(), 1, 2, &["--promote", "off"]));
    let c = client(&server, false);
    for k in ["a", "b", "c"] {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    assert_eq!(tiers_of(&c, &["a"]).await, ["nvme"]);
    let body = serde_json::to_vec(&json!({ "keys": ["a", "never-stored"] })).unwrap();
    let a = c.send(Method::POST, "/v1/prefetch", ChunkedBody::new(vec![Bytes::from(body)]), Some("application/json")).await.unwrap();
    assert_eq!(a.status, StatusCode::ACCEPTED);
    assert_eq!(serde_json::from_slice::<Value>(&a.body.to_bytes()).unwrap(), json!({ "requested": 2, "found": 1 }));
    let deadline = Instant::now() + Duration::from_secs(5);
    while tiers_of(&c, &["a"]).await != ["ram"] {
        assert!(Instant::now() < deadline, "prefetch did not promote a");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(read_tier(&c, "a").await, "ram");
    assert_eq!(tier(&c.stats().await.unwrap(), "ram")["promotions"], 1);
    for (body, status) in [(&b"{\"keys\":\"a\"}"[..], StatusCode::BAD_REQUEST), (&b"{\"keys\":[\"../x\"]}"[..], StatusCode::BAD_REQUEST)] {
        let a = c.send(Method::POST, "/v1/prefetch", ChunkedBody::new(vec![Bytes::copy_from_slice(body)]), None).await.unwrap();
        assert_eq!(a.status, status, "{}", String::from_utf8_lossy(&a.body.to_bytes()));
    }
    let a = c.send(Method::GET, "/v1/prefetch", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
    server.stop();
}
