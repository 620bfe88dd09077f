//! `kvtier-loadgen sweep`: closed-loop workers at rising concurrency levels,
//! each iteration a fixed mix of prefix lookups, block reads and block
//! writes (7:6:3 by default, as in the KVStore capacity benchmarks), against
//! one or more targets on the same workload.
//!
//! **Key space.** `working_set_blocks` blocks form chains of `chain_blocks`
//! chained keys ([`crate::keys::block_key`] over seeded pseudo-random token
//! ids), stored before the first level. The key space stays fixed, so a
//! Redis beside kvtier holds the same bytes and neither evicts.
//!
//! **One iteration** (a worker runs them back to back, one request in
//! flight):
//! - each lookup asks for a random chain followed by `lookup_extra_blocks`
//!   fresh keys never stored (the prompt's new tokens), so a lookup returns
//!   a real prefix hit of at most `chain_blocks`;
//! - each read GETs a random block among those the iteration's lookups hit
//!   (any block of the working set if none hit) and checks its bytes;
//! - each write PUTs a random block of the working set again (same key,
//!   same bytes: a refresh, so every read stays checkable).
//!
//! **Measuring.** A level runs `warmup` and then `duration`; an operation or
//! iteration counts when it completes inside the measured window (so the
//! warm-up should be longer than one iteration at the highest level). Server
//! bandwidth is the difference of the target's byte counters read at the
//! window's edges.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use http::{HeaderName, HeaderValue};

use crate::keys;
use crate::payload::Payloads;
use crate::stats::{ratio, FirstError, LatencySummary, OpLatency, TierLatency};
use crate::tag::{BlockTag, TagHeaders};
use crate::target::{Target, TargetError};

/// Consecutive failed operations after which a worker stops (an
/// unreachable target must not spin the level at full speed on errors).
pub const WORKER_ERRORS_MAX: u32 = 10;
/// Throughput gain below which the next level no longer pays: 5 %.
pub const SATURATION_GAIN: f64 = 0.05;
/// Requests in flight while storing the working set.
pub const PRELOAD_CONCURRENCY: usize = 8;

/// Operations per iteration, `LOOKUPS:READS:WRITES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mix {
    /// Prefix lookups.
    pub lookups: u32,
    /// Block reads.
    pub reads: u32,
    /// Block writes.
    pub writes: u32,
}

impl std::str::FromStr for Mix {
    type Err = String;

    /// Parses `7:6:3`.
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<_> = s.split(':').map(|p| p.trim().parse::<u32>()).collect();
        match parts.as_slice() {
            [Ok(l), Ok(r), Ok(w)] if l + r + w > 0 => Ok(Mix { lookups: *l, reads: *r, writes: *w }),
            _ => Err(format!("bad mix {s:?}: expected LOOKUPS:READS:WRITES, e.g. 7:6:3, not all zero")),
        }
    }
}

/// How a sweep runs (the same for every target).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepConfig {
    /// Concurrency levels (workers), in order.
    pub concurrency: Vec<usize>,
    /// Warm-up seconds per level, not measured.
    pub warmup_s: f64,
    /// Measured seconds per level.
    pub duration_s: f64,
    /// Operations per iteration.
    pub mix: Mix,
    /// Blocks in the working set.
    pub working_set_blocks: usize,
    /// Blocks per prefix chain.
    pub chain_blocks: usize,
    /// Never-stored keys appended to each lookup.
    pub lookup_extra_blocks: usize,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Model of the geometry (for the report).
    pub model: String,
    /// Seed of keys, payloads and choices.
    pub seed: u64,
    /// p99 bound, in milliseconds, that every operation must meet at an
    /// operating point.
    pub sla_ms: f64,
    /// Tokens/s the capacity-planning line must serve.
    pub target_tokens_per_s: f64,
    /// Draw progress bars on stderr.
    #[serde(skip)]
    pub progress: bool,
}

/// Latencies of one level.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LevelLatency {
    /// Prefix lookups.
    pub lookup: LatencySummary,
    /// Block reads (hits and misses).
    pub read: LatencySummary,
    /// Block writes.
    pub write: LatencySummary,
    /// Whole iterations.
    pub iteration: LatencySummary,
}

/// Latency distributions of one level in log-spaced buckets
/// (`[upper_us, count]`, upper bounds powers of two), for charts.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct LevelHistograms {
    /// Prefix lookups.
    pub lookup: Vec<(u64, u64)>,
    /// Block reads.
    pub read: Vec<(u64, u64)>,
    /// Block writes.
    pub write: Vec<(u64, u64)>,
}

/// The server's bandwidth over the measured window.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bandwidth {
    /// Bytes received per second.
    pub in_bytes_per_s: f64,
    /// Bytes sent per second.
    pub out_bytes_per_s: f64,
    /// `in_bytes_per_s` over the link's bytes/s (None without a link figure).
    pub in_link_share: Option<f64>,
    /// `out_bytes_per_s` over the link's bytes/s.
    pub out_link_share: Option<f64>,
}

/// Little's law at one level: in a closed loop, concurrency L = throughput
/// X × mean iteration latency W.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LittlesLaw {
    /// Workers (L as set).
    pub concurrency: usize,
    /// X × W: iterations/s × mean iteration latency in s.
    pub predicted_concurrency: f64,
    /// predicted / set: near 1 when the measurement is consistent (workers
    /// were busy the whole window and nothing was lost).
    pub ratio: f64,
}

/// What one concurrency level measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LevelResult {
    /// Workers, each one request in flight.
    pub concurrency: usize,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// Iterations completed in the window.
    pub iterations: u64,
    /// iterations / elapsed_s.
    pub iterations_per_s: f64,
    /// (blocks_read + blocks_written) × block_tokens / elapsed_s.
    pub tokens_per_s: f64,
    /// Lookups completed.
    pub lookups: u64,
    /// Blocks read (hits).
    pub blocks_read: u64,
    /// Reads of a key that was not stored.
    pub read_misses: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// Keys asked for in lookups.
    pub lookup_blocks: u64,
    /// Leading keys found.
    pub lookup_hit_blocks: u64,
    /// lookup_hit_blocks / lookup_blocks (at most chain / (chain + extra)).
    pub prefix_hit_rate: f64,
    /// Failed operations during the level, warm-up included.
    pub errors: u64,
    /// Requests the server refused with 503 and `Retry-After` (overload)
    /// during the level, warm-up included; each was sent again after the
    /// delay, which counts in its latency.
    #[serde(default)]
    pub refusals: u64,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Blocks read back with bytes other than written (must be 0).
    pub wrong_bytes: u64,
    /// Percentiles per operation, µs.
    pub latency: LevelLatency,
    /// Read latency per serving tier (`x-kvtier-tier`; `redis` for Redis).
    pub read_latency_by_tier: BTreeMap<String, LatencySummary>,
    /// Distributions for charts.
    pub histograms: LevelHistograms,
    /// Server bandwidth (None when its counters could not be read).
    pub server: Option<Bandwidth>,
    /// Little's-law check.
    pub littles_law: LittlesLaw,
}

/// Where throughput stops growing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Saturation {
    /// Whether a level gained less than 5 % over the one before; if not, the
    /// sweep ended before saturating and this is its last level.
    pub reached: bool,
    /// The last level that still gained ≥ 5 %.
    pub concurrency: usize,
    /// Its tokens/s.
    pub tokens_per_s: f64,
    /// Gain of the next level over it (None at the last level).
    pub next_gain: Option<f64>,
}

/// The best level under the SLA.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OperatingPoint {
    /// Its concurrency.
    pub concurrency: usize,
    /// Its tokens/s.
    pub tokens_per_s: f64,
    /// Its worst p99 over lookup, read and write, ms.
    pub worst_p99_ms: f64,
}

/// Instances needed for a target throughput.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Capacity {
    /// Tokens/s to serve.
    pub target_tokens_per_s: f64,
    /// Tokens/s one instance gives at `basis`.
    pub per_instance_tokens_per_s: f64,
    /// `"operating point"` (under the SLA) or `"saturation point"` when no
    /// level met the SLA.
    pub basis: String,
    /// ceil(target / per instance).
    pub instances: u64,
}

/// Conclusions drawn from the levels.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Analysis {
    /// Saturation point.
    pub saturation: Option<Saturation>,
    /// Highest throughput with every p99 under the SLA (None if no level).
    pub operating_point: Option<OperatingPoint>,
    /// Capacity-planning line.
    pub capacity: Option<Capacity>,
}

/// Storing the working set before the first level.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Preload {
    /// Blocks stored.
    pub blocks: u64,
    /// Seconds it took.
    pub elapsed_s: f64,
}

/// One target's sweep.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TargetResult {
    /// URL.
    pub target: String,
    /// `kvtier` or `redis`.
    pub kind: String,
    /// `h2c`, `http/1.1` or `resp`.
    pub protocol: String,
    /// Connections (0: HTTP/1.1 pool, one per request in flight).
    pub connections: usize,
    /// Working-set preload.
    pub preload: Preload,
    /// Levels measured, in order.
    pub levels: Vec<LevelResult>,
    /// Saturation, operating point, capacity.
    pub analysis: Analysis,
    /// Why the sweep of this target stopped early, if it did.
    pub error: Option<String>,
}

/// The link bandwidth shares are computed against.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second (None: unknown).
    pub bytes_per_s: Option<f64>,
    /// Where the figure comes from: `--link-gbps`, `iperf3 loopback`, or
    /// why there is none.
    pub source: String,
}

/// Everything a sweep writes to `results.json`. Schema in docs/LOADGEN.md.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SweepResults {
    /// `"sweep"`.
    pub mode: String,
    /// Seconds since the Unix epoch at start.
    pub started_unix_s: u64,
    /// Settings.
    pub config: SweepConfig,
    /// Link bandwidth.
    pub link: Link,
    /// One entry per target, in the order given.
    pub targets: Vec<TargetResult>,
    /// Why the run failed, if it did.
    pub error: Option<String>,
}

impl SweepResults {
    /// Failed operations and wrong blocks over every target and level, and
    /// target-level errors.
    pub fn failures(&self) -> u64 {
        let ops: u64 = self.targets.iter().flat_map(|t| &t.levels).map(|l| l.errors + l.wrong_bytes).sum();
        ops + self.targets.iter().filter(|t| t.error.is_some()).count() as u64 + u64::from(self.error.is_some())
    }
}

/// The fixed key space and payloads.
pub struct Workload {
    chains: Vec<Vec<String>>,
    /// Each block's tag headers, by chain and block (`--kv-tags`); `None`:
    /// blocks are stored untagged.
    tags: Option<Vec<Vec<TagHeaders>>>,
    payloads: Payloads,
    cfg: SweepConfig,
}

impl Workload {
    /// Builds the chains of `cfg` (at least one chain of at least one block).
    pub fn new(cfg: &SweepConfig) -> Self {
        let chains = (0..Self::chain_count(cfg))
            .map(|c| {
                let mut chain: Vec<String> = Vec::with_capacity(cfg.chain_blocks.max(1));
                for tokens in Self::chain_tokens(cfg, c) {
                    let key = keys::block_key(chain.last().map(String::as_str).unwrap_or(""), &tokens);
                    chain.push(key);
                }
                chain
            })
            .collect();
        Workload { chains, tags: None, payloads: Payloads::new(cfg.block_bytes as usize, cfg.seed), cfg: cfg.clone() }
    }

    fn chain_count(cfg: &SweepConfig) -> usize {
        cfg.working_set_blocks.div_ceil(cfg.chain_blocks.max(1)).max(1)
    }

    /// The token ids of each block of chain `c`: seeded pseudo-random ids.
    fn chain_tokens(cfg: &SweepConfig, c: usize) -> Vec<Vec<u32>> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed ^ ((c as u64 + 1) << 20));
        (0..cfg.chain_blocks.max(1)).map(|_| (0..cfg.block_tokens).map(|_| rng.gen_range(0..100_000)).collect()).collect()
    }

    /// This workload with every block tagged (`--kv-tags`): each chain's
    /// engine hashes chained over its token ids ([`crate::tag`]), one engine
    /// block of `block_tokens` per kvtier block, the token ids sent too (up
    /// to [`crate::tag::TOKEN_IDS_MAX`]). The headers are made here, once,
    /// so that a tagged sweep measures the server's cost of the tag, not
    /// the loadgen's of formatting it.
    pub fn with_kv_tags(mut self) -> Self {
        let block_tokens = self.cfg.block_tokens as usize;
        let tags = (0..self.chains.len())
            .map(|c| {
                let tokens: Vec<u32> = Self::chain_tokens(&self.cfg, c).concat();
                let mut hashes = Vec::new();
                crate::tag::extend_hashes(&mut hashes, &tokens, block_tokens);
                (0..hashes.len()).map(|b| BlockTag::of_block(&hashes, &tokens, block_tokens, b).headers()).collect()
            })
            .collect();
        self.tags = Some(tags);
        self
    }

    /// The tag headers of block `b` of chain `c` (none when untagged).
    fn tag_headers(&self, c: usize, b: usize) -> &[(HeaderName, HeaderValue)] {
        self.tags.as_ref().map_or(&[], |t| &t[c][b])
    }

    /// Every key of the working set.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.chains.iter().flatten()
    }

    /// Blocks in the working set.
    pub fn blocks(&self) -> usize {
        self.chains.len() * self.cfg.chain_blocks.max(1)
    }
}

#[derive(Default)]
struct WorkerStats {
    lookup: OpLatency,
    read: OpLatency,
    write: OpLatency,
    iteration: OpLatency,
    by_tier: TierLatency,
    blocks_read: u64,
    read_misses: u64,
    lookup_blocks: u64,
    lookup_hit_blocks: u64,
    errors: u64,
    wrong_bytes: u64,
}

impl WorkerStats {
    fn merge(&mut self, o: &WorkerStats) {
        self.lookup.merge(&o.lookup);
        self.read.merge(&o.read);
        self.write.merge(&o.write);
        self.iteration.merge(&o.iteration);
        self.by_tier.merge(&o.by_tier);
        self.blocks_read += o.blocks_read;
        self.read_misses += o.read_misses;
        self.lookup_blocks += o.lookup_blocks;
        self.lookup_hit_blocks += o.lookup_hit_blocks;
        self.errors += o.errors;
        self.wrong_bytes += o.wrong_bytes;
    }
}

/// The measured window of a level.
#[derive(Clone, Copy)]
struct Window {
    start: Instant,
    end: Instant,
}

impl Window {
    fn contains(&self, t: Instant) -> bool {
        t >= self.start && t < self.end
    }
}

struct Level {
    target: Arc<Target>,
    workload: Arc<Workload>,
    window: Window,
    first_error: FirstError,
    stop: AtomicBool,
}

impl Level {
    fn fail(&self, e: &TargetError, st: &mut WorkerStats, streak: &mut u32) {
        st.errors += 1;
        *streak += 1;
        self.first_error.note(e.to_string());
    }

    fn fresh_key(parent: &str, rng: &mut Xoshiro256PlusPlus, block_tokens: u64) -> String {
        let tokens: Vec<u32> = (0..block_tokens).map(|_| rng.gen_range(0..100_000)).collect();
        keys::block_key(parent, &tokens)
    }

    async fn worker(self: Arc<Self>, seed: u64) -> WorkerStats {
        let (wl, cfg) = (&self.workload, &self.workload.cfg);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut st = WorkerStats::default();
        let mut streak = 0u32;
        let mut hit_blocks: Vec<(usize, usize)> = Vec::new();
        while Instant::now() < self.window.end && streak < WORKER_ERRORS_MAX && !self.stop.load(Ordering::Relaxed) {
            let iteration_start = Instant::now();
            hit_blocks.clear();
            for _ in 0..cfg.mix.lookups {
                let c = rng.gen_range(0..wl.chains.len());
                let mut query = wl.chains[c].clone();
                for _ in 0..cfg.lookup_extra_blocks {
                    let key = Self::fresh_key(query.last().expect("chains are not empty"), &mut rng, cfg.block_tokens);
                    query.push(key);
                }
                let t = Instant::now();
                match self.target.lookup(&query).await {
                    Ok(hits) => {
                        streak = 0;
                        let done = Instant::now();
                        if self.window.contains(done) {
                            st.lookup.record((done - t).as_micros() as u64);
                            st.lookup_blocks += query.len() as u64;
                            st.lookup_hit_blocks += hits as u64;
                        }
                        hit_blocks.extend((0..hits.min(wl.chains[c].len())).map(|b| (c, b)));
                    }
                    Err(e) => self.fail(&e, &mut st, &mut streak),
                }
            }
            for _ in 0..cfg.mix.reads {
                let (c, b) = if hit_blocks.is_empty() {
                    let c = rng.gen_range(0..wl.chains.len());
                    (c, rng.gen_range(0..wl.chains[c].len()))
                } else {
                    hit_blocks[rng.gen_range(0..hit_blocks.len())]
                };
                let key = &wl.chains[c][b];
                let t = Instant::now();
                match self.target.get(key).await {
                    Ok(found) => {
                        streak = 0;
                        let done = Instant::now();
                        let us = (done - t).as_micros() as u64;
                        let counted = self.window.contains(done);
                        if counted {
                            st.read.record(us);
                        }
                        match found {
                            Some(block) => {
                                if !wl.payloads.verify_body(key, &block.body, false) {
                                    st.wrong_bytes += 1;
                                }
                                if counted {
                                    st.blocks_read += 1;
                                    st.by_tier.record(&block.tier, us);
                                }
                            }
                            None if counted => st.read_misses += 1,
                            None => {}
                        }
                    }
                    Err(e) => self.fail(&e, &mut st, &mut streak),
                }
            }
            for _ in 0..cfg.mix.writes {
                let c = rng.gen_range(0..wl.chains.len());
                let b = rng.gen_range(0..wl.chains[c].len());
                let key = &wl.chains[c][b];
                let t = Instant::now();
                match self.target.put_tagged(key, wl.payloads.chunks(key), wl.tag_headers(c, b)).await {
                    Ok(()) => {
                        streak = 0;
                        let done = Instant::now();
                        if self.window.contains(done) {
                            st.write.record((done - t).as_micros() as u64);
                        }
                    }
                    Err(e) => self.fail(&e, &mut st, &mut streak),
                }
            }
            let done = Instant::now();
            // Counted like every operation, by completion: an iteration
            // begun in the warm-up and ended in the window counts, one
            // ended after the window does not (requiring both ends inside
            // would drop every iteration longer than the window).
            if self.window.contains(done) {
                st.iteration.record((done - iteration_start).as_micros() as u64);
            }
        }
        st
    }
}

/// A progress bar of `len` steps labelled `prefix` on stderr (hidden when
/// not `enabled`; indicatif also hides it when stderr is not a terminal).
pub(crate) fn progress_bar(enabled: bool, len: u64, prefix: String) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>28} [{bar:30}] {elapsed_precise} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    bar
}

/// Stores every block of the working set (PRELOAD_CONCURRENCY in flight).
///
/// # Errors
/// The first failed PUT: a sweep on a partly stored working set would
/// measure misses, not the store.
pub async fn preload(target: Arc<Target>, workload: Arc<Workload>, progress: bool) -> Result<Preload, TargetError> {
    // Every block by (chain, block), in key order.
    let keys: Arc<Vec<(usize, usize)>> =
        Arc::new(workload.chains.iter().enumerate().flat_map(|(c, chain)| (0..chain.len()).map(move |b| (c, b))).collect());
    let bar = progress_bar(progress, keys.len() as u64, format!("{} preload", target.kind()));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..PRELOAD_CONCURRENCY)
        .map(|_| {
            let (target, workload, keys, next, bar) = (target.clone(), workload.clone(), keys.clone(), next.clone(), bar.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(c, b)) = keys.get(i) else { return Ok(()) };
                    let key = &workload.chains[c][b];
                    target.put_tagged(key, workload.payloads.chunks(key), workload.tag_headers(c, b)).await?;
                    bar.inc(1);
                }
            })
        })
        .collect();
    let mut result = Ok(());
    for t in tasks {
        let r = t.await.expect("preload task");
        if result.is_ok() {
            result = r;
        }
    }
    bar.finish_and_clear();
    result.map(|()| Preload { blocks: keys.len() as u64, elapsed_s: started.elapsed().as_secs_f64() })
}

/// Runs one level of `concurrency` workers: warm-up, then the measured
/// window. `link_bytes_per_s` turns bandwidth into link shares.
pub async fn run_level(
    target: Arc<Target>,
    workload: Arc<Workload>,
    concurrency: usize,
    level_index: usize,
    link_bytes_per_s: Option<f64>,
) -> LevelResult {
    let cfg = workload.cfg.clone();
    let start = Instant::now() + Duration::from_secs_f64(cfg.warmup_s.max(0.0));
    let window = Window { start, end: start + Duration::from_secs_f64(cfg.duration_s.max(0.001)) };
    let refusals_before = target.refusals();
    let level =
        Arc::new(Level { target: target.clone(), workload, window, first_error: FirstError::default(), stop: AtomicBool::new(false) });
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|w| tokio::spawn(level.clone().worker(cfg.seed ^ ((level_index as u64) << 32) ^ ((w as u64 + 1) * 0x9E37_79B9))))
        .collect();
    // Server byte counters at the window's edges, and the progress bar.
    let total_ms = (window.end - Instant::now()).as_millis() as u64;
    let bar = progress_bar(cfg.progress, total_ms, format!("{} c={concurrency}", target.kind()));
    let counters = {
        let (target, bar) = (target.clone(), bar.clone());
        tokio::spawn(async move {
            let began = Instant::now();
            let tick = |msg: &str| {
                bar.set_position(began.elapsed().as_millis() as u64);
                bar.set_message(msg.to_string());
            };
            while Instant::now() < window.start {
                tick("warm-up");
                tokio::time::sleep(Duration::from_millis(100).min(window.start - Instant::now())).await;
            }
            let before = target.server_bytes().await.ok();
            while Instant::now() < window.end {
                tick("measuring");
                tokio::time::sleep(Duration::from_millis(100).min(window.end.saturating_duration_since(Instant::now()))).await;
            }
            let after = target.server_bytes().await.ok();
            bar.finish_and_clear();
            before.zip(after).map(|((i0, o0), (i1, o1))| (i1.saturating_sub(i0), o1.saturating_sub(o0)))
        })
    };
    let mut total = WorkerStats::default();
    for w in workers {
        total.merge(&w.await.expect("sweep worker"));
    }
    // Workers that all gave up on errors end the level early.
    level.stop.store(true, Ordering::Relaxed);
    if Instant::now() < window.end {
        counters.abort();
    }
    let bytes = counters.await.ok().flatten();
    bar.finish_and_clear();
    let elapsed_s = (window.end - window.start).as_secs_f64();
    let iterations = total.iteration.count();
    let iterations_per_s = iterations as f64 / elapsed_s;
    let blocks_written = total.write.count();
    let mean_iteration_s = total.iteration.summary().mean_us / 1e6;
    let predicted = iterations_per_s * mean_iteration_s;
    let share = |b: f64| link_bytes_per_s.filter(|l| *l > 0.0).map(|l| b / l);
    LevelResult {
        concurrency,
        elapsed_s,
        iterations,
        iterations_per_s,
        tokens_per_s: ((total.blocks_read + blocks_written) * cfg.block_tokens) as f64 / elapsed_s,
        lookups: total.lookup.count(),
        blocks_read: total.blocks_read,
        read_misses: total.read_misses,
        blocks_written,
        lookup_blocks: total.lookup_blocks,
        lookup_hit_blocks: total.lookup_hit_blocks,
        prefix_hit_rate: ratio(total.lookup_hit_blocks, total.lookup_blocks),
        errors: total.errors,
        refusals: target.refusals().saturating_sub(refusals_before),
        first_error: level.first_error.get(),
        wrong_bytes: total.wrong_bytes,
        latency: LevelLatency {
            lookup: total.lookup.summary(),
            read: total.read.summary(),
            write: total.write.summary(),
            iteration: total.iteration.summary(),
        },
        read_latency_by_tier: total.by_tier.summaries(),
        histograms: LevelHistograms { lookup: total.lookup.buckets(), read: total.read.buckets(), write: total.write.buckets() },
        server: bytes.map(|(i, o)| {
            let (i, o) = (i as f64 / elapsed_s, o as f64 / elapsed_s);
            Bandwidth { in_bytes_per_s: i, out_bytes_per_s: o, in_link_share: share(i), out_link_share: share(o) }
        }),
        littles_law: LittlesLaw {
            concurrency,
            predicted_concurrency: predicted,
            ratio: if concurrency > 0 { predicted / concurrency as f64 } else { 0.0 },
        },
    }
}

/// Saturation point, operating point under `sla_ms` and the capacity line
/// for `target_tokens_per_s`, from the levels in sweep order.
pub fn analyze(levels: &[LevelResult], sla_ms: f64, target_tokens_per_s: f64) -> Analysis {
    let usable: Vec<&LevelResult> = levels.iter().filter(|l| l.iterations > 0).collect();
    let saturation = usable.first().map(|first| {
        let mut at = *first;
        for next in &usable[1..] {
            let gain = if at.tokens_per_s > 0.0 { next.tokens_per_s / at.tokens_per_s - 1.0 } else { f64::INFINITY };
            if gain < SATURATION_GAIN {
                return Saturation { reached: true, concurrency: at.concurrency, tokens_per_s: at.tokens_per_s, next_gain: Some(gain) };
            }
            at = next;
        }
        Saturation { reached: false, concurrency: at.concurrency, tokens_per_s: at.tokens_per_s, next_gain: None }
    });
    let worst_p99_ms = |l: &LevelResult| {
        [&l.latency.lookup, &l.latency.read, &l.latency.write].iter().filter(|s| s.count > 0).map(|s| s.p99_us).max().unwrap_or(0) as f64
            / 1e3
    };
    let operating_point = usable
        .iter()
        .filter(|l| l.errors == 0 && worst_p99_ms(l) <= sla_ms)
        .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s))
        .map(|l| OperatingPoint { concurrency: l.concurrency, tokens_per_s: l.tokens_per_s, worst_p99_ms: worst_p99_ms(l) });
    let basis = match (&operating_point, &saturation) {
        (Some(op), _) => Some(("operating point", op.tokens_per_s)),
        (None, Some(s)) => Some(("saturation point", s.tokens_per_s)),
        _ => None,
    };
    let capacity = basis.filter(|(_, tps)| *tps > 0.0 && target_tokens_per_s > 0.0).map(|(basis, tps)| Capacity {
        target_tokens_per_s,
        per_instance_tokens_per_s: tps,
        basis: basis.into(),
        instances: (target_tokens_per_s / tps).ceil() as u64,
    });
    Analysis { saturation, operating_point, capacity }
}

/// Measures loopback bandwidth with iperf3 for `seconds` (a one-off
/// `iperf3 -s -1` on a free port, then `iperf3 -c 127.0.0.1 -J`), in bytes/s.
///
/// # Errors
/// iperf3 missing, failing, or printing no `sum_received`.
pub fn iperf3_loopback(seconds: u32) -> Result<f64, String> {
    use std::process::{Command, Stdio};
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run iperf3 (install it, or pass --link-gbps): {e}"))?;
    let mut last = String::new();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(100));
        let out = Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-p", &port.to_string(), "-t", &seconds.max(1).to_string(), "-J"])
            .output()
            .map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            let _ = server.wait();
            return Ok(bps / 8.0);
        }
        last = v["error"].as_str().unwrap_or("no result").to_string();
    }
    let _ = server.kill();
    let _ = server.wait();
    Err(format!("iperf3 loopback measurement failed: {last}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(concurrency: usize, tokens_per_s: f64, p99_ms: u64, errors: u64) -> LevelResult {
        let lat =
            LatencySummary { count: 10, p50_us: 1000, p95_us: p99_ms * 900, p99_us: p99_ms * 1000, max_us: p99_ms * 1000, mean_us: 1500.0 };
        LevelResult {
            concurrency,
            elapsed_s: 1.0,
            iterations: 10,
            iterations_per_s: 10.0,
            tokens_per_s,
            lookups: 70,
            blocks_read: 60,
            read_misses: 0,
            blocks_written: 30,
            lookup_blocks: 700,
            lookup_hit_blocks: 560,
            prefix_hit_rate: 0.8,
            errors,
            refusals: 0,
            first_error: None,
            wrong_bytes: 0,
            latency: LevelLatency { lookup: lat.clone(), read: lat.clone(), write: lat.clone(), iteration: lat },
            read_latency_by_tier: BTreeMap::new(),
            histograms: LevelHistograms::default(),
            server: None,
            littles_law: LittlesLaw { concurrency, predicted_concurrency: concurrency as f64, ratio: 1.0 },
        }
    }

    #[test]
    fn mix_parses_and_refuses_nonsense() {
        assert_eq!("7:6:3".parse::<Mix>().unwrap(), Mix { lookups: 7, reads: 6, writes: 3 });
        for bad in ["7:6", "0:0:0", "a:b:c", "1:2:3:4", ""] {
            assert!(bad.parse::<Mix>().is_err(), "{bad}");
        }
    }

    #[test]
    fn analysis_finds_saturation_operating_point_and_capacity() {
        // 100 → 190 (+90 %) → 200 (+5.3 %) → 205 (+2.5 %): saturated at c=4.
        let levels = vec![level(1, 100.0, 5, 0), level(2, 190.0, 20, 0), level(4, 200.0, 80, 0), level(8, 205.0, 300, 0)];
        let a = analyze(&levels, 100.0, 1000.0);
        let s = a.saturation.unwrap();
        assert!(s.reached);
        assert_eq!(s.concurrency, 4);
        assert!((s.next_gain.unwrap() - 0.025).abs() < 1e-9);
        let op = a.operating_point.unwrap();
        assert_eq!((op.concurrency, op.worst_p99_ms), (4, 80.0));
        let cap = a.capacity.unwrap();
        assert_eq!((cap.instances, cap.basis.as_str()), (5, "operating point"));

        // No level under the SLA (or clean): capacity falls back to the
        // saturation point; a sweep that keeps gaining is not saturated.
        let levels = vec![level(1, 100.0, 500, 0), level(2, 300.0, 500, 0), level(4, 300.0, 20, 3)];
        let a = analyze(&levels, 100.0, 1000.0);
        assert!(a.operating_point.is_none());
        assert_eq!(a.saturation.as_ref().unwrap().concurrency, 2);
        assert_eq!(a.capacity.unwrap().basis, "saturation point");
        let a = analyze(&levels[..2], 1000.0, 0.0);
        assert!(!a.saturation.unwrap().reached);
        assert!(a.capacity.is_none(), "no capacity line without a target throughput");
        assert!(analyze(&[], 100.0, 1.0).saturation.is_none());
    }

    #[test]
    fn workload_chains_are_deterministic_and_sized() {
        let cfg = SweepConfig {
            concurrency: vec![1],
            warmup_s: 0.0,
            duration_s: 1.0,
            mix: Mix { lookups: 7, reads: 6, writes: 3 },
            working_set_blocks: 20,
            chain_blocks: 8,
            lookup_extra_blocks: 2,
            block_bytes: 4096,
            block_tokens: 128,
            model: "custom".into(),
            seed: 1,
            sla_ms: 100.0,
            target_tokens_per_s: 0.0,
            progress: false,
        };
        let (a, b) = (Workload::new(&cfg), Workload::new(&cfg));
        assert_eq!(a.blocks(), 24, "rounded up to whole chains");
        assert!(a.keys().eq(b.keys()));
        let distinct: std::collections::HashSet<_> = a.keys().collect();
        assert_eq!(distinct.len(), 24);
        assert_ne!(a.chains[0], Workload::new(&SweepConfig { seed: 2, ..cfg }).chains[0]);
    }
}
