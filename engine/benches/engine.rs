//! Engine bandwidth against fio, in one run.
//!
//! `make bench` (= `cargo bench -p kvtier-engine --bench engine -- --bench`)
//! measures whole-block PUTs and GETs through the engine (one shard, one
//! executor, `O_DIRECT` through io_uring) against two `fio --direct=1
//! --ioengine=io_uring` references on the same filesystem:
//!
//! - *same op* (the original column): `randwrite` / `randread` of one
//!   block per request at the engine's queue depth.
//! - *same bytes* (issue 43): fio's best form of the same work. PUTs: `rw=write`,
//!   sequential whole blocks at the engine's queue depth, which is what the
//!   log's appends are. GETs: each block read as the engine reads it, split
//!   into its chunk-sized requests (1 MiB; a 1.2 MB block is 2 reads of
//!   600 KiB, the same count) all in flight at once
//!   (`READ_AHEAD_CHUNKS`, 16, in engine/src/shard/reader.rs), sequential
//!   within a block and a random block after that (`rw=randread:N`), at
//!   iodepth = queue depth × reads per block: the same bytes in flight as
//!   the engine's GETs, where one block-size read at depth 1 has one
//!   request in flight and leaves the device idle between them.
//!
//! The `best` ratio divides by the faster of the two in each pair. Runs
//! alternate the engine and both fio references in `--pairs` pairs (the disk
//! here swings up to 2× from minute to minute), and the report gives each
//! pair's ratios and their medians. JSON goes to `target/bench/engine.json`.
//!
//! Bandwidth counts payload bytes only: the engine also writes a 4 KiB
//! header per block, which this ratio charges against it.
//!
//! Without `--bench` (as `cargo test` runs it) it does a tiny run with no fio,
//! so the program is exercised on every test run.

use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kvtier_engine::key::StoredKey;
use kvtier_engine::{BlockBody, Error, Geometry, Store, StoreConfig};
use serde::Serialize;

// The server's allocator, so buffer costs match what `kvtier serve` pays.
kvtier_engine::jemalloc_with_huge_pages!();

struct Plan {
    sizes: Vec<u64>,
    depths: Vec<usize>,
    seconds: f64,
    pairs: usize,
    fio: bool,
    dir: PathBuf,
    store_bytes: u64,
    out: Option<PathBuf>,
}

#[derive(Serialize, Clone)]
struct Case {
    block_bytes: u64,
    queue_depth: usize,
    op: &'static str,
    engine_bytes_per_s: Vec<f64>,
    /// fio with the same op: randwrite / randread, one block per request
    /// at `queue_depth` (the original reference).
    fio_bytes_per_s: Vec<f64>,
    ratios: Vec<f64>,
    ratio_median: f64,
    ratio_min: f64,
    ratio_max: f64,
    /// fio's form of the same bytes ([`same_bytes`]), its command line
    /// arguments, and the engine's ratios to it.
    fio_same_bytes: String,
    fio_same_bytes_bytes_per_s: Vec<f64>,
    same_bytes_ratios: Vec<f64>,
    same_bytes_ratio_median: f64,
    /// Ratios to the faster fio reference of each pair.
    best_ratios: Vec<f64>,
    best_ratio_median: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn plan() -> Plan {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("target/bench");
    if !full {
        return Plan {
            sizes: vec![65_536],
            depths: vec![1, 4],
            seconds: 0.2,
            pairs: 1,
            fio: false,
            dir: std::env::temp_dir().join(format!("kvtier-bench-{}", std::process::id())),
            store_bytes: 64 << 20,
            out: None,
        };
    }
    Plan {
        sizes: value("--sizes").map(|s| s.split(',').map(|x| x.parse().expect("--sizes")).collect()).unwrap_or(vec![1_228_800, 16 << 20]),
        depths: value("--depths").map(|s| s.split(',').map(|x| x.parse().expect("--depths")).collect()).unwrap_or(vec![1, 16]),
        seconds: value("--seconds").map(|s| s.parse().expect("--seconds")).unwrap_or(5.0),
        pairs: value("--pairs").map(|s| s.parse().expect("--pairs")).unwrap_or(3),
        fio: true,
        dir: value("--dir").map(PathBuf::from).unwrap_or(target.join("data")),
        store_bytes: 4 << 30,
        out: Some(target.join("engine.json")),
    }
}

/// Reads of one block the engine keeps in flight: `READ_AHEAD_CHUNKS` in
/// engine/src/shard/reader.rs (private there).
const READ_AHEAD_CHUNKS: u64 = 16;

/// fio's best form of the engine's work on blocks of `block_bytes` at
/// `depth`: (rw, bs, iodepth). PUTs are the log's sequential appends:
/// `write` of whole blocks. A GET reads its block as chunk-sized requests
/// (`kvtier_engine::slot::chunk_bytes_for`), up to `READ_AHEAD_CHUNKS` in
/// flight: the same count of equal requests (4 KiB multiples), sequential
/// within a block (`randread:N`: a random offset every N reads), at the
/// same bytes in flight.
fn same_bytes(write: bool, block_bytes: u64, depth: usize) -> (String, u64, usize) {
    if write {
        return ("write".into(), block_bytes, depth);
    }
    let chunks = kvtier_engine::slot::chunk_count(block_bytes, kvtier_engine::slot::chunk_bytes_for(block_bytes)).max(1);
    let bs = block_bytes.div_ceil(chunks).div_ceil(4096) * 4096;
    let rw = if chunks > 1 { format!("randread:{chunks}") } else { "randread".into() };
    (rw, bs, depth * chunks.min(READ_AHEAD_CHUNKS) as usize)
}

/// Runs fio and returns bytes/s of `rw` (write, randwrite, randread, ...).
fn fio(file: &Path, rw: &str, block_bytes: u64, depth: usize, seconds: f64, size_bytes: u64) -> f64 {
    let out = Command::new("fio")
        .args([
            "--name=kvtier-bench",
            &format!("--filename={}", file.display()),
            &format!("--size={size_bytes}"),
            "--direct=1",
            "--ioengine=io_uring",
            &format!("--rw={rw}"),
            &format!("--bs={block_bytes}"),
            &format!("--iodepth={depth}"),
            &format!("--runtime={seconds}"),
            "--time_based",
            "--output-format=json",
        ])
        .output()
        .expect("fio runs (make bench installs it)");
    assert!(out.status.success(), "fio failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("fio JSON");
    let job = &v["jobs"][0];
    let key = if rw.contains("write") { "write" } else { "read" };
    job[key]["bw_bytes"].as_f64().expect("bw_bytes")
}

/// PUTs (or GETs) whole blocks from `depth` concurrent tasks for `seconds`;
/// returns payload bytes/s.
async fn engine(store: &Rc<Store>, write: bool, depth: usize, seconds: f64, body: &Bytes, written: &Rc<RefCell<Vec<StoredKey>>>) -> f64 {
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let next = Rc::new(Cell::new(0u64));
    let moved = Rc::new(Cell::new(0u64));
    let started = Instant::now();
    let workers = (0..depth).map(|w| {
        let (store, next, moved, written, body) = (store.clone(), next.clone(), moved.clone(), written.clone(), body.clone());
        async move {
            let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ w as u64;
            while Instant::now() < deadline {
                if write {
                    let n = next.get();
                    next.set(n + 1);
                    let key = StoredKey::unscoped(&format!("bench-{}-{n}", written.borrow().len() + 1_000_000 * w)).expect("a valid key");
                    store.put(&key, vec![body.clone()]).await.expect("put");
                    written.borrow_mut().push(key);
                    moved.set(moved.get() + body.len() as u64);
                } else {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let key = {
                        let w = written.borrow();
                        w[(rng % w.len() as u64) as usize].clone()
                    };
                    // Every verified chunk is taken as the server would send
                    // it; none is copied again.
                    match store.get_stream(&key).await {
                        Ok((BlockBody::Whole(b), _)) => moved.set(moved.get() + b.len() as u64),
                        Ok((BlockBody::Chunks(mut chunks), _)) => {
                            while let Some(chunk) = chunks.next().await {
                                moved.set(moved.get() + chunk.expect("chunk").len() as u64);
                            }
                        }
                        Err(Error::NotFound) => {} // reclaimed by the write phase
                        Err(e) => panic!("get: {e}"),
                    }
                }
            }
        }
    });
    futures::future::join_all(workers).await;
    moved.get() as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let plan = plan();
    std::fs::create_dir_all(&plan.dir).unwrap();
    let mut cases: Vec<Case> = Vec::new();
    for &block_bytes in &plan.sizes {
        let data_dir = plan.dir.join(format!("store-{block_bytes}"));
        let _ = std::fs::remove_dir_all(&data_dir);
        let slot = block_bytes.div_ceil(4096) * 4096 + 4096;
        let segment_bytes = (64 * slot + 4096).min(plan.store_bytes / 4);
        let fio_file = plan.dir.join("fio.dat");
        let config = StoreConfig {
            data_dir: data_dir.clone(),
            layout: None,
            geometry: Geometry::from_block_bytes(block_bytes, 128).unwrap(),
            shards: 1,
            disk_bytes: plan.store_bytes,
            segment_bytes,
            sync: false,
            io_depth_max: *plan.depths.iter().max().unwrap(),
            io_queue_max: usize::MAX,
            pin_cpus: true,
            snapshot_secs: 0,
            ram_bytes: 0,
            ram_shared: Default::default(),
            shared_index: false,
            write_policy: kvtier_engine::WritePolicy::Through,
            promote: false,
            gpu: Default::default(),
            io_memory_bytes: kvtier_engine::store::IO_MEMORY_BYTES_DEFAULT,
            remote: None,
            health_window: kvtier_engine::health::ERROR_WINDOW,
            trace: None,
            owners: Default::default(),
            events: None,
            stalls: None,
            device_faults: None,
        };
        let (depths, seconds, pairs, fio_on, store_bytes) = (plan.depths.clone(), plan.seconds, plan.pairs, plan.fio, plan.store_bytes);
        let out = kvtier_engine::run(config, move |store| {
            let (depths, fio_file) = (depths.clone(), fio_file.clone());
            async move {
                let body = Bytes::from((0..block_bytes).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>());
                let written = Rc::new(RefCell::new(Vec::new()));
                let mut cases = Vec::new();
                for &depth in &depths {
                    for (op, write) in [("put", true), ("get", false)] {
                        let mut case = Case {
                            block_bytes,
                            queue_depth: depth,
                            op,
                            engine_bytes_per_s: vec![],
                            fio_bytes_per_s: vec![],
                            ratios: vec![],
                            ratio_median: 0.0,
                            ratio_min: 0.0,
                            ratio_max: 0.0,
                            fio_same_bytes: String::new(),
                            fio_same_bytes_bytes_per_s: vec![],
                            same_bytes_ratios: vec![],
                            same_bytes_ratio_median: 0.0,
                            best_ratios: vec![],
                            best_ratio_median: 0.0,
                        };
                        let (best_rw, best_bs, best_depth) = same_bytes(write, block_bytes, depth);
                        case.fio_same_bytes = format!("--rw={best_rw} --bs={best_bs} --iodepth={best_depth}");
                        for pair in 0..pairs {
                            let e = engine(&store, write, depth, seconds, &body, &written).await;
                            case.engine_bytes_per_s.push(e);
                            if fio_on {
                                let rw = if write { "randwrite" } else { "randread" };
                                // The two references alternate which goes first.
                                let (f, b) = if pair % 2 == 0 {
                                    let f = fio(&fio_file, rw, block_bytes, depth, seconds, store_bytes);
                                    (f, fio(&fio_file, &best_rw, best_bs, best_depth, seconds, store_bytes))
                                } else {
                                    let b = fio(&fio_file, &best_rw, best_bs, best_depth, seconds, store_bytes);
                                    (fio(&fio_file, rw, block_bytes, depth, seconds, store_bytes), b)
                                };
                                case.fio_bytes_per_s.push(f);
                                case.ratios.push(e / f);
                                case.fio_same_bytes_bytes_per_s.push(b);
                                case.same_bytes_ratios.push(e / b);
                                case.best_ratios.push(e / f.max(b));
                            }
                        }
                        if !case.ratios.is_empty() {
                            case.ratio_median = median(case.ratios.clone());
                            case.ratio_min = case.ratios.iter().cloned().fold(f64::MAX, f64::min);
                            case.ratio_max = case.ratios.iter().cloned().fold(0.0, f64::max);
                            case.same_bytes_ratio_median = median(case.same_bytes_ratios.clone());
                            case.best_ratio_median = median(case.best_ratios.clone());
                        }
                        assert!(case.engine_bytes_per_s.iter().all(|b| *b > 0.0), "engine moved no bytes");
                        cases.push(case);
                    }
                }
                cases
            }
        })
        .expect("store runs");
        cases.extend(out.into_iter().flatten());
        let _ = std::fs::remove_dir_all(&data_dir);
    }
    let _ = std::fs::remove_file(plan.dir.join("fio.dat"));
    println!("same op: fio randwrite/randread, one block per request at depth qd (the original reference)");
    println!("same bytes: fio write (sequential) / randread of chunk-sized requests, the same bytes in flight as the engine");
    println!("best: the engine over the faster of the two in each pair");
    println!(
        "{:>10} {:>3} {:>4} {:>8} {:>8} {:>7} {:>8} {:>7} {:>6}  {:<36} ratios same op / same bytes",
        "block", "qd", "op", "engine", "same op", "/op", "same by", "/bytes", "/best", "same bytes fio (MB/s columns)"
    );
    let round = |v: &[f64]| v.iter().map(|r| (r * 100.0).round() / 100.0).collect::<Vec<_>>();
    for c in &cases {
        println!(
            "{:>10} {:>3} {:>4} {:>8.0} {:>8.0} {:>7.2} {:>8.0} {:>7.2} {:>6.2}  {:<36} {:?} / {:?}",
            c.block_bytes,
            c.queue_depth,
            c.op,
            median(c.engine_bytes_per_s.clone()) / 1e6,
            median(c.fio_bytes_per_s.clone()) / 1e6,
            c.ratio_median,
            median(c.fio_same_bytes_bytes_per_s.clone()) / 1e6,
            c.same_bytes_ratio_median,
            c.best_ratio_median,
            c.fio_same_bytes,
            round(&c.ratios),
            round(&c.same_bytes_ratios),
        );
    }
    if let Some(out) = plan.out {
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        std::fs::write(&out, serde_json::to_string_pretty(&cases).unwrap() + "\n").unwrap();
        println!("wrote {}", out.display());
    } else {
        let _ = std::fs::remove_dir_all(&plan.dir);
    }
}
