//! The crash and soak harnesses of `kvtier-loadgen`, in their short
//! versions, against the real server binary (`make crash-test` and
//! `make soak` run the long ones).

mod common;

use std::path::PathBuf;

use kvtier_loadgen::{crash, report, soak};

/// The test server's flags ([`common::serve_flags`]; the harness's
/// launcher adds `--listen` and `--data-dir`) with `disk_gb` of disk,
/// `block_bytes` blocks, a 64 MiB RAM tier and the log at `info`.
fn serve_args(disk_gb: &str, block_bytes: u64) -> Vec<String> {
    let mut args = common::serve_flags();
    common::set_flag(&mut args, "--block-bytes", &block_bytes.to_string());
    common::set_flag(&mut args, "--disk-gb", disk_gb);
    common::set_flag(&mut args, "--log-level", "info");
    common::set_flag(&mut args, "--ram-gb", "0.0625");
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_put_load_loses_no_acknowledged_block() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = crash::CrashConfig {
        server_bin: PathBuf::from(env!("CARGO_BIN_EXE_kvtier")),
        data_dir: dir.path().join("data"),
        out_dir: dir.path().join("out"),
        serve_args: serve_args("1", common::BLOCK_BYTES),
        rounds: 4,
        clients: 4,
        kill_min_ms: 150,
        kill_max_ms: 600,
        overwrite_share: 0.2,
        read_share: 0.2,
        restart_target_ms: 2000,
        seed: 7,
    };
    let r = crash::run(cfg, false).await.expect("harness runs");
    assert_eq!(r.rounds, 4);
    assert!(r.passed, "crash harness failed: {:?}", r.problems);
    assert_eq!((r.lost, r.wrong), (0, 0));
    assert!(r.blocks_acknowledged > 100, "too little load: {}", r.blocks_acknowledged);
    // Every kill landed under load: some PUTs were never acknowledged.
    let unacked: u64 = r.per_round.iter().map(|x| x.puts_unacknowledged).sum();
    assert!(unacked > 0, "no kill hit a PUT in flight: {:?}", r.per_round);
    assert!(r.per_round.iter().all(|x| x.reads > 0 && x.keys_verified > 0 && x.restart_ms > 0.0));
    // Every key stored is verified again after the last restart.
    assert!(r.per_round.last().unwrap().keys_verified >= r.keys_stored);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_soak_samples_rss_fds_and_p99_across_both_kinds_of_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = soak::SoakConfig {
        server_bin: PathBuf::from(env!("CARGO_BIN_EXE_kvtier")),
        data_dir: dir.path().join("data"),
        out_dir: dir.path().join("out"),
        serve_args: serve_args("0.5", common::BLOCK_BYTES),
        windows: 3,
        window_s: 1.5,
        restart_every: 1,
        concurrency: 2,
        working_set_mib: 4,
        seed: 3,
    };
    let r = soak::run(cfg, false).await.expect("soak runs");
    assert_eq!(r.samples.len(), 3);
    let signals: Vec<&str> = r.restarts.iter().map(|x| x.signal.as_str()).collect();
    assert_eq!(signals, ["sigterm", "sigkill"]);
    assert_eq!((r.errors, r.wrong_bytes), (0, 0), "{:?}", r.problems);
    for s in &r.samples {
        assert!(s.rss_bytes > 1 << 20 && s.open_fds > 3, "{s:?}");
        assert!(s.tokens_per_s > 0.0 && s.iteration_p99_us > 0, "{s:?}");
    }
    // Data survived both restarts: every window finds the same prefix hits
    // (8 of each 10 keys looked up) and reads them all.
    for s in &r.samples {
        assert!((s.prefix_hit_rate - 0.8).abs() < 1e-9 && s.read_misses == 0, "{s:?}");
    }
    let html = report::soak_html(&r);
    assert_eq!(html.matches("<svg").count(), 4, "four charts");
    common::browser::assert_report_renders(&html, dir.path(), "soak");
}
