//! `kvtier-loadgen engine-report`: its flags and its run.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

/// `kvtier-loadgen engine-report`'s flags.
#[derive(Args, Debug)]
pub struct EngineReportArgs {
    /// results.json of clients/python/bench/bench_engine.py.
    #[arg(long)]
    results: PathBuf,
    /// Directory the report is written to.
    #[arg(long)]
    out: PathBuf,
}

/// Runs `kvtier-loadgen engine-report`: writes `OUT/report.html` from the
/// benchmark's results ([`crate::engine_report::run`]).
///
/// # Errors
/// As [`crate::engine_report::run`].
pub fn run(args: EngineReportArgs) -> Result<ExitCode, String> {
    crate::engine_report::run(&args.results, &args.out).map(|()| ExitCode::SUCCESS)
}
