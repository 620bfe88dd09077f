//! Soak: the sweep's mixed workload at one concurrency for a long time,
//! with the server restarted every few windows (SIGTERM and SIGKILL in
//! turn). After each window the harness samples the server's RSS and open
//! file descriptors from `/proc` and the window's p99 latencies; the
//! verdict asks that they stay flat.
//!
//! Flat means, comparing the median of the last third of windows with the
//! median of the first third: RSS grew by at most [`RSS_GROWTH_MAX`], open
//! fds by at most [`FDS_GROWTH_MAX`], and the iteration p99 by at most
//! [`P99_GROWTH_MAX`] (loose: these machines are shared and noisy); and no
//! operation failed or read wrong bytes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::server_process::Launcher;
use crate::sweep::{self, SweepConfig, Workload};
use crate::target::Target;

/// Largest allowed ratio of late to early median RSS.
pub const RSS_GROWTH_MAX: f64 = 1.25;
/// Largest allowed growth of the median open-fd count.
pub const FDS_GROWTH_MAX: f64 = 16.0;
/// Largest allowed ratio of late to early median iteration p99.
pub const P99_GROWTH_MAX: f64 = 2.0;

/// What [`run`] does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakConfig {
    /// The `kvtier` binary.
    pub server_bin: PathBuf,
    /// Data directory (kept across restarts).
    pub data_dir: PathBuf,
    /// Directory for `server.log`.
    pub out_dir: PathBuf,
    /// Extra `kvtier serve` arguments; the harness adds `--listen
    /// 127.0.0.1:0` and `--data-dir`.
    pub serve_args: Vec<String>,
    /// Measured windows (a sample each).
    pub windows: usize,
    /// Seconds per window (60: a sample a minute).
    pub window_s: f64,
    /// Restart the server after every this many windows (0: never).
    pub restart_every: usize,
    /// Closed-loop workers.
    pub concurrency: usize,
    /// Working set in MiB.
    pub working_set_mib: u64,
    /// Seed of keys and choices.
    pub seed: u64,
}

/// One window's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakSample {
    /// Window number from 0.
    pub window: usize,
    /// Seconds since the soak began, at the sample.
    pub elapsed_s: f64,
    /// Restarts before this window.
    pub restarts: usize,
    /// Server resident set size, bytes.
    pub rss_bytes: u64,
    /// Server open file descriptors.
    pub open_fds: u64,
    /// Tokens/s over the window.
    pub tokens_per_s: f64,
    /// Leading keys found over keys looked up (the sweep asks for a stored
    /// chain plus never-stored keys, so it is constant while nothing is lost).
    pub prefix_hit_rate: f64,
    /// Reads of a block a lookup had just found that came back 404.
    pub read_misses: u64,
    /// p99 per operation and per iteration, µs.
    pub lookup_p99_us: u64,
    /// Block reads.
    pub read_p99_us: u64,
    /// Block writes.
    pub write_p99_us: u64,
    /// Whole iterations.
    pub iteration_p99_us: u64,
    /// Failed operations.
    pub errors: u64,
    /// The first failure, if any.
    pub first_error: Option<String>,
    /// Blocks read back wrong.
    pub wrong_bytes: u64,
}

/// One restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakRestart {
    /// After this window.
    pub after_window: usize,
    /// "sigterm" or "sigkill".
    pub signal: String,
    /// Spawn to "listening", ms.
    pub restart_ms: f64,
}

/// Early against late medians.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Drift {
    /// Median of the first third of windows.
    pub early: f64,
    /// Median of the last third.
    pub late: f64,
    /// late / early.
    pub ratio: f64,
}

/// The soak's figures and verdict (`results.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakResults {
    /// Always "soak".
    pub mode: String,
    /// The settings.
    pub config: SoakConfig,
    /// Block size.
    pub block_bytes: u64,
    /// Per window.
    pub samples: Vec<SoakSample>,
    /// Restarts in order.
    pub restarts: Vec<SoakRestart>,
    /// RSS, bytes.
    pub rss: Drift,
    /// Open fds.
    pub fds: Drift,
    /// Iteration p99, µs.
    pub iteration_p99: Drift,
    /// Failed operations over the soak.
    pub errors: u64,
    /// Wrong blocks over the soak.
    pub wrong_bytes: u64,
    /// Why it did not pass, in words.
    pub problems: Vec<String>,
    /// Flat and clean (see the module docs).
    pub passed: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if !n.is_multiple_of(2) {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Medians of the first and last thirds (at least one sample each) of `v`.
pub fn drift(v: &[f64]) -> Drift {
    let third = v.len().div_ceil(3).max(1).min(v.len());
    let early = median(v[..third].to_vec());
    let late = median(v[v.len() - third..].to_vec());
    Drift { early, late, ratio: if early > 0.0 { late / early } else { 0.0 } }
}

/// Runs the soak.
///
/// # Errors
/// A message when the server cannot start or restart, or its geometry
/// cannot be read, or the working set cannot be stored.
pub async fn run(cfg: SoakConfig, progress: bool) -> Result<SoakResults, String> {
    let launcher = Launcher::new(&cfg.server_bin, &cfg.data_dir, &cfg.out_dir, &cfg.serve_args)?;
    let concurrency = cfg.concurrency.max(1);
    let open = |url: String| async move { Target::open(&url, false, 1, concurrency).await.map(Arc::new).map_err(|e| e.to_string()) };
    let mut server = launcher.start().await?;
    let mut target = open(server.url().to_string()).await?;
    let (block_bytes, block_tokens, model) =
        target.geometry().await.map_err(|e| e.to_string())?.ok_or("the server reported no geometry")?;
    let sweep_cfg = SweepConfig {
        concurrency: vec![concurrency],
        warmup_s: 0.0,
        duration_s: cfg.window_s.max(0.1),
        mix: sweep::Mix { lookups: 7, reads: 6, writes: 3 },
        working_set_blocks: ((cfg.working_set_mib << 20) / block_bytes).max(8) as usize,
        chain_blocks: 8,
        lookup_extra_blocks: 2,
        block_bytes,
        block_tokens,
        model,
        seed: cfg.seed,
        sla_ms: 100.0,
        target_tokens_per_s: 0.0,
        progress,
    };
    let workload = Arc::new(Workload::new(&sweep_cfg));
    sweep::preload(target.clone(), workload.clone(), progress).await.map_err(|e| format!("storing the working set: {e}"))?;
    let began = Instant::now();
    let mut samples = Vec::new();
    let mut restarts: Vec<SoakRestart> = Vec::new();
    for window in 0..cfg.windows {
        let level = sweep::run_level(target.clone(), workload.clone(), concurrency, window, None).await;
        let sample = SoakSample {
            window,
            elapsed_s: began.elapsed().as_secs_f64(),
            restarts: restarts.len(),
            rss_bytes: server.rss_bytes().unwrap_or(0),
            open_fds: server.open_fds().unwrap_or(0),
            tokens_per_s: level.tokens_per_s,
            prefix_hit_rate: level.prefix_hit_rate,
            read_misses: level.read_misses,
            lookup_p99_us: level.latency.lookup.p99_us,
            read_p99_us: level.latency.read.p99_us,
            write_p99_us: level.latency.write.p99_us,
            iteration_p99_us: level.latency.iteration.p99_us,
            errors: level.errors,
            first_error: level.first_error.clone(),
            wrong_bytes: level.wrong_bytes,
        };
        if progress {
            eprintln!(
                "window {:>3} ({:>6.0} s): RSS {:>7.1} MiB, {:>4} fds, {:>8.0} tokens/s, p99 lookup/read/write {}/{}/{} µs, errors {}, wrong {}",
                window,
                sample.elapsed_s,
                sample.rss_bytes as f64 / (1 << 20) as f64,
                sample.open_fds,
                sample.tokens_per_s,
                sample.lookup_p99_us,
                sample.read_p99_us,
                sample.write_p99_us,
                sample.errors,
                sample.wrong_bytes
            );
        }
        samples.push(sample);
        if cfg.restart_every > 0 && (window + 1) % cfg.restart_every == 0 && window + 1 < cfg.windows {
            let signal = if restarts.len().is_multiple_of(2) { "sigterm" } else { "sigkill" };
            drop(target);
            if signal == "sigterm" {
                server.stop().map_err(|e| format!("stopping the server: {e}"))?;
            } else {
                server.kill9();
            }
            server = launcher.start().await?;
            target = open(server.url().to_string()).await?;
            let restart_ms = server.start_time.as_secs_f64() * 1e3;
            if progress {
                eprintln!("restart after window {window} ({signal}): {restart_ms:.1} ms");
            }
            restarts.push(SoakRestart { after_window: window, signal: signal.into(), restart_ms });
        }
    }
    drop(target);
    server.stop().map_err(|e| format!("stopping the server: {e}"))?;
    let rss = drift(&samples.iter().map(|s| s.rss_bytes as f64).collect::<Vec<_>>());
    let fds = drift(&samples.iter().map(|s| s.open_fds as f64).collect::<Vec<_>>());
    let iteration_p99 = drift(&samples.iter().map(|s| s.iteration_p99_us as f64).collect::<Vec<_>>());
    let errors = samples.iter().map(|s| s.errors).sum();
    let wrong_bytes = samples.iter().map(|s| s.wrong_bytes).sum();
    let mut problems = Vec::new();
    if errors > 0 {
        let first = samples.iter().find_map(|s| s.first_error.clone()).unwrap_or_default();
        problems.push(format!("{errors} operations failed; first: {first}"));
    }
    if wrong_bytes > 0 {
        problems.push(format!("{wrong_bytes} blocks read back wrong"));
    }
    if rss.ratio > RSS_GROWTH_MAX {
        problems.push(format!("RSS grew {:.2}× (median {:.0} → {:.0} MiB)", rss.ratio, rss.early / 1048576.0, rss.late / 1048576.0));
    }
    if fds.late - fds.early > FDS_GROWTH_MAX {
        problems.push(format!("open fds grew from {:.0} to {:.0}", fds.early, fds.late));
    }
    if iteration_p99.ratio > P99_GROWTH_MAX {
        problems
            .push(format!("iteration p99 grew {:.2}× ({:.0} → {:.0} µs)", iteration_p99.ratio, iteration_p99.early, iteration_p99.late));
    }
    if samples.iter().any(|s| s.rss_bytes == 0 || s.open_fds == 0) {
        problems.push("RSS or fds could not be read from /proc".into());
    }
    Ok(SoakResults {
        mode: "soak".into(),
        block_bytes,
        samples,
        restarts,
        rss,
        fds,
        iteration_p99,
        errors,
        wrong_bytes,
        passed: problems.is_empty(),
        problems,
        config: cfg,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_compares_first_and_last_thirds() {
        let d = drift(&[10.0, 12.0, 11.0, 50.0, 20.0, 22.0]);
        assert_eq!((d.early, d.late), (11.0, 21.0));
        assert!((d.ratio - 21.0 / 11.0).abs() < 1e-9);
        let one = drift(&[5.0]);
        assert_eq!((one.early, one.late, one.ratio), (5.0, 5.0, 1.0));
        assert_eq!(drift(&[]).ratio, 0.0);
    }
}
