//! `kvtier-loadgen sweep`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;

use super::{fail_early, read_token_file, GeometryArgs};
use crate::report;
use crate::sweep::{self, Mix, SweepConfig, SweepResults};
use crate::target::Target;

/// `kvtier-loadgen sweep`'s flags.
#[derive(Args, Debug)]
pub struct SweepArgs {
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
    /// Send every PUT with a block tag (docs/API.md, "Block tags"):
    /// engine hashes chained over each block's token ids, the block size
    /// and the ids, so a server with --kv-events publishes every block's
    /// moves (an untagged block publishes nothing). kvtier over HTTP only.
    #[arg(long)]
    kv_tags: bool,
    /// Directory for results.json and report.html.
    #[arg(long, default_value = "target/loadgen/sweep")]
    out: PathBuf,
}

/// Runs `kvtier-loadgen sweep`: opens every target, stores the working
/// set, runs each concurrency level, and writes `OUT/results.json` and
/// `OUT/report.html` after each level. Success unless an operation failed,
/// a block came back wrong or a target stopped.
///
/// # Errors
/// The output cannot be written; a run that fails before it measures
/// anything (bad flags, a target that cannot be opened) also writes
/// `OUT/results.json` saying why.
pub async fn run(args: SweepArgs) -> Result<ExitCode, String> {
    let label = args.targets.join(" ");
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        return fail_early(&args.out, "sweep", &label, "--concurrency needs levels of at least 1".into());
    }
    if args.kv_tags {
        if let Some(t) = args.targets.iter().find(|t| !t.starts_with("http://")) {
            return fail_early(&args.out, "sweep", &label, format!("--kv-tags sends block tags over HTTP only, not to {t}"));
        }
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
    let (block_bytes, block_tokens, model) = match crate::target::resolve_geometry(
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
    let workload = sweep::Workload::new(&config);
    let workload = Arc::new(if args.kv_tags { workload.with_kv_tags() } else { workload });
    let mut results = SweepResults {
        mode: "sweep".into(),
        started_unix_s: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        config: SweepConfig { working_set_blocks: workload.blocks(), ..config.clone() },
        link: link.clone(),
        targets: Vec::new(),
        error: None,
    };
    eprintln!(
        "kvtier-loadgen: sweep of {} at concurrency {:?}, {} s + {} s per level, mix {}:{}:{}, {} blocks of {} bytes{}; link {}",
        label,
        config.concurrency,
        config.warmup_s,
        config.duration_s,
        config.mix.lookups,
        config.mix.reads,
        config.mix.writes,
        workload.blocks(),
        block_bytes,
        if args.kv_tags { ", tagged" } else { "" },
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

/// Whether `url`'s host is a loopback address: the link is then measured
/// with iperf3 on loopback.
fn is_loopback(url: &str) -> bool {
    let host = url.split("://").nth(1).unwrap_or("").split(['/', '@']).next().unwrap_or("");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    matches!(host, "localhost" | "[::1]" | "::1") || host.starts_with("127.")
}
