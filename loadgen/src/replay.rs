//! `kvtier-loadgen replay`: real conversations against a kvtier server, the
//! way an inference engine with a KV-cache connector would use it (as
//! MLPerf Storage's KV-cache benchmark does).
//!
//! Each user takes the next conversation from a seeded shuffle of the
//! dataset. Per turn, the context is every earlier message plus the new user
//! message, tokenized with cl100k_base; its full 128-token blocks get
//! chained keys ([`crate::keys`]). The user looks the chain up, GETs the
//! prefix hits (prefill skipped for them), PUTs the blocks that missed
//! (prefill computed them), then appends the reply and PUTs the blocks the
//! reply completed (decode wrote them). With `--generation-mode fast` or
//! `realistic` the user first waits 2 or 30 ms per reply token (decode
//! time), as MLPerf Storage's KV-cache benchmark does.
//!
//! **QoS classes.** User `u` belongs to class `u mod 3`: interactive,
//! responsive, batch, with p95 SLAs of 50, 100 and 1,000 ms (MLPerf Storage
//! KV-cache benchmark) on a turn's storage latency: the lookup, the GETs
//! of the prefix hits and the PUTs of the prompt's missed blocks, i.e. the
//! storage work before the first token.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use kvtier_engine::trace::{TraceOp, TraceTier};

use self::trace::{trace_tier, ClientTrace};
use crate::keys;
use crate::oracle::PolicyOracle;
use crate::payload::Payloads;
use crate::sharegpt::Conversation;
use crate::stats::{ratio, FirstError, LatencySummary, OpLatency, TierLatency};
use crate::target::{Target, TargetError};

mod trace;

/// Decode-time simulation: how long a user waits per generated (reply)
/// token before writing the blocks the reply completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum GenerationMode {
    /// No wait: storage as fast as it goes.
    None,
    /// 2 ms per token.
    Fast,
    /// 30 ms per token (a loaded GPU's decode rate).
    Realistic,
}

impl GenerationMode {
    /// `none`, `fast` or `realistic`.
    pub fn name(self) -> &'static str {
        match self {
            GenerationMode::None => "none",
            GenerationMode::Fast => "fast",
            GenerationMode::Realistic => "realistic",
        }
    }

    /// Milliseconds per generated token: 0, 2 or 30 (MLPerf Storage's
    /// KV-cache benchmark generation modes).
    pub fn ms_per_token(self) -> u64 {
        match self {
            GenerationMode::None => 0,
            GenerationMode::Fast => 2,
            GenerationMode::Realistic => 30,
        }
    }
}

/// A user's quality-of-service class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QosClass {
    /// Chat: p95 ≤ 50 ms.
    Interactive,
    /// Assistants, agents: p95 ≤ 100 ms.
    Responsive,
    /// Offline: p95 ≤ 1,000 ms.
    Batch,
}

impl QosClass {
    /// The classes, in the order users are dealt to them.
    pub const ALL: [QosClass; 3] = [QosClass::Interactive, QosClass::Responsive, QosClass::Batch];

    /// The class of user `u`: `ALL[u mod 3]`.
    pub fn of_user(u: usize) -> Self {
        Self::ALL[u % Self::ALL.len()]
    }

    /// p95 SLA on a turn's storage latency in ms (MLPerf Storage KV-cache
    /// benchmark): 50, 100, 1,000.
    pub fn sla_p95_ms(self) -> u64 {
        match self {
            QosClass::Interactive => 50,
            QosClass::Responsive => 100,
            QosClass::Batch => 1000,
        }
    }

    /// `interactive`, `responsive` or `batch`.
    pub fn name(self) -> &'static str {
        match self {
            QosClass::Interactive => "interactive",
            QosClass::Responsive => "responsive",
            QosClass::Batch => "batch",
        }
    }
}

/// SLA compliance of one QoS class.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QosResult {
    /// The class.
    pub class: QosClass,
    /// Users in it.
    pub users: usize,
    /// Its p95 SLA, ms.
    pub sla_p95_ms: u64,
    /// Turn storage latency (lookup + hit GETs + prompt PUTs), µs.
    pub turn_latency: LatencySummary,
    /// Fraction of turns within the SLA.
    pub within_sla: f64,
    /// Whether the p95 met the SLA.
    pub met: bool,
}

/// One bucket of the run's timeline.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct TimelinePoint {
    /// Bucket start, seconds since the run began.
    pub t_s: f64,
    /// Tokens in the full blocks looked up.
    pub tokens_looked_up: u64,
    /// Tokens in their prefix hits.
    pub tokens_hit: u64,
    /// tokens_hit / tokens_looked_up (0 without lookups).
    pub prefix_hit_rate: f64,
    /// Blocks read.
    pub blocks_read: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// (read + written) × block_tokens / bucket seconds.
    pub tokens_per_s: f64,
    /// Failed requests.
    pub errors: u64,
}

/// Width of a timeline bucket: 1 s for runs up to 2 minutes, then wider so
/// a run has at most 120 points.
pub fn timeline_bucket_s(duration: Duration) -> f64 {
    (duration.as_secs_f64() / 120.0).ceil().max(1.0)
}

/// Latency distributions for charts (`[upper_us, count]`, powers of two).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ReplayHistograms {
    /// Lookups.
    pub lookup: Vec<(u64, u64)>,
    /// Block GETs.
    pub get: Vec<(u64, u64)>,
    /// Block PUTs.
    pub put: Vec<(u64, u64)>,
    /// Block GETs that found the block, per serving tier.
    pub get_by_tier: BTreeMap<String, Vec<(u64, u64)>>,
}

/// Consecutive failed requests after which a user gives up.
const USER_ERRORS_MAX: u32 = 10;

/// How a replay runs.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Concurrent users (each one conversation at a time).
    pub users: usize,
    /// Stop after this long.
    pub duration: Duration,
    /// Seed of the conversation order and of the payload bytes.
    pub seed: u64,
    /// Stop after this many passes over the dataset (None: only the
    /// duration limits the run).
    pub passes: Option<usize>,
    /// A conversation stops once its context exceeds this many tokens.
    pub max_context_tokens: usize,
    /// Compare every byte of every block read (otherwise the length and the
    /// key stamp).
    pub verify_full: bool,
    /// Decode-time simulation.
    pub generation: GenerationMode,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// Run the policy oracle beside the server (an empty kvtier store).
    pub oracle: Option<OracleConfig>,
    /// Write every operation of the run to this trace file (docs/TRACE.md),
    /// as the client saw it: for sizing with `kvtier-loadgen size`.
    pub trace_out: Option<PathBuf>,
}

/// The server's placement settings, for the policy oracle.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OracleConfig {
    /// Shards.
    pub shards: usize,
    /// RAM slots per shard.
    pub ram_blocks_per_shard: usize,
    /// GPU slots per shard (0: no GPU tier).
    #[serde(default)]
    pub gpu_blocks_per_shard: usize,
    /// `--write-policy back`.
    pub write_back: bool,
    /// `--promote on`.
    pub promote: bool,
    /// The tenant the run's token names (`--tenants`), whose key scope and
    /// limits the oracle takes; `None` without tenants.
    #[serde(default)]
    pub tenant: Option<String>,
    /// That tenant's RAM limit in blocks over the whole store (`None`:
    /// none).
    #[serde(default)]
    pub ram_limit_blocks: Option<u64>,
    /// Its GPU limit in blocks (`None`: none).
    #[serde(default)]
    pub gpu_limit_blocks: Option<u64>,
}

/// The oracle's predictions beside what the server did.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct OracleResults {
    /// Settings simulated.
    pub config: Option<OracleConfig>,
    /// Predicted prefix hit rate (tokens).
    pub predicted_hit_rate: f64,
    /// Measured prefix hit rate (tokens), as `prefix_hit_rate`.
    pub measured_hit_rate: f64,
    /// Lookups compared.
    pub lookups_checked: u64,
    /// Lookups whose prefix hits differed from the prediction.
    pub lookup_mismatches: u64,
    /// GETs compared.
    pub gets_checked: u64,
    /// GETs served from another tier than predicted, or missing when
    /// predicted present (or the reverse).
    pub get_mismatches: u64,
    /// GETs per predicted tier (`miss` for none).
    pub predicted_gets_by_tier: BTreeMap<String, u64>,
    /// GETs per serving tier (`miss` for 404).
    pub measured_gets_by_tier: BTreeMap<String, u64>,
    /// The first disagreement, for the report.
    pub first_mismatch: Option<String>,
}

impl OracleResults {
    fn mismatch(&mut self, what: String) {
        if self.first_mismatch.is_none() {
            self.first_mismatch = Some(what);
        }
    }
}

impl OracleConfig {
    /// Reads the placement settings of an empty kvtier server from
    /// `/v1/stats` (for a `unix://` target, at its `?http=` address). Run
    /// as a tenant (its token), the tenant's key scope and RAM and GPU
    /// limits come with them (the oracle's model of tenants, `oracle.rs`).
    ///
    /// # Errors
    /// Not a kvtier target; the stats cannot be read (a `unix://` target
    /// without `?http=`); the store (or, run as a tenant, that tenant)
    /// already holds blocks (the oracle starts from an empty store); other
    /// tenants hold memory-tier blocks and this tenant's reservation is not
    /// its limit (they could then take its room, which it cannot model).
    pub async fn from_server(target: &Target) -> Result<OracleConfig, String> {
        if matches!(target, Target::Redis(_)) {
            return Err("--oracle needs a kvtier target".into());
        }
        let v = target.stats().await.map_err(|e| format!("cannot read the server's stats for --oracle: {e}"))?;
        let shards = v["shards"].as_u64().ok_or("no shard count in /v1/stats")? as usize;
        let block_bytes = v["geometry"]["block_bytes"].as_u64().unwrap_or(1).max(1);
        let tenant = v["tenant"].as_str().map(str::to_string);
        let me = tenant.as_ref().and_then(|t| v["tenants"].as_array()?.iter().find(|o| o["name"] == t.as_str()).cloned());
        let tiers_of = |o: &serde_json::Value, t: &str| o["tiers"][t].clone();
        let held = match &me {
            Some(o) => ["gpu", "ram", "nvme"].iter().filter_map(|t| tiers_of(o, t)["blocks"].as_u64()).sum::<u64>(),
            None => v["tiers"].as_array().map_or(0, |ts| ts.iter().filter_map(|t| t["used_blocks"].as_u64()).sum::<u64>()),
        };
        if held > 0 {
            return Err(format!("--oracle needs an empty store (it simulates from empty), but the server holds {held} blocks"));
        }
        let (mut ram_limit_blocks, mut gpu_limit_blocks) = (None, None);
        if let (Some(t), Some(o)) = (&tenant, &me) {
            for (tier, slot) in [("ram", &mut ram_limit_blocks), ("gpu", &mut gpu_limit_blocks)] {
                let q = tiers_of(o, tier);
                let (reserved, limit) = (q["reserved_bytes"].as_u64().unwrap_or(0), q["limit_bytes"].as_u64().unwrap_or(0));
                let others: u64 = v["tenants"].as_array().map_or(0, |all| {
                    all.iter().filter(|x| x["name"] != t.as_str()).filter_map(|x| x["tiers"][tier]["blocks"].as_u64()).sum()
                });
                if others > 0 && reserved != limit {
                    return Err(format!(
                        "--oracle as tenant {t:?}: other tenants hold {others} blocks in the {tier} tier and {t:?} reserves {reserved} bytes there with a limit of {limit}; the oracle models a tenant alone, or one whose reservation is its limit"
                    ));
                }
                *slot = Some(limit / block_bytes);
            }
        }
        let capacity = |tier: &str| {
            v["per_shard"][0]["tiers"]
                .as_array()
                .and_then(|ts| ts.iter().find(|t| t["tier"] == tier))
                .and_then(|t| t["capacity_blocks"].as_u64())
                .unwrap_or(0) as usize
        };
        Ok(OracleConfig {
            shards,
            ram_blocks_per_shard: capacity("ram"),
            gpu_blocks_per_shard: capacity("gpu"),
            write_back: v["write_policy"] == "back",
            promote: v["promote"] != false,
            tenant,
            ram_limit_blocks,
            gpu_limit_blocks,
        })
    }
}

/// The oracle and its tally, applied in completion order.
struct OracleState {
    oracle: PolicyOracle,
    results: OracleResults,
    tokens_looked_up: u64,
    tokens_predicted: u64,
}

/// What one replay measured. Schema in docs/LOADGEN.md.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ReplayResults {
    /// `"replay"`.
    pub mode: String,
    /// Server URL.
    pub target: String,
    /// `"kvtier"` or `"redis"`.
    pub target_kind: String,
    /// `"h2c"`, `"http/1.1"`, `"unix"` or `"resp"`.
    pub protocol: String,
    /// `"http"`, `"unix"` (kvtier's local socket) or `"tcp"` (Redis).
    #[serde(default)]
    pub transport: String,
    /// Decode-time simulation.
    pub generation_mode: GenerationMode,
    /// Dataset file.
    pub dataset_path: PathBuf,
    /// Conversations in the dataset (with at least one user turn).
    pub dataset_conversations: usize,
    /// Concurrent users.
    pub users: usize,
    /// Seed.
    pub seed: u64,
    /// Model of the server's geometry.
    pub model: String,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Requested duration in seconds.
    pub duration_s: f64,
    /// Wall time of the run in seconds.
    pub elapsed_s: f64,
    /// Conversations started.
    pub conversations: u64,
    /// Turns completed.
    pub turns: u64,
    /// Lookups sent.
    pub lookups: u64,
    /// Block GETs sent.
    pub gets: u64,
    /// Block PUTs sent.
    pub puts: u64,
    /// All requests.
    pub requests: u64,
    /// Failed requests (transport errors, unexpected statuses).
    pub errors: u64,
    /// Requests the server refused with 503 and `Retry-After` (overload);
    /// each was sent again after the delay, which counts in its latency.
    #[serde(default)]
    pub refusals: u64,
    /// The first error seen, for the report.
    pub first_error: Option<String>,
    /// GETs of a key the lookup had just reported stored that answered 404
    /// (evicted in between).
    pub get_misses: u64,
    /// Blocks read back with bytes other than those written (must be 0).
    pub wrong_bytes: u64,
    /// Tokens in the full blocks looked up.
    pub tokens_looked_up: u64,
    /// Tokens in the prefix hits.
    pub tokens_hit: u64,
    /// tokens_hit / tokens_looked_up.
    pub prefix_hit_rate: f64,
    /// Blocks read.
    pub blocks_read: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// (blocks read + written) × block_tokens / elapsed_s.
    pub tokens_per_s: f64,
    /// (blocks read + written) × block_tokens / time spent in block GETs
    /// and PUTs summed over users (MLPerf's storage throughput).
    pub storage_tokens_per_s: f64,
    /// Block bytes read per second of wall time.
    pub read_bytes_per_s: f64,
    /// Block bytes written per second of wall time.
    pub write_bytes_per_s: f64,
    /// Lookup latency.
    pub lookup_latency: LatencySummary,
    /// Block GET latency.
    pub get_latency: LatencySummary,
    /// Block PUT latency.
    pub put_latency: LatencySummary,
    /// Latency of GETs that found the block, per serving tier
    /// (`x-kvtier-tier`; `redis` for Redis).
    pub get_latency_by_tier: BTreeMap<String, LatencySummary>,
    /// SLA compliance per QoS class.
    pub qos: Vec<QosResult>,
    /// Seconds per timeline bucket.
    pub timeline_bucket_s: f64,
    /// Hit rate and throughput over time.
    pub timeline: Vec<TimelinePoint>,
    /// Distributions for charts.
    pub histograms: ReplayHistograms,
    /// Why the run stopped early (every user gave up), if it did.
    pub error: Option<String>,
    /// The policy oracle's predictions (with `--oracle`).
    pub oracle: Option<OracleResults>,
}

#[derive(Default, Clone)]
struct UserStats {
    lookup: OpLatency,
    get: OpLatency,
    put: OpLatency,
    by_tier: TierLatency,
    turn: BTreeMap<QosClass, OpLatency>,
    turns_within_sla: BTreeMap<QosClass, u64>,
    timeline: Vec<TimelinePoint>,
    gave_up: bool,
    conversations: u64,
    turns: u64,
    errors: u64,
    get_misses: u64,
    wrong_bytes: u64,
}

impl UserStats {
    fn merge(&mut self, o: &UserStats) {
        self.lookup.merge(&o.lookup);
        self.get.merge(&o.get);
        self.put.merge(&o.put);
        self.by_tier.merge(&o.by_tier);
        for (class, l) in &o.turn {
            self.turn.entry(*class).or_default().merge(l);
        }
        for (class, n) in &o.turns_within_sla {
            *self.turns_within_sla.entry(*class).or_default() += n;
        }
        if self.timeline.len() < o.timeline.len() {
            self.timeline.resize(o.timeline.len(), TimelinePoint::default());
        }
        for (t, p) in self.timeline.iter_mut().zip(&o.timeline) {
            t.tokens_looked_up += p.tokens_looked_up;
            t.tokens_hit += p.tokens_hit;
            t.blocks_read += p.blocks_read;
            t.blocks_written += p.blocks_written;
            t.errors += p.errors;
        }
        self.conversations += o.conversations;
        self.turns += o.turns;
        self.errors += o.errors;
        self.get_misses += o.get_misses;
        self.wrong_bytes += o.wrong_bytes;
    }
}

/// Everything the users share.
struct Shared {
    target: Arc<Target>,
    dataset: Arc<Vec<Conversation>>,
    order: Vec<usize>,
    next: AtomicUsize,
    cfg: ReplayConfig,
    block_tokens: usize,
    payloads: Payloads,
    deadline: Instant,
    stop: AtomicBool,
    first_error: FirstError,
    /// Turns completed so far, for the progress bar.
    turns_done: AtomicU64,
    started: Instant,
    bucket_s: f64,
    oracle: Option<Mutex<OracleState>>,
    trace: Option<Mutex<ClientTrace>>,
}

/// Token ids of each turn: (user message, reply).
pub(crate) fn tokenize(conv: &Conversation) -> Vec<(Vec<u32>, Vec<u32>)> {
    let bpe = tiktoken_rs::cl100k_base_singleton();
    conv.turns().into_iter().map(|(user, reply)| (bpe.encode_ordinary(user), bpe.encode_ordinary(reply))).collect()
}

impl Shared {
    fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }

    /// The timeline bucket of now, grown on demand.
    fn bucket<'a>(&self, stats: &'a mut UserStats) -> &'a mut TimelinePoint {
        let i = (self.started.elapsed().as_secs_f64() / self.bucket_s) as usize;
        if stats.timeline.len() <= i {
            stats.timeline.resize(i + 1, TimelinePoint::default());
        }
        &mut stats.timeline[i]
    }

    fn trace<'a>(&self, op: TraceOp, keys: impl IntoIterator<Item = (&'a str, TraceTier)>) {
        if let Some(t) = &self.trace {
            t.lock().expect("trace lock").record(op, keys);
        }
    }

    fn note_error(&self, e: &TargetError, stats: &mut UserStats, streak: &mut u32) {
        stats.errors += 1;
        self.bucket(stats).errors += 1;
        *streak += 1;
        if self.first_error.note(e.to_string()) {
            eprintln!("kvtier-loadgen: {e}");
        }
    }

    /// PUTs `keys`, recording each.
    async fn put_all(&self, keys: &[String], stats: &mut UserStats, streak: &mut u32) {
        for key in keys {
            if self.done() {
                return;
            }
            let t = Instant::now();
            match self.target.put(key, self.payloads.chunks(key)).await {
                Ok(()) => {
                    if let Some(o) = &self.oracle {
                        o.lock().expect("oracle lock").oracle.put(key);
                    }
                    self.trace(TraceOp::Put, [(key.as_str(), TraceTier::None)]);
                    stats.put.record(t.elapsed().as_micros() as u64);
                    self.bucket(stats).blocks_written += 1;
                    *streak = 0;
                }
                Err(e) => self.note_error(&e, stats, streak),
            }
        }
    }

    async fn user(self: Arc<Self>, user: usize) -> UserStats {
        let class = QosClass::of_user(user);
        let mut stats = UserStats::default();
        let mut streak = 0u32;
        let n = self.order.len();
        'conversations: while !self.done() && streak < USER_ERRORS_MAX {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            if self.cfg.passes.is_some_and(|p| c / n >= p) {
                break;
            }
            let conv_index = self.order[c % n];
            let dataset = self.dataset.clone();
            let turns = tokio::task::spawn_blocking(move || tokenize(&dataset[conv_index])).await.expect("tokenizer task");
            stats.conversations += 1;
            let (mut context, mut chain): (Vec<u32>, Vec<String>) = (Vec::new(), Vec::new());
            for (user_tokens, reply_tokens) in turns {
                if self.done() || streak >= USER_ERRORS_MAX {
                    break 'conversations;
                }
                context.extend_from_slice(&user_tokens);
                if context.len() > self.cfg.max_context_tokens {
                    break;
                }
                keys::extend_chain(&mut chain, &context, self.block_tokens);
                let prompt_blocks = chain.len();
                if prompt_blocks > 0 {
                    let t = Instant::now();
                    let hits = match self.target.lookup(&chain).await {
                        Ok(h) => {
                            if let Some(o) = &self.oracle {
                                let mut o = o.lock().expect("oracle lock");
                                let predicted = o.oracle.lookup(&chain);
                                o.results.lookups_checked += 1;
                                o.tokens_looked_up += (prompt_blocks * self.block_tokens) as u64;
                                o.tokens_predicted += (predicted.min(prompt_blocks) * self.block_tokens) as u64;
                                if predicted != h {
                                    o.results.lookup_mismatches += 1;
                                    o.results.mismatch(format!("lookup of {} keys: predicted {predicted} hits, server {h}", chain.len()));
                                }
                            }
                            stats.lookup.record(t.elapsed().as_micros() as u64);
                            // Hits as found (the count says no tier), the rest as misses.
                            let tier = |i: usize| if i < h { TraceTier::None } else { TraceTier::Miss };
                            self.trace(TraceOp::Lookup, chain.iter().enumerate().map(|(i, k)| (k.as_str(), tier(i))));
                            streak = 0;
                            h.min(prompt_blocks)
                        }
                        Err(e) => {
                            self.note_error(&e, &mut stats, &mut streak);
                            continue;
                        }
                    };
                    let b = self.bucket(&mut stats);
                    b.tokens_looked_up += (prompt_blocks * self.block_tokens) as u64;
                    b.tokens_hit += (hits * self.block_tokens) as u64;
                    for key in &chain[..hits] {
                        if self.done() {
                            break 'conversations;
                        }
                        let t = Instant::now();
                        let answer = self.target.get(key).await;
                        if let (Some(o), Ok(found)) = (&self.oracle, &answer) {
                            let mut o = o.lock().expect("oracle lock");
                            let predicted = o.oracle.get(key).map_or("miss", |p| p.as_str());
                            let measured = found.as_ref().map_or("miss", |b| b.tier.as_str()).to_string();
                            o.results.gets_checked += 1;
                            *o.results.predicted_gets_by_tier.entry(predicted.to_string()).or_default() += 1;
                            *o.results.measured_gets_by_tier.entry(measured.clone()).or_default() += 1;
                            if predicted != measured {
                                o.results.get_mismatches += 1;
                                o.results.mismatch(format!("GET {key}: predicted {predicted}, served {measured}"));
                            }
                        }
                        if let Ok(found) = &answer {
                            let tier = found.as_ref().map_or(TraceTier::Miss, |b| trace_tier(&b.tier));
                            self.trace(TraceOp::Get, [(key.as_str(), tier)]);
                        }
                        match answer {
                            Ok(Some(block)) => {
                                let us = t.elapsed().as_micros() as u64;
                                stats.get.record(us);
                                stats.by_tier.record(&block.tier, us);
                                self.bucket(&mut stats).blocks_read += 1;
                                streak = 0;
                                if self.target.keeps_bytes() && !self.payloads.verify_body(key, &block.body, self.cfg.verify_full) {
                                    stats.wrong_bytes += 1;
                                    eprintln!("kvtier-loadgen: block {key} read back with wrong bytes");
                                }
                            }
                            Ok(None) => {
                                stats.get.record(t.elapsed().as_micros() as u64);
                                stats.get_misses += 1;
                            }
                            Err(e) => self.note_error(&e, &mut stats, &mut streak),
                        }
                    }
                    self.put_all(&chain[hits..prompt_blocks], &mut stats, &mut streak).await;
                    let turn_us = t.elapsed().as_micros() as u64;
                    stats.turn.entry(class).or_default().record(turn_us);
                    if turn_us <= class.sla_p95_ms() * 1000 {
                        *stats.turns_within_sla.entry(class).or_default() += 1;
                    }
                }
                let decode_ms = self.cfg.generation.ms_per_token() * reply_tokens.len() as u64;
                if decode_ms > 0 {
                    let left = self.deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(Duration::from_millis(decode_ms).min(left)).await;
                    if self.done() {
                        break 'conversations;
                    }
                }
                context.extend_from_slice(&reply_tokens);
                keys::extend_chain(&mut chain, &context, self.block_tokens);
                self.put_all(&chain[prompt_blocks..], &mut stats, &mut streak).await;
                stats.turns += 1;
                self.turns_done.fetch_add(1, Ordering::Relaxed);
            }
        }
        stats.gave_up = streak >= USER_ERRORS_MAX;
        stats
    }
}

/// Runs a replay and returns its figures (also when requests failed: the
/// figures gathered so far, with `errors`, `first_error` and `error`).
/// `block` is the geometry, `(block_bytes, block_tokens, model)`.
pub async fn run(
    target: Arc<Target>,
    dataset: Arc<Vec<Conversation>>,
    dataset_path: PathBuf,
    block: (u64, u64, String),
    cfg: ReplayConfig,
) -> ReplayResults {
    let (block_bytes, block_tokens, model) = block;
    let mut order: Vec<usize> = (0..dataset.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(cfg.seed));
    let started = Instant::now();
    let bucket_s = timeline_bucket_s(cfg.duration);
    let (trace, mut trace_error) = match &cfg.trace_out {
        None => (None, None),
        Some(path) => match ClientTrace::create(path, &target, (block_bytes, block_tokens, &model)).await {
            Ok(t) => (Some(Mutex::new(t)), None),
            Err(e) => (None, Some(e)),
        },
    };
    let shared = Arc::new(Shared {
        target: target.clone(),
        dataset: dataset.clone(),
        order,
        next: AtomicUsize::new(0),
        block_tokens: block_tokens as usize,
        payloads: Payloads::new(block_bytes as usize, cfg.seed),
        deadline: started + cfg.duration,
        stop: AtomicBool::new(false),
        first_error: FirstError::default(),
        turns_done: AtomicU64::new(0),
        started,
        bucket_s,
        oracle: cfg.oracle.clone().map(|c| {
            let oracle = PolicyOracle::new(c.shards, c.ram_blocks_per_shard, c.write_back, c.promote).with_gpu(c.gpu_blocks_per_shard);
            let oracle = match &c.tenant {
                Some(t) => oracle.for_tenant(t, c.ram_limit_blocks, c.gpu_limit_blocks),
                None => oracle,
            };
            Mutex::new(OracleState {
                oracle,
                results: OracleResults { config: Some(c), ..Default::default() },
                tokens_looked_up: 0,
                tokens_predicted: 0,
            })
        }),
        trace,
        cfg: cfg.clone(),
    });
    let users: Vec<_> = (0..cfg.users.max(1)).map(|u| tokio::spawn(shared.clone().user(u))).collect();
    let bar = crate::sweep::progress_bar(cfg.progress, cfg.duration.as_millis() as u64, "replay".into());
    let ticker = {
        let (shared, bar) = (shared.clone(), bar.clone());
        tokio::spawn(async move {
            loop {
                bar.set_position(started.elapsed().as_millis() as u64);
                bar.set_message(format!("{} turns", shared.turns_done.load(Ordering::Relaxed)));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let mut total = UserStats::default();
    let mut gave_up = 0;
    for u in users {
        match u.await {
            Ok(s) => {
                gave_up += usize::from(s.gave_up);
                total.merge(&s);
            }
            Err(e) => eprintln!("kvtier-loadgen: a user task failed: {e}"),
        }
    }
    ticker.abort();
    bar.finish_and_clear();
    let elapsed_s = started.elapsed().as_secs_f64();
    let (blocks_read, blocks_written) = (total.get.count() - total.get_misses, total.put.count());
    let tokens_moved = ((blocks_read + blocks_written) * block_tokens) as f64;
    let io_s = (total.get.total_us + total.put.total_us) as f64 / 1e6;
    let per_s = |x: f64| if elapsed_s > 0.0 { x / elapsed_s } else { 0.0 };
    if let Some(t) = shared.trace.as_ref() {
        trace_error = trace_error.or(t.lock().expect("trace lock").finish());
    }
    if let Some(e) = &trace_error {
        shared.first_error.note(e.clone());
        eprintln!("kvtier-loadgen: {e}");
    }
    let first_error = shared.first_error.get();
    // Totals are the sums of the timeline's buckets.
    let tokens_looked_up: u64 = total.timeline.iter().map(|p| p.tokens_looked_up).sum();
    let tokens_hit: u64 = total.timeline.iter().map(|p| p.tokens_hit).sum();
    let users = cfg.users.max(1);
    let qos = QosClass::ALL
        .iter()
        .map(|&class| {
            let lat = total.turn.get(&class).cloned().unwrap_or_default();
            let within = total.turns_within_sla.get(&class).copied().unwrap_or(0);
            let summary = lat.summary();
            QosResult {
                class,
                users: (0..users).filter(|&u| QosClass::of_user(u) == class).count(),
                sla_p95_ms: class.sla_p95_ms(),
                within_sla: if summary.count > 0 { within as f64 / summary.count as f64 } else { 0.0 },
                met: summary.count > 0 && summary.p95_us <= class.sla_p95_ms() * 1000,
                turn_latency: summary,
            }
        })
        .filter(|q| q.users > 0)
        .collect();
    let timeline = total
        .timeline
        .iter()
        .enumerate()
        .map(|(i, p)| TimelinePoint {
            t_s: i as f64 * bucket_s,
            prefix_hit_rate: ratio(p.tokens_hit, p.tokens_looked_up),
            tokens_per_s: ((p.blocks_read + p.blocks_written) * block_tokens) as f64 / bucket_s,
            ..p.clone()
        })
        .collect();
    let prefix_hit_rate = ratio(tokens_hit, tokens_looked_up);
    let oracle = shared.oracle.as_ref().map(|o| {
        let o = o.lock().expect("oracle lock");
        OracleResults {
            predicted_hit_rate: ratio(o.tokens_predicted, o.tokens_looked_up),
            measured_hit_rate: prefix_hit_rate,
            ..o.results.clone()
        }
    });
    ReplayResults {
        oracle,
        mode: "replay".into(),
        target: target.url().to_string(),
        target_kind: target.kind().to_string(),
        protocol: target.protocol().to_string(),
        transport: target.transport().to_string(),
        generation_mode: cfg.generation,
        dataset_path,
        dataset_conversations: dataset.len(),
        users: cfg.users,
        seed: cfg.seed,
        model,
        block_bytes,
        block_tokens,
        duration_s: cfg.duration.as_secs_f64(),
        elapsed_s,
        conversations: total.conversations,
        turns: total.turns,
        lookups: total.lookup.count(),
        gets: total.get.count(),
        puts: total.put.count(),
        requests: total.lookup.count() + total.get.count() + total.put.count() + total.errors,
        errors: total.errors,
        refusals: target.refusals(),
        error: trace_error.or_else(|| {
            (gave_up == users).then(|| {
                format!("every user gave up after {USER_ERRORS_MAX} failed requests in a row: {}", first_error.clone().unwrap_or_default())
            })
        }),
        first_error,
        get_misses: total.get_misses,
        wrong_bytes: total.wrong_bytes,
        tokens_looked_up,
        tokens_hit,
        prefix_hit_rate,
        blocks_read,
        blocks_written,
        tokens_per_s: per_s(tokens_moved),
        storage_tokens_per_s: if io_s > 0.0 { tokens_moved / io_s } else { 0.0 },
        read_bytes_per_s: per_s((blocks_read * block_bytes) as f64),
        write_bytes_per_s: per_s((blocks_written * block_bytes) as f64),
        lookup_latency: total.lookup.summary(),
        get_latency: total.get.summary(),
        put_latency: total.put.summary(),
        get_latency_by_tier: total.by_tier.summaries(),
        qos,
        timeline_bucket_s: bucket_s,
        timeline,
        histograms: ReplayHistograms {
            lookup: total.lookup.buckets(),
            get: total.get.buckets(),
            put: total.put.buckets(),
            get_by_tier: total.by_tier.buckets(),
        },
    }
}
