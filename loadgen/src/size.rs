//! `kvtier-loadgen size`: how much GPU, RAM and NVMe a recorded workload
//! needs, from its trace (`kvtier serve --trace-dir`, or `replay
//! --trace-out`; docs/TRACE.md).
//!
//! It lives in the loadgen, not the server: it reads files offline, shares
//! the policy oracle ([`crate::oracle`]) and the HTML reports
//! ([`crate::report`]) with the replay, and keeps the server binary free of
//! plotting.
//!
//! From the trace's records, in time order, per shard (each memory tier is
//! an LRU per shard, `slots = bytes / shards / block_bytes`):
//! - PUT, GET and prefetch are references (the block becomes the most
//!   recently used); HEAD and lookup are probes (nothing moves); DELETE
//!   takes the block out (exact without DELETEs: a delete frees a slot in
//!   caches of every size but leaves them differently full, so LRU with
//!   deletes is not a stack algorithm; engines rarely delete).
//! - **Memory curve** (GETs): the share of block GETs a memory tier of each
//!   size serves, exact by stack distance ([`crate::mrc::LruStack`]), or
//!   estimated by SHARDS (`sample_rate`, `sample_blocks`). With promotion
//!   on, GPU and RAM together are one LRU stack (a block is in exactly one
//!   of them, moved to the top on each use), so the GPU serves distances up
//!   to its size and RAM the next `ram` ones.
//! - **Prefix curve** (tokens): the share of looked-up tokens a store of
//!   each capacity finds as prefix hits: a chain's key counts when it and
//!   every key before it are within the capacity (the running maximum of
//!   their probe distances). The NVMe log is sized by it.
//! - **Policy curve**: kvtier's own placement (write policy, promotion, GPU
//!   above RAM) by miniature simulations (Waldspurger et al., "Cache
//!   Modeling and Optimization using Miniature Simulations", USENIX ATC
//!   2017): the policy oracle run on a hash-sampled trace with every tier
//!   scaled by the same rate, at a few dozen RAM sizes.

use std::path::PathBuf;
use std::time::Instant;

use kvtier_engine::trace::{self, Record, TraceHeader, TraceOp};
use serde::Serialize;

use crate::mrc::{Curve, DistanceHistogram, LruStack, Shards};
use crate::oracle::{Placement, PolicyOracle};

/// A workload loaded from one or more trace files.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The files, as given.
    pub files: Vec<PathBuf>,
    /// The first file's header (every file agrees on geometry and shards).
    pub header: TraceHeader,
    /// Every record, in time order (times made absolute across files).
    pub records: Vec<Record>,
}

/// Reads trace files into one workload.
///
/// # Errors
/// `FILE: at byte N: reason` for the first file that cannot be used: as
/// [`trace::read`] (empty, truncated, newer version, bad record); a file
/// with no records; a file whose block size, block tokens or shard count
/// differ from the first file's or from `block_bytes` when given.
pub fn load(files: &[PathBuf], block_bytes: Option<u64>) -> Result<Workload, String> {
    if files.is_empty() {
        return Err("no trace files given".into());
    }
    let mut header: Option<TraceHeader> = None;
    let mut records = Vec::new();
    for path in files {
        let mut t = trace::read(path).map_err(|e| e.to_string())?;
        let at = |offset: u64, reason: String| trace::TraceError { path: path.clone(), offset, reason }.to_string();
        if t.records.is_empty() {
            return Err(at(t.records_offset, "no records: the trace is empty (was the recorder on while the workload ran?)".into()));
        }
        if let Some(want) = block_bytes {
            if t.header.block_bytes != want {
                return Err(at(
                    trace::PREAMBLE_BYTES as u64,
                    format!("the trace's blocks are {} bytes, not the {want} asked for (--block-bytes)", t.header.block_bytes),
                ));
            }
        }
        if let Some(first) = &header {
            let (a, b) = (&t.header, first);
            if (a.block_bytes, a.block_tokens, a.shards) != (b.block_bytes, b.block_tokens, b.shards) {
                return Err(at(
                    trace::PREAMBLE_BYTES as u64,
                    format!(
                        "blocks of {} bytes / {} tokens on {} shards, but {} has {} bytes / {} tokens on {} shards: traces of different stores cannot be sized together",
                        a.block_bytes,
                        a.block_tokens,
                        a.shards,
                        files[0].display(),
                        b.block_bytes,
                        b.block_tokens,
                        b.shards
                    ),
                ));
            }
        }
        let base_us = t.header.started_unix_ms.saturating_mul(1000);
        for r in &mut t.records {
            r.time_us = r.time_us.saturating_add(base_us);
        }
        records.extend(t.records);
        header.get_or_insert(t.header);
    }
    records.sort_by_key(|r| r.time_us);
    Ok(Workload { files: files.to_vec(), header: header.expect("at least one file"), records })
}

/// What to compute.
#[derive(Debug, Clone)]
pub struct SizeOptions {
    /// SHARDS at this rate (0–1) beside the exact curve.
    pub sample_rate: Option<f64>,
    /// Fixed-size SHARDS tracking at most this many blocks.
    pub sample_blocks: Option<usize>,
    /// Skip the exact memory curve (SHARDS only; the prefix curve stays
    /// exact).
    pub skip_exact: bool,
    /// GPU, RAM and disk sizes to judge, bytes (default: the trace's
    /// header).
    pub gpu_bytes: Option<u64>,
    /// RAM tier bytes.
    pub ram_bytes: Option<u64>,
    /// Disk bytes.
    pub disk_bytes: Option<u64>,
    /// Miniature simulations of kvtier's policy: how many RAM sizes (0:
    /// none).
    pub policy_sizes: usize,
    /// Their sampling rate (default: 1 up to 50,000 distinct blocks, then
    /// lower to keep about 50,000).
    pub policy_rate: Option<f64>,
    /// Points per curve in the report.
    pub points: usize,
}

impl Default for SizeOptions {
    fn default() -> Self {
        SizeOptions {
            sample_rate: None,
            sample_blocks: None,
            skip_exact: false,
            gpu_bytes: None,
            ram_bytes: None,
            disk_bytes: None,
            policy_sizes: 24,
            policy_rate: None,
            points: 48,
        }
    }
}

/// One size on a curve.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct SizePoint {
    /// Slots per shard.
    pub blocks_per_shard: u64,
    /// The tier's bytes across shards (`slots × shards × block_bytes`).
    pub bytes: u64,
    /// Hit ratio there (0–1).
    pub hit_ratio: f64,
}

/// A curve with its landmarks.
#[derive(Debug, Clone, Serialize)]
pub struct CurveReport {
    /// What it measures.
    pub name: String,
    /// How it was computed.
    pub method: String,
    /// Hit ratio with no capacity limit (1 − cold misses).
    pub unbounded_hit_ratio: f64,
    /// The knee (Kneedle).
    pub knee: Option<SizePoint>,
    /// The smallest sizes reaching 90 %, 95 % and 99 % of the unbounded
    /// hit ratio.
    pub reach_90: SizePoint,
    /// 95 %.
    pub reach_95: SizePoint,
    /// 99 %.
    pub reach_99: SizePoint,
    /// The curve, smallest size first.
    pub points: Vec<SizePoint>,
    /// Seconds it took.
    pub seconds: f64,
}

/// One tier's advice.
#[derive(Debug, Clone, Serialize)]
pub struct TierAdvice {
    /// `gpu`, `ram` or `nvme`.
    pub tier: String,
    /// What the curve measures for it.
    pub measure: String,
    /// The size judged (the trace's, or the one asked), and its hit ratio.
    pub configured: SizePoint,
    /// The knee of its curve.
    pub knee: Option<SizePoint>,
    /// Smallest sizes reaching 90/95/99 % of the unbounded hit ratio.
    pub reach: [SizePoint; 3],
    /// Prefill tokens this tier saved over the trace per GB (10^9 bytes)
    /// of it at the configured size: its GET hits × block tokens / GB (for
    /// NVMe: every prefix-hit token of a store that large, per GB of disk).
    pub tokens_saved_per_gb: f64,
}

/// The sizing report (`results.json`).
#[derive(Debug, Clone, Serialize)]
pub struct SizeReport {
    /// The trace files.
    pub traces: Vec<String>,
    /// What wrote the first.
    pub source: String,
    /// Geometry.
    pub model: String,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Shards (each tier's LRU is per shard).
    pub shards: u32,
    /// Records in all.
    pub records: u64,
    /// Seconds from the first record to the last.
    pub duration_s: f64,
    /// Records per operation.
    pub operations: std::collections::BTreeMap<String, u64>,
    /// Distinct blocks referenced.
    pub distinct_blocks: u64,
    /// Sizes judged, bytes: GPU, RAM, disk.
    pub gpu_bytes: u64,
    /// RAM bytes judged.
    pub ram_bytes: u64,
    /// Disk bytes judged.
    pub disk_bytes: u64,
    /// Write policy and promotion the policy simulations used.
    pub write_policy: String,
    /// Whether reads promote.
    pub promote: bool,
    /// GETs served by a memory tier (GPU + RAM) of each size: exact LRU.
    pub memory: Option<CurveReport>,
    /// The same by SHARDS, when asked.
    pub memory_shards: Option<CurveReport>,
    /// Mean absolute error of the SHARDS curve against the exact one, over
    /// every size from 1 slot per shard to where the exact curve stops
    /// rising (both computed).
    pub memory_shards_mae: Option<f64>,
    /// Lookup tokens found as prefix hits by a store of each capacity.
    pub prefix: CurveReport,
    /// GETs served from GPU or RAM under kvtier's own policy at each RAM
    /// size (GPU as judged), by miniature simulations.
    pub policy: Option<CurveReport>,
    /// Per tier, at the sizes judged.
    pub tiers: Vec<TierAdvice>,
    /// References (PUT, GET, prefetch) per second of the exact pass.
    pub exact_references_per_s: f64,
    /// Records (every access: references and probes) per second of the
    /// exact pass.
    pub exact_records_per_s: f64,
}

/// Counts of one pass: histograms of GET distances and prefix tokens.
struct Pass {
    gets: DistanceHistogram,
    prefix: DistanceHistogram,
    get_count: u64,
    references: u64,
    distinct: u64,
}

/// The exact pass: per-shard stacks, GET distances, lookup chains' prefix
/// distances (in blocks per shard).
fn exact_pass(w: &Workload, with_gets: bool) -> Pass {
    let shards = w.header.shards as usize;
    let mut per_shard = vec![0usize; shards];
    for r in &w.records {
        if matches!(r.op, TraceOp::Put | TraceOp::Get | TraceOp::Prefetch) {
            per_shard[r.shard as usize] += 1;
        }
    }
    let mut stacks: Vec<LruStack> = per_shard.iter().map(|n| LruStack::with_capacity(*n)).collect();
    let mut pass =
        Pass { gets: DistanceHistogram::default(), prefix: DistanceHistogram::default(), get_count: 0, references: 0, distinct: 0 };
    // The running maximum distance of the current lookup chain (`None`
    // inside: a key before was cold, so every later key misses).
    let mut chain: Option<Option<u64>> = None;
    let tokens = f64::from(w.header.block_tokens);
    for r in &w.records {
        let s = r.shard as usize;
        let block = r.hash.0;
        match r.op {
            TraceOp::Put | TraceOp::Prefetch => {
                stacks[s].reference(block);
                pass.references += 1;
            }
            TraceOp::Get => {
                let d = stacks[s].reference(block);
                pass.references += 1;
                pass.get_count += 1;
                if with_gets {
                    pass.gets.add(d, 1.0);
                }
            }
            TraceOp::Lookup => {
                let d = stacks[s].distance(block);
                let running = match chain {
                    Some(prev) if r.pos > 0 => prev.and_then(|p| d.map(|d| d.max(p))),
                    _ => d,
                };
                chain = Some(running);
                pass.prefix.add(running, tokens);
            }
            TraceOp::Head => {}
            TraceOp::Delete => {
                stacks[s].remove(block);
            }
        }
    }
    pass
}

fn count_distinct(w: &Workload) -> u64 {
    let mut seen = rustc_hash::FxHashSet::default();
    for r in &w.records {
        seen.insert(r.hash.0);
    }
    seen.len() as u64
}

/// The SHARDS pass over GETs: the histogram (SHARDS_adj applied) and the
/// rate it ended at.
fn shards_pass(w: &Workload, rate: Option<f64>, blocks: Option<usize>) -> (DistanceHistogram, f64, u64) {
    let shards = w.header.shards as usize;
    let mut s = match blocks {
        Some(n) => Shards::fixed_size(n, shards),
        None => Shards::fixed_rate(rate.unwrap_or(0.01), shards),
    };
    let mut h = DistanceHistogram::default();
    let mut gets = 0u64;
    for r in &w.records {
        // The sample test first: it is false for nearly every record and
        // predictable, unlike the operation.
        gets += u64::from(r.op == TraceOp::Get);
        if !s.samples(r.hash.0) {
            continue;
        }
        match r.op {
            TraceOp::Put | TraceOp::Prefetch => {
                s.reference(r.shard as usize, r.hash.0);
            }
            TraceOp::Get => {
                if let Some((d, weight)) = s.reference(r.shard as usize, r.hash.0) {
                    h.add(d.map(|d| d.ceil() as u64), weight);
                }
            }
            TraceOp::Delete => s.remove(r.shard as usize, r.hash.0),
            _ => {}
        }
    }
    // SHARDS_adj: the GETs the sample over- or under-represents count at
    // distance 0, so the weights sum to the GETs seen.
    h.adjust_first_bucket(gets as f64 - h.total());
    (h, s.rate(), gets)
}

/// One miniature simulation: kvtier's policy with `ram_blocks` RAM slots
/// per shard (and `gpu_blocks` GPU slots), on the records whose block
/// falls in the sample at `rate`, every size scaled by it. Returns the
/// share of sampled GETs served from GPU or RAM.
fn policy_run(w: &Workload, rate: f64, gpu_blocks: u64, ram_blocks: u64, write_back: bool, promote: bool) -> f64 {
    let threshold = (rate * crate::mrc::SHARDS_MODULUS as f64).round() as u64;
    let scale = |b: u64| (b as f64 * rate).round() as usize;
    let mut o = PolicyOracle::new(w.header.shards as usize, scale(ram_blocks), write_back, promote).with_gpu(scale(gpu_blocks));
    let (mut gets, mut memory) = (0u64, 0u64);
    for r in &w.records {
        if crate::mrc::shards_value(r.hash.0) >= threshold {
            continue;
        }
        match r.op {
            TraceOp::Put => o.put_hash(r.hash),
            TraceOp::Get => {
                gets += 1;
                if matches!(o.get_hash(r.hash), Some(Placement::Gpu | Placement::Ram)) {
                    memory += 1;
                }
            }
            TraceOp::Prefetch => o.prefetch_hash(r.hash),
            TraceOp::Delete => o.delete_hash(r.hash),
            _ => {}
        }
    }
    if gets == 0 {
        0.0
    } else {
        memory as f64 / gets as f64
    }
}

/// Computes the sizing report of a workload.
pub fn size(w: &Workload, opts: &SizeOptions) -> SizeReport {
    let h = &w.header;
    let shards = u64::from(h.shards);
    let block_bytes = h.block_bytes;
    let per_shard_bytes = shards * block_bytes;
    let slot_bytes = kvtier_engine::slot::slot_bytes(block_bytes);
    let gpu_bytes = opts.gpu_bytes.unwrap_or(h.gpu_blocks_per_shard * per_shard_bytes);
    let ram_bytes = opts.ram_bytes.unwrap_or(h.ram_blocks_per_shard * per_shard_bytes);
    let disk_bytes = opts.disk_bytes.unwrap_or(h.disk_bytes);
    let (gpu_blocks, ram_blocks) = (gpu_bytes / per_shard_bytes, ram_bytes / per_shard_bytes);
    let disk_blocks = disk_bytes / shards / slot_bytes;
    let mem_point =
        |c: &Curve, blocks: u64| SizePoint { blocks_per_shard: blocks, bytes: blocks * per_shard_bytes, hit_ratio: c.at(blocks) };
    let disk_point =
        |c: &Curve, blocks: u64| SizePoint { blocks_per_shard: blocks, bytes: blocks * shards * slot_bytes, hit_ratio: c.at(blocks) };
    let report =
        |name: &str, method: String, c: &Curve, seconds: f64, point: &dyn Fn(&Curve, u64) -> SizePoint, marks: &[u64]| CurveReport {
            name: name.into(),
            method,
            unbounded_hit_ratio: c.unbounded(),
            knee: c.knee().map(|k| point(c, k)),
            reach_90: point(c, c.reaching(0.90)),
            reach_95: point(c, c.reaching(0.95)),
            reach_99: point(c, c.reaching(0.99)),
            points: Curve::grid(c.saturation().max(1) + c.saturation() / 8, opts.points, marks).into_iter().map(|b| point(c, b)).collect(),
            seconds,
        };

    let t = Instant::now();
    let mut pass = exact_pass(w, !opts.skip_exact);
    let exact_s = t.elapsed().as_secs_f64();
    pass.distinct = count_distinct(w);
    let memory_curve = pass.gets.curve(Some(pass.get_count as f64));
    let prefix_curve = pass.prefix.curve(None);
    let marks = [gpu_blocks, gpu_blocks + ram_blocks];
    let memory = (!opts.skip_exact).then(|| {
        report("GETs served from memory (GPU + RAM)", "exact LRU (stack distances)".into(), &memory_curve, exact_s, &mem_point, &marks)
    });
    let mut memory_shards_mae = None;
    let memory_shards = (opts.sample_rate.is_some() || opts.sample_blocks.is_some()).then(|| {
        let t = Instant::now();
        let (hist, rate, gets) = shards_pass(w, opts.sample_rate, opts.sample_blocks);
        let c = hist.curve(Some(gets as f64));
        if !opts.skip_exact {
            let top = memory_curve.saturation().max(1);
            memory_shards_mae = Some((1..=top).map(|b| (c.at(b) - memory_curve.at(b)).abs()).sum::<f64>() / top as f64);
        }
        let method = match opts.sample_blocks {
            Some(n) => format!("SHARDS fixed-size ({n} blocks; rate at the end {rate:.5})"),
            None => format!("SHARDS at rate {rate:.4}"),
        };
        report("GETs served from memory (GPU + RAM)", method, &c, t.elapsed().as_secs_f64(), &mem_point, &marks)
    });
    let prefix = report(
        "lookup tokens found as prefix hits",
        "exact LRU (running maximum of the chain's probe distances)".into(),
        &prefix_curve,
        exact_s,
        &disk_point,
        &[disk_blocks],
    );
    let policy = (opts.policy_sizes > 0 && pass.get_count > 0).then(|| {
        let t = Instant::now();
        let rate = opts.policy_rate.unwrap_or_else(|| (50_000.0 / pass.distinct.max(1) as f64).min(1.0));
        let top = (memory_curve.saturation().max(gpu_blocks + ram_blocks) + 1).max(2);
        let sizes = Curve::grid(top, opts.policy_sizes, &[ram_blocks]);
        let write_back = h.write_policy == "back";
        let hits: Vec<(u64, f64)> = std::thread::scope(|scope| {
            let jobs: Vec<_> =
                sizes.iter().map(|&ram| scope.spawn(move || (ram, policy_run(w, rate, gpu_blocks, ram, write_back, h.promote)))).collect();
            jobs.into_iter().map(|j| j.join().expect("a simulation")).collect()
        });
        let top_hit = hits.iter().map(|p| p.1).fold(0.0, f64::max);
        let point = |(ram, hit): (u64, f64)| SizePoint { blocks_per_shard: ram, bytes: ram * per_shard_bytes, hit_ratio: hit };
        let reach = |f: f64| point(hits.iter().copied().find(|p| p.1 >= f * top_hit - 1e-12).unwrap_or(*hits.last().expect("sizes")));
        CurveReport {
            name: "GETs served from GPU or RAM by kvtier's policy, at each RAM size".into(),
            method: format!(
                "miniature simulations of the policy oracle at sampling rate {rate:.4} ({} sizes; write {}, promote {})",
                sizes.len(),
                h.write_policy,
                if h.promote { "on" } else { "off" }
            ),
            unbounded_hit_ratio: top_hit,
            knee: None,
            reach_90: reach(0.90),
            reach_95: reach(0.95),
            reach_99: reach(0.99),
            points: hits.iter().copied().map(point).collect(),
            seconds: t.elapsed().as_secs_f64(),
        }
    });

    let gb = |bytes: u64| bytes as f64 / 1e9;
    let tokens = f64::from(h.block_tokens);
    let per_gb = |hits: f64, bytes: u64| if bytes > 0 { hits * tokens / gb(bytes) } else { 0.0 };
    let gets = pass.get_count as f64;
    let c = &memory_curve;
    let reach3 = |c: &Curve, point: &dyn Fn(&Curve, u64) -> SizePoint| {
        [point(c, c.reaching(0.90)), point(c, c.reaching(0.95)), point(c, c.reaching(0.99))]
    };
    let mut tiers = vec![
        TierAdvice {
            tier: "gpu".into(),
            measure: "GETs served from the GPU tier (the top of the LRU stack)".into(),
            configured: mem_point(c, gpu_blocks),
            knee: c.knee().map(|k| mem_point(c, k)),
            reach: reach3(c, &mem_point),
            tokens_saved_per_gb: per_gb(c.at(gpu_blocks) * gets, gpu_bytes),
        },
        TierAdvice {
            tier: "ram".into(),
            measure: format!("GETs served from GPU or RAM, with {} GB of GPU", gb(gpu_bytes)),
            configured: mem_point(c, gpu_blocks + ram_blocks),
            knee: c.knee().map(|k| mem_point(c, k.saturating_sub(gpu_blocks))),
            reach: reach3(c, &|c: &Curve, b: u64| {
                let p = mem_point(c, b.max(gpu_blocks) - gpu_blocks);
                SizePoint { hit_ratio: c.at(b.max(gpu_blocks)), ..p }
            }),
            tokens_saved_per_gb: per_gb((c.at(gpu_blocks + ram_blocks) - c.at(gpu_blocks)) * gets, ram_bytes),
        },
    ];
    let p = &prefix_curve;
    let looked_up_tokens = pass.prefix.total();
    tiers.push(TierAdvice {
        tier: "nvme".into(),
        measure: "lookup tokens found as prefix hits by a store this large (write-through: the log holds every block)".into(),
        configured: disk_point(p, disk_blocks),
        knee: p.knee().map(|k| disk_point(p, k)),
        reach: reach3(p, &disk_point),
        tokens_saved_per_gb: if disk_bytes > 0 { p.at(disk_blocks) * looked_up_tokens / gb(disk_bytes) } else { 0.0 },
    });
    if gpu_bytes == 0 {
        tiers.remove(0);
    }

    let mut operations = std::collections::BTreeMap::new();
    for r in &w.records {
        *operations.entry(r.op.as_str().to_string()).or_insert(0u64) += 1;
    }
    let (first, last) = (w.records.first().map_or(0, |r| r.time_us), w.records.last().map_or(0, |r| r.time_us));
    SizeReport {
        traces: w.files.iter().map(|p| p.display().to_string()).collect(),
        source: h.source.clone(),
        model: h.model.clone(),
        block_bytes,
        block_tokens: h.block_tokens,
        shards: h.shards,
        records: w.records.len() as u64,
        duration_s: (last - first) as f64 / 1e6,
        operations,
        distinct_blocks: pass.distinct,
        gpu_bytes,
        ram_bytes,
        disk_bytes,
        write_policy: h.write_policy.clone(),
        promote: h.promote,
        memory,
        memory_shards,
        memory_shards_mae,
        prefix,
        policy,
        tiers,
        exact_references_per_s: if exact_s > 0.0 { pass.references as f64 / exact_s } else { 0.0 },
        exact_records_per_s: if exact_s > 0.0 { w.records.len() as f64 / exact_s } else { 0.0 },
    }
}

/// The exact memory curve alone: the share of GETs an LRU tier of each
/// size (slots per shard) serves.
pub fn memory_curve(w: &Workload) -> Curve {
    let pass = exact_pass(w, true);
    pass.gets.curve(Some(pass.get_count as f64))
}

/// The GET hit ratio of an LRU memory tier of `blocks_per_shard` slots per
/// shard, by direct simulation (a hash map and an ordered map per shard):
/// the reference the exact curve is tested and benchmarked against.
pub fn direct_lru_hit_ratio(w: &Workload, blocks_per_shard: u64) -> f64 {
    let mut o = PolicyOracle::new(w.header.shards as usize, blocks_per_shard as usize, true, true);
    let (mut gets, mut hits) = (0u64, 0u64);
    for r in &w.records {
        match r.op {
            TraceOp::Put | TraceOp::Prefetch => {
                // Write-back with no NVMe misses: the RAM LRU alone.
                o.put_hash(r.hash);
            }
            TraceOp::Get => {
                gets += 1;
                if o.get_hash(r.hash) == Some(Placement::Ram) {
                    hits += 1;
                } else {
                    o.put_hash(r.hash);
                }
            }
            TraceOp::Delete => o.delete_hash(r.hash),
            _ => {}
        }
    }
    if gets == 0 {
        0.0
    } else {
        hits as f64 / gets as f64
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// Bytes in GiB, or MiB under 1 GiB.
pub fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// The report as a text table.
pub fn text(r: &SizeReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} records over {:.1} s from {} trace file(s) ({}); {} distinct blocks of {} bytes / {} tokens on {} shards",
        r.records,
        r.duration_s,
        r.traces.len(),
        r.source,
        r.distinct_blocks,
        r.block_bytes,
        r.block_tokens,
        r.shards
    );
    let ops: Vec<String> = r.operations.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(out, "operations: {}", ops.join(", "));
    let _ = writeln!(
        out,
        "\n{:<6} {:>12} {:>9} {:>12} {:>12} {:>12} {:>12} {:>16}",
        "tier", "judged", "hit", "knee", "90%", "95%", "99%", "tokens saved/GB"
    );
    for t in &r.tiers {
        let _ = writeln!(
            out,
            "{:<6} {:>12} {:>9} {:>12} {:>12} {:>12} {:>12} {:>16.0}",
            t.tier,
            human_bytes(t.configured.bytes),
            pct(t.configured.hit_ratio),
            t.knee.map_or("-".into(), |k| human_bytes(k.bytes)),
            human_bytes(t.reach[0].bytes),
            human_bytes(t.reach[1].bytes),
            human_bytes(t.reach[2].bytes),
            t.tokens_saved_per_gb
        );
    }
    for t in &r.tiers {
        let _ = writeln!(out, "  {}: {}", t.tier, t.measure);
    }
    if let Some(mae) = r.memory_shards_mae {
        let _ = writeln!(out, "\nSHARDS against exact: mean absolute error {mae:.4} over every size");
    }
    let curves = [r.memory.as_ref(), r.memory_shards.as_ref(), Some(&r.prefix), r.policy.as_ref()];
    for c in curves.into_iter().flatten() {
        let _ = writeln!(
            out,
            "\n{} — {} ({:.2} s); unbounded {}, knee {}",
            c.name,
            c.method,
            c.seconds,
            pct(c.unbounded_hit_ratio),
            c.knee.map_or("-".into(), |k| format!("{} ({})", human_bytes(k.bytes), pct(k.hit_ratio)))
        );
        let _ = writeln!(out, "  {:>12} {:>12} {:>9}", "slots/shard", "size", "hit");
        let step = (c.points.len() / 12).max(1);
        for p in c.points.iter().step_by(step) {
            let _ = writeln!(out, "  {:>12} {:>12} {:>9}", p.blocks_per_shard, human_bytes(p.bytes), pct(p.hit_ratio));
        }
    }
    out
}
