//! `kvtier-loadgen`: drives a kvtier server with real workloads and writes
//! the figures to `OUT/results.json`. Each subcommand's flags and run are in
//! the library's [`kvtier_loadgen::cli`]; this only parses and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvtier_loadgen::cli;

kvtier_engine::jemalloc_with_huge_pages!();

/// Load generator for kvtier, the KV-cache block store, and for the
/// hardware under it. Every mode writes OUT/results.json (schema in
/// docs/LOADGEN.md); sweep and replay also write OUT/report.html.
#[derive(Parser, Debug)]
#[command(name = "kvtier-loadgen", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Closed-loop concurrency sweep: at each level, N workers run
    /// iterations of lookups, block reads and block writes (7:6:3) over
    /// prefix chains; per level tokens/s, p50/p95/p99 per operation, server
    /// bandwidth; then the saturation point, the operating point under the
    /// SLA, a Little's-law check and a capacity line. Several --target
    /// (kvtier and Redis) run the same workload one after the other.
    Sweep(cli::sweep::SweepArgs),
    /// Replay ShareGPT V3 conversations as an inference engine with a
    /// KV-cache connector would: per turn, look up the prompt's chained
    /// block keys, GET the prefix hits, PUT the misses and the blocks the
    /// reply completes.
    Replay(cli::replay::ReplayArgs),
    /// Whole-block PUT or GET throughput at one concurrency: the raw
    /// transfer path, to set beside iperf3 (loopback bandwidth) or fio.
    Blocks(cli::blocks::BlocksArgs),
    /// Crash harness: starts `kvtier serve` on its own data directory,
    /// drives PUT load (new keys, overwrites, verified reads) from several
    /// clients, kill -9s the server at a random moment, restarts it and
    /// reads back every key ever written. Fails on any acknowledged block
    /// lost, any wrong bytes served, or a restart over the target.
    /// Arguments after `--` go to `kvtier serve`.
    Crash(cli::crash::CrashArgs),
    /// Soak: the sweep's mixed workload at one concurrency for many
    /// windows, restarting the server (SIGTERM and SIGKILL in turn) every
    /// few windows; samples the server's RSS, open fds and p99 per window
    /// and fails unless they stay flat. Arguments after `--` go to
    /// `kvtier serve`.
    Soak(cli::soak::SoakArgs),
    /// Tier sizing from a recorded trace (`kvtier serve --trace-dir`, or
    /// `replay --trace-out`): the hit ratio of GETs against the memory
    /// tiers' size (exact LRU by stack distance; SHARDS sampling for long
    /// traces; kvtier's own policy by miniature simulations) and of lookup
    /// tokens against the NVMe log's size, each with its knee and the sizes
    /// reaching 90/95/99% of an unbounded tier's hit ratio, and the prefill
    /// tokens each tier saves per GB. Prints a table; writes OUT/results.json
    /// and OUT/report.html. docs/OPERATIONS.md, "Sizing the tiers".
    Size(cli::size::SizeArgs),
    /// The HTML report of `make bench-engine` (a real `vllm serve` per
    /// connector): reads the benchmark's results.json, writes
    /// OUT/report.html with its table and TTFT charts.
    EngineReport(cli::engine_report::EngineReportArgs),
    /// KV-aware routing: the ShareGPT replay over several kvtier nodes
    /// (`serve --kv-events`), each turn sent by a router that follows the
    /// nodes' KV events (every event, store events only, or round robin),
    /// its PUTs tagged with the engine's block hashes; prefix tokens served
    /// from the nodes' own tiers against the shared bucket, tokens/s, p99.
    Route(cli::route::RouteArgs),
    /// Read a node's whole KV event stream (as a router would) until a stop
    /// file appears; counts batches, events and gaps.
    Subscribe(cli::subscribe::SubscribeArgs),
}

fn main() -> ExitCode {
    let Cli { command } = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = match command {
        Command::Sweep(args) => runtime.block_on(cli::sweep::run(args)),
        Command::Replay(args) => runtime.block_on(cli::replay::run(args)),
        Command::Blocks(args) => runtime.block_on(cli::blocks::run(args)),
        Command::Crash(args) => runtime.block_on(cli::crash::run(args)),
        Command::Soak(args) => runtime.block_on(cli::soak::run(args)),
        Command::Size(args) => cli::size::run(args).map(|()| ExitCode::SUCCESS),
        Command::EngineReport(args) => cli::engine_report::run(args),
        Command::Route(args) => runtime.block_on(cli::route::run(args)),
        Command::Subscribe(args) => runtime.block_on(cli::subscribe::run(args)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier-loadgen: {e}");
            ExitCode::FAILURE
        }
    }
}
