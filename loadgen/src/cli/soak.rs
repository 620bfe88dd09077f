//! `kvtier-loadgen soak`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::{fail_early, fresh_dir, verdict};
use crate::{report, server_process, soak};

/// `kvtier-loadgen soak`'s flags.
#[derive(Args, Debug)]
pub struct SoakArgs {
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

/// Runs `kvtier-loadgen soak`: empties the data directory, runs the soak
/// ([`soak::run`]) and writes `OUT/results.json` and `OUT/report.html`.
/// Success when the soak passed; else each problem goes to stderr.
///
/// # Errors
/// The data directory cannot be emptied or the output written; a soak that
/// cannot run also writes `OUT/results.json` saying why.
pub async fn run(args: SoakArgs) -> Result<ExitCode, String> {
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
