//! `kvtier-loadgen route`: a ShareGPT multi-turn replay sent over a fleet
//! of kvtier nodes by a KV-aware router that follows the nodes' KV events
//! (`kvtier serve --kv-events`), against round robin and against a router
//! fed store events only (docs/BENCHMARKS.md, "KV-aware routing").
//!
//! The replay is `kvtier-loadgen replay`'s ([`crate::replay`]): each user
//! takes the next conversation of a seeded shuffle; per turn the prompt is
//! the conversation so far, its full blocks keyed by [`crate::keys`]. Here
//! each block also gets the engine's chained hash ([`crate::tag`]), which
//! the PUT sends as its block tag, so the node publishes the block's every
//! move between its tiers under that hash. Per turn:
//!
//! 1. the router picks a node from the prompt's hashes ([`router`]; its
//!    per-node indexes are filled by one SUB socket per node,
//!    [`subscriber`], decoding vLLM's wire format, [`wire`]);
//! 2. on that node: a lookup of the prompt's keys, a GET of each prefix
//!    hit (prefill skipped for it) noting the tier that served it
//!    (`x-kvtier-tier`: `gpu`, `ram` and `nvme` are the node's own, `s3`
//!    the bucket the nodes share), tagged PUTs of the blocks that missed;
//! 3. the decode wait of `--generation-mode`, then tagged PUTs of the
//!    blocks the reply completed, on the same node;
//! 4. the user's think time (`--think-ms`) before the next turn.
//!
//! The figure of merit is the share of prefix tokens served from the
//! node's own tiers rather than from S3: what a router's choice decides.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::client::{Client, ClientError};
use crate::keys;
use crate::payload::Payloads;
use crate::replay::GenerationMode;
use crate::sharegpt::Conversation;
use crate::stats::{ratio, FirstError, LatencySummary, OpLatency, TierLatency};
use crate::tag::{self, BlockTag};

pub mod index;
pub mod router;
pub mod subscriber;
pub mod wire;

use self::router::{RouteMode, RouteScore, Router};
use self::subscriber::{Subscriber, SubscriberStats};

/// Consecutive failed requests after which a user gives up.
const USER_ERRORS_MAX: u32 = 10;

/// The tiers (`x-kvtier-tier`) that are a node's own.
pub const LOCAL_TIERS: [&str; 3] = ["gpu", "ram", "nvme"];

/// How a routed replay runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteConfig {
    /// The router's mode.
    pub mode: RouteMode,
    /// Concurrent users, each one conversation at a time.
    pub users: usize,
    /// Stop after this long.
    pub duration_s: f64,
    /// Seed of the conversation order and of the payload bytes.
    pub seed: u64,
    /// Stop after this many passes over the dataset.
    pub passes: Option<usize>,
    /// A conversation stops once its context exceeds this many tokens.
    pub max_context_tokens: usize,
    /// Decode-time simulation.
    pub generation: GenerationMode,
    /// A user's think time, ms: the wait between a turn's reply (its blocks
    /// written) and the user's next turn of the same conversation.
    #[serde(default)]
    pub think_ms: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Tokens per block (one engine block per kvtier block).
    pub block_tokens: u64,
    /// The router's weight of a prefill block against an active block
    /// ([`router`]).
    pub overlap_weight: f64,
    /// What the router counts as a node's local prefix.
    pub score: RouteScore,
}

/// One kvtier node of the fleet: its block API and its event stream.
pub struct Node {
    /// The block API.
    pub client: Client,
    /// The subscription to its KV events.
    pub events: Subscriber,
    /// Prompt blocks of the turns this node serves now (prefill and
    /// decode): the router's measure of its load.
    active_blocks: AtomicUsize,
}

impl Node {
    /// A node reached at `client`, its events read by `events`.
    pub fn new(client: Client, events: Subscriber) -> Node {
        Node { client, events, active_blocks: AtomicUsize::new(0) }
    }
}

/// What a routed replay measured, per run. Schema in docs/LOADGEN.md.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteResults {
    /// `"route"`.
    pub mode: String,
    /// The settings.
    pub config: RouteConfig,
    /// Each node's URL.
    pub nodes: Vec<String>,
    /// Conversations in the dataset.
    pub dataset_conversations: usize,
    /// Wall time, s.
    pub elapsed_s: f64,
    /// Conversations started.
    pub conversations: u64,
    /// Turns completed.
    pub turns: u64,
    /// Turns sent to each node.
    pub turns_per_node: Vec<u64>,
    /// Tokens in the full blocks of every prompt looked up.
    pub tokens_looked_up: u64,
    /// Tokens of the prefix hits the lookups reported (local or S3).
    pub tokens_hit: u64,
    /// Prefix tokens whose GET a node served from its own tiers.
    pub tokens_local: u64,
    /// Prefix tokens whose GET came from the shared bucket (`s3`).
    pub tokens_s3: u64,
    /// tokens_local / tokens_hit: the share of the reused prefix that
    /// never left the node.
    pub local_share_of_hits: f64,
    /// tokens_local / tokens_looked_up.
    pub local_share_of_prompts: f64,
    /// GETs per serving tier.
    pub gets_by_tier: BTreeMap<String, u64>,
    /// Prefix GETs that found nothing (evicted between lookup and GET).
    pub get_misses: u64,
    /// Blocks read.
    pub blocks_read: u64,
    /// Blocks written.
    pub blocks_written: u64,
    /// (blocks read + written) × block_tokens / elapsed_s.
    pub tokens_per_s: f64,
    /// A turn's storage time: lookup, prefix GETs and the prompt's PUTs
    /// (the work before the first token), µs.
    pub turn_latency: LatencySummary,
    /// Lookups, µs.
    pub lookup_latency: LatencySummary,
    /// Block GETs per serving tier, µs.
    pub get_latency_by_tier: BTreeMap<String, LatencySummary>,
    /// Block PUTs, µs.
    pub put_latency: LatencySummary,
    /// Prefix blocks the router believed the chosen node held locally, as
    /// its score counts them, summed over turns (0 in round robin).
    pub predicted_local_blocks: u64,
    /// The same blocks as the chosen node served them (score `prefix`: its
    /// leading run of local GETs; `fleet`: all its local GETs), summed.
    pub served_local_prefix_blocks: u64,
    /// Turns whose chosen node served fewer blocks locally than the router
    /// believed (a stale index).
    pub turns_overpredicted: u64,
    /// Each node's event stream as the router received it.
    pub subscribers: Vec<SubscriberStats>,
    /// Blocks in each node's index at the end.
    pub index_blocks: Vec<usize>,
    /// Failed requests.
    pub errors: u64,
    /// The first error.
    pub first_error: Option<String>,
    /// Blocks read back with other bytes than written (must be 0).
    pub wrong_bytes: u64,
}

#[derive(Default)]
struct UserStats {
    turn: OpLatency,
    lookup: OpLatency,
    put: OpLatency,
    by_tier: TierLatency,
    gets_by_tier: BTreeMap<String, u64>,
    conversations: u64,
    turns: u64,
    turns_per_node: Vec<u64>,
    tokens_looked_up: u64,
    tokens_hit: u64,
    tokens_local: u64,
    tokens_s3: u64,
    get_misses: u64,
    blocks_read: u64,
    blocks_written: u64,
    predicted_local_blocks: u64,
    served_local_prefix_blocks: u64,
    turns_overpredicted: u64,
    errors: u64,
    wrong_bytes: u64,
    gave_up: bool,
}

impl UserStats {
    fn merge(&mut self, o: &UserStats) {
        self.turn.merge(&o.turn);
        self.lookup.merge(&o.lookup);
        self.put.merge(&o.put);
        self.by_tier.merge(&o.by_tier);
        for (t, n) in &o.gets_by_tier {
            *self.gets_by_tier.entry(t.clone()).or_default() += n;
        }
        if self.turns_per_node.len() < o.turns_per_node.len() {
            self.turns_per_node.resize(o.turns_per_node.len(), 0);
        }
        for (a, b) in self.turns_per_node.iter_mut().zip(&o.turns_per_node) {
            *a += b;
        }
        self.conversations += o.conversations;
        self.turns += o.turns;
        self.tokens_looked_up += o.tokens_looked_up;
        self.tokens_hit += o.tokens_hit;
        self.tokens_local += o.tokens_local;
        self.tokens_s3 += o.tokens_s3;
        self.get_misses += o.get_misses;
        self.blocks_read += o.blocks_read;
        self.blocks_written += o.blocks_written;
        self.predicted_local_blocks += o.predicted_local_blocks;
        self.served_local_prefix_blocks += o.served_local_prefix_blocks;
        self.turns_overpredicted += o.turns_overpredicted;
        self.errors += o.errors;
        self.wrong_bytes += o.wrong_bytes;
    }
}

/// What the users share.
struct Shared {
    nodes: Vec<Node>,
    router: Router,
    dataset: Arc<Vec<Conversation>>,
    order: Vec<usize>,
    next: AtomicUsize,
    cfg: RouteConfig,
    payloads: Payloads,
    deadline: Instant,
    stop: AtomicBool,
    first_error: FirstError,
    turns_done: AtomicU64,
}

/// A prompt's blocks: keys, engine hashes and the tokens under them.
struct Prompt<'a> {
    keys: &'a [String],
    hashes: &'a [u64],
    tokens: &'a [u32],
}

impl Shared {
    fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }

    fn note_error(&self, e: &ClientError, stats: &mut UserStats, streak: &mut u32) {
        stats.errors += 1;
        *streak += 1;
        if self.first_error.note(e.to_string()) {
            eprintln!("kvtier-loadgen: {e}");
        }
    }

    /// Tagged PUTs of blocks `range` of `prompt` on `node`.
    async fn put_blocks(&self, node: &Node, prompt: &Prompt<'_>, range: std::ops::Range<usize>, stats: &mut UserStats, streak: &mut u32) {
        let block_tokens = self.cfg.block_tokens as usize;
        for i in range {
            if self.done() {
                return;
            }
            let key = &prompt.keys[i];
            let headers = BlockTag::of_block(prompt.hashes, prompt.tokens, block_tokens, i).headers();
            let t = Instant::now();
            match node.client.put_with_headers(key, self.payloads.chunks(key), &headers).await {
                Ok(_) => {
                    stats.put.record(t.elapsed().as_micros() as u64);
                    stats.blocks_written += 1;
                    *streak = 0;
                }
                Err(e) => self.note_error(&e, stats, streak),
            }
        }
    }

    /// A turn's storage work on the chosen node: lookup, prefix GETs, the
    /// prompt's PUTs. Returns the blocks served locally, as the router's
    /// score counts them (the leading run for `prefix`, all for `fleet`),
    /// or `None` when the lookup failed.
    async fn prefill(&self, node: &Node, prompt: &Prompt<'_>, stats: &mut UserStats, streak: &mut u32) -> Option<usize> {
        let block_tokens = self.cfg.block_tokens;
        let blocks = prompt.keys.len();
        let t = Instant::now();
        let (hits, _tiers) = match node.client.lookup_tiers(prompt.keys).await {
            Ok(answer) => answer,
            Err(e) => {
                self.note_error(&e, stats, streak);
                return None;
            }
        };
        stats.lookup.record(t.elapsed().as_micros() as u64);
        *streak = 0;
        let hits = hits.min(blocks);
        stats.tokens_looked_up += blocks as u64 * block_tokens;
        stats.tokens_hit += hits as u64 * block_tokens;
        let (mut leading_local, mut all_local, mut still_leading) = (0, 0, true);
        let served = |leading, all| match self.cfg.score {
            RouteScore::Prefix => leading,
            RouteScore::Fleet => all,
        };
        for key in &prompt.keys[..hits] {
            if self.done() {
                return Some(served(leading_local, all_local));
            }
            let g = Instant::now();
            match node.client.get(key).await {
                Ok(Some((body, tier))) => {
                    let tier = tier.unwrap_or_else(|| "unknown".into());
                    stats.by_tier.record(&tier, g.elapsed().as_micros() as u64);
                    *stats.gets_by_tier.entry(tier.clone()).or_default() += 1;
                    stats.blocks_read += 1;
                    *streak = 0;
                    let local = LOCAL_TIERS.contains(&tier.as_str());
                    if local {
                        stats.tokens_local += block_tokens;
                    } else if tier == "s3" {
                        stats.tokens_s3 += block_tokens;
                    }
                    still_leading &= local;
                    leading_local += usize::from(still_leading);
                    all_local += usize::from(local);
                    if !self.payloads.verify_body(key, &body, false) {
                        stats.wrong_bytes += 1;
                        eprintln!("kvtier-loadgen: block {key} read back with wrong bytes");
                    }
                }
                Ok(None) => {
                    stats.get_misses += 1;
                    still_leading = false;
                }
                Err(e) => {
                    still_leading = false;
                    self.note_error(&e, stats, streak);
                }
            }
        }
        self.put_blocks(node, prompt, hits..blocks, stats, streak).await;
        stats.turn.record(t.elapsed().as_micros() as u64);
        Some(served(leading_local, all_local))
    }

    async fn user(self: Arc<Self>) -> UserStats {
        let mut stats = UserStats { turns_per_node: vec![0; self.nodes.len()], ..Default::default() };
        let mut streak = 0u32;
        let n = self.order.len();
        let block_tokens = self.cfg.block_tokens as usize;
        'conversations: while !self.done() && streak < USER_ERRORS_MAX {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            if self.cfg.passes.is_some_and(|p| c / n >= p) {
                break;
            }
            let dataset = self.dataset.clone();
            let conv_index = self.order[c % n];
            let turns = tokio::task::spawn_blocking(move || crate::replay::tokenize(&dataset[conv_index])).await.expect("tokenizer task");
            stats.conversations += 1;
            let (mut context, mut keys, mut hashes): (Vec<u32>, Vec<String>, Vec<u64>) = (Vec::new(), Vec::new(), Vec::new());
            for (user_tokens, reply_tokens) in turns {
                if self.done() || streak >= USER_ERRORS_MAX {
                    break 'conversations;
                }
                context.extend_from_slice(&user_tokens);
                if context.len() > self.cfg.max_context_tokens {
                    break;
                }
                keys::extend_chain(&mut keys, &context, block_tokens);
                tag::extend_hashes(&mut hashes, &context, block_tokens);
                let prompt_blocks = keys.len();
                let indexes: Vec<_> = self.nodes.iter().map(|n| &*n.events.index).collect();
                let loads: Vec<usize> = self.nodes.iter().map(|n| n.active_blocks.load(Ordering::Relaxed)).collect();
                let choice = self.router.choose(&hashes, &indexes, &loads);
                let node = &self.nodes[choice.node];
                node.active_blocks.fetch_add(prompt_blocks, Ordering::Relaxed);
                stats.turns_per_node[choice.node] += 1;
                if prompt_blocks > 0 {
                    let prompt = Prompt { keys: &keys, hashes: &hashes, tokens: &context };
                    let served = self.prefill(node, &prompt, &mut stats, &mut streak).await;
                    if let Some(served) = served {
                        stats.predicted_local_blocks += choice.predicted_blocks as u64;
                        stats.served_local_prefix_blocks += served as u64;
                        stats.turns_overpredicted += u64::from(served < choice.predicted_blocks);
                    }
                }
                let decode_ms = self.cfg.generation.ms_per_token() * reply_tokens.len() as u64;
                if decode_ms > 0 {
                    let left = self.deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(Duration::from_millis(decode_ms).min(left)).await;
                }
                if !self.done() {
                    context.extend_from_slice(&reply_tokens);
                    keys::extend_chain(&mut keys, &context, block_tokens);
                    tag::extend_hashes(&mut hashes, &context, block_tokens);
                    let prompt = Prompt { keys: &keys, hashes: &hashes, tokens: &context };
                    self.put_blocks(node, &prompt, prompt_blocks..keys.len(), &mut stats, &mut streak).await;
                }
                node.active_blocks.fetch_sub(prompt_blocks, Ordering::Relaxed);
                if self.done() {
                    break 'conversations;
                }
                stats.turns += 1;
                self.turns_done.fetch_add(1, Ordering::Relaxed);
                if self.cfg.think_ms > 0 {
                    let left = self.deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(Duration::from_millis(self.cfg.think_ms).min(left)).await;
                }
            }
        }
        stats.gave_up = streak >= USER_ERRORS_MAX;
        stats
    }
}

/// Runs a routed replay over `nodes` (each already subscribed to) and
/// returns its figures; the subscriptions end with it.
pub async fn run(nodes: Vec<Node>, urls: Vec<String>, dataset: Arc<Vec<Conversation>>, cfg: RouteConfig, progress: bool) -> RouteResults {
    assert!(!nodes.is_empty() && nodes.len() == urls.len(), "one URL per node");
    let mut order: Vec<usize> = (0..dataset.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(cfg.seed));
    let started = Instant::now();
    let duration = Duration::from_secs_f64(cfg.duration_s.max(0.0));
    let shared = Arc::new(Shared {
        nodes,
        router: Router::new(cfg.mode, cfg.score, cfg.overlap_weight),
        dataset: dataset.clone(),
        order,
        next: AtomicUsize::new(0),
        payloads: Payloads::new(cfg.block_bytes as usize, cfg.seed),
        deadline: started + duration,
        stop: AtomicBool::new(false),
        first_error: FirstError::default(),
        turns_done: AtomicU64::new(0),
        cfg: cfg.clone(),
    });
    let users: Vec<_> = (0..cfg.users.max(1)).map(|_| tokio::spawn(shared.clone().user())).collect();
    let bar = crate::sweep::progress_bar(progress, duration.as_millis() as u64, format!("route {}", cfg.mode.name()));
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
    let mut total = UserStats { turns_per_node: vec![0; urls.len()], ..Default::default() };
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
    let _ = ticker.await;
    bar.finish_and_clear();
    let elapsed_s = started.elapsed().as_secs_f64();
    let shared = Arc::try_unwrap(shared).unwrap_or_else(|_| panic!("every user and the ticker ended"));
    let index_blocks = shared.nodes.iter().map(|n| n.events.index.lock().expect("index lock").len()).collect();
    let subscribers = shared.nodes.into_iter().map(|n| n.events.stop()).collect();
    if gave_up == cfg.users.max(1) {
        shared.first_error.note("every user gave up after failed requests".into());
    }
    let tokens_moved = (total.blocks_read + total.blocks_written) * cfg.block_tokens;
    RouteResults {
        mode: "route".into(),
        config: cfg,
        nodes: urls,
        dataset_conversations: dataset.len(),
        elapsed_s,
        conversations: total.conversations,
        turns: total.turns,
        turns_per_node: total.turns_per_node,
        tokens_looked_up: total.tokens_looked_up,
        tokens_hit: total.tokens_hit,
        tokens_local: total.tokens_local,
        tokens_s3: total.tokens_s3,
        local_share_of_hits: ratio(total.tokens_local, total.tokens_hit),
        local_share_of_prompts: ratio(total.tokens_local, total.tokens_looked_up),
        gets_by_tier: total.gets_by_tier,
        get_misses: total.get_misses,
        blocks_read: total.blocks_read,
        blocks_written: total.blocks_written,
        tokens_per_s: if elapsed_s > 0.0 { tokens_moved as f64 / elapsed_s } else { 0.0 },
        turn_latency: total.turn.summary(),
        lookup_latency: total.lookup.summary(),
        get_latency_by_tier: total.by_tier.summaries(),
        put_latency: total.put.summary(),
        predicted_local_blocks: total.predicted_local_blocks,
        served_local_prefix_blocks: total.served_local_prefix_blocks,
        turns_overpredicted: total.turns_overpredicted,
        subscribers,
        index_blocks,
        errors: total.errors,
        first_error: shared.first_error.get(),
        wrong_bytes: total.wrong_bytes,
    }
}
