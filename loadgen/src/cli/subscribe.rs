//! `kvtier-loadgen subscribe`: one subscriber reading a node's whole KV
//! event stream into a router's index until told to stop, then writing
//! what it received. The subscriber the cost benchmark keeps attached
//! (loadgen/scripts/bench_events_cost.sh).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;

use super::fail_early;
use crate::client::Client;
use crate::report;
use crate::route::subscriber::{Subscriber, SubscriberStats};

/// How often the stop file is looked for.
const STOP_POLL: Duration = Duration::from_millis(100);

/// `kvtier-loadgen subscribe`'s flags.
#[derive(Args, Debug)]
pub struct SubscribeArgs {
    /// The node, http://HOST:PORT, started with --kv-events: its event
    /// endpoint is read from /v1/stats.
    #[arg(long, default_value = "http://127.0.0.1:8085")]
    node: String,
    /// Stop once this file exists.
    #[arg(long)]
    stop_file: Option<PathBuf>,
    /// Stop after this many seconds at most.
    #[arg(long, default_value_t = 3600.0)]
    duration_s: f64,
    /// Directory for results.json.
    #[arg(long, default_value = "target/loadgen/subscribe")]
    out: PathBuf,
}

/// What `subscribe` writes.
#[derive(Debug, Serialize)]
struct SubscribeResults {
    mode: &'static str,
    node: String,
    elapsed_s: f64,
    /// Blocks in the index (every event applied) at the end.
    index_blocks: usize,
    events: SubscriberStats,
}

/// Runs `kvtier-loadgen subscribe`.
///
/// # Errors
/// The output cannot be written; a node without `--kv-events` or
/// unreachable also writes `OUT/results.json` saying why.
pub async fn run(args: SubscribeArgs) -> Result<ExitCode, String> {
    let fail = |e: String| fail_early(&args.out, "subscribe", &args.node, e);
    let client = match Client::new(&args.node, false, 1) {
        Ok(c) => c,
        Err(e) => return fail(e.to_string()),
    };
    let stats = match client.stats().await {
        Ok(s) => s,
        Err(e) => return fail(format!("cannot reach {}: {e}", args.node)),
    };
    let Some(endpoint) = stats["kv_events"]["endpoint"].as_str() else {
        return fail(format!("{} publishes no KV events: start it with --kv-events", args.node));
    };
    let subscriber = match Subscriber::connect(endpoint, true).await {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    eprintln!("kvtier-loadgen: subscribed to {endpoint}");
    let started = Instant::now();
    let limit = Duration::from_secs_f64(args.duration_s.max(0.0));
    while started.elapsed() < limit && !args.stop_file.as_ref().is_some_and(|f| f.exists()) {
        tokio::time::sleep(STOP_POLL).await;
    }
    let index_blocks = subscriber.index.lock().expect("index lock").len();
    let events = subscriber.stop();
    let r =
        SubscribeResults { mode: "subscribe", node: args.node.clone(), elapsed_s: started.elapsed().as_secs_f64(), index_blocks, events };
    report::write_out(&args.out, &r, None)?;
    println!(
        "subscribe: {} batches, {} events (stored {}, removed {}, cleared {}), {} batches missed, {} malformed, {} blocks indexed in {:.1} s",
        r.events.batches,
        r.events.events,
        r.events.stored,
        r.events.removed,
        r.events.cleared,
        r.events.missed_batches,
        r.events.malformed,
        r.index_blocks,
        r.elapsed_s
    );
    Ok(if r.events.malformed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
