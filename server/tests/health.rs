//! Tier health: a tier that fails is never silent. Here the log: its shard
//! directories made immutable (`chattr +i`, which stops even root from
//! creating a segment file there), so the log cannot grow and a PUT that
//! needs a new segment fails with an I/O error. The log is then `down`,
//! `/readyz` answers 503 naming it, `/healthz` (liveness) still answers
//! 200, stored blocks keep being served, and once the directories are
//! writable again the next PUT succeeds and health returns to `ok`.
//!
//! Needs root and a filesystem with the immutable attribute (ext4 here),
//! which `make test` has where it runs (CI runs as root); without them the
//! tests fail, naming what is missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{client, payload, set_flag, start, test_args};
use http::{Method, StatusCode};
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::Value;

/// Makes directories immutable; makes them mutable again on drop, so the
/// temporary directory can be removed whatever the test did.
struct Immutable(Vec<PathBuf>);

impl Immutable {
    fn set(dirs: Vec<PathBuf>) -> Result<Immutable, String> {
        let out = Command::new("chattr")
            .arg("+i")
            .args(&dirs)
            .output()
            .map_err(|e| format!("chattr: {e} (`apt-get install e2fsprogs` installs it)"))?;
        if !out.status.success() {
            return Err(format!("chattr +i: {}", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(Immutable(dirs))
    }

    fn clear(&mut self) {
        if !self.0.is_empty() {
            let status = Command::new("chattr").arg("-i").args(&self.0).status().expect("chattr -i");
            assert!(status.success(), "chattr -i failed");
            self.0.clear();
        }
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            let _ = Command::new("chattr").arg("-i").args(&self.0).status();
        }
    }
}

/// Fails the test, naming why, unless it runs as root: `chattr +i` needs
/// CAP_LINUX_IMMUTABLE. `make test` runs as root in CI.
fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert!(unsafe { libc::geteuid() } == 0, "not root: `chattr +i` needs CAP_LINUX_IMMUTABLE (run `make test` as root, as CI does)");
}

async fn put(c: &Client, key: &str) -> StatusCode {
    c.send(Method::PUT, &format!("/v1/blocks/{key}"), ChunkedBody::new(vec![payload(key)]), None).await.unwrap().status
}

async fn get_json(c: &Client, path: &str) -> (StatusCode, Value) {
    common::json_call(c, Method::GET, path, None).await
}

/// `tier`'s entry in `/readyz`.
fn tier<'a>(ready: &'a Value, tier: &str) -> &'a Value {
    ready["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == tier).unwrap_or_else(|| panic!("no {tier} in {ready}"))
}

fn shard_dirs(data: &Path) -> Vec<PathBuf> {
    (0..2).map(|i| data.join(format!("shard-{i:03}"))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_cannot_grow_is_down_and_not_ready_until_it_can() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut args = test_args(&data);
    // 1 MiB segments hold 15 slots of 68 KiB: the log grows every 15 PUTs
    // per shard. A RAM tier serves reads meanwhile.
    set_flag(&mut args, "--segment-mib", "1");
    set_flag(&mut args, "--ram-gb", "0.01");
    set_flag(&mut args, "--health-window-ms", "300");
    let server = start(&args);
    let c = client(&server, false);
    let stored: Vec<String> = (0..40).map(|i| format!("s-{i}")).collect();
    for k in &stored {
        assert_eq!(put(&c, k).await, StatusCode::CREATED, "{k}");
    }
    let (status, ready) = get_json(&c, "/readyz").await;
    assert_eq!((status, &ready["status"]), (StatusCode::OK, &Value::from("ready")), "{ready}");
    assert_eq!(tier(&ready, "nvme")["state"], "ok", "{ready}");

    let mut immutable = Immutable::set(shard_dirs(&data)).unwrap_or_else(|why| panic!("{why}"));
    // PUTs go on until one needs a new segment, which cannot be created
    // (after the spare segment each shard made ahead is full: 15 more).
    let mut refused = None;
    for i in 0..100 {
        let key = format!("t-{i}");
        match put(&c, &key).await {
            StatusCode::CREATED => {}
            status => {
                refused = Some((key, status));
                break;
            }
        }
    }
    let (key, status) = refused.expect("a PUT needed a new segment");
    // An I/O error in the log is the device failing: 503 device_down (issue 63).
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{key}");

    let (status, ready) = get_json(&c, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{ready}");
    assert_eq!(ready["status"], "not_ready");
    assert_eq!(ready["down"], serde_json::json!(["nvme"]), "{ready}");
    let nvme = tier(&ready, "nvme");
    let reason = nvme["reason"].as_str().unwrap();
    assert!(reason.contains("last write failed") && reason.contains("shard-00"), "the reason names the failure: {reason}");
    // Liveness is not readiness; the whole table is in the stats, the
    // state and the errors in the metrics.
    assert_eq!(get_json(&c, "/healthz").await.0, StatusCode::OK);
    let (_, stats) = get_json(&c, "/v1/stats").await;
    let nvme = stats["health"].as_array().unwrap().iter().find(|h| h["tier"] == "nvme").unwrap().clone();
    assert_eq!(nvme["state"], "down", "{nvme}");
    assert!(nvme["errors"]["write"].as_u64().unwrap() >= 1, "{nvme}");
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap();
    let text = String::from_utf8(metrics.body.to_bytes().to_vec()).unwrap();
    assert!(text.contains("kvtier_tier_up{tier=\"nvme\"} 0"), "{text}");
    assert!(text.contains("kvtier_tier_errors_total{tier=\"nvme\",kind=\"write\"}"), "{text}");
    assert!(server.log().contains("tier nvme is down"), "one log line at the change of state:\n{}", server.log());
    // What is stored keeps being served.
    for k in &stored {
        let (body, _) = c.get(k).await.unwrap().unwrap_or_else(|| panic!("{k} is stored"));
        assert_eq!(body.to_bytes(), payload(k), "{k}");
    }

    // Writable again: the shard refuses writes (503 device_down) for at most
    // LOG_PROBE_EVERY after the last failure, then lets one through; it
    // succeeds, and the log is ready at once (degraded for the health
    // window by the errors it met), then ok.
    immutable.clear();
    let until = Instant::now() + kvtier_engine::shard::LOG_PROBE_EVERY + Duration::from_millis(500);
    loop {
        match put(&c, &key).await {
            StatusCode::CREATED => break,
            StatusCode::SERVICE_UNAVAILABLE if Instant::now() < until => tokio::time::sleep(Duration::from_millis(50)).await,
            status => panic!("{key} after chattr -i: {status}, past the probe interval"),
        }
    }
    let (status, ready) = get_json(&c, "/readyz").await;
    assert_eq!(status, StatusCode::OK, "{ready}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, ready) = get_json(&c, "/readyz").await;
        if tier(&ready, "nvme")["state"] == "ok" {
            assert_eq!(ready["degraded"], serde_json::json!([]), "{ready}");
            break;
        }
        assert!(Instant::now() < deadline, "the log did not return to ok: {ready}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(server.log().contains("tier nvme is ok again"), "{}", server.log());
    assert!(server.stop().success());
}

#[test]
fn a_zero_health_window_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = test_args(&dir.path().join("data"));
    set_flag(&mut args, "--health-window-ms", "0");
    let Err((_, log)) = common::try_start(&args) else { panic!("started with --health-window-ms 0") };
    assert!(log.contains("--health-window-ms must be at least 1"), "{log}");
}
