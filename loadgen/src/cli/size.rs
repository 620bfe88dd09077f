//! `kvtier-loadgen size`: its flags and its run (the sizing itself is
//! [`crate::size`]).

use std::path::PathBuf;

/// `kvtier-loadgen size`'s flags.
#[derive(clap::Args, Debug)]
pub struct SizeArgs {
    /// Trace files (`*.kvtrace`), or directories holding them (every trace
    /// file inside, in name order: one recording's rotated files).
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Directory for results.json and report.html (written only when every
    /// trace reads).
    #[arg(long, default_value = "target/loadgen/size")]
    pub out: PathBuf,
    /// Also estimate the memory curve by SHARDS at this sampling rate
    /// (0 < R ≤ 1; e.g. 0.01), beside the exact curve.
    #[arg(long)]
    pub sample_rate: Option<f64>,
    /// Also estimate it by fixed-size SHARDS tracking at most this many
    /// blocks (bounded memory).
    #[arg(long, conflicts_with = "sample_rate")]
    pub sample_blocks: Option<usize>,
    /// Skip the exact memory curve (with --sample-rate or --sample-blocks,
    /// for traces too long for one exact pass).
    #[arg(long)]
    pub skip_exact: bool,
    /// GPU tier size to judge, GiB (default: the trace's server's).
    #[arg(long)]
    pub gpu_gb: Option<f64>,
    /// RAM tier size to judge, GiB (default: the trace's server's).
    #[arg(long)]
    pub ram_gb: Option<f64>,
    /// Disk size to judge, GiB (default: the trace's server's).
    #[arg(long)]
    pub disk_gb: Option<f64>,
    /// RAM sizes simulated with kvtier's own policy (0: none).
    #[arg(long, default_value_t = 24)]
    pub policy_sizes: usize,
    /// Sampling rate of those simulations (default: all blocks up to
    /// 50,000 distinct, fewer beyond).
    #[arg(long)]
    pub policy_rate: Option<f64>,
    /// Refuse traces whose blocks are not this many bytes.
    #[arg(long)]
    pub block_bytes: Option<u64>,
}

/// Runs `kvtier-loadgen size`: reads the traces, prints the table, writes
/// `OUT/results.json` and `OUT/report.html`.
///
/// # Errors
/// A flag out of range; a directory without trace files; a trace that
/// cannot be used (`FILE: at byte N: reason`, nothing written); the output
/// cannot be written.
pub fn run(args: SizeArgs) -> Result<(), String> {
    let rate_ok = |r: f64| r > 0.0 && r <= 1.0;
    if let Some(r) = args.sample_rate.filter(|r| !rate_ok(*r)) {
        return Err(format!("--sample-rate must be in (0, 1], got {r}"));
    }
    if let Some(r) = args.policy_rate.filter(|r| !rate_ok(*r)) {
        return Err(format!("--policy-rate must be in (0, 1], got {r}"));
    }
    if args.skip_exact && args.sample_rate.is_none() && args.sample_blocks.is_none() {
        return Err("--skip-exact needs --sample-rate or --sample-blocks".into());
    }
    let gb = |flag: &str, v: Option<f64>| -> Result<Option<u64>, String> {
        match v {
            Some(g) if !(g.is_finite() && g >= 0.0) => Err(format!("{flag} must be 0 or more GiB, got {g}")),
            Some(g) => Ok(Some((g * (1u64 << 30) as f64) as u64)),
            None => Ok(None),
        }
    };
    let mut files = Vec::new();
    for p in &args.traces {
        if p.is_dir() {
            let mut inside: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| format!("cannot list {}: {e}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.to_string_lossy().ends_with(kvtier_engine::trace::FILE_SUFFIX))
                .collect();
            if inside.is_empty() {
                return Err(format!("{}: no trace files (*{}) in this directory", p.display(), kvtier_engine::trace::FILE_SUFFIX));
            }
            inside.sort();
            files.extend(inside);
        } else {
            files.push(p.clone());
        }
    }
    let opts = crate::size::SizeOptions {
        sample_rate: args.sample_rate,
        sample_blocks: args.sample_blocks,
        skip_exact: args.skip_exact,
        gpu_bytes: gb("--gpu-gb", args.gpu_gb)?,
        ram_bytes: gb("--ram-gb", args.ram_gb)?,
        disk_bytes: gb("--disk-gb", args.disk_gb)?,
        policy_sizes: args.policy_sizes,
        policy_rate: args.policy_rate,
        ..Default::default()
    };
    let workload = crate::size::load(&files, args.block_bytes)?;
    let report = crate::size::size(&workload, &opts);
    print!("{}", crate::size::text(&report));
    crate::report::write_out(&args.out, &report, Some(crate::report::size_html(&report)))?;
    println!("results: {}  report: {}", args.out.join("results.json").display(), args.out.join("report.html").display());
    Ok(())
}
