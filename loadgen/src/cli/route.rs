//! `kvtier-loadgen route`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use super::{fail_early, ConversationArgs};
use crate::client::Client;
use crate::replay::GenerationMode;
use crate::route::router::{RouteMode, RouteScore};
use crate::route::subscriber::Subscriber;
use crate::route::{self, Node, RouteConfig};
use crate::{report, sharegpt};

/// How long the run waits for every node to count its subscriber.
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(10);

/// After a node counts the subscriber, how long its subscription (sent
/// after the connection) is given to arrive: a PUB socket sends nothing
/// to a subscriber whose subscription it has not read.
const SUBSCRIPTION_SETTLE: Duration = Duration::from_millis(300);

/// `kvtier-loadgen route`'s flags.
#[derive(Args, Debug)]
pub struct RouteArgs {
    /// A kvtier node, http://HOST:PORT, started with --kv-events; repeat
    /// for each node of the fleet (at least one). Its event endpoint is
    /// read from its /v1/stats.
    #[arg(long = "node", required = true)]
    nodes: Vec<String>,
    /// How the router picks a node: events (every KV event), store-only
    /// (BlockStored only, as a router fed a tier that never publishes
    /// removals), round-robin (no index).
    #[arg(long, value_enum, default_value_t = RouteMode::Events)]
    mode: RouteMode,
    /// The router's weight of a block of prefill saved against a block of
    /// load (the prompt blocks of the turns a node serves now), as Dynamo's
    /// overlap_score_weight: cost = weight × blocks to prefill + active
    /// blocks. Large (1e6): the longest prefix, then the less loaded.
    #[arg(long, default_value_t = 1.0)]
    overlap_weight: f64,
    /// What the router counts as a node's local prefix: fleet (its local
    /// blocks within the prefix some node or the shared bucket holds: with
    /// a shared tier, a node that lost a prompt's first blocks still
    /// serves the rest itself) or prefix (the longest prefix it holds
    /// locally). loadgen/src/route/router.rs says why.
    #[arg(long, value_enum, default_value_t = RouteScore::Fleet)]
    score: RouteScore,
    #[command(flatten)]
    set: ConversationArgs,
    /// Concurrent users, each replaying one conversation at a time.
    #[arg(long, default_value_t = 8)]
    users: usize,
    /// Decode time per generated token before the reply's blocks are
    /// written: none (0 ms), fast (2 ms), realistic (30 ms). Without it the
    /// next turn can come before the node has published the last one's
    /// blocks (events go out every --kv-events-interval-ms).
    #[arg(long, value_enum, default_value_t = GenerationMode::Fast)]
    generation_mode: GenerationMode,
    /// A user's think time in ms: the wait between a reply (its blocks
    /// written) and the same user's next turn. 0 sends the next turn at
    /// once, typically before the node has published the reply's blocks
    /// (events go out every --kv-events-interval-ms), so a router sees a
    /// conversation's newest blocks only at the turn after.
    #[arg(long, default_value_t = 0)]
    think_ms: u64,
    /// HTTP/2 connections per node.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Directory for results.json.
    #[arg(long, default_value = "target/loadgen/route")]
    out: PathBuf,
}

/// Runs `kvtier-loadgen route`: loads the dataset, subscribes to every
/// node's KV events, replays through the router, and writes
/// `OUT/results.json`. Success unless a request failed or a block came
/// back wrong.
///
/// # Errors
/// The output cannot be written; a run that fails before it measures
/// anything (a node without --kv-events, unreachable, of another block
/// geometry) also writes `OUT/results.json` saying why.
pub async fn run(args: RouteArgs) -> Result<ExitCode, String> {
    let label = args.nodes.join(" ");
    let fail = |e: String| fail_early(&args.out, "route", &label, e);
    if !(args.overlap_weight.is_finite() && args.overlap_weight >= 0.0) {
        return fail(format!("--overlap-weight must be 0 or more, got {}", args.overlap_weight));
    }
    let (_, dataset) = match sharegpt::replay_set(args.set.dataset_path.as_deref(), args.set.conversations) {
        Ok(d) => d,
        Err(e) => return fail(e.to_string()),
    };
    let (nodes, geometry) = match open_nodes(&args.nodes, args.mode, args.connections).await {
        Ok(n) => n,
        Err(e) => return fail(e),
    };
    let (block_bytes, block_tokens, _) = geometry;
    eprintln!(
        "kvtier-loadgen: routing {} conversations over {} nodes ({}), {} users, at most {} s, {}-token blocks, generation {}",
        dataset.len(),
        nodes.len(),
        args.mode.name(),
        args.users,
        args.set.duration_s,
        block_tokens,
        args.generation_mode.name()
    );
    let cfg = RouteConfig {
        mode: args.mode,
        users: args.users,
        duration_s: args.set.duration_s,
        seed: args.set.seed,
        passes: args.set.passes,
        max_context_tokens: args.set.max_context_tokens,
        generation: args.generation_mode,
        think_ms: args.think_ms,
        block_bytes,
        block_tokens,
        overlap_weight: args.overlap_weight,
        score: args.score,
    };
    let r = route::run(nodes, args.nodes.clone(), Arc::new(dataset), cfg, true).await;
    report::write_out(&args.out, &r, None)?;
    let missed: u64 = r.subscribers.iter().map(|s| s.missed_batches).sum();
    println!(
        "route ({}): {} turns in {:.1} s, turns per node {:?}; prefix tokens {} hit of {} looked up: {} local ({:.1}% of hits), {} from S3; \
         {:.0} tokens/s; turn p50/p99 {}/{} µs; router believed {} local prefix blocks, {} served locally ({} turns over); \
         events {} (stored {}, removed {}), missed batches {}; errors {}",
        r.config.mode.name(),
        r.turns,
        r.elapsed_s,
        r.turns_per_node,
        r.tokens_hit,
        r.tokens_looked_up,
        r.tokens_local,
        r.local_share_of_hits * 100.0,
        r.tokens_s3,
        r.tokens_per_s,
        r.turn_latency.p50_us,
        r.turn_latency.p99_us,
        r.predicted_local_blocks,
        r.served_local_prefix_blocks,
        r.turns_overpredicted,
        r.subscribers.iter().map(|s| s.events).sum::<u64>(),
        r.subscribers.iter().map(|s| s.stored).sum::<u64>(),
        r.subscribers.iter().map(|s| s.removed).sum::<u64>(),
        missed,
        r.errors
    );
    println!("results: {}", args.out.join("results.json").display());
    if r.errors > 0 || r.wrong_bytes > 0 {
        eprintln!("kvtier-loadgen: {} errors (first: {:?}), {} blocks with wrong bytes", r.errors, r.first_error, r.wrong_bytes);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Opens each node: its client, its geometry (all alike), its event
/// endpoint from `/v1/stats`, a subscription the node has counted.
async fn open_nodes(urls: &[String], mode: RouteMode, connections: usize) -> Result<(Vec<Node>, (u64, u64, String)), String> {
    let mut nodes = Vec::with_capacity(urls.len());
    let mut geometry: Option<(u64, u64, String)> = None;
    for url in urls {
        let client = Client::new(url, false, connections.max(1)).map_err(|e| e.to_string())?;
        let stats = client.stats().await.map_err(|e| format!("cannot reach {url}: {e}"))?;
        let g = client.geometry().await.map_err(|e| format!("cannot reach {url}: {e}"))?;
        if let Some(first) = &geometry {
            if first.0 != g.0 || first.1 != g.1 {
                return Err(format!("{url} stores {}-byte blocks of {} tokens, another node {} of {}", g.0, g.1, first.0, first.1));
            }
        }
        geometry.get_or_insert(g);
        let endpoint = stats["kv_events"]["endpoint"]
            .as_str()
            .ok_or_else(|| format!("{url} publishes no KV events: start it with --kv-events tcp://127.0.0.1:PORT"))?
            .to_string();
        if stats["kv_events"]["hash"] != "int" {
            return Err(format!(
                "{url} publishes hashes as {}: the router indexes vLLM's integers (--kv-events-hash int)",
                stats["kv_events"]["hash"]
            ));
        }
        let subscribers_before = stats["kv_events"]["subscribers"].as_u64().unwrap_or(0);
        let events = Subscriber::connect(&endpoint, mode.follows_removals()).await?;
        let waited = Instant::now();
        loop {
            let s = client.stats().await.map_err(|e| format!("cannot reach {url}: {e}"))?;
            if s["kv_events"]["subscribers"].as_u64().unwrap_or(0) > subscribers_before {
                break;
            }
            if waited.elapsed() > SUBSCRIBE_WAIT {
                return Err(format!("{url} did not count the subscriber at {endpoint} within {} s", SUBSCRIBE_WAIT.as_secs()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        nodes.push(Node::new(client, events));
    }
    tokio::time::sleep(SUBSCRIPTION_SETTLE).await;
    Ok((nodes, geometry.expect("at least one node")))
}
