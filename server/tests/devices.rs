//! Several data directories per store, one per device (docs/OPERATIONS.md,
//! "Several devices"; `kvtier_engine::devices`), against a real
//! `kvtier serve`: blocks spread over two loop-mounted ext4 filesystems
//! within ±10 % and read back byte for byte after a kill -9 and a restart
//! with the directories given in the other order (and `fsck` over both); a
//! directory of another store refused naming both; a device not given
//! absent (its shards refusing PUTs); a device absent at start three ways
//! (not mounted, an empty directory where it mounts, failing every I/O)
//! serving from S3 and refusing PUTs, then back; an empty directory
//! standing in for a lost device, its shards starting empty while the
//! other device's blocks still serve; a store
//! made with one directory opening alone as before; devices added to a
//! store (`--add-devices`); a device whose filesystem fills refusing its
//! shards' PUTs, naming it, while the other stores on; a device that fails
//! under load (its filesystem shut down, so every I/O on it fails as on a
//! dead drive) costing its shards' blocks and nothing else.
//!
//! The spread test needs root, mkfs.ext4 and loop devices (as
//! tests/full_disk.rs); without them it fails naming what is missing.

mod common;
mod s3_support;

use std::path::Path;
use std::time::Instant;

use common::loopfs::LoopFs;
use common::{client, payload, set_flag, start, test_args, try_start, Server};
use http::{Method, StatusCode};
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::Value;

/// A store over `dirs`, in that order, of `shards` shards.
fn args(dirs: &[&Path], shards: usize) -> Vec<String> {
    let mut a = test_args(dirs[0]);
    for d in &dirs[1..] {
        a.push("--data-dir".into());
        a.push(d.display().to_string());
    }
    set_flag(&mut a, "--shards", &shards.to_string());
    set_flag(&mut a, "--disk-gb", "0.1");
    set_flag(&mut a, "--ram-gb", "0");
    a
}

/// A 160 MiB ext4 filesystem on a loop device in `dir`: one device.
fn device(dir: &Path) -> LoopFs {
    LoopFs::make(dir, 160).unwrap_or_else(|why| {
        panic!("the devices test needs loop-mounted ext4 images: {why} (mkfs.ext4 and mount come with `apt-get install e2fsprogs mount`)")
    })
}

async fn put_keys(c: &Client, prefix: &str, n: usize) -> Vec<String> {
    let mut keys = Vec::with_capacity(n);
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let a = c.send(Method::PUT, &format!("/v1/blocks/{key}"), ChunkedBody::new(vec![payload(&key)]), None).await.unwrap();
        assert_eq!(a.status, StatusCode::CREATED, "PUT {key}");
        keys.push(key);
    }
    keys
}

/// Per key: `Some(true)` read back right, `None` a miss; a wrong byte panics.
async fn read_back(c: &Client, keys: &[String]) -> Vec<Option<bool>> {
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        match c.get(key).await.unwrap() {
            Some((body, _)) => {
                assert!(body.to_bytes() == payload(key), "{key} served with wrong bytes");
                out.push(Some(true));
            }
            None => out.push(None),
        }
    }
    out
}

async fn devices(server: &Server) -> Vec<Value> {
    client(server, false).stats().await.unwrap()["devices"].as_array().unwrap().clone()
}

fn store_id(dir: &Path) -> String {
    let m: Value = serde_json::from_slice(&std::fs::read(dir.join("store.json")).unwrap()).unwrap();
    m["store_id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_spread_over_two_filesystems_and_survive_a_crash_and_a_reordered_restart() {
    let (ta, tb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (fa, fb) = (device(ta.path()), device(tb.path()));
    let (a, b) = (fa.mnt.join("data"), fb.mnt.join("data"));
    let server = start(&args(&[&a, &b], 4));
    let c = client(&server, false);
    let keys = put_keys(&c, "spread", 400).await;
    let per_device: Vec<u64> = devices(&server).await.iter().map(|d| d["blocks"].as_u64().unwrap()).collect();
    assert_eq!(per_device.iter().sum::<u64>(), 400, "{per_device:?}");
    for (i, n) in per_device.iter().enumerate() {
        assert!((180..=220).contains(n), "device {i} holds {n} of 400 blocks, not within 10 % of 200: {per_device:?}");
    }
    assert_ne!(store_id(&a), "");
    assert_eq!(store_id(&a), store_id(&b));
    server.crash();
    // The directories the other way round: matched by their store.json.
    let server = start(&args(&[&b, &a], 4));
    let c = client(&server, false);
    assert!(read_back(&c, &keys).await.iter().all(|r| *r == Some(true)), "a block was lost over the crash");
    let per_device: Vec<u64> = devices(&server).await.iter().map(|d| d["blocks"].as_u64().unwrap()).collect();
    assert_eq!(per_device.iter().sum::<u64>(), 400);
    let ready: Value =
        serde_json::from_slice(&c.send(Method::GET, "/readyz", ChunkedBody::new(vec![]), None).await.unwrap().body.to_bytes()).unwrap();
    assert_eq!(ready["status"], "ready", "{ready}");
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::new(vec![]), None).await.unwrap().body.to_bytes();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvtier_device_up{device=\"0\"} 1") && metrics.contains("kvtier_device_up{device=\"1\"} 1"), "{metrics}");
    server.stop();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["fsck", "--json", "--data-dir"])
        .arg(&a)
        .arg("--data-dir")
        .arg(&b)
        .output()
        .unwrap();
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("fsck: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{report}");
    assert_eq!(report["live_blocks"], 400, "{report}");
}

/// Every later I/O on `mnt`'s filesystem fails with EIO, as on a device
/// that died: ext4's `EXT4_IOC_SHUTDOWN` (`_IOR('X', 125, __u32)`) with
/// `EXT4_GOING_FLAGS_NOLOGFLUSH`, as xfstests' `godown` does (root).
fn fail_device(mnt: &Path) {
    use std::os::fd::AsRawFd;
    let dir = std::fs::File::open(mnt).unwrap();
    let flags: u32 = 2;
    // SAFETY: the ioctl reads one u32 we own from a valid pointer.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), 0x8004_587D, &flags) };
    assert_eq!(rc, 0, "EXT4_IOC_SHUTDOWN on {}: {}", mnt.display(), std::io::Error::last_os_error());
}

async fn status_and_body(c: &Client, method: Method, key: &str) -> (StatusCode, Value) {
    let body = if method == Method::PUT { vec![payload(key)] } else { vec![] };
    let a = c.send(method, &format!("/v1/blocks/{key}"), ChunkedBody::new(body), None).await.unwrap();
    (a.status, serde_json::from_slice(&a.body.to_bytes()).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_fails_under_load_costs_its_shards_blocks_and_nothing_else() {
    let (ta, tb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (fa, fb) = (device(ta.path()), device(tb.path()));
    let server = start(&args(&[&fa.mnt.join("data"), &fb.mnt.join("data")], 4));
    let c = client(&server, false);
    let before = put_keys(&c, "before", 200).await;
    fail_device(&fb.mnt);
    // PUTs: the failed device's shards answer 503 device_down, naming it;
    // the other device's store every block. Never a 500.
    let mut stored_after = Vec::new();
    let mut refused = 0;
    for i in 0..200 {
        let key = format!("after-{i}");
        match status_and_body(&c, Method::PUT, &key).await {
            (StatusCode::CREATED, _) => stored_after.push(key),
            (StatusCode::SERVICE_UNAVAILABLE, body) => {
                assert_eq!(body["error"]["code"], "device_down", "{body}");
                assert!(body["error"]["message"].as_str().unwrap().contains("device"), "{body}");
                refused += 1;
            }
            (status, body) => panic!("PUT {key} with device 1 failed: {status} {body}"),
        }
    }
    assert!((60..=140).contains(&refused), "device 1's half refused, device 0's stored: {refused} refused of 200");
    // GETs: every block acknowledged on the healthy device reads back; the
    // failed device's are misses; nothing is served wrong, nothing is a 5xx.
    assert!(read_back(&c, &stored_after).await.iter().all(|r| *r == Some(true)), "a block stored on the healthy device was lost");
    let served = read_back(&c, &before).await.iter().filter(|r| r.is_some()).count();
    assert!((60..=140).contains(&served), "the healthy device's half of the earlier blocks serves: {served} of 200");
    let ready: Value =
        serde_json::from_slice(&c.send(Method::GET, "/readyz", ChunkedBody::new(vec![]), None).await.unwrap().body.to_bytes()).unwrap();
    assert_eq!(ready["status"], "degraded", "{ready}");
    assert_eq!(ready["devices_down"][0]["device"], 1, "{ready}");
    assert!(ready["devices_down"][0]["dir"].as_str().unwrap().starts_with(&fb.mnt.display().to_string()), "{ready}");
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::new(vec![]), None).await.unwrap().body.to_bytes();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvtier_device_up{device=\"0\"} 1") && metrics.contains("kvtier_device_up{device=\"1\"} 0"), "{metrics}");
    server.crash(); // its failed filesystem is unmounted next
}

/// A device whose filesystem fills before its share does (1 GiB promised
/// on a 48 MiB filesystem): its shard first reuses its own segment that
/// holds no live block (logged, naming the device), then refuses PUTs 507
/// `disk_full` naming device 0 and how to size it; the other device's shard
/// stores on; every block acknowledged anywhere reads back; `/readyz`
/// names the full device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_fills_reclaims_and_refuses_on_its_own_shards_naming_it_and_the_other_stores_on() {
    let (ta, tb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let fa = LoopFs::make(ta.path(), 48).unwrap_or_else(|why| {
        panic!("the devices test needs loop-mounted ext4 images: {why} (mkfs.ext4 and mount come with `apt-get install e2fsprogs mount`)")
    });
    let (a, b) = (fa.mnt.join("data"), tb.path().join("data"));
    let (a_sized, b_sized) = (format!("{}=1", a.display()), format!("{}=0.2", b.display()));
    let server = start(&args(&[Path::new(&a_sized), Path::new(&b_sized)], 2));
    let c = client(&server, false);
    // Blocks stored, then deleted: each shard's first segment then holds
    // nothing live, so the full device reuses it before it refuses.
    for key in put_keys(&c, "gone", 300).await {
        assert_eq!(status_and_body(&c, Method::DELETE, &key).await.0, StatusCode::NO_CONTENT, "DELETE {key}");
    }
    let (mut stored, mut refused) = (Vec::new(), 0);
    for i in 0..3000 {
        let key = format!("fill-{i}");
        match status_and_body(&c, Method::PUT, &key).await {
            (StatusCode::CREATED, _) => stored.push(key),
            (StatusCode::INSUFFICIENT_STORAGE, body) => {
                assert_eq!(body["error"]["code"], "disk_full", "{body}");
                let message = body["error"]["message"].as_str().unwrap();
                assert!(
                    message.contains(&format!("device 0 ({})", a.display())) && message.contains("--data-dir DIR=SIZE_GB"),
                    "{message}"
                );
                refused += 1;
                if refused == 100 {
                    break;
                }
            }
            (status, body) => panic!("PUT {key}: {status} {body}"),
        }
    }
    assert_eq!(refused, 100, "3000 PUTs never filled device 0's 48 MiB filesystem");
    assert!(server.log().contains(&format!("(device 0 ({})): reusing segment", a.display())), "{}", server.log());
    // Once device 0 is full, device 1's shard takes about half the PUTs.
    let (mut stored_after, mut refused_after) = (0, 0);
    for i in 0..100 {
        let key = format!("after-{i}");
        match status_and_body(&c, Method::PUT, &key).await.0 {
            StatusCode::CREATED => {
                stored.push(key);
                stored_after += 1;
            }
            StatusCode::INSUFFICIENT_STORAGE => refused_after += 1,
            other => panic!("PUT {key}: {other}"),
        }
    }
    assert!((25..=75).contains(&stored_after), "device 1 stored {stored_after} of 100, refused {refused_after}");
    assert!(read_back(&c, &stored).await.iter().all(|r| *r == Some(true)), "a block acknowledged before the device filled was lost");
    let nvme = common::ready_tier(&c, "nvme").await;
    assert!(nvme["reason"].as_str().unwrap_or_default().contains("device 0 ("), "{nvme}");
    server.stop();
}

#[test]
fn a_directory_of_another_store_is_refused_naming_both_stores() {
    let t = tempfile::tempdir().unwrap();
    let [a, b, c, d] = ["a", "b", "c", "d"].map(|n| t.path().join(n));
    start(&args(&[&a, &b], 2)).stop();
    start(&args(&[&c, &d], 2)).stop();
    let (_, stderr) = try_start(&args(&[&a, &c], 2)).err().expect("a mix of two stores started");
    assert!(stderr.contains("belongs to store"), "{stderr}");
    assert!(stderr.contains(&store_id(&a)) && stderr.contains(&store_id(&c)), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_not_given_starts_absent_and_named_and_its_shards_refuse_puts() {
    let t = tempfile::tempdir().unwrap();
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    start(&args(&[&a, &b], 2)).stop();
    let server = start(&args(&[&a], 2));
    let log = server.log();
    assert!(log.contains("device 1 is absent") && log.contains("not among the directories given"), "{log}");
    let c = client(&server, false);
    let (mut stored, mut refused) = (0, 0);
    for i in 0..40 {
        match status_and_body(&c, Method::PUT, &format!("given-{i}")).await {
            (StatusCode::CREATED, _) => stored += 1,
            (StatusCode::SERVICE_UNAVAILABLE, body) => {
                assert_eq!(body["error"]["code"], "device_down", "{body}");
                assert!(body["error"]["message"].as_str().unwrap().contains("device 1 is absent"), "{body}");
                refused += 1;
            }
            (status, body) => panic!("PUT with device 1 absent: {status} {body}"),
        }
    }
    assert!(stored >= 10 && refused >= 10, "shard 0 stores, shard 1 refuses: {stored} stored, {refused} refused");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_directory_stands_in_for_a_lost_device_and_its_shards_start_empty() {
    let t = tempfile::tempdir().unwrap();
    let (a, b, e) = (t.path().join("a"), t.path().join("b"), t.path().join("e"));
    let server = start(&args(&[&a, &b], 2));
    let keys = put_keys(&client(&server, false), "lost", 100).await;
    server.stop();
    // Device 1 is gone; e replaces it.
    std::fs::remove_dir_all(&b).unwrap();
    // A directory that does not exist leaves device 1 absent (an unmounted
    // device's, most often) and is not made; one holding files is refused;
    // an empty one stands in.
    let server = start(&args(&[&a, &e], 2));
    assert!(server.log().contains("does not exist") && server.log().contains("mount the device"), "{}", server.log());
    server.stop();
    assert!(!e.exists(), "a start made {} for an absent device", e.display());
    std::fs::create_dir(&e).unwrap();
    std::fs::write(e.join("notes.txt"), b"not a device").unwrap();
    let (_, stderr) = try_start(&args(&[&e, &a], 2)).err().expect("a directory holding files stood in for device 1");
    assert!(stderr.contains("holds files (notes.txt"), "{stderr}");
    std::fs::remove_file(e.join("notes.txt")).unwrap();
    let server = start(&args(&[&e, &a], 2));
    assert!(server.log().contains("in place of a missing one"), "{}", server.log());
    let got = read_back(&client(&server, false), &keys).await;
    let served = got.iter().filter(|r| r.is_some()).count();
    assert!((30..=70).contains(&served), "device 0's half still serves, device 1's misses: {served} of 100 served");
    assert_eq!(store_id(&e), store_id(&a));
    server.stop();
}

#[test]
fn a_store_made_with_one_directory_opens_alone_as_before_and_refuses_a_second() {
    let t = tempfile::tempdir().unwrap();
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    start(&args(&[&a], 2)).stop();
    // As a store made before devices: no store id, no device list.
    let path = a.join("store.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for field in ["store_id", "devices", "device_index"] {
        m.as_object_mut().unwrap().remove(field);
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    start(&args(&[&a], 2)).stop();
    let kept: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert!(kept.get("store_id").is_none(), "an old store's manifest was rewritten: {kept}");
    let (_, stderr) = try_start(&args(&[&a, &b], 2)).err().expect("an old one-directory store took a second directory");
    assert!(stderr.contains("made with one data directory"), "{stderr}");
}

/// Devices added to a store (`--add-devices`): a start with more
/// directories than the store has devices is refused without the flag, and
/// an added one without its size or holding files is refused with it. 4
/// shards over 2 devices, then 3: shards 0 and 1 stay where they were
/// (s mod 2 = s mod 3) and keep their blocks, byte for byte; shards 2 and
/// 3 are placed anew and start empty, their old segments deleted; new
/// blocks reach the new device; every store.json lists 3 devices, so later
/// starts need no flag, in any order (one store.json left with 2, as by an
/// add that stopped midway, is rewritten); fsck counts every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_added_to_a_store_keep_the_blocks_of_shards_that_stay_and_start_the_others_empty() {
    let t = tempfile::tempdir().unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|n| t.path().join(n));
    let server = start(&args(&[&a, &b], 4));
    let before = put_keys(&client(&server, false), "before", 200).await;
    server.stop();
    let sized = format!("{}=0.05", c.display());
    let mut three = args(&[&a, &b], 4);
    three.extend(["--data-dir".to_string(), sized.clone()]);
    let (_, stderr) = try_start(&three).err().expect("a third directory was taken without --add-devices");
    assert!(stderr.contains("--add-devices"), "{stderr}");
    let mut no_size = args(&[&a, &b, &c], 4);
    no_size.push("--add-devices".into());
    let (_, stderr) = try_start(&no_size).err().expect("a device was added without its size");
    assert!(stderr.contains("give its size"), "{stderr}");
    std::fs::create_dir_all(&c).unwrap();
    std::fs::write(c.join("notes.txt"), b"x").unwrap();
    three.push("--add-devices".into());
    let (_, stderr) = try_start(&three).err().expect("a directory holding files was added");
    assert!(stderr.contains("holds files (notes.txt"), "{stderr}");
    std::fs::remove_file(c.join("notes.txt")).unwrap();
    let two_devices = std::fs::read(a.join("store.json")).unwrap();

    let server = start(&three);
    assert!(server.log().contains("devices were added (2 to 3), so shard 2"), "{}", server.log());
    let cl = client(&server, false);
    let kept: Vec<u64> = devices(&server).await.iter().map(|d| d["blocks"].as_u64().unwrap()).collect();
    assert_eq!(kept.len(), 3, "{kept:?}");
    assert_eq!(kept[2], 0, "the new device holds nothing yet: {kept:?}");
    let served = read_back(&cl, &before).await.iter().filter(|r| r.is_some()).count() as u64;
    assert_eq!(served, kept.iter().sum::<u64>(), "every block the index kept is served right, and only those");
    assert!((50..150).contains(&served), "shards 0 and 1 keep about half of 200 blocks, not {served}");
    assert!(!a.join("shard-002").exists() && !b.join("shard-003").exists(), "the moved shards' old directories are left");
    let after = put_keys(&cl, "after", 150).await;
    let spread: Vec<u64> = devices(&server).await.iter().map(|d| d["blocks"].as_u64().unwrap()).collect();
    assert!(spread[2] >= 20, "new blocks reach the added device: {spread:?}");
    server.stop();
    for (i, dir) in [&a, &b, &c].iter().enumerate() {
        let m: Value = serde_json::from_slice(&std::fs::read(dir.join("store.json")).unwrap()).unwrap();
        assert_eq!(m["devices"].as_array().unwrap().len(), 3, "{}: {m}", dir.display());
        assert_eq!(m["device_index"], i, "{m}");
    }
    // As if the add had stopped before it rewrote a's store.json: the next
    // start takes the longest device list and finishes it. No flag needed
    // any more, and any order.
    std::fs::write(a.join("store.json"), &two_devices).unwrap();
    let server = start(&args(&[&c, &a, &b], 4));
    let m: Value = serde_json::from_slice(&std::fs::read(a.join("store.json")).unwrap()).unwrap();
    assert_eq!(m["devices"].as_array().unwrap().len(), 3, "a's store.json is not rewritten: {m}");
    let cl = client(&server, false);
    assert!(read_back(&cl, &after).await.iter().all(|r| *r == Some(true)), "a block stored after the add was lost");
    assert_eq!(read_back(&cl, &before).await.iter().filter(|r| r.is_some()).count() as u64, served);
    server.stop();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["fsck", "--json"])
        .args([&a, &b, &c].iter().flat_map(|d| ["--data-dir".into(), d.display().to_string()]))
        .output()
        .unwrap();
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("fsck: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{report}");
    assert_eq!(report["live_blocks"].as_u64(), Some(served + 150), "{report}");
}

/// A segment file of another store, put under this store's shard directory
/// with the same shard, segment id and geometry (a restore gone wrong, two
/// stores' disks swapped by hand), is foreign: its superblock names the
/// other store, so recovery skips it and counts it, and none of the other
/// store's blocks is served here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_of_another_store_is_foreign_and_its_blocks_are_not_served() {
    let t = tempfile::tempdir().unwrap();
    let [a, b, c, d] = ["a", "b", "c", "d"].map(|n| t.path().join(n));
    let theirs_server = start(&args(&[&a, &b], 2));
    let theirs = put_keys(&client(&theirs_server, false), "theirs", 40).await;
    theirs_server.stop();
    let ours_server = start(&args(&[&c, &d], 2));
    let ours = put_keys(&client(&ours_server, false), "ours", 40).await;
    ours_server.crash(); // no index snapshot: recovery reads every segment's records
                         // Shard 0 lives on device 0 in both stores: its first segment swapped for theirs.
    std::fs::copy(a.join("shard-000/seg-000000.kvt"), c.join("shard-000/seg-000000.kvt")).unwrap();
    let server = start(&args(&[&c, &d], 2));
    let c0 = client(&server, false);
    let served = read_back(&c0, &theirs).await.iter().filter(|r| r.is_some()).count();
    assert_eq!(served, 0, "{served} of the other store's blocks were served from its segment");
    // Ours on shard 0's swapped segment are gone (misses); the rest serve, never a wrong byte.
    let ours_served = read_back(&c0, &ours).await.iter().filter(|r| r.is_some()).count();
    assert!((10..40).contains(&ours_served), "{ours_served} of 40 served");
    let totals = c0.stats().await.unwrap()["totals"].clone();
    assert_eq!(totals["foreign_files_at_start"], 1, "{totals}");
    assert!(server.log().contains("not a segment of this store"), "{}", server.log());
    server.stop();
}

/// The store over two loop-mounted filesystems with the shared tier on
/// moto: `shards` shards, a small RAM tier, S3 write-through (a PUT is
/// uploaded before it is acknowledged).
fn s3_args(dirs: &[&Path], shards: usize, moto: &s3_support::Moto) -> Vec<String> {
    let mut a = args(dirs, shards);
    set_flag(&mut a, "--ram-gb", "0.01");
    let url = format!("s3://{}/{}", s3_support::BUCKET, s3_support::PREFIX);
    a.extend(["--s3-url".into(), url, "--s3-endpoint".into(), moto.endpoint(), "--s3-write-policy".into(), "through".into()]);
    a
}

/// `/readyz`'s status code and JSON.
async fn readyz(c: &Client) -> (StatusCode, Value) {
    let a = c.send(Method::GET, "/readyz", ChunkedBody::new(vec![]), None).await.unwrap();
    (a.status, serde_json::from_slice(&a.body.to_bytes()).unwrap())
}

/// Per key, the tier it was served from; a wrong byte or a miss panics.
async fn tiers(c: &Client, keys: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        out.push(s3_support::get_tier(c, key).await.unwrap_or_else(|| panic!("{key} missed")));
    }
    out
}

/// A device absent at start, three ways (its drive unmounted, so its
/// directory does not exist; an empty directory where the drive should be
/// mounted; its filesystem failing every I/O), leaves its shards serving
/// from RAM and S3 with their log down and their PUTs refused, the other
/// device's shards serving as ever, and nothing made where it should be;
/// with the drive back, its blocks serve from its log again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_absent_at_start_leaves_its_shards_serving_from_s3_and_refusing_puts() {
    let moto = s3_support::Moto::start();
    let (ta, tb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (fa, fb) = (device(ta.path()), device(tb.path()));
    let (a, b) = (fa.mnt.join("data"), fb.mnt.join("data"));
    let server = start(&s3_args(&[&a, &b], 4, &moto));
    let held = put_keys(&client(&server, false), "held", 100).await;
    server.stop();

    // The drive is gone: its mount point is an empty directory, `b` is not there.
    fb.unmount();
    let started = Instant::now();
    let server = start(&s3_args(&[&a, &b], 4, &moto));
    println!("restart with device 1 absent: listening after {} ms", started.elapsed().as_millis());
    assert!(server.log().contains("device 1 is absent") && server.log().contains("does not exist"), "{}", server.log());
    let c = client(&server, false);
    // Every block serves, right: device 0's from its log, device 1's from S3.
    let got = tiers(&c, &held).await;
    let from_s3 = got.iter().filter(|t| *t == "s3").count();
    assert!((30..=70).contains(&from_s3), "device 1's half from S3, device 0's from its log: {got:?}");
    assert_eq!(got.iter().filter(|t| *t == "nvme" || *t == "s3").count(), 100, "{got:?}");
    // Read again, device 1's come from RAM: the S3 reads were kept there.
    let again = tiers(&c, &held).await;
    let kept = got.iter().zip(&again).filter(|(first, then)| *first == "s3" && *then == "ram").count();
    assert_eq!(kept, from_s3, "{again:?}");
    // PUTs: device 1's shards answer 503 device_down naming it; device 0's store.
    let mut refused = 0;
    for i in 0..100 {
        let key = format!("during-{i}");
        match status_and_body(&c, Method::PUT, &key).await {
            (StatusCode::CREATED, _) => {}
            (StatusCode::SERVICE_UNAVAILABLE, body) => {
                assert_eq!(body["error"]["code"], "device_down", "{body}");
                assert!(body["error"]["message"].as_str().unwrap().contains("device 1 is absent"), "{body}");
                refused += 1;
            }
            (status, body) => panic!("PUT {key} with device 1 absent: {status} {body}"),
        }
    }
    assert!((30..=70).contains(&refused), "device 1's half refused: {refused} of 100");
    let (status, ready) = readyz(&c).await;
    assert_eq!((status, ready["status"].as_str()), (StatusCode::OK, Some("degraded")), "{ready}");
    assert_eq!(ready["devices_down"][0]["device"], 1, "{ready}");
    assert!(ready["devices_down"][0]["reason"].as_str().unwrap().contains("absent"), "{ready}");
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::new(vec![]), None).await.unwrap().body.to_bytes();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("kvtier_device_up{device=\"0\"} 1") && metrics.contains("kvtier_device_up{device=\"1\"} 0"), "{metrics}");
    server.stop();
    assert!(!b.exists(), "a start made {} for an absent device", b.display());

    // An empty directory where the drive should be mounted (on the root
    // filesystem, while device 1 had one of its own) is not taken as a new
    // drive: device 1 stays absent and the directory stays empty.
    std::fs::create_dir(&b).unwrap();
    let server = start(&s3_args(&[&a, &b], 4, &moto));
    assert!(server.log().contains("device 1 is absent") && server.log().contains("filesystem of its own"), "{}", server.log());
    assert_eq!(tiers(&client(&server, false), &held).await.iter().filter(|t| *t == "s3").count(), from_s3);
    server.stop();
    assert_eq!(std::fs::read_dir(&b).unwrap().count(), 0, "a start wrote into the empty directory standing where device 1 mounts");
    std::fs::remove_dir(&b).unwrap();

    // The drive is back: its blocks serve from its log, and the store is ready.
    fb.mount();
    let server = start(&s3_args(&[&a, &b], 4, &moto));
    let c = client(&server, false);
    let got = tiers(&c, &held).await;
    assert_eq!(got.iter().filter(|t| *t == "nvme").count(), 100, "every block from the logs again: {got:?}");
    assert_eq!(readyz(&c).await.1["status"], "ready");
    server.stop();

    // Its filesystem fails every I/O (a dead drive still mounted): absent,
    // named with the error.
    fail_device(&fb.mnt);
    let server = start(&s3_args(&[&a, &b], 4, &moto));
    assert!(server.log().contains("device 1 is absent") && server.log().contains("Input/output error"), "{}", server.log());
    assert_eq!(tiers(&client(&server, false), &held).await.iter().filter(|t| *t == "s3").count(), from_s3);
    server.crash(); // its failed filesystem is unmounted next
}

/// One shard over two devices (fewer shards than devices): its segments
/// rotate over both, so its blocks spread within ±10 % (1 MiB segments of
/// 15 slots, 400 blocks: 205 and 195); they survive a kill -9 and
/// a restart with the directories the other way round, and fsck reads
/// them over both. A device replaced by an empty filesystem discards the
/// shard's segments on the other too (an older version there must not be
/// served), and the shard serves on, writing over both again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_over_two_devices_rotates_its_segments_over_both() {
    let (ta, tb, tc) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (fa, fb) = (device(ta.path()), device(tb.path()));
    let (a, b) = (fa.mnt.join("data"), fb.mnt.join("data"));
    let mut one_shard = args(&[&a, &b], 1);
    set_flag(&mut one_shard, "--segment-mib", "1");
    let server = start(&one_shard);
    let c = client(&server, false);
    let keys = put_keys(&c, "rotate", 400).await;
    let per_device: Vec<u64> = devices(&server).await.iter().map(|d| d["blocks"].as_u64().unwrap()).collect();
    assert_eq!(per_device.iter().sum::<u64>(), 400, "{per_device:?}");
    for (i, n) in per_device.iter().enumerate() {
        assert!((180..=220).contains(n), "device {i} holds {n} of 400 blocks, not within 10 % of 200: {per_device:?}");
    }
    assert!(a.join("shard-000").read_dir().unwrap().count() > 1 && b.join("shard-000").read_dir().unwrap().count() > 1);
    server.crash();
    let mut reversed = args(&[&b, &a], 1);
    set_flag(&mut reversed, "--segment-mib", "1");
    let server = start(&reversed);
    assert!(read_back(&client(&server, false), &keys).await.iter().all(|r| *r == Some(true)), "a block was lost over the crash");
    server.stop();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["fsck", "--json", "--data-dir"])
        .arg(&a)
        .arg("--data-dir")
        .arg(&b)
        .output()
        .unwrap();
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("fsck: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{report}");
    assert_eq!((report["live_blocks"].as_u64(), report["foreign_files"].as_array().map(Vec::len)), (Some(400), Some(0)), "{report}");

    // Device 1 replaced by a new, empty filesystem: the shard starts empty
    // on both, and writes over both again.
    drop(fb);
    let fc = device(tc.path());
    let c_dir = fc.mnt.join("data");
    std::fs::create_dir(&c_dir).unwrap();
    let mut replaced = args(&[&a, &c_dir], 1);
    set_flag(&mut replaced, "--segment-mib", "1");
    let server = start(&replaced);
    assert!(server.log().contains("segments on the other devices it spans are discarded"), "{}", server.log());
    let c = client(&server, false);
    assert!(read_back(&c, &keys).await.iter().all(|r| r.is_none()), "a block of the discarded log was served");
    let again = put_keys(&c, "again", 40).await;
    assert!(read_back(&c, &again).await.iter().all(|r| *r == Some(true)));
    let per_device: Vec<u64> = devices(&server).await.iter().map(|d| d["blocks"].as_u64().unwrap()).collect();
    assert_eq!(per_device, vec![25, 15], "40 blocks of 15 a segment: segments 0 and 2 on device 0, segment 1 on device 1");
    server.stop();
}
