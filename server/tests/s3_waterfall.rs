//! The shared S3 tier as one step of the waterfall on the shard that owns a
//! key: whichever shard a connection lands on, a hot key missing locally
//! costs one S3 read; the owner's presence cache sees every DELETE and PUT
//! of its keys; a block read from S3 never overwrites a newer PUT, in memory
//! or in the log (checked again after `kill -9`).
//!
//! Real `kvtier serve` processes with two shards, a real S3-compatible
//! server (moto) on loopback, and a slow proxy in front of it where a read
//! must stay in flight for a while.

mod common;
mod s3_support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{client, payload, start, Server, BLOCK_BYTES};
use http::{Method, StatusCode};
use kvtier_loadgen::client::{ChunkedBody, Client};
use s3_support::*;
use serde_json::Value;

/// A client whose one connection the kernel gave to shard `shard` (the
/// shards share the port through `SO_REUSEPORT`): its second stats request
/// sees its first counted on that shard.
async fn client_on_shard(server: &Server, shard: usize) -> Client {
    let requests = |v: &Value| v["http"]["per_shard"][shard]["requests"].as_u64().unwrap();
    for _ in 0..200 {
        let c = client(server, true);
        let before = c.stats().await.unwrap();
        let after = c.stats().await.unwrap();
        if requests(&after) > requests(&before) {
            return c;
        }
    }
    panic!("no connection landed on shard {shard} in 200 tries");
}

/// PUTs `bytes` under `key`; the answer's JSON.
async fn put_bytes(c: &Client, key: &str, bytes: Bytes) -> Value {
    let a = c.send(Method::PUT, &format!("/v1/blocks/{key}"), ChunkedBody::new(vec![bytes]), None).await.unwrap();
    assert!(a.status.is_success(), "PUT {key}: {} {:?}", a.status, a.body.to_bytes());
    serde_json::from_slice(&a.body.to_bytes()).unwrap()
}

/// GETs `key`: its bytes and tier (`None` on 404).
async fn get_bytes(c: &Client, key: &str) -> Option<(Bytes, String)> {
    let (body, tier) = c.get(key).await.unwrap_or_else(|e| panic!("GET {key}: {e}"))?;
    Some((body.to_bytes(), tier.expect("x-kvtier-tier")))
}

/// The payload of the object stored in the bucket for `key` (after its
/// header), if any.
fn object_payload(moto: &Moto, key: &str) -> Option<Vec<u8>> {
    let object = moto.get_object(&object_name(key))?;
    Some(object[object.len() - BLOCK_BYTES as usize..].to_vec())
}

fn two_shard_node(dir: &std::path::Path, endpoint: &str, extra: &[&str]) -> Server {
    let mut args = node_args(dir, endpoint, extra);
    common::set_flag(&mut args, "--shards", "2");
    start(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_missing_locally_costs_one_s3_read_whichever_shard_the_gets_arrive_on() {
    let moto = Moto::start();
    let proxy = SlowProxy::start(moto.addr);
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(&node_args(da.path(), &moto.endpoint(), &["--s3-write-policy", "through"]));
    assert_eq!(put_answer(&client(&a, false), "hot").await["s3"], "uploaded");

    // B has never seen the key; its S3 reads take 300 ms, so every GET
    // below arrives while the first read is in flight.
    let b = two_shard_node(db.path(), &format!("http://{}", proxy.addr), &[]);
    proxy.delay_ms.store(300, Ordering::SeqCst);
    let clients: Vec<Client> = (0..32).map(|i| client(&b, i % 2 == 0)).collect();
    let gets = clients.iter().map(|c| get_bytes(c, "hot"));
    for got in futures::future::join_all(gets).await {
        let (bytes, tier) = got.expect("every GET finds the block");
        assert_eq!(bytes, payload("hot"), "served from {tier} with other bytes");
    }
    proxy.delay_ms.store(0, Ordering::SeqCst);

    let stats = client(&b, false).stats().await.unwrap();
    let connections: Vec<u64> =
        stats["http"]["per_shard"].as_array().unwrap().iter().map(|s| s["connections_total"].as_u64().unwrap()).collect();
    assert!(connections.iter().all(|n| *n > 0), "the GETs came over connections on both shards: {connections:?}");
    let t = &stats["s3"]["totals"];
    println!("32 GETs of a key only in S3, over both shards: s3 totals {t}");
    assert_eq!((t["reads"].as_u64(), t["read_hits"].as_u64(), t["installs"].as_u64()), (Some(1), Some(1), Some(1)), "{t}");
    // Those that came while the read was in flight joined it; later ones
    // found the installed block.
    assert!(t["reads_joined"].as_u64().unwrap() >= 1, "{t}");
    let per_shard: Vec<u64> = stats["s3"]["per_shard"].as_array().unwrap().iter().map(|s| s["reads"].as_u64().unwrap()).collect();
    assert_eq!(per_shard.iter().filter(|n| **n > 0).count(), 1, "only the owning shard reads S3: {per_shard:?}");
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_through_one_shard_then_a_put_through_the_other_leaves_the_new_bytes_in_the_bucket() {
    let moto = Moto::start();
    let d = tempfile::tempdir().unwrap();
    let node = two_shard_node(d.path(), &moto.endpoint(), &["--s3-write-policy", "through"]);
    let (on_0, on_1) = (client_on_shard(&node, 0).await, client_on_shard(&node, 1).await);
    // Whichever shard owns a key, the writes come through both shards.
    for key in ["swap-0", "swap-1", "swap-2", "swap-3"] {
        let (old, new) = (payload(&format!("{key}-old")), payload(&format!("{key}-new")));
        assert_eq!(put_bytes(&on_0, key, old.clone()).await["s3"], "uploaded");
        assert_eq!(object_payload(&moto, key).as_deref(), Some(&old[..]));
        let deleted = on_1.send(Method::DELETE, &format!("/v1/blocks/{key}"), ChunkedBody::default(), None).await.unwrap();
        assert_eq!(deleted.status, StatusCode::NO_CONTENT);
        assert_eq!(object_payload(&moto, key), None, "{key}: the DELETE removed the object");
        assert_eq!(put_bytes(&on_0, key, new.clone()).await["s3"], "uploaded", "{key}: the PUT after the DELETE uploads");
        assert_eq!(object_payload(&moto, key).as_deref(), Some(&new[..]), "{key}: the bucket holds the new bytes");
    }
    node.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_during_a_slow_s3_read_of_its_key_wins_and_still_wins_after_kill_9() {
    let moto = Moto::start();
    let proxy = SlowProxy::start(moto.addr);
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(&node_args(da.path(), &moto.endpoint(), &["--s3-write-policy", "through"]));
    assert_eq!(put_answer(&client(&a, false), "k").await["s3"], "uploaded");
    let old = payload("k");
    let new = payload("k-newer");

    // B reads k from S3 slowly; its own PUT of k lands meanwhile. B uploads
    // nothing (policy off), so the bucket keeps the old bytes throughout.
    let b_args = node_args(db.path(), &format!("http://{}", proxy.addr), &["--s3-write-policy", "off", "--s3-timeout-ms", "5000"]);
    let b = start(&b_args);
    let cb = client(&b, false);
    proxy.delay_ms.store(1_000, Ordering::SeqCst);
    let slow = {
        let c = client(&b, false);
        tokio::spawn(async move { get_bytes(&c, "k").await })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while cb.stats().await.unwrap()["s3"]["totals"]["reads"] == 0 {
        assert!(Instant::now() < deadline, "the S3 read did not start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let put = put_bytes(&cb, "k", new.clone()).await;
    assert_eq!(put["status"], "created", "{put}");
    assert_eq!(get_bytes(&cb, "k").await.unwrap().0, new, "the PUT is served at once");
    // The slow GET began before the PUT: the old bytes are a fair answer.
    let (bytes, tier) = slow.await.unwrap().expect("the slow GET finds the block");
    assert!(bytes == old || bytes == new, "the slow GET got neither version (from {tier})");
    proxy.delay_ms.store(0, Ordering::SeqCst);

    let t = cb.stats().await.unwrap()["s3"]["totals"].clone();
    assert_eq!((t["install_superseded"].as_u64(), t["installs"].as_u64()), (Some(1), Some(0)), "{t}");
    let (bytes, tier) = get_bytes(&cb, "k").await.unwrap();
    assert_eq!(bytes, new, "after the S3 read landed, k is the PUT's bytes (from {tier})");

    // kill -9: recovery replays the log; the PUT's record is the newest.
    b.crash();
    let b = start(&b_args);
    let (bytes, tier) = get_bytes(&client(&b, false), "k").await.unwrap();
    assert_eq!(bytes, new, "after kill -9, k is the PUT's bytes (from {tier})");
    assert!(tier == "nvme" || tier == "ram", "served locally, not from S3: {tier}");
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_s3_shows_as_degraded_with_its_reason_and_ok_again_once_it_is_back() {
    let mut moto = Moto::start();
    let d = tempfile::tempdir().unwrap();
    let node = two_shard_node(d.path(), &moto.endpoint(), &["--s3-write-policy", "through", "--health-window-ms", "500"]);
    let c = client(&node, false);
    assert_eq!(put_answer(&c, "local").await["s3"], "uploaded");
    assert_eq!(common::ready_tier(&c, "s3").await["state"], "ok");

    moto.kill();
    // A miss goes to S3, which is gone: answered as a miss, and the tier
    // says so. The local path keeps serving.
    assert_eq!(get_bytes(&c, "only-in-a-dead-bucket").await, None);
    let s3 = common::ready_tier(&c, "s3").await;
    assert_eq!(s3["state"], "degraded", "{s3}");
    assert!(s3["reason"].as_str().unwrap().contains("only-in-a-dead-bucket"), "the reason names the failed request: {s3}");
    assert_eq!(get_bytes(&c, "local").await.map(|(b, _)| b), Some(payload("local")));
    let stats = c.stats().await.unwrap();
    let health = stats["health"].as_array().unwrap().iter().find(|h| h["tier"] == "s3").unwrap().clone();
    assert!(health["errors"]["read"].as_u64().unwrap_or(0) + health["errors"]["timeout"].as_u64().unwrap_or(0) >= 1, "{health}");
    let text =
        String::from_utf8(c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap().body.to_bytes().to_vec()).unwrap();
    assert!(text.contains("kvtier_tier_degraded{tier=\"s3\"} 1"), "{text}");

    // S3 back: once the health window has passed without a failure, ok.
    moto.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // A request that reaches S3 and succeeds (the object is absent).
        assert_eq!(get_bytes(&c, "still-absent").await, None);
        if common::ready_tier(&c, "s3").await["state"] == "ok" {
            break;
        }
        assert!(Instant::now() < deadline, "S3 did not return to ok: {}", common::ready_tier(&c, "s3").await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(node.log().contains("tier s3 is degraded") && node.log().contains("tier s3 is ok again"), "{}", node.log());
    node.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_socket_reaches_the_s3_tier_through_the_same_waterfall() {
    use common::local::{get_block, keys_payload, put_block, ready_with_buffer, EXISTS};
    let moto = Moto::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = two_shard_node(da.path(), &moto.endpoint(), &["--s3-write-policy", "through"]);
    let keys = ["local-s3-0", "local-s3-1", "local-s3-2", "local-s3-3"];
    let (sa, sb) = (a.data_dir.join("kvtier.sock"), db.path().join("kvtier.sock"));
    let blocks: Vec<Vec<u8>> = keys.iter().map(|k| payload(k).to_vec()).collect();
    tokio::task::spawn_blocking(move || {
        let (mut r, fd, h) = ready_with_buffer(&sa, BLOCK_BYTES);
        for (k, b) in keys.iter().zip(&blocks) {
            assert_eq!(put_block(&mut r, &fd, h, k, b), 0, "{k}");
        }
    })
    .await
    .unwrap();
    for k in keys {
        assert_eq!(object_payload(&moto, k).as_deref(), Some(&payload(k)[..]), "{k}: uploaded through");
    }
    // A second node with an empty disk finds them in S3, over its socket.
    let b = two_shard_node(db.path(), &moto.endpoint(), &[]);
    tokio::task::spawn_blocking(move || {
        let (mut r, fd, h) = ready_with_buffer(&sb, BLOCK_BYTES);
        let a = r.call(EXISTS, &keys_payload(&keys));
        assert_eq!(&a.body[4..], &[4, 4, 4, 4], "EXISTS counts the S3 tier");
        for k in keys {
            let (n, tier, bytes) = get_block(&mut r, &fd, h, k, BLOCK_BYTES);
            assert_eq!((n, tier), (BLOCK_BYTES as i64, 4), "{k}: read from s3");
            assert!(bytes == payload(k)[..], "{k}: byte-exact from S3");
            // Installed locally by that read: the next is a local hit.
            let (_, tier, again) = get_block(&mut r, &fd, h, k, BLOCK_BYTES);
            assert!(matches!(tier, 2 | 3) && again == payload(k)[..], "{k}: then from ram or nvme, got tier {tier}");
        }
    })
    .await
    .unwrap();
    a.stop();
    b.stop();
}
