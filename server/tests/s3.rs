//! The shared S3 tier, end to end: real `kvtier serve` processes with
//! separate data directories sharing one bucket on a real S3-compatible
//! server (moto_server from `target/py-s3`, made by `make python-env`) on
//! loopback. Blocks move between nodes through the bucket; create-only
//! uploads make racing writers harmless; a killed, restarted or slow S3
//! never fails a PUT or a local GET; a tampered object is never served.

mod common;
mod s3_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{client, payload, start, test_args, try_start, BLOCK_BYTES};
use http::{Method, StatusCode};
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::{json, Value};

use s3_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_put_on_one_node_are_read_looked_up_and_prefetched_on_others() {
    let moto = Moto::start();
    let (da, db, dc) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(&node_args(da.path(), &moto.endpoint(), &[]));
    let b = start(&node_args(db.path(), &moto.endpoint(), &["--s3-write-policy", "off"]));
    let c = start(&node_args(dc.path(), &moto.endpoint(), &["--s3-write-policy", "through"]));
    let (ca, cb, cc) = (client(&a, false), client(&b, true), client(&c, false));

    // A writes a 6-block prefix; write-behind answers before the upload.
    let prefix = keys("p", 6);
    for k in &prefix {
        assert_eq!(put_answer(&ca, k).await["s3"], "queued");
    }
    let t = uploads_settle(&ca).await;
    assert_eq!((t["uploads_done"].as_u64(), t["uploads_dropped"].as_u64(), t["uploads_failed"].as_u64()), (Some(6), Some(0), Some(0)));
    let mut names = moto.list();
    names.sort();
    let mut want: Vec<String> = prefix.iter().map(|k| object_name(k)).collect();
    want.sort();
    assert_eq!(names, want, "one object per block, named as docs/FORMAT.md says");

    // B counts A's prefix (one existence check per missing block at most),
    // stopping at the first key nobody has.
    let mut asked = prefix.clone();
    asked.push("p-absent".into());
    asked.push(prefix[0].clone());
    assert_eq!(lookup(&cb, &asked).await, ["s3"; 6]);
    // HEAD looks in S3 too.
    let h = cb.send(Method::HEAD, "/v1/blocks/p-3", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(h.status, StatusCode::OK);
    let h = cb.send(Method::HEAD, "/v1/blocks/p-absent", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(h.status, StatusCode::NOT_FOUND);
    // B reads p-0 from S3, then from its own tiers.
    assert_eq!(get_tier(&cb, "p-0").await.as_deref(), Some("s3"));
    let local = get_tier(&cb, "p-0").await.unwrap();
    assert!(local == "ram" || local == "nvme", "second read from {local}");
    let tiers = lookup(&cb, &prefix).await;
    assert!(tiers[0] == "ram" || tiers[0] == "nvme", "{tiers:?}");
    assert_eq!(tiers[1..], ["s3"; 5]);
    let bt = s3_totals(&cb).await;
    assert_eq!((bt["reads"].as_u64(), bt["read_hits"].as_u64(), bt["installs"].as_u64()), (Some(1), Some(1), Some(1)), "{bt}");
    assert!(bt["exists_checks"].as_u64().unwrap() >= 7, "{bt}");

    // C prefetches p-1 and p-2 from S3 into its local tiers.
    let body = serde_json::to_vec(&json!({ "keys": ["p-1", "p-2", "p-absent"] })).unwrap();
    let r = cc.send(Method::POST, "/v1/prefetch", ChunkedBody::new(vec![Bytes::from(body)]), Some("application/json")).await.unwrap();
    assert_eq!(r.status, StatusCode::ACCEPTED);
    let v: Value = serde_json::from_slice(&r.body.to_bytes()).unwrap();
    assert_eq!((v["found"].as_u64(), v["s3_requested"].as_u64()), (Some(0), Some(3)), "{v}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while s3_totals(&cc).await["prefetched"] != 2 {
        assert!(Instant::now() < deadline, "prefetch did not finish: {}", s3_totals(&cc).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for k in ["p-1", "p-2"] {
        let t = get_tier(&cc, k).await.unwrap();
        assert!(t == "ram" || t == "nvme", "{k} prefetched, then read from {t}");
    }

    // Write-through on C: acknowledged after the upload, so B reads it at once.
    assert_eq!(put_answer(&cc, "t-0").await["s3"], "uploaded");
    assert_eq!(get_tier(&cb, "t-0").await.as_deref(), Some("s3"));
    // The same block PUT on another write-through node is already there.
    // (B writes nothing: off.)
    let off = put_answer(&cb, "b-0").await;
    assert!(off.get("s3").is_none(), "{off}");
    assert_eq!(moto.list().len(), 7, "B's write policy is off: b-0 not uploaded");

    // B restarts: its copy of p-0 is local, not read from S3 again.
    b.stop();
    let b = start(&node_args(db.path(), &moto.endpoint(), &["--s3-write-policy", "off"]));
    let cb = client(&b, false);
    let t = get_tier(&cb, "p-0").await.unwrap();
    assert!(t == "nvme" || t == "ram", "after restart p-0 from {t}");
    assert_eq!(s3_totals(&cb).await["reads"], 0);

    // DELETE removes the block from the node and from the bucket: the next
    // node misses it. (A keeps its own local copy: nodes do not talk.)
    let d = cc.send(Method::DELETE, "/v1/blocks/p-5", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    assert!(moto.get_object(&object_name("p-5")).is_none());
    assert_eq!(get_tier(&cb, "p-5").await, None);
    let d = cc.send(Method::DELETE, "/v1/blocks/never-stored", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(d.status, StatusCode::NOT_FOUND);

    // Stats and metrics say what happened.
    let metrics = cc.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap();
    let text = String::from_utf8(metrics.body.to_bytes().to_vec()).unwrap();
    for name in [
        "kvtier_s3_uploads_done_total",
        "kvtier_s3_read_hits_total",
        "kvtier_s3_prefetched_total",
        "kvtier_s3_request_duration_seconds_bucket",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics");
    }
    let st = cc.stats().await.unwrap();
    assert_eq!(st["s3"]["write_policy"], "through");
    assert_eq!(st["s3"]["totals"]["uploads_done"], 1);
    for n in [a, b, c] {
        assert!(n.stop().success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_puts_of_one_key_make_one_object_with_the_right_bytes() {
    let moto = Moto::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let through = ["--s3-write-policy", "through"];
    let a = start(&node_args(da.path(), &moto.endpoint(), &through));
    let b = start(&node_args(db.path(), &moto.endpoint(), &through));
    let (ca, cb) = (client(&a, false), client(&b, false));

    // In turn: the second upload finds the object there (412 on a
    // create-only PUT) and succeeds without writing.
    assert_eq!(put_answer(&ca, "seq-0").await["s3"], "uploaded");
    assert_eq!(put_answer(&cb, "seq-0").await["s3"], "present");

    // At once, on both nodes, for several keys.
    let racing = keys("race", 8);
    for k in &racing {
        let (x, y) = tokio::join!(put_answer(&ca, k), put_answer(&cb, k));
        for v in [&x, &y] {
            assert!(v["s3"] == "uploaded" || v["s3"] == "present", "{k}: {v}");
            assert_eq!(v["status"], "created");
        }
    }
    let names = moto.list();
    assert_eq!(names.len(), 1 + racing.len(), "{names:?}");
    for k in racing.iter().chain(std::iter::once(&"seq-0".to_string())) {
        let object = moto.get_object(&object_name(k)).unwrap();
        assert!(object.starts_with(b"KVTS3"), "{k}: not a kvtier block object");
        assert_eq!(&object[object.len() - BLOCK_BYTES as usize..], &payload(k)[..], "{k}: the object holds other bytes");
    }
    let (ta, tb) = (s3_totals(&ca).await, s3_totals(&cb).await);
    let done = ta["uploads_done"].as_u64().unwrap() + tb["uploads_done"].as_u64().unwrap();
    let present = ta["uploads_present"].as_u64().unwrap() + tb["uploads_present"].as_u64().unwrap();
    assert_eq!(done + present, 2 + 2 * racing.len() as u64, "{ta} {tb}");
    assert!(present >= 1, "{ta} {tb}");
    assert_eq!(ta["uploads_failed"].as_u64().unwrap() + tb["uploads_failed"].as_u64().unwrap(), 0);
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_killed_mid_upload_and_mid_read_then_restarted_fails_nothing_local() {
    let mut moto = Moto::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let fast = ["--s3-timeout-ms", "1000", "--s3-upload-timeout-ms", "3000"];
    let a = start(&node_args(da.path(), &moto.endpoint(), &fast));
    let b = start(&node_args(db.path(), &moto.endpoint(), &[&fast[..], &["--s3-write-policy", "through"]].concat()));
    let (ca, cb) = (client(&a, false), client(&b, false));
    let shared = keys("up", 4);
    for k in &shared {
        put_answer(&ca, k).await;
    }
    uploads_settle(&ca).await;

    assert_eq!(get_tier(&cb, &shared[0]).await.as_deref(), Some("s3"));

    // A burst of PUTs on A and GETs on B of blocks only S3 has; S3 dies
    // once a third of the PUTs are in, so the later uploads and reads meet
    // a dead server (some of them mid-request).
    let burst = keys("burst", 24);
    let put_count = Arc::new(AtomicU64::new(0));
    let puts = {
        let ca = client(&a, false);
        let (burst, put_count) = (burst.clone(), put_count.clone());
        tokio::spawn(async move {
            for k in &burst {
                let v = put_answer(&ca, k).await;
                assert_eq!(v["status"], "created", "{k}: {v}");
                put_count.fetch_add(1, Ordering::SeqCst);
            }
        })
    };
    let reads = {
        let cb = client(&b, false);
        let shared = shared.clone();
        tokio::spawn(async move {
            for _ in 0..4 {
                for k in &shared[1..] {
                    // Either the right bytes (from S3 or, once installed,
                    // locally) or a miss: never an error, never other bytes.
                    get_tier(&cb, k).await;
                }
            }
        })
    };
    while put_count.load(Ordering::SeqCst) < 8 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    moto.kill();
    puts.await.unwrap();
    reads.await.unwrap();
    // B's installed copy is local now, S3 or not.
    let t = get_tier(&cb, &shared[0]).await.unwrap();
    assert!(t == "ram" || t == "nvme", "{t}");

    // Local hits on A still answer, with the right bytes.
    for k in burst.iter().chain(&shared) {
        let t = get_tier(&ca, k).await.unwrap();
        assert!(t == "ram" || t == "nvme", "{k} from {t}");
    }
    // A write-through PUT with S3 down is acknowledged once the upload failed.
    let v = put_answer(&cb, "through-while-down").await;
    assert_eq!((v["status"].as_str(), v["s3"].as_str()), (Some("created"), Some("failed")), "{v}");
    assert_eq!(get_tier(&cb, "through-while-down").await.as_deref(), Some("ram"));
    // With S3 down, a miss on B is a miss (404), counted as an error. Four
    // of them: the racing reads above may all have finished before the
    // kill (on a loaded machine they did), and three failures in a row
    // take S3 as down, so the fourth is skipped.
    for k in ["burst-20", "burst-21", "burst-22", "burst-23"] {
        assert_eq!(get_tier(&cb, k).await, None, "{k}");
    }
    assert_eq!(lookup(&cb, &["burst-23".to_string()]).await.len(), 0);
    let ta = uploads_settle(&ca).await;
    let tb = s3_totals(&cb).await;
    assert!(ta["uploads_failed"].as_u64().unwrap() >= 1, "uploads after the kill fail and are counted: {ta}");
    assert_eq!(
        ta["uploads_done"].as_u64().unwrap() + ta["uploads_failed"].as_u64().unwrap() + ta["uploads_dropped"].as_u64().unwrap(),
        (shared.len() + burst.len()) as u64,
        "every upload is accounted for: {ta}"
    );
    assert!(tb["read_errors"].as_u64().unwrap() >= 3, "{tb}");
    // After 3 failures in a row S3 is taken as down for a second: misses
    // then answer without sending anything.
    let sb = cb.stats().await.unwrap();
    assert!(sb["s3"]["down_trips"].as_u64().unwrap() >= 1, "{}", sb["s3"]);
    assert!(tb["skipped_down"].as_u64().unwrap() >= 1, "{tb}");
    assert!(tb["exists_errors"].as_u64().unwrap() + tb["skipped_down"].as_u64().unwrap() >= 1, "{tb}");
    assert!(b.log().contains("taken as down"), "{}", b.log());
    assert!(a.log().contains("S3 upload"), "a rate-limited warning names the failure:\n{}", a.log());

    // S3 comes back (empty: moto keeps objects in memory): new blocks flow
    // again; lost objects are misses, never errors.
    moto.restart();
    // Past the down window, requests go out again.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(put_answer(&ca, "after-0").await["s3"], "queued");
    uploads_settle(&ca).await;
    assert_eq!(get_tier(&cb, "after-0").await.as_deref(), Some("s3"));
    assert_eq!(get_tier(&cb, "burst-22").await, None);
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_s3_turns_reads_into_misses_at_the_timeout_and_does_not_hold_local_hits() {
    let moto = Moto::start();
    let proxy = SlowProxy::start(moto.addr);
    let d = tempfile::tempdir().unwrap();
    let a = start(&node_args(
        d.path(),
        &format!("http://{}", proxy.addr),
        &[
            "--s3-timeout-ms",
            "800",
            "--s3-upload-timeout-ms",
            "2000",
            "--s3-presence-ttl-ms",
            "0",
            "--s3-upload-queue-mib",
            "1",
            "--s3-uploads-inflight",
            "1",
        ],
    ));
    let ca = client(&a, false);
    let local = keys("local", 4);
    for k in &local {
        put_answer(&ca, k).await;
    }
    uploads_settle(&ca).await;

    // Concurrent misses of one key on a node share one S3 read.
    let db = tempfile::tempdir().unwrap();
    let b = start(&node_args(db.path(), &format!("http://{}", proxy.addr), &[]));
    let cb = client(&b, false);
    proxy.delay_ms.store(300, Ordering::SeqCst);
    let reads = (0..8).map(|_| get_tier(&cb, "local-0"));
    for tier in futures::future::join_all(reads).await {
        assert_eq!(tier.as_deref(), Some("s3"));
    }
    let t = s3_totals(&cb).await;
    assert_eq!((t["reads"].as_u64(), t["reads_joined"].as_u64(), t["installs"].as_u64()), (Some(1), Some(7), Some(1)), "{t}");
    b.stop();

    proxy.delay_ms.store(5_000, Ordering::SeqCst);
    // A read of a block only S3 might have waits for S3 at most the timeout.
    let slow = {
        let ca = client(&a, false);
        tokio::spawn(async move {
            let started = Instant::now();
            let got = get_tier(&ca, "only-in-s3").await;
            (got, started.elapsed(), Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Meanwhile local hits answer, all before the S3 read gives up.
    for _ in 0..5 {
        for k in &local {
            let t = get_tier(&ca, k).await.unwrap();
            assert!(t == "ram" || t == "nvme", "{k} from {t}");
        }
    }
    let locals_done = Instant::now();
    let (got, waited, s3_done) = slow.await.unwrap();
    assert_eq!(got, None, "a slow S3 is a miss");
    assert!(locals_done < s3_done, "local hits waited for the slow S3 read");
    assert!(waited >= Duration::from_millis(700) && waited < Duration::from_millis(4_000), "the S3 read gave up after {waited:?}");
    // A PUT is not held by the slow upload behind it.
    assert_eq!(put_answer(&ca, "while-slow").await["s3"], "queued");
    // A write burst while S3 is slow: every PUT is answered at once; what
    // does not fit the bounded queue (1 MiB: 16 blocks a shard) is dropped
    // and counted, never waited for.
    let mut dropped = 0;
    for k in keys("burst", 48) {
        let v = put_answer(&ca, &k).await;
        assert_eq!(v["status"], "created");
        match v["s3"].as_str().unwrap() {
            "dropped" => dropped += 1,
            other => assert_eq!(other, "queued", "{k}: {v}"),
        }
    }
    assert!(dropped > 0, "a 48-block burst fits a 16-block queue behind a stalled upload?");
    let t = s3_totals(&ca).await;
    assert_eq!(t["uploads_dropped"], dropped, "{t}");
    assert_eq!(t["uploads_queued_max"], 16, "the queue fills to its bound and no further: {t}");
    assert!(t["timeouts"].as_u64().unwrap() >= 1 && t["read_errors"].as_u64().unwrap() >= 1, "{t}");
    proxy.delay_ms.store(0, Ordering::SeqCst);
    a.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_or_truncated_object_is_never_served() {
    let moto = Moto::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(&node_args(da.path(), &moto.endpoint(), &["--s3-write-policy", "through"]));
    let b = start(&node_args(db.path(), &moto.endpoint(), &[]));
    let (ca, cb) = (client(&a, false), client(&b, false));
    for k in ["flip-0", "cut-0", "hdr-0"] {
        assert_eq!(put_answer(&ca, k).await["s3"], "uploaded");
    }
    // A payload byte flipped, the object cut short, a header byte flipped.
    let mut flipped = moto.get_object(&object_name("flip-0")).unwrap();
    let at = flipped.len() - 1000;
    flipped[at] ^= 0x5a;
    moto.put_object(&object_name("flip-0"), &flipped);
    let whole = moto.get_object(&object_name("cut-0")).unwrap();
    moto.put_object(&object_name("cut-0"), &whole[..whole.len() - 10]);
    let mut header = moto.get_object(&object_name("hdr-0")).unwrap();
    header[14] ^= 0x01;
    moto.put_object(&object_name("hdr-0"), &header);

    for k in ["flip-0", "cut-0", "hdr-0"] {
        assert_eq!(get_tier(&cb, k).await, None, "{k} served from a damaged object");
        assert!(moto.get_object(&object_name(k)).is_none(), "{k}: the damaged object is deleted so a writer can replace it");
    }
    let t = s3_totals(&cb).await;
    assert_eq!((t["read_corrupt"].as_u64(), t["read_hits"].as_u64(), t["installs"].as_u64()), (Some(3), Some(0), Some(0)), "{t}");
    assert_eq!(cb.stats().await.unwrap()["totals"]["blocks"], 0, "nothing damaged was installed");
    // A's copy is intact and local.
    assert_eq!(get_tier(&ca, "flip-0").await.as_deref(), Some("ram"));
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_come_from_the_shared_credentials_file_when_the_environment_has_none() {
    let moto = Moto::start();
    let d = tempfile::tempdir().unwrap();
    // A wrapper that starts kvtier without credentials in its environment
    // (and without the instance role: no metadata service answers here),
    // pointing at a credentials file of a named profile instead.
    let creds = d.path().join("credentials");
    std::fs::write(
        &creds,
        "[default]\naws_access_key_id = wrong\n\n[fleet]\naws_access_key_id = from-file\naws_secret_access_key = from-file\n",
    )
    .unwrap();
    let wrapper = d.path().join("kvtier-without-env");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY AWS_PROFILE=fleet AWS_SHARED_CREDENTIALS_FILE={} \
             AWS_EC2_METADATA_DISABLED=true AWS_METADATA_ENDPOINT=http://127.0.0.1:9 {} \"$@\"\n",
            creds.display(),
            env!("CARGO_BIN_EXE_kvtier")
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let data = d.path().join("data");
    let log = d.path().join("serve.log");
    let node = kvtier_loadgen::server_process::ServerProcess::start(
        &wrapper,
        &node_args(&data, &moto.endpoint(), &["--s3-write-policy", "through", "--s3-timeout-ms", "1000"]),
        &log,
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    let c = Client::new(node.url(), false, 1).unwrap();
    // Signed with the file's key: moto takes any, but with no credentials
    // at all the client could not sign, and the upload would fail.
    let v = put_answer(&c, "creds-0").await;
    assert_eq!(v["s3"], "uploaded", "{v}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    assert!(moto.get_object(&object_name("creds-0")).is_some());
    node.stop().unwrap();
}

/// A `credential_process` profile (which the AWS SDK's chain runs; the
/// shared files alone have no keys) whose credentials expire in 5 s: each
/// signed request fetches them again rather than using the first ones past
/// their expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_come_from_a_credential_process_and_are_fetched_again_before_they_expire() {
    let moto = Moto::start();
    let d = tempfile::tempdir().unwrap();
    let calls = d.path().join("calls");
    let process = d.path().join("issue-credentials");
    std::fs::write(
        &process,
        format!(
            "#!/bin/sh\necho called >> {}\nprintf '{{\"Version\":1,\"AccessKeyId\":\"from-process\",\"SecretAccessKey\":\"from-process\",\
             \"SessionToken\":\"token-%s\",\"Expiration\":\"%s\"}}' \"$(date +%s%N)\" \"$(date -u -d '+5 seconds' +%Y-%m-%dT%H:%M:%SZ)\"\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&process, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = d.path().join("config");
    std::fs::write(&config, format!("[profile fleet]\nregion = us-east-1\ncredential_process = {}\n", process.display())).unwrap();
    let wrapper = d.path().join("kvtier-with-process");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_REGION AWS_PROFILE=fleet AWS_CONFIG_FILE={} \
             AWS_SHARED_CREDENTIALS_FILE={}/absent AWS_EC2_METADATA_DISABLED=true {} \"$@\"\n",
            config.display(),
            d.path().display(),
            env!("CARGO_BIN_EXE_kvtier")
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let log = d.path().join("serve.log");
    let node = kvtier_loadgen::server_process::ServerProcess::start(
        &wrapper,
        &node_args(&d.path().join("data"), &moto.endpoint(), &["--s3-write-policy", "through", "--s3-timeout-ms", "2000"]),
        &log,
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    let c = Client::new(node.url(), false, 1).unwrap();
    let count = || std::fs::read_to_string(&calls).map(|s| s.lines().count()).unwrap_or(0);
    for key in ["proc-0", "proc-1"] {
        let v = put_answer(&c, key).await;
        assert_eq!(v["s3"], "uploaded", "{v}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        assert!(moto.get_object(&object_name(key)).is_some());
    }
    assert!(count() >= 2, "credentials expiring within a minute are fetched again for each signing: {} calls", count());
    node.stop().unwrap();
}

#[test]
fn bad_s3_flags_are_refused_with_the_reason() {
    aws_env();
    let d = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["--s3-url", "https://bucket/x"], "must look like s3://BUCKET[/PREFIX]"),
        (&["--s3-url", "s3://"], "names no bucket"),
        (&["--s3-url", "s3://Bad_Bucket"], "may hold only"),
        (&["--s3-url", "s3://kv", "--s3-endpoint", "127.0.0.1:9000"], "must be an http:// or https:// URL"),
        (&["--s3-url", "s3://kv", "--s3-timeout-ms", "0"], "--s3-timeout-ms must be at least 1"),
        (&["--s3-endpoint", "http://127.0.0.1:9"], "--s3-url"),
    ];
    for (flags, want) in cases {
        let mut args = test_args(d.path());
        args.extend(flags.iter().map(|s| s.to_string()));
        match try_start(&args) {
            Ok(s) => panic!("{flags:?} was accepted: {}", s.listening_line()),
            Err((_, log)) => assert!(log.contains(want), "{flags:?}: expected {want:?} in:\n{log}"),
        }
    }
    // Nothing was created by a refused start.
    assert!(!d.path().join("store.json").exists());
}
