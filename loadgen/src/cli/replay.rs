//! `kvtier-loadgen replay`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::{fail_early, read_token_file, ConversationArgs, GeometryArgs};
use crate::replay::{self, GenerationMode};
use crate::target::Target;
use crate::{report, sharegpt};

/// `kvtier-loadgen replay`'s flags.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Target URL: http://HOST:PORT (kvtier), unix:///PATH/kvtier.sock
    /// [?http=HOST:PORT] (kvtier's same-host socket; --oracle needs the
    /// HTTP address for /v1/stats) or redis://HOST:PORT[/DB].
    #[arg(long, default_value = "http://127.0.0.1:8085")]
    target: String,
    #[command(flatten)]
    set: ConversationArgs,
    /// Concurrent users, each replaying one conversation at a time; user u
    /// is in QoS class u mod 3 (interactive, responsive, batch).
    #[arg(long, default_value_t = 16)]
    users: usize,
    #[command(flatten)]
    geometry: GeometryArgs,
    /// Decode time per generated token before the reply's blocks are
    /// written: none (0 ms), fast (2 ms), realistic (30 ms).
    #[arg(long, value_enum, default_value_t = GenerationMode::None)]
    generation_mode: GenerationMode,
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

/// Runs `kvtier-loadgen replay`: loads the dataset, opens the target,
/// replays, and writes `OUT/results.json` and `OUT/report.html`. Success
/// unless a request failed or a block came back wrong.
///
/// # Errors
/// The output cannot be written; a run that fails before it measures
/// anything also writes `OUT/results.json` saying why.
pub async fn run(args: ReplayArgs) -> Result<ExitCode, String> {
    let (path, dataset) = match sharegpt::replay_set(args.set.dataset_path.as_deref(), args.set.conversations) {
        Ok(d) => d,
        Err(e) => return fail_early(&args.out, "replay", &args.target, e.to_string()),
    };
    let token = match read_token_file(args.token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail_early(&args.out, "replay", &args.target, e),
    };
    let target = match Target::open_as(&args.target, args.http1, args.connections, args.users, token.as_deref()).await {
        Ok(t) => Arc::new(t),
        Err(e) => return fail_early(&args.out, "replay", &args.target, e.to_string()),
    };
    let (block_bytes, block_tokens, model) = match crate::target::resolve_geometry(
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
        args.set.duration_s,
        block_bytes,
        block_tokens,
        args.generation_mode.name()
    );
    let cfg = replay::ReplayConfig {
        users: args.users,
        duration: Duration::from_secs_f64(args.set.duration_s.max(0.0)),
        seed: args.set.seed,
        passes: args.set.passes,
        max_context_tokens: args.set.max_context_tokens,
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
