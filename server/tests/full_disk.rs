//! A full filesystem: a small loop-mounted ext4 image made by the test.
//! PUT answers 507 with a clear message once space is gone, every stored
//! block still reads back (also after a restart and through fsck), PUTs
//! succeed again once space is freed, and a --disk-gb that fits the space
//! turns the full filesystem back into ordinary log reclaim.
//!
//! Needs root, mkfs.ext4 (e2fsprogs) and loop devices, which `make test`
//! has where it runs (CI runs as root); without them the test fails, naming
//! what is missing.

mod common;

use std::path::Path;

use common::loopfs::LoopFs;
use common::{client, payload, set_flag, start, test_args, Server};
use http::{Method, StatusCode};
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::Value;

/// Image size: room for a handful of 8 MiB segments after ext4's overhead.
const IMAGE_MIB: u64 = 48;
/// A file the test deletes to free space.
const FILLER_MIB: u64 = 12;

async fn put(c: &Client, key: &str) -> (StatusCode, Value) {
    let a = c.send(Method::PUT, &format!("/v1/blocks/{key}"), ChunkedBody::new(vec![payload(key)]), None).await.unwrap();
    let v = serde_json::from_slice(&a.body.to_bytes()).unwrap_or(Value::Null);
    (a.status, v)
}

/// PUTs new keys `{prefix}-N` until 30 in a row are refused; returns the
/// keys stored and the last refusal's body.
async fn fill(c: &Client, prefix: &str) -> (Vec<String>, Value) {
    let (mut stored, mut refused_in_a_row) = (Vec::new(), 0);
    for i in 0..5000 {
        let key = format!("{prefix}-{i}");
        let (status, body) = put(c, &key).await;
        match status {
            StatusCode::CREATED => {
                stored.push(key);
                refused_in_a_row = 0;
            }
            StatusCode::INSUFFICIENT_STORAGE => {
                refused_in_a_row += 1;
                if refused_in_a_row == 30 {
                    return (stored, body);
                }
            }
            other => panic!("PUT {key}: {other} {body}"),
        }
    }
    panic!("5000 PUTs never filled a {IMAGE_MIB} MiB filesystem");
}

async fn assert_all_read_back(c: &Client, keys: &[String]) {
    for key in keys {
        let (body, _) = c.get(key).await.unwrap().unwrap_or_else(|| panic!("{key} lost"));
        assert!(body.to_bytes() == payload(key), "{key} read back wrong");
    }
}

/// One shard, so that the disk share of the last step maps onto exactly
/// the segments the filesystem held.
fn args(data: &Path, disk_gb: &str) -> Vec<String> {
    let mut a = test_args(data);
    set_flag(&mut a, "--disk-gb", disk_gb);
    set_flag(&mut a, "--shards", "1");
    a
}

fn fsck_clean(data: &Path) {
    let (clean, report) = common::fsck_json(data);
    assert!(clean, "fsck after ENOSPC: {report}");
}

async fn stats(server: &Server) -> Value {
    client(server, false).stats().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_filesystem_refuses_puts_with_507_and_keeps_every_block() {
    let dir = tempfile::tempdir().unwrap();
    let fs = LoopFs::make(dir.path(), IMAGE_MIB).unwrap_or_else(|why| {
        panic!(
            "the full-disk test needs a loop-mounted ext4 image: {why} (mkfs.ext4 and mount come with `apt-get install e2fsprogs mount`)"
        )
    });
    let filler = fs.mnt.join("filler");
    std::fs::write(&filler, vec![7u8; (FILLER_MIB << 20) as usize]).unwrap();
    let data = fs.mnt.join("data");
    // The disk share (1 GiB) is far above the filesystem (48 MiB).
    let server = start(&args(&data, "1"));
    let c = client(&server, false);
    // 150 blocks written twice: the first segment (120 slots of 64 KiB)
    // then holds only superseded copies, so when the filesystem fills, the
    // log reuses it rather than refusing.
    let rewritten: Vec<String> = (0..150).map(|i| format!("x-{i}")).collect();
    for round in 0..2 {
        for key in &rewritten {
            let expected = if round == 0 { StatusCode::CREATED } else { StatusCode::OK };
            assert_eq!(put(&c, key).await.0, expected, "{key}");
        }
    }
    let (mut stored, refusal) = fill(&c, "a").await;
    assert!(server.log().contains("reusing segment 0, which holds no live block"), "{}", server.log());
    stored.extend(rewritten);
    assert!(stored.len() > 100, "only {} blocks fit", stored.len());
    assert_eq!(refusal["error"]["code"], "disk_full", "{refusal}");
    let message = refusal["error"]["message"].as_str().unwrap();
    assert!(message.contains("is full") && message.contains("stays readable") && message.contains("--disk-gb"), "{message}");
    assert_all_read_back(&c, &stored).await;
    let s = stats(&server).await;
    assert!(s["totals"]["disk_full_refusals"].as_u64().unwrap() >= 30, "{}", s["totals"]);
    assert_eq!(s["totals"]["evicted_blocks"], 0, "nothing stored was evicted to make room");
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap();
    assert!(String::from_utf8_lossy(&metrics.body.to_bytes()).contains("kvtier_shard_disk_full_refusals"));
    // Over HTTP/1.1 too, and a DELETE of an unknown key is still a 404.
    let h1 = client(&server, true);
    assert_eq!(put(&h1, "a-h1-extra").await.0, StatusCode::INSUFFICIENT_STORAGE);
    // Never silent: the log is degraded, and says why.
    let nvme = common::ready_tier(&c, "nvme").await;
    assert_eq!(nvme["state"], "degraded", "{nvme}");
    assert!(nvme["reason"].as_str().unwrap().contains("is full"), "{nvme}");
    let del = c.send(Method::DELETE, "/v1/blocks/never-stored", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(del.status, StatusCode::NOT_FOUND);

    // A clean stop on the full filesystem, fsck, a restart: all there.
    assert!(server.stop().success());
    fsck_clean(&data);
    let server = start(&args(&data, "1"));
    let c = client(&server, false);
    assert_all_read_back(&c, &stored).await;
    assert_eq!(put(&c, "a-after-restart").await.0, StatusCode::INSUFFICIENT_STORAGE);

    // Space freed on the filesystem: PUTs succeed again, without a restart,
    // and the log is ok again at once (a full disk is a condition, not an
    // error of the device).
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(put(&c, "b-first").await.0, StatusCode::CREATED);
    let nvme = common::ready_tier(&c, "nvme").await;
    assert_eq!(nvme["state"], "ok", "{nvme}");
    let (more, _) = fill(&c, "b").await;
    assert!(more.len() > 50, "freeing {FILLER_MIB} MiB let only {} blocks in", more.len());
    assert_all_read_back(&c, &stored).await;
    assert_all_read_back(&c, &more).await;
    let disk_bytes = stats(&server).await["totals"]["disk_bytes"].as_u64().unwrap();

    // A crash on the full filesystem loses nothing acknowledged either.
    server.crash();
    fsck_clean(&data);
    // A disk share that fits what the filesystem holds: the full log
    // reclaims its oldest segments as usual, and PUTs succeed.
    let fits = format!("{}", disk_bytes as f64 / (1u64 << 30) as f64);
    let server = start(&args(&data, &fits));
    let c = client(&server, false);
    let fresh: Vec<String> = (0..200).map(|i| format!("c-{i}")).collect();
    for key in &fresh {
        let (status, body) = put(&c, key).await;
        assert_eq!(status, StatusCode::CREATED, "PUT {key} with --disk-gb {fits}: {body}");
    }
    assert_all_read_back(&c, &fresh).await;
    let s = stats(&server).await;
    assert!(s["totals"]["evicted_blocks"].as_u64().unwrap() > 0, "{}", s["totals"]);
    // Evicted blocks are misses, never wrong bytes.
    for key in stored.iter().chain(&more) {
        if let Some((body, _)) = c.get(key).await.unwrap() {
            assert!(body.to_bytes() == payload(key), "{key} read back wrong after reclaim");
        }
    }
    assert!(server.stop().success());
    fsck_clean(&data);
}
