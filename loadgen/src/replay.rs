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
//! reply completed (decode wrote them).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use crate::client::{Client, ClientError};
use crate::keys;
use crate::payload::Payloads;
use crate::sharegpt::Conversation;
use crate::stats::{LatencySummary, OpLatency};

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
    /// Print a progress line to stderr this often (None: quiet).
    pub progress_every: Option<Duration>,
}

/// What one replay measured. Schema in docs/LOADGEN.md.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ReplayResults {
    /// `"replay"`.
    pub mode: String,
    /// Server URL.
    pub target: String,
    /// `"h2c"` or `"http/1.1"`.
    pub protocol: String,
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
}

#[derive(Default, Clone)]
struct UserStats {
    lookup: OpLatency,
    get: OpLatency,
    put: OpLatency,
    conversations: u64,
    turns: u64,
    errors: u64,
    get_misses: u64,
    wrong_bytes: u64,
    tokens_looked_up: u64,
    tokens_hit: u64,
}

impl UserStats {
    fn merge(&mut self, o: &UserStats) {
        self.lookup.merge(&o.lookup);
        self.get.merge(&o.get);
        self.put.merge(&o.put);
        self.conversations += o.conversations;
        self.turns += o.turns;
        self.errors += o.errors;
        self.get_misses += o.get_misses;
        self.wrong_bytes += o.wrong_bytes;
        self.tokens_looked_up += o.tokens_looked_up;
        self.tokens_hit += o.tokens_hit;
    }
}

/// Everything the users share.
struct Shared {
    client: Arc<Client>,
    dataset: Arc<Vec<Conversation>>,
    order: Vec<usize>,
    next: AtomicUsize,
    cfg: ReplayConfig,
    block_tokens: usize,
    payloads: Payloads,
    deadline: Instant,
    stop: AtomicBool,
    first_error: Mutex<Option<String>>,
    /// Turns completed so far, for the progress line.
    turns_done: AtomicU64,
}

/// Token ids of each turn: (user message, reply).
fn tokenize(conv: &Conversation) -> Vec<(Vec<u32>, Vec<u32>)> {
    let bpe = tiktoken_rs::cl100k_base_singleton();
    conv.turns().into_iter().map(|(user, reply)| (bpe.encode_ordinary(user), bpe.encode_ordinary(reply))).collect()
}

impl Shared {
    fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }

    fn note_error(&self, e: &ClientError, stats: &mut UserStats, streak: &mut u32) {
        stats.errors += 1;
        *streak += 1;
        let mut first = self.first_error.lock().expect("lock");
        if first.is_none() {
            eprintln!("kvtier-loadgen: {e}");
            *first = Some(e.to_string());
        }
    }

    /// PUTs `keys`, recording each.
    async fn put_all(&self, keys: &[String], stats: &mut UserStats, streak: &mut u32) {
        for key in keys {
            if self.done() {
                return;
            }
            let t = Instant::now();
            match self.client.put(key, self.payloads.chunks(key)).await {
                Ok(_) => {
                    stats.put.record(t.elapsed().as_micros() as u64);
                    *streak = 0;
                }
                Err(e) => self.note_error(&e, stats, streak),
            }
        }
    }

    async fn user(self: Arc<Self>) -> UserStats {
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
                    let hits = match self.client.lookup(&chain).await {
                        Ok(h) => {
                            stats.lookup.record(t.elapsed().as_micros() as u64);
                            streak = 0;
                            h.min(prompt_blocks)
                        }
                        Err(e) => {
                            self.note_error(&e, &mut stats, &mut streak);
                            continue;
                        }
                    };
                    stats.tokens_looked_up += (prompt_blocks * self.block_tokens) as u64;
                    stats.tokens_hit += (hits * self.block_tokens) as u64;
                    for key in &chain[..hits] {
                        if self.done() {
                            break 'conversations;
                        }
                        let t = Instant::now();
                        match self.client.get(key).await {
                            Ok(Some((body, _tier))) => {
                                stats.get.record(t.elapsed().as_micros() as u64);
                                streak = 0;
                                if !self.payloads.verify(key, &body, self.cfg.verify_full) {
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
                }
                context.extend_from_slice(&reply_tokens);
                keys::extend_chain(&mut chain, &context, self.block_tokens);
                self.put_all(&chain[prompt_blocks..], &mut stats, &mut streak).await;
                stats.turns += 1;
                self.turns_done.fetch_add(1, Ordering::Relaxed);
            }
        }
        stats
    }
}

/// Runs a replay and returns its figures. `block` is the server's
/// `(block_bytes, block_tokens, model)`.
pub async fn run(
    client: Arc<Client>,
    dataset: Arc<Vec<Conversation>>,
    dataset_path: PathBuf,
    block: (u64, u64, String),
    cfg: ReplayConfig,
) -> ReplayResults {
    let (block_bytes, block_tokens, model) = block;
    let mut order: Vec<usize> = (0..dataset.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(cfg.seed));
    let started = Instant::now();
    let shared = Arc::new(Shared {
        client: client.clone(),
        dataset: dataset.clone(),
        order,
        next: AtomicUsize::new(0),
        block_tokens: block_tokens as usize,
        payloads: Payloads::new(block_bytes as usize, cfg.seed),
        deadline: started + cfg.duration,
        stop: AtomicBool::new(false),
        first_error: Mutex::new(None),
        turns_done: AtomicU64::new(0),
        cfg: cfg.clone(),
    });
    let users: Vec<_> = (0..cfg.users.max(1)).map(|_| tokio::spawn(shared.clone().user())).collect();
    let progress = cfg.progress_every.map(|every| {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let turns = shared.turns_done.load(Ordering::Relaxed);
                eprintln!("kvtier-loadgen: {:>5.0} s  {turns} turns", started.elapsed().as_secs_f64());
            }
        })
    });
    let mut total = UserStats::default();
    for u in users {
        match u.await {
            Ok(s) => total.merge(&s),
            Err(e) => eprintln!("kvtier-loadgen: a user task failed: {e}"),
        }
    }
    if let Some(p) = progress {
        p.abort();
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let (blocks_read, blocks_written) = (total.get.count() - total.get_misses, total.put.count());
    let tokens_moved = ((blocks_read + blocks_written) * block_tokens) as f64;
    let io_s = (total.get.total_us + total.put.total_us) as f64 / 1e6;
    let per_s = |x: f64| if elapsed_s > 0.0 { x / elapsed_s } else { 0.0 };
    let first_error = shared.first_error.lock().expect("lock").clone();
    ReplayResults {
        mode: "replay".into(),
        target: client.target().to_string(),
        protocol: client.protocol().to_string(),
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
        first_error,
        get_misses: total.get_misses,
        wrong_bytes: total.wrong_bytes,
        tokens_looked_up: total.tokens_looked_up,
        tokens_hit: total.tokens_hit,
        prefix_hit_rate: if total.tokens_looked_up > 0 { total.tokens_hit as f64 / total.tokens_looked_up as f64 } else { 0.0 },
        blocks_read,
        blocks_written,
        tokens_per_s: per_s(tokens_moved),
        storage_tokens_per_s: if io_s > 0.0 { tokens_moved / io_s } else { 0.0 },
        read_bytes_per_s: per_s((blocks_read * block_bytes) as f64),
        write_bytes_per_s: per_s((blocks_written * block_bytes) as f64),
        lookup_latency: total.lookup.summary(),
        get_latency: total.get.summary(),
        put_latency: total.put.summary(),
    }
}
