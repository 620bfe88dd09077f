//! The GPU tier's copy path against a plain pinned memcpy, in one run.
//!
//! `make gpu-check` runs `cargo bench -p kvtier-engine --bench gpu`. On the
//! device of `--device` (default 0) it measures, in `--rounds` rounds:
//! - **tier H2D**: [`GpuTier::write`] of `--blocks` blocks of
//!   `--block-bytes` (copy into PORTABLE pinned staging with the CRC-32,
//!   async H2D on the tier's stream, event polled from a glommio timer);
//! - **tier D2H**: [`GpuTier::read`] of them (async D2H into staging, event
//!   polled, one pass copying into a response buffer with the CRC check);
//! - **reference**: `cuMemcpyHtoD_v2` / `cuMemcpyDtoH_v2` (synchronous) of
//!   the same bytes between one PORTABLE pinned buffer and one device
//!   buffer: the plain pinned memcpy, no staging copy, no CRC.
//!
//! Each round measures the tier and the reference back to back; the report
//! gives each round's ratio (tier / reference) and their median. JSON goes
//! to `target/bench/gpu.json`. Exits 2 when no device can be opened.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use kvtier_engine::gpu::{GpuDevice, GpuRead, GpuTier};
use kvtier_engine::key::{BlockHash, StoredKey};
use kvtier_engine::pool::BufferPool;
use serde::Serialize;

#[derive(Serialize)]
struct Report {
    device: String,
    block_bytes: u64,
    blocks: u32,
    tier_h2d_bytes_per_s: Vec<f64>,
    memcpy_h2d_bytes_per_s: Vec<f64>,
    h2d_ratios: Vec<f64>,
    h2d_ratio_median: f64,
    tier_d2h_bytes_per_s: Vec<f64>,
    memcpy_d2h_bytes_per_s: Vec<f64>,
    d2h_ratios: Vec<f64>,
    d2h_ratio_median: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(|v| v.parse().expect("a number")).unwrap_or(default)
}

/// Bytes per second of `blocks` blocks of `block_bytes` in `secs`.
fn rate(blocks: u32, block_bytes: u64, secs: f64) -> f64 {
    blocks as f64 * block_bytes as f64 / secs
}

/// The reference: synchronous pinned memcpy both ways, `blocks` times.
fn reference(device: &GpuDevice, block_bytes: u64, blocks: u32) -> (f64, f64) {
    device.bind_to_thread().expect("context");
    // SAFETY: plain allocations freed below; copies are synchronous.
    unsafe {
        let host = cu::malloc_host(block_bytes as usize, sys::CU_MEMHOSTALLOC_PORTABLE).expect("cuMemHostAlloc");
        std::ptr::write_bytes(host.cast::<u8>(), 7, block_bytes as usize);
        let dev = cu::malloc_sync(block_bytes as usize).expect("cuMemAlloc");
        let t = Instant::now();
        for _ in 0..blocks {
            sys::cuMemcpyHtoD_v2(dev, host, block_bytes as usize).result().expect("cuMemcpyHtoD");
        }
        let h2d = rate(blocks, block_bytes, t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..blocks {
            sys::cuMemcpyDtoH_v2(host, dev, block_bytes as usize).result().expect("cuMemcpyDtoH");
        }
        let d2h = rate(blocks, block_bytes, t.elapsed().as_secs_f64());
        cu::free_sync(dev).expect("cuMemFree");
        cu::free_host(host).expect("cuMemFreeHost");
        (h2d, d2h)
    }
}

fn main() {
    let block_bytes = arg("--block-bytes", 16 << 20);
    let blocks = arg("--blocks", 32) as u32;
    let rounds = arg("--rounds", 5);
    let ordinal = arg("--device", 0) as usize;
    let device = match GpuDevice::open(ordinal) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu bench: no GPU to measure: {e}");
            std::process::exit(2);
        }
    };
    println!("GPU copy path on device {} ({}), {blocks} blocks of {block_bytes} bytes, {rounds} rounds", ordinal, device.name);
    let dev = device.clone();
    let report = glommio::LocalExecutorBuilder::default()
        .spawn(move || async move { measure(dev, block_bytes, blocks, rounds).await })
        .expect("executor")
        .join()
        .expect("bench");
    println!("{:>5} {:>14} {:>14} {:>7}  range", "dir", "tier MB/s", "memcpy MB/s", "ratio");
    for (dir, tier, reference, ratios, med) in [
        ("H2D", &report.tier_h2d_bytes_per_s, &report.memcpy_h2d_bytes_per_s, &report.h2d_ratios, report.h2d_ratio_median),
        ("D2H", &report.tier_d2h_bytes_per_s, &report.memcpy_d2h_bytes_per_s, &report.d2h_ratios, report.d2h_ratio_median),
    ] {
        let lo = ratios.iter().cloned().fold(f64::MAX, f64::min);
        let hi = ratios.iter().cloned().fold(0.0, f64::max);
        println!("{dir:>5} {:>14.0} {:>14.0} {med:>7.2}  {lo:.2}-{hi:.2}", median(tier.clone()) / 1e6, median(reference.clone()) / 1e6);
    }
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&out).expect("target/bench");
    std::fs::write(out.join("gpu.json"), serde_json::to_string_pretty(&report).expect("json")).expect("gpu.json");
    println!("wrote target/bench/gpu.json");
}

async fn measure(device: Arc<GpuDevice>, block_bytes: u64, blocks: u32, rounds: u64) -> Report {
    let tier = GpuTier::new(device.clone(), blocks, block_bytes).expect("GPU tier");
    let pool = BufferPool::new(block_bytes);
    let data: Vec<u8> = (0..block_bytes).map(|i| (i * 31 % 251) as u8).collect();
    let keys: Vec<(StoredKey, BlockHash)> = (0..blocks)
        .map(|i| StoredKey::unscoped(&format!("b{i}")).expect("a valid key"))
        .map(|k| {
            let hash = k.hash();
            (k, hash)
        })
        .collect();
    let mut r = Report {
        device: device.name.clone(),
        block_bytes,
        blocks,
        tier_h2d_bytes_per_s: vec![],
        memcpy_h2d_bytes_per_s: vec![],
        h2d_ratios: vec![],
        h2d_ratio_median: 0.0,
        tier_d2h_bytes_per_s: vec![],
        memcpy_d2h_bytes_per_s: vec![],
        d2h_ratios: vec![],
        d2h_ratio_median: 0.0,
    };
    for _ in 0..rounds {
        let t = Instant::now();
        for (key, hash) in &keys {
            tier.remove(hash);
            let slot = match tier.take_free(0).await {
                Some(s) => s,
                None => {
                    let v = tier.victim_for(0).expect("a full tier has a victim");
                    tier.evict(v.slot);
                    tier.take_free(0).await.expect("a slot after eviction")
                }
            };
            assert!(tier.write(slot, key, *hash, 0, &[&data], false, &|| true).await.expect("tier write"), "installed");
        }
        let h2d = rate(blocks, block_bytes, t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (key, hash) in &keys {
            match tier.read(key, hash, &pool).await {
                GpuRead::Hit(b) => assert_eq!(b.len() as u64, block_bytes),
                _ => panic!("block {key} not read back from the GPU"),
            }
        }
        let d2h = rate(blocks, block_bytes, t.elapsed().as_secs_f64());
        let (ref_h2d, ref_d2h) = reference(&device, block_bytes, blocks);
        r.tier_h2d_bytes_per_s.push(h2d);
        r.memcpy_h2d_bytes_per_s.push(ref_h2d);
        r.h2d_ratios.push(h2d / ref_h2d);
        r.tier_d2h_bytes_per_s.push(d2h);
        r.memcpy_d2h_bytes_per_s.push(ref_d2h);
        r.d2h_ratios.push(d2h / ref_d2h);
    }
    r.h2d_ratio_median = median(r.h2d_ratios.clone());
    r.d2h_ratio_median = median(r.d2h_ratios.clone());
    r
}
