//! `kvtier-loadgen crash`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::{fail_early, fresh_dir, verdict};
use crate::{crash, report, server_process};

/// `kvtier-loadgen crash`'s flags.
#[derive(Args, Debug)]
pub struct CrashArgs {
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

/// Runs `kvtier-loadgen crash`: empties the data directory, runs the
/// crash harness ([`crash::run`]) and writes `OUT/results.json`. Success
/// when the harness passed; else each problem goes to stderr.
///
/// # Errors
/// The data directory cannot be emptied or the output written; a harness
/// that cannot run also writes `OUT/results.json` saying why.
pub async fn run(args: CrashArgs) -> Result<ExitCode, String> {
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
