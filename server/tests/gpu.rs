//! The GPU tier end to end: a real `kvtier serve` whose cudarc calls land in
//! a fake CUDA driver (server/tests/fake-cuda/fake_cuda.c, built here into
//! target/fake-cuda/ and put on the child's LD_LIBRARY_PATH), with the
//! fake's switches in the child's environment: device memory size, failing
//! init, no device, slow events, failing or corrupting copies, and deferred
//! copies that land only when the caller waits.
//!
//! `KVTIER_GPU_TEST_DRIVER=real` (`make gpu-check`) runs the same tests
//! against the machine's driver instead; tests that need a fake switch say
//! so and return.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{client, payload, read_tier, repo_root, test_args, tiers_of, try_start_env, Server, BLOCK_BYTES};
use http::{Method, StatusCode};
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::{json, Value};

/// Whether the tests run against the machine's real driver: built with
/// `KVTIER_GPU_TEST_DRIVER=real` (`make gpu-check`; see server/build.rs).
/// The tests that need the fake driver's fault switches are then marked
/// ignored, so the runner reports them as such.
fn real_driver() -> bool {
    cfg!(kvtier_real_gpu)
}

/// Builds the fake driver once per test process: target/fake-cuda/
/// libcuda.so.1 and a libcuda.so link (what `make fake-cuda` builds).
fn fake_cuda_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = repo_root();
        let dir = root.join("target/fake-cuda");
        std::fs::create_dir_all(&dir).unwrap();
        let tmp = dir.join(format!("libcuda.so.1.{}.tmp", std::process::id()));
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = std::process::Command::new(&cc)
            .args(["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o"])
            .arg(&tmp)
            .arg(root.join("server/tests/fake-cuda/fake_cuda.c"))
            .arg("-lpthread")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cc} to build the fake CUDA driver: {e}"));
        assert!(out.status.success(), "building the fake CUDA driver failed:\n{}", String::from_utf8_lossy(&out.stderr));
        std::fs::rename(&tmp, dir.join("libcuda.so.1")).unwrap();
        let link = dir.join("libcuda.so");
        if std::fs::symlink_metadata(&link).is_err() {
            let _ = std::os::unix::fs::symlink("libcuda.so.1", &link);
        }
        dir
    })
}

/// The child's environment: the fake driver on LD_LIBRARY_PATH plus
/// `switches` (none with the real driver).
fn driver_env(switches: &[(&str, &str)]) -> Vec<(String, String)> {
    if real_driver() {
        return Vec::new();
    }
    let mut env = vec![("LD_LIBRARY_PATH".to_string(), fake_cuda_dir().display().to_string())];
    env.extend(switches.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

fn gb(blocks: u64) -> String {
    ((blocks * BLOCK_BYTES) as f64 / (1u64 << 30) as f64).to_string()
}

/// One shard, a GPU tier of `gpu_blocks` and a RAM tier of `ram_blocks`,
/// plus `extra` flags.
fn gpu_args(dir: &Path, gpu_blocks: u64, ram_blocks: u64, extra: &[&str]) -> Vec<String> {
    let mut args = test_args(dir);
    common::set_flag(&mut args, "--shards", "1");
    common::set_flag(&mut args, "--ram-gb", &gb(ram_blocks));
    common::set_flag(&mut args, "--gpu-mem-gb", &gb(gpu_blocks));
    for pair in extra.chunks(2) {
        common::set_flag(&mut args, pair[0], pair[1]);
    }
    args
}

fn start_gpu(args: &[String], switches: &[(&str, &str)]) -> Server {
    try_start_env(args, &driver_env(switches)).unwrap_or_else(|(status, log)| panic!("server exited ({status:?}) before listening:\n{log}"))
}

/// The start's failure message (the server must refuse to start).
fn refused(args: &[String], switches: &[(&str, &str)]) -> String {
    match try_start_env(args, &driver_env(switches)) {
        Ok(s) => {
            let log = s.log();
            s.stop();
            panic!("the server started with {switches:?}; log:\n{log}")
        }
        Err((_, log)) => log,
    }
}

async fn put_all(c: &Client, keys: &[String]) {
    for k in keys {
        assert_eq!(c.put(k, vec![payload(k)]).await.unwrap(), StatusCode::CREATED, "PUT {k}");
    }
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k{i}")).collect()
}

fn tier<'a>(stats: &'a Value, name: &str) -> &'a Value {
    stats["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == name).unwrap_or_else(|| panic!("no {name} tier in {stats}"))
}

fn trace_file(dir: &Path) -> (PathBuf, String) {
    let p = dir.join("fake-cuda.trace");
    let s = p.display().to_string();
    (p, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_tier_placement_demotion_and_promotion() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, trace_s) = trace_file(dir.path());
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 4, 4, &[]), &[("FAKE_CUDA_TRACE", &trace_s)]);
    let c = client(&server, false);
    let k = keys(10);
    put_all(&c, &k).await;
    // New blocks go to the GPU; its LRU blocks move down to RAM, RAM's to
    // the log (write-through: the log has them all).
    let all: Vec<&str> = k.iter().map(|s| s.as_str()).collect();
    assert_eq!(tiers_of(&c, &all[6..]).await, ["gpu"; 4]);
    assert_eq!(tiers_of(&c, &all[2..6]).await, ["ram"; 4]);
    assert_eq!(tiers_of(&c, &all[..2]).await, ["nvme"; 2]);
    assert_eq!(read_tier(&c, "k9").await, "gpu");
    // A read from the log promotes k0 to the GPU; the GPU's LRU block (k6)
    // moves to RAM, whose LRU block (k2) leaves RAM (the log keeps it).
    assert_eq!(read_tier(&c, "k0").await, "nvme");
    assert_eq!(tiers_of(&c, &["k0", "k6", "k2"]).await, ["gpu", "ram", "nvme"]);
    // A read from RAM promotes k3 to the GPU and k7 comes down in its place.
    assert_eq!(read_tier(&c, "k3").await, "ram");
    assert_eq!(tiers_of(&c, &["k3", "k7"]).await, ["gpu", "ram"]);
    assert_eq!(read_tier(&c, "k3").await, "gpu");

    let stats = c.stats().await.unwrap();
    let gpu = tier(&stats, "gpu");
    assert_eq!(stats["tiers"][0]["tier"], "gpu", "fastest tier first: {stats}");
    assert_eq!((gpu["capacity_blocks"].as_u64(), gpu["used_blocks"].as_u64()), (Some(4), Some(4)), "{gpu}");
    assert_eq!((gpu["hits"].as_u64(), gpu["misses"].as_u64()), (Some(2), Some(2)), "{gpu}");
    assert_eq!((gpu["promotions"].as_u64(), gpu["demotions"].as_u64()), (Some(2), Some(8)), "{gpu}");
    assert_eq!(gpu["bytes_out"].as_u64(), Some(2 * BLOCK_BYTES));
    assert_eq!(gpu["bytes_in"].as_u64(), Some(12 * BLOCK_BYTES), "10 PUTs and 2 promotions copied in");
    if !real_driver() {
        assert_eq!(gpu["gpu"]["device"], "kvtier fake GPU", "{gpu}");
    }
    assert_eq!(gpu["gpu"]["unavailable"], Value::Null);
    assert_eq!(gpu["gpu"]["copy_errors"], 0);
    assert_eq!(gpu["gpu"]["corrupt_blocks"], 0);
    let ram = tier(&stats, "ram");
    assert_eq!((ram["used_blocks"].as_u64(), ram["hits"].as_u64()), (Some(4), Some(1)), "{ram}");
    assert_eq!(tier(&stats, "nvme")["used_blocks"].as_u64(), Some(10));

    // /metrics carries the GPU tier under its own label.
    let m = c.send(Method::GET, "/metrics", ChunkedBody::new(vec![]), None).await.unwrap();
    let text = String::from_utf8(m.body.to_bytes().to_vec()).unwrap();
    assert!(text.contains("kvtier_tier_used_blocks{tier=\"gpu\"} 4"), "{text}");
    assert!(text.contains("kvtier_gpu_copy_errors_total 0"), "{text}");
    server.stop();

    if !real_driver() {
        let calls = std::fs::read_to_string(&trace).unwrap();
        assert!(calls.contains("cuMemAlloc_v2 bytes="), "device memory from cuMemAlloc_v2:\n{calls}");
        assert!(!calls.contains("cuMemAllocAsync"), "never the stream-ordered pool");
        assert!(
            calls.lines().filter(|l| l.starts_with("cuMemHostAlloc")).all(|l| l.ends_with("flags=1")),
            "staging is PORTABLE pinned memory:\n{calls}"
        );
        assert!(
            calls.lines().filter(|l| l.starts_with("cuMemcpy")).all(|l| l.contains(" host=pinned")),
            "every copy DMAs from or into page-locked staging:\n{calls}"
        );
        assert!(calls.contains("cuMemFree_v2") && calls.contains("cuDevicePrimaryCtxRelease_v2"), "a clean stop frees the device memory");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_back_blocks_on_the_gpu_reach_the_log_at_a_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = gpu_args(&data, 4, 2, &["--write-policy", "back"]);
    let server = start_gpu(&args, &[]);
    let c = client(&server, false);
    let k = keys(8);
    put_all(&c, &k).await;
    let all: Vec<&str> = k.iter().map(|s| s.as_str()).collect();
    assert_eq!(tiers_of(&c, &all[4..]).await, ["gpu"; 4]);
    assert_eq!(tiers_of(&c, &all[2..4]).await, ["ram"; 2]);
    let stats = c.stats().await.unwrap();
    assert_eq!(tier(&stats, "nvme")["used_blocks"].as_u64(), Some(2), "write-back: only blocks pushed out of RAM reached the log");
    assert!(server.stop().success());
    // Restarted without any memory tier: every block comes from the log.
    let plain = gpu_args(&data, 0, 0, &[]);
    let server = common::start(&plain);
    let c = client(&server, false);
    for key in &k {
        assert_eq!(read_tier(&c, key).await, "nvme");
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_copies_and_slow_events_are_waited_for() {
    // Copies land only when the shard's event query succeeds, and every
    // event first answers "not ready" three times: reading a staging buffer
    // before the copy completed would read stale bytes and fail the CRC.
    let dir = tempfile::tempdir().unwrap();
    let (trace, trace_s) = trace_file(dir.path());
    let switches = [("FAKE_CUDA_DEFERRED", "1"), ("FAKE_CUDA_NOT_READY", "3"), ("FAKE_CUDA_TRACE", trace_s.as_str())];
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 4, 4, &[]), &switches);
    let c = client(&server, false);
    let k = keys(8);
    put_all(&c, &k).await;
    for key in &k[4..] {
        assert_eq!(read_tier(&c, key).await, "gpu");
    }
    // Reads from RAM move blocks up and down: more copies in both ways.
    for key in &k[..4] {
        assert_eq!(read_tier(&c, key).await, "ram");
    }
    for key in &k[..4] {
        assert_eq!(read_tier(&c, key).await, "gpu");
    }
    let stats = c.stats().await.unwrap();
    let gpu = &tier(&stats, "gpu")["gpu"];
    assert_eq!((gpu["corrupt_blocks"].as_u64(), gpu["copy_errors"].as_u64()), (Some(0), Some(0)), "{gpu}");
    server.stop();
    if !real_driver() {
        let calls = std::fs::read_to_string(&trace).unwrap();
        assert!(calls.contains("cuEventQuery NOT_READY"), "the fake made the shard wait");
        assert!(!calls.contains("cuStreamSynchronize\ncuMemcpy"), "no blocking sync on the request path");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn a_failing_read_copy_falls_back_to_the_log() {
    let dir = tempfile::tempdir().unwrap();
    // The second copy back from the device fails.
    let switches = [("FAKE_CUDA_FAIL_COPY", "2"), ("FAKE_CUDA_FAIL_KIND", "dtoh")];
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 4, 4, &["--health-window-ms", "300"]), &switches);
    let c = client(&server, false);
    put_all(&c, &keys(3)).await;
    assert_eq!(read_tier(&c, "k0").await, "gpu");
    // k1's copy fails: it is dropped from the GPU and served from the log
    // (write-through), then promoted back.
    assert_eq!(read_tier(&c, "k1").await, "nvme");
    assert_eq!(read_tier(&c, "k1").await, "gpu");
    let stats = c.stats().await.unwrap();
    let gpu = tier(&stats, "gpu");
    assert_eq!(gpu["gpu"]["copy_errors"].as_u64(), Some(1), "{gpu}");
    assert_eq!(gpu["gpu"]["blocks_lost"].as_u64(), Some(0), "{gpu}");
    // Never silent: the GPU tier is degraded by the failed copy, names it,
    // and is ok again once no fault is left in the health window.
    let health = |stats: &serde_json::Value| stats["health"].as_array().unwrap().iter().find(|h| h["tier"] == "gpu").unwrap().clone();
    let gpu = health(&stats);
    assert_eq!(gpu["state"], "degraded", "{gpu}");
    assert!(gpu["reason"].as_str().unwrap().contains("copy_errors 1"), "{gpu}");
    assert_eq!(gpu["errors"]["fault"].as_u64(), Some(1), "{gpu}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while health(&c.stats().await.unwrap())["state"] != "ok" {
        assert!(std::time::Instant::now() < deadline, "the GPU tier did not return to ok");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(read_tier(&c, "k1").await, "gpu", "the GPU serves again");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn failing_writes_to_the_device_leave_blocks_in_ram() {
    let dir = tempfile::tempdir().unwrap();
    let switches = [("FAKE_CUDA_FAIL_COPY", "1"), ("FAKE_CUDA_FAIL_EVERY", "1"), ("FAKE_CUDA_FAIL_KIND", "htod")];
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 4, 4, &["--write-policy", "back"]), &switches);
    let c = client(&server, false);
    put_all(&c, &keys(3)).await;
    assert_eq!(tiers_of(&c, &["k0", "k1", "k2"]).await, ["ram"; 3]);
    for k in ["k0", "k1", "k2"] {
        assert_eq!(read_tier(&c, k).await, "ram");
    }
    let stats = c.stats().await.unwrap();
    let gpu = tier(&stats, "gpu");
    assert_eq!(gpu["used_blocks"].as_u64(), Some(0), "{gpu}");
    // 3 PUTs and 3 promotions from RAM tried the device.
    assert_eq!(gpu["gpu"]["copy_errors"].as_u64(), Some(6), "{gpu}");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn a_corrupted_copy_is_never_served() {
    for policy in ["through", "back"] {
        let dir = tempfile::tempdir().unwrap();
        // The first copy back from the device flips a byte.
        let switches = [("FAKE_CUDA_CORRUPT_COPY", "1"), ("FAKE_CUDA_FAIL_KIND", "dtoh")];
        let server = start_gpu(&gpu_args(&dir.path().join("data"), 4, 4, &["--write-policy", policy]), &switches);
        let c = client(&server, false);
        put_all(&c, &keys(2)).await;
        if policy == "through" {
            // Dropped from the GPU, served from the log, byte-exact.
            assert_eq!(read_tier(&c, "k0").await, "nvme");
        } else {
            // Held only on the GPU: lost, and a miss rather than wrong bytes.
            assert!(c.get("k0").await.unwrap().is_none(), "a block failing its CRC is never served");
        }
        assert_eq!(read_tier(&c, "k1").await, "gpu");
        let stats = c.stats().await.unwrap();
        let gpu = &tier(&stats, "gpu")["gpu"];
        assert_eq!(gpu["corrupt_blocks"].as_u64(), Some(1), "{policy}: {gpu}");
        assert_eq!(gpu["blocks_lost"].as_u64(), Some(if policy == "back" { 1 } else { 0 }), "{policy}: {gpu}");
        server.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn a_lost_write_back_block_is_a_miss_not_its_older_bytes() {
    let dir = tempfile::tempdir().unwrap();
    // One GPU slot, no RAM: D2H copies 1 and 2 move blocks to the log; the
    // third (the GET) comes back corrupted.
    let switches = [("FAKE_CUDA_CORRUPT_COPY", "3"), ("FAKE_CUDA_FAIL_KIND", "dtoh")];
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 1, 0, &["--write-policy", "back"]), &switches);
    let c = client(&server, false);
    let old = Bytes::from(vec![0x0du8; BLOCK_BYTES as usize]);
    assert_eq!(c.put("k0", vec![old]).await.unwrap(), StatusCode::CREATED);
    put_all(&c, &["k1".to_string()]).await; // k0 (old bytes) -> log
    assert_eq!(c.put("k0", vec![payload("k0")]).await.unwrap(), StatusCode::OK); // k1 -> log; new k0 on the GPU only
    assert_eq!(tiers_of(&c, &["k0", "k1"]).await, ["gpu", "nvme"]);
    assert!(c.get("k0").await.unwrap().is_none(), "the newest k0 is lost: a miss, never its older bytes");
    assert_eq!(read_tier(&c, "k1").await, "nvme");
    let stats = c.stats().await.unwrap();
    let gpu = &tier(&stats, "gpu")["gpu"];
    assert_eq!((gpu["corrupt_blocks"].as_u64(), gpu["blocks_lost"].as_u64()), (Some(1), Some(1)), "{gpu}");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn out_of_device_memory_at_start_and_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // At start: the device is smaller than the tier.
    let small = (2 * BLOCK_BYTES).to_string();
    let log = refused(&gpu_args(&data, 8, 4, &[]), &[("FAKE_CUDA_MEM_BYTES", &small)]);
    assert!(log.contains("the device cannot hold it") && log.contains("--gpu-optional"), "{log}");
    // At start: the first slab does not fit in what is free.
    let reserved = (8 * BLOCK_BYTES - BLOCK_BYTES).to_string();
    let total = (8 * BLOCK_BYTES).to_string();
    let log = refused(&gpu_args(&data, 8, 4, &[]), &[("FAKE_CUDA_MEM_BYTES", &total), ("FAKE_CUDA_RESERVED_BYTES", &reserved)]);
    assert!(log.contains("CUDA_ERROR_OUT_OF_MEMORY") && log.contains("first slab"), "{log}");
    // With --gpu-optional the server runs without the tier and says why.
    let mut optional = gpu_args(&data, 8, 4, &[]);
    optional.push("--gpu-optional".into());
    let server = start_gpu(&optional, &[("FAKE_CUDA_MEM_BYTES", &small)]);
    let c = client(&server, false);
    put_all(&c, &keys(2)).await;
    assert_eq!(read_tier(&c, "k0").await, "ram");
    let stats = c.stats().await.unwrap();
    let gpu = tier(&stats, "gpu");
    assert_eq!(gpu["capacity_blocks"].as_u64(), Some(0));
    assert!(gpu["gpu"]["unavailable"].as_str().unwrap().contains("less than --gpu-mem-gb"), "{gpu}");
    server.stop();

    // At run time: 8 blocks in 4 slabs of 2, but only 2 slabs' worth is
    // free: the tier stops at 4 blocks, the rest go to RAM, all readable.
    let dir = tempfile::tempdir().unwrap();
    let reserved = (4 * BLOCK_BYTES).to_string();
    let server = start_gpu(
        &gpu_args(&dir.path().join("data"), 8, 8, &[]),
        &[("FAKE_CUDA_MEM_BYTES", &total), ("FAKE_CUDA_RESERVED_BYTES", &reserved)],
    );
    let c = client(&server, false);
    let k = keys(8);
    put_all(&c, &k).await;
    let stats = c.stats().await.unwrap();
    let gpu = tier(&stats, "gpu");
    assert_eq!((gpu["capacity_blocks"].as_u64(), gpu["used_blocks"].as_u64()), (Some(8), Some(4)), "{gpu}");
    assert_eq!(gpu["gpu"]["allocated_bytes"].as_u64(), Some(4 * BLOCK_BYTES), "{gpu}");
    assert!(gpu["gpu"]["out_of_memory"].as_u64().unwrap() >= 1, "{gpu}");
    for key in &k {
        read_tier(&c, key).await;
    }
    assert!(server.log().contains("GPU slab of"), "the refusal is logged:\n{}", server.log());
    server.stop();
}

/// No driver: an empty library path hides the fake, and on a machine whose
/// loader cache lists no libcuda there is then none to find.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    any(kvtier_real_gpu, kvtier_system_cuda),
    ignore = "this machine has a CUDA driver in its loader cache: no library path hides it"
)]
async fn no_driver_refuses_to_start_unless_optional() {
    let dir = tempfile::tempdir().unwrap();
    let args = gpu_args(&dir.path().join("data"), 4, 4, &[]);
    let mut optional = args.clone();
    optional.push("--gpu-optional".into());
    let empty = tempfile::tempdir().unwrap();
    let no_lib = vec![("LD_LIBRARY_PATH".to_string(), empty.path().display().to_string())];
    let log = match try_start_env(&args, &no_lib) {
        Ok(s) => {
            s.stop();
            panic!("kvtier found a CUDA driver with an empty LD_LIBRARY_PATH although the loader cache lists none");
        }
        Err((_, log)) => log,
    };
    assert!(log.contains("no CUDA driver was found") && log.contains("--gpu-optional"), "{log}");
    let s = try_start_env(&optional, &no_lib).unwrap_or_else(|(_, l)| panic!("{l}"));
    let c = client(&s, false);
    put_all(&c, &keys(1)).await;
    assert_eq!(read_tier(&c, "k0").await, "ram");
    let stats = c.stats().await.unwrap();
    assert!(tier(&stats, "gpu")["gpu"]["unavailable"].as_str().unwrap().contains("libcuda"), "{stats}");
    assert!(s.log().contains("running without the GPU tier"), "{}", s.log());
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn no_device_refuses_to_start_unless_optional() {
    let dir = tempfile::tempdir().unwrap();
    let args = gpu_args(&dir.path().join("data"), 4, 4, &[]);
    let mut optional2 = gpu_args(&dir.path().join("data2"), 4, 4, &[]);
    optional2.push("--gpu-optional".into());

    // A driver with no device.
    let log = refused(&args, &[("FAKE_CUDA_DEVICES", "0")]);
    assert!(log.contains("the CUDA driver has no such device") && log.contains("CUDA_ERROR_NO_DEVICE"), "{log}");
    // A device ordinal the driver does not have.
    let mut dev3 = args.clone();
    dev3.extend(["--gpu-device".into(), "3".into()]);
    let log = refused(&dev3, &[]);
    assert!(log.contains("no CUDA device 3: the driver reports 1 device(s)"), "{log}");
    // cuInit failing for another reason.
    let log = refused(&args, &[("FAKE_CUDA_INIT_ERROR", "999")]);
    assert!(log.contains("the CUDA driver failed") && log.contains("999"), "{log}");
    // Optional: runs without the tier.
    let s = start_gpu(&optional2, &[("FAKE_CUDA_DEVICES", "0")]);
    let c = client(&s, false);
    put_all(&c, &keys(1)).await;
    assert_eq!(read_tier(&c, "k0").await, "ram");
    let stats = c.stats().await.unwrap();
    assert!(tier(&stats, "gpu")["gpu"]["unavailable"].as_str().unwrap().contains("CUDA_ERROR_NO_DEVICE"), "{stats}");
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_gpu_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut args = gpu_args(&data, 4, 4, &[]);
    let i = args.iter().position(|a| a == "--gpu-mem-gb").unwrap();
    args.remove(i + 1);
    args[i] = "--gpu-mem-gb=-1".into();
    let log = refused(&args, &[]);
    assert!(log.contains("--gpu-mem-gb must be 0 or more, got -1"), "{log}");
    args[i] = "--gpu-mem-gb=0.00001".into();
    let log = refused(&args, &[]);
    assert!(log.contains("less than one block"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_moves_blocks_up_to_the_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 2, 2, &[]), &[]);
    let c = client(&server, false);
    put_all(&c, &keys(6)).await;
    assert_eq!(tiers_of(&c, &["k0", "k2", "k4"]).await, ["nvme", "ram", "gpu"]);
    let body = serde_json::to_vec(&json!({ "keys": ["k0", "k2"] })).unwrap();
    let a = c.send(Method::POST, "/v1/prefetch", ChunkedBody::new(vec![Bytes::from(body)]), Some("application/json")).await.unwrap();
    assert_eq!(a.status, StatusCode::ACCEPTED);
    let deadline = Instant::now() + Duration::from_secs(10);
    while tiers_of(&c, &["k0", "k2"]).await != ["gpu", "gpu"] {
        assert!(Instant::now() < deadline, "prefetch did not bring k0 and k2 to the GPU: {:?}", tiers_of(&c, &["k0", "k2"]).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(read_tier(&c, "k0").await, "gpu");
    assert_eq!(read_tier(&c, "k2").await, "gpu");
    let stats = c.stats().await.unwrap();
    assert_eq!(tier(&stats, "gpu")["promotions"].as_u64(), Some(2));
    server.stop();
}

/// A replay whose working set is several times the memory tiers: the policy
/// oracle, at three tiers, predicts every lookup and the tier of every GET,
/// under both write policies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_through_gpu_and_ram_tiers_matches_the_oracle_block_for_block() {
    for policy in ["through", "back"] {
        let dir = tempfile::tempdir().unwrap();
        // 2 shards: 4 GPU slots and 8 RAM slots each.
        let args = gpu_args(dir.path(), 8, 16, &["--shards", "2", "--write-policy", policy]);
        let server = start_gpu(&args, &[("FAKE_CUDA_NOT_READY", "1")]);
        let (oracle, r) = common::replay_matching_the_oracle(&server.url, policy).await;
        assert_eq!((oracle.shards, oracle.gpu_blocks_per_shard, oracle.ram_blocks_per_shard), (2, 4, 8));
        assert!(r.blocks_written >= 3 * 24, "working set {} blocks is not several times the memory tiers", r.blocks_written);
        let o = r.oracle.as_ref().unwrap();
        for t in ["gpu", "ram", "nvme"] {
            assert!(o.measured_gets_by_tier.get(t).is_some_and(|&n| n > 0), "{policy}: no GET served from {t}: {o:?}");
        }
        let stats = Client::new(&server.url, false, 1).unwrap().stats().await.unwrap();
        assert_eq!(tier(&stats, "nvme")["evictions"], 0, "the log held the whole run, as the oracle assumes");
        assert_eq!(tier(&stats, "gpu")["gpu"]["copy_errors"], 0);
        server.stop();
    }
}

/// A block moving between memory tiers is in neither for as long as its
/// copy to the GPU takes. In write-back nothing else may hold it (the log
/// has no copy), so that time must not show: while the copy is in flight
/// GETs and lookups find the block, a PUT or DELETE of its key answers as
/// for a stored block and wins over the move, and nothing comes back later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(kvtier_real_gpu, ignore = "needs the fake driver's fault switches (run by `make test`)")]
async fn a_block_on_its_way_to_the_gpu_stays_readable_and_newer_writes_win() {
    let dir = tempfile::tempdir().unwrap();
    // Each copy waits out 2,000 "not ready" event polls: a window of
    // 100 ms or more per copy, which the GETs below fall into.
    let switches = [("FAKE_CUDA_DEFERRED", "1"), ("FAKE_CUDA_NOT_READY", "2000")];
    // RAM has room for every block the GPU moves down: nothing is written
    // to the log.
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 2, 8, &["--write-policy", "back"]), &switches);
    let c = std::sync::Arc::new(Client::new(&server.url, false, 4).unwrap());
    put_all(&c, &keys(6)).await;
    // k4 and k5 on the GPU, k0..k3 dirty in RAM: nothing in the log.
    assert_eq!(tiers_of(&c, &["k0", "k1", "k2", "k3", "k4", "k5"]).await, ["ram", "ram", "ram", "ram", "gpu", "gpu"]);
    // A GET of `key` (in RAM) that moves it up, returned once the move has
    // begun: the GET has been served from RAM, and the move is then under
    // way for 2 copies of 100 ms or more.
    async fn start_move(c: &std::sync::Arc<Client>, key: &'static str) -> tokio::task::JoinHandle<String> {
        let ram_hits = |stats: Value| tier(&stats, "ram")["hits"].as_u64().unwrap();
        let before = ram_hits(c.stats().await.unwrap());
        let mover = tokio::spawn({
            let c = c.clone();
            async move { read_tier(&c, key).await }
        });
        while ram_hits(c.stats().await.unwrap()) == before {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        mover
    }
    // Reads of k0 while a GET moves it up to the GPU.
    let mover = start_move(&c, "k0").await;
    let mut reads = 0;
    while !mover.is_finished() {
        // From the bytes on their way up ("ram"), or the GPU once landed.
        let tier = read_tier(&c, "k0").await;
        assert!(tier == "ram" || tier == "gpu", "{tier}");
        let found = tiers_of(&c, &["k0"]).await;
        assert!(found == ["ram"] || found == ["gpu"], "lookup of k0 while it moved: {found:?}");
        reads += 1;
    }
    assert_eq!(mover.await.unwrap(), "ram");
    assert!(reads > 0, "no read fell into the copy's window");
    assert_eq!(tiers_of(&c, &["k0"]).await, ["gpu"]);

    // A PUT of k1 while k1 moves up: the new bytes stay, whichever copy
    // completes first.
    let v2 = payload("k1, second version");
    assert_eq!(tiers_of(&c, &["k1", "k2", "k3"]).await, ["ram"; 3]);
    let mover = start_move(&c, "k1").await;
    assert!(!mover.is_finished(), "the PUT must come while k1 moves");
    assert_eq!(c.put("k1", vec![v2.clone()]).await.unwrap(), StatusCode::OK, "PUT over a block on its way up");
    assert_eq!(mover.await.unwrap(), "ram");
    let (body, _) = c.get("k1").await.unwrap().expect("k1 stored");
    assert!(body.to_bytes() == v2, "k1 read back with the bytes the move carried, not the newer PUT's");

    // A DELETE of k2 while k2 moves up: deleted once it has landed, and
    // not brought back.
    assert_eq!(tiers_of(&c, &["k2", "k3"]).await, ["ram"; 2]);
    let mover = start_move(&c, "k2").await;
    assert!(!mover.is_finished(), "the DELETE must come while k2 moves");
    let deleted = c.send(Method::DELETE, "/v1/blocks/k2", ChunkedBody::new(Vec::new()), None).await.unwrap();
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "DELETE of a block on its way up");
    assert_eq!(mover.await.unwrap(), "ram");
    assert!(c.get("k2").await.unwrap().is_none(), "k2 came back after its DELETE");
    assert_eq!(tiers_of(&c, &["k2"]).await, Vec::<String>::new());

    // Reads of k3 while a PUT of new bytes places them: old or new bytes,
    // never a miss.
    let v2 = payload("k3, second version");
    let writer = tokio::spawn({
        let (c, v2) = (c.clone(), v2.clone());
        async move { c.put("k3", vec![v2]).await.unwrap() }
    });
    let mut reads = 0;
    while !writer.is_finished() {
        let (body, tier) = c.get("k3").await.unwrap().expect("k3 missing while a PUT replaced it");
        let body = body.to_bytes();
        assert!(body == payload("k3") || body == v2, "k3 read back as neither version ({tier:?})");
        reads += 1;
    }
    assert_eq!(writer.await.unwrap(), StatusCode::OK);
    assert!(reads > 0, "no read fell into the PUT's window");
    assert!(c.get("k3").await.unwrap().expect("k3 stored").0.to_bytes() == v2);

    let stats = c.stats().await.unwrap();
    let gpu = &tier(&stats, "gpu")["gpu"];
    assert_eq!((gpu["corrupt_blocks"].as_u64(), gpu["blocks_lost"].as_u64()), (Some(0), Some(0)), "{gpu}");
    let transit_hits = stats["per_shard"][0]["transit_hits"].as_u64().unwrap();
    assert!(transit_hits > 0, "{}", stats["per_shard"][0]);
    let metrics = c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap().body.to_bytes();
    let line = format!("kvtier_shard_transit_hits_total{{shard=\"0\"}} {transit_hits}");
    assert!(String::from_utf8_lossy(&metrics).contains(&line), "no {line} in /metrics");
    server.stop();
}

/// Many clients at once over two shards, with deferred copies and slow
/// events: copies in flight overlap (two staging buffers per shard), slots
/// are evicted and refilled while reads of them are queued, and every GET
/// still returns its own key's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_over_deferred_copies_get_their_own_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let switches = [("FAKE_CUDA_DEFERRED", "1"), ("FAKE_CUDA_NOT_READY", "2")];
    for policy in ["through", "back"] {
        let data = dir.path().join(policy);
        let server = start_gpu(&gpu_args(&data, 8, 8, &["--shards", "2", "--write-policy", policy]), &switches);
        let c = std::sync::Arc::new(kvtier_loadgen::client::Client::new(&server.url, false, 4).unwrap());
        let k = keys(48);
        put_all(&c, &k).await;
        let mut tasks = Vec::new();
        for t in 0..8usize {
            let (c, k) = (c.clone(), k.clone());
            tasks.push(tokio::spawn(async move {
                let mut served = std::collections::BTreeMap::<String, u64>::new();
                for i in 0..40usize {
                    let key = &k[(t * 7 + i * 13) % k.len()];
                    if i % 5 == 0 {
                        assert!(c.put(key, vec![payload(key)]).await.unwrap().is_success(), "PUT {key}");
                    }
                    *served.entry(read_tier(&c, key).await).or_default() += 1;
                }
                served
            }));
        }
        let mut served = std::collections::BTreeMap::<String, u64>::new();
        for task in tasks {
            for (tier, n) in task.await.unwrap() {
                *served.entry(tier).or_default() += n;
            }
        }
        assert!(served.get("gpu").is_some_and(|&n| n > 0), "{policy}: {served:?}");
        let stats = c.stats().await.unwrap();
        let gpu = &tier(&stats, "gpu")["gpu"];
        assert_eq!((gpu["corrupt_blocks"].as_u64(), gpu["copy_errors"].as_u64()), (Some(0), Some(0)), "{policy}: {gpu}");
        server.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_socket_copies_blocks_from_every_local_tier() {
    use common::local::{get_block, put_block, ready_with_buffer};
    let dir = tempfile::tempdir().unwrap();
    let server = start_gpu(&gpu_args(&dir.path().join("data"), 2, 2, &[]), &[]);
    let path = server.data_dir.join("kvtier.sock");
    tokio::task::spawn_blocking(move || {
        let (mut r, fd, h) = ready_with_buffer(&path, BLOCK_BYTES);
        let keys: Vec<String> = (0..6).map(|i| format!("local-{i}")).collect();
        for k in &keys {
            assert_eq!(put_block(&mut r, &fd, h, k, &payload(k)), 0, "{k}");
        }
        // GPU 2 blocks, RAM 2, the log the rest: newest on the GPU.
        let want = [(5, 1u8), (4, 1), (3, 2), (2, 2), (0, 3)];
        for (i, tier) in want {
            let k = &keys[i];
            let (n, got_tier, bytes) = get_block(&mut r, &fd, h, k, BLOCK_BYTES);
            assert_eq!((n, got_tier), (BLOCK_BYTES as i64, tier), "{k}");
            assert!(bytes == payload(k)[..], "{k}: byte-exact from tier {tier}");
        }
    })
    .await
    .unwrap();
    server.stop();
}
