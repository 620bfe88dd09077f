//! `kvtier-loadgen blocks`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use super::{fail_early, read_token_file};
use crate::target::Target;

/// `kvtier-loadgen blocks`'s flags.
#[derive(Args, Debug)]
pub struct BlocksArgs {
    /// kvtier server: http://HOST:PORT, or unix:///PATH/kvtier.sock (its
    /// same-host socket: blocks copied through registered memory, one
    /// block slot per request in flight).
    #[arg(long, default_value = "http://127.0.0.1:8085")]
    target: String,
    /// put or get.
    #[arg(long, value_enum)]
    op: crate::blocks::BlockOp,
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

/// Runs `kvtier-loadgen blocks`: whole-block PUTs or GETs at one
/// concurrency, written to `OUT/results.json`. Success unless a request
/// failed.
///
/// # Errors
/// The output cannot be written; a run that fails before it measures
/// anything also writes `OUT/results.json` saying why.
pub async fn run(args: BlocksArgs) -> Result<ExitCode, String> {
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
    let results = match crate::blocks::run(
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
