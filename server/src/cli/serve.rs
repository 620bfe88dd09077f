//! `kvtier serve`: the start-up (each step timed), the shards started on
//! the engine thread, the signals, the clean stop.

use std::fs;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};

use kvtier_engine::store::START_WARN_AFTER;
use kvtier_server::{metrics, shard, tenants};

use super::args::*;
use super::listen::bind_listeners;

/// Where the kernel gives its transparent huge page mode.
const THP_ENABLED_PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// How long each step of `kvtier serve`'s start-up took, logged once when
/// the shards listen, so a slow start names what it waited for (a warning
/// past [`START_WARN_AFTER`]).
struct StartSteps {
    started: std::time::Instant,
    last: std::time::Instant,
    steps: Vec<(&'static str, std::time::Duration)>,
}

impl StartSteps {
    fn new(started: std::time::Instant) -> StartSteps {
        StartSteps { started, last: started, steps: Vec::new() }
    }

    /// The step `what` ended now.
    fn end(&mut self, what: &'static str) {
        let now = std::time::Instant::now();
        self.steps.push((what, now - self.last));
        self.last = now;
    }

    fn log(&self) {
        let total = self.last - self.started;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let steps: Vec<String> = self.steps.iter().map(|(what, d)| format!("{what} {:.0} ms", ms(*d))).collect();
        let line = format!("start-up took {:.0} ms: {}", ms(total), steps.join(", "));
        match self.steps.iter().max_by_key(|(_, d)| *d) {
            Some((what, d)) if total > START_WARN_AFTER => {
                tracing::warn!("{line}; over {START_WARN_AFTER:?}, mostly waiting for {what} ({:.0} ms)", ms(*d))
            }
            _ => tracing::info!("{line}"),
        }
    }
}

/// Holds an exclusive `flock` on `<data-dir>/LOCK` for the process's life,
/// so two servers never write one data directory.
pub(crate) fn lock_data_dir(dir: &Path) -> Result<fs::File, String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create data directory {}: {e}", dir.display()))?;
    let path = dir.join("LOCK");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(format!("data directory {} is in use by another kvtier process", dir.display()));
    }
    Ok(file)
}

/// Warns, at start, of a device layout that costs balance or isolation:
/// shards not a multiple of the devices (some devices hold more shards'
/// logs, so more blocks and more I/O), fewer shards than devices not
/// dividing them (some shards span more devices than others), and two
/// directories on one filesystem (they share its bandwidth and fail
/// together).
fn warn_about_devices(layout: &kvtier_engine::devices::Layout, shards: usize) {
    let n = layout.devices.len();
    if shards < n {
        tracing::info!(
            "{shards} shards over {n} data directories: each shard's segments rotate over the devices it spans (shard s on every device d with d mod {shards} = s); a device that fails costs the writes of its shard, and one replaced costs that shard's segments on its other devices too"
        );
        if !n.is_multiple_of(shards) {
            tracing::warn!(
                "{n} data directories over {shards} shards: not a multiple, so {} shards span {} devices and the rest {} (the smallest share of its devices sets each shard's capacity); use a number of shards that divides {n} for an even spread",
                n % shards,
                n / shards + 1,
                n / shards
            );
        }
    } else if n > 1 && !shards.is_multiple_of(n) {
        tracing::warn!(
            "{shards} shards over {n} data directories: not a multiple, so {} of them hold {} shards' logs and the rest {} (use a multiple of {n} shards for an even spread)",
            shards % n,
            shards / n + 1,
            shards / n
        );
    }
    let present: Vec<_> = layout.devices.iter().filter(|d| d.absent.is_none()).collect();
    for (i, a) in present.iter().enumerate() {
        if let Some(b) = present[..i].iter().find(|b| b.fs_id == a.fs_id && a.fs_id != "?") {
            tracing::warn!(
                "data directories {} and {} are on one filesystem ({}): they share its bandwidth and fail together",
                b.dir.display(),
                a.dir.display(),
                a.fs_id
            );
        }
    }
    for d in present {
        tracing::info!(
            "device {}: {} ({} bytes of segments, filesystem {}), shards {:?}",
            d.index,
            d.dir.display(),
            d.capacity_bytes,
            d.fs_id,
            layout.shards_on(d.index as usize, shards)
        );
    }
}

fn read_token(path: &Path) -> Result<Arc<[u8]>, String> {
    let raw = fs::read_to_string(path).map_err(|e| format!("cannot read --auth-token-file {}: {e}", path.display()))?;
    let token = raw.trim();
    if token.is_empty() {
        return Err(format!("--auth-token-file {} is empty", path.display()));
    }
    Ok(Arc::from(token.as_bytes()))
}

pub(crate) fn serve(args: ServeArgs) -> Result<(), String> {
    let started = std::time::Instant::now();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log_level).map_err(|e| format!("--log-level {:?}: {e}", args.log_level))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();

    let auth_token = args.auth_token_file.as_deref().map(read_token).transpose()?;
    if !args.listen.ip().is_loopback() && auth_token.is_none() && args.tenants.is_none() {
        return Err(format!(
            "refusing to listen on non-loopback address {} without --auth-token-file or --tenants: anyone who can reach it could read and overwrite KV blocks",
            args.listen
        ));
    }
    for (flag, value) in [
        ("--idle-timeout-s", args.idle_timeout_s),
        ("--header-timeout-s", args.header_timeout_s),
        ("--body-timeout-s", args.body_timeout_s),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return Err(format!("{flag} must be a positive number of seconds, got {value}"));
        }
    }
    if args.put_inflight_mib == 0 {
        return Err("--put-inflight-mib must be at least 1".into());
    }
    let (mut config, segment_origin) = args.store.config()?;
    let (gpu_config, gpu_line) = args.store.gpu.open(&config)?;
    config.gpu = gpu_config;
    let s3_tier = match &args.s3.s3_url {
        Some(_) => Some(kvtier_s3::S3Tier::new(&args.s3, config.shards, config.geometry.block_bytes, config.health_window)?),
        None => None,
    };
    config.remote = s3_tier.clone().map(|t| t as Arc<dyn kvtier_engine::remote::Remote>);
    if let Some(dir) = &args.trace_dir {
        let recorder = kvtier_engine::trace::Recorder::new(dir, args.trace_max_mb.saturating_mul(1 << 20))?;
        recorder.set_header(config.trace_header("kvtier serve"));
        futures::executor::block_on(recorder.start()).map_err(|e| format!("--trace-dir {}: {e}", dir.display()))?;
        config.trace = Some(recorder);
    }
    let stalls = match args.stall_threshold_ms {
        0 => None,
        ms => Some(kvtier_engine::stall::Stalls::new(config.shards, std::time::Duration::from_millis(ms), args.stall_log.clone())?),
    };
    config.stalls = stalls.clone();
    let tenancy = match &args.tenants {
        Some(path) => {
            let capacity = tenants::Capacity {
                shard_blocks: config.shard_capacity_blocks(),
                shards: config.shards,
                block_bytes: config.geometry.block_bytes,
            };
            let t = Arc::new(tenants::Tenancy::load(path, capacity)?);
            config.owners = t.owners();
            Some(t)
        }
        None => None,
    };
    let mut steps = StartSteps::new(started);
    steps.end("configuration");
    let layout = config.layout();
    let _locks = layout.devices.iter().filter(|d| d.absent.is_none()).map(|d| lock_data_dir(&d.dir)).collect::<Result<Vec<_>, _>>()?;
    steps.end("the data-directory lock");
    warn_about_devices(&layout, config.shards);
    let mut listeners = bind_listeners(args.listen, config.shards)
        .map_err(|e| format!("cannot listen on {}: {e} (is another kvtier running?)", args.listen))?;
    steps.end("the listening sockets");

    let local = args.local.open(&config.data_dir, config.shards)?;
    if let Some(l) = &local {
        // Known before any shard accepts: HELLO answers with it from the
        // first connection on (set after the listening line, a client that
        // connected at once was told there was no HTTP address).
        if let Some(addr) = listeners.local_addr() {
            let _ = l.http_addr.set(addr);
        }
        steps.end("the local socket");
    }
    // Before the store opens: its first events (blocks recovery finds)
    // follow the publisher's [AllBlocksCleared], and a bad flag or a port
    // in use stops the start here.
    let events = args.events.open()?;
    if let Some(publisher) = &events {
        config.events = Some(publisher.clone() as Arc<dyn kvtier_engine::events::EventSink>);
        steps.end("the KV event sockets");
    }

    let mut signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT, signal_hook::consts::SIGHUP])
            .map_err(|e| format!("installing signal handlers: {e}"))?;
    let (ready_tx, ready_rx) = mpsc::channel();
    let shared = Arc::new(shard::Process {
        auth_token,
        tenancy: tenancy.clone(),
        shutdown: Default::default(),
        put_budget_bytes: args.put_inflight_mib << 20,
        http: kvtier_server::http::accept::HttpConfig {
            listeners: listeners.take_sockets(),
            stats: metrics::RequestStats::new(config.shards, &kvtier_server::http::routes::HTTP_ROUTE_NAMES),
            idle_timeout: std::time::Duration::from_secs_f64(args.idle_timeout_s),
            header_timeout: std::time::Duration::from_secs_f64(args.header_timeout_s),
            body_timeout: std::time::Duration::from_secs_f64(args.body_timeout_s),
        },
        local: local.clone(),
        events: events.clone(),
        metrics: Default::default(),
        stalls: stalls.clone(),
        ready: Mutex::new(ready_tx),
    });
    if let Some(tier) = &s3_tier {
        // S3 down at start is not fatal: reads miss and uploads fail, counted.
        match tier.probe() {
            Ok(()) => tracing::info!("shared tier {}", kvtier_engine::remote::Remote::describe(tier.as_ref())),
            Err(e) => tracing::warn!(
                "shared tier {} does not answer yet ({e}); serving from the local tiers meanwhile",
                kvtier_engine::remote::Remote::describe(tier.as_ref())
            ),
        }
        steps.end("the S3 probe");
    }
    let data_dirs: Vec<String> = layout
        .devices
        .iter()
        .map(|d| if d.absent.is_some() { format!("device {} absent", d.index) } else { d.dir.display().to_string() })
        .collect();
    let (shards, geometry, segment_bytes) = (config.shards, config.geometry.clone(), config.segment_bytes);
    let engine = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("kvtier-engine".into())
            .spawn(move || kvtier_engine::run(config, move |store| shard::serve(store, shared.clone())))
            .map_err(|e| format!("starting the engine thread: {e}"))?
    };

    let mut addr = None;
    let mut failure = None;
    let mut ready = 0;
    while ready < shards {
        match ready_rx.recv_timeout(std::time::Duration::from_millis(50)) {
            Ok(Ok(a)) => {
                addr = Some(a);
                ready += 1;
            }
            Ok(Err(e)) => {
                failure = Some(e);
                break;
            }
            // The engine stopped before every shard served (e.g. the data
            // directory has another geometry): its error is in the join.
            Err(mpsc::RecvTimeoutError::Timeout) if engine.is_finished() => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    if ready < shards && failure.is_none() {
        addr = None;
    }
    if failure.is_some() || addr.is_none() {
        shared.shutdown.request();
        let engine_error = engine.join().map_err(|_| "engine thread panicked".to_string())?.err().map(|e| e.to_string());
        if let Some(publisher) = &events {
            publisher.stop();
        }
        return Err(failure.or(engine_error).unwrap_or_else(|| "the store stopped before serving".into()));
    }
    let addr = addr.expect("bound");
    steps.end("the shards (executors, recovery, listeners)");
    steps.log();
    println!(
        "kvtier listening on http://{addr} (h2c and HTTP/1.1; {shards} shards; model {}; block_bytes {}; segment_bytes {} {}; data dir {})",
        geometry.model,
        geometry.block_bytes,
        segment_bytes,
        segment_origin.describe(),
        data_dirs.join(", ")
    );
    if let Some(l) = &local {
        println!("kvtier: same-host data plane on unix://{} (docs/LOCAL.md)", l.path.display());
    }
    if let Some(line) = gpu_line {
        println!("kvtier: {line}");
    }
    if let Some(t) = &tenancy {
        let table = t.table();
        let kinds = |k: &str| table.entries.iter().filter(|e| e.kind == k).count();
        println!(
            "kvtier: {} tenants and {} shared namespaces from {} (keys scoped per tenant; SIGHUP reloads; docs/OPERATIONS.md \"Tenants\")",
            kinds("tenant"),
            kinds("namespace"),
            t.path().display()
        );
    }
    if let Some(p) = &events {
        let replay = p.replay_endpoint().map(|a| format!(", replay on tcp://{a}")).unwrap_or_default();
        println!("kvtier: KV events on tcp://{}{replay} (vLLM's format; docs/OPERATIONS.md \"KV events for routers\")", p.endpoint());
    }
    if let Some(dir) = &args.trace_dir {
        println!("kvtier: recording block operations to {} (at most {} MiB; docs/TRACE.md)", dir.display(), args.trace_max_mb);
    }
    tracing::info!(%addr, shards, block_bytes = geometry.block_bytes, segment_bytes, "serving");
    if std::fs::read_to_string(THP_ENABLED_PATH).is_ok_and(|mode| mode.contains("[never]")) {
        tracing::warn!(
            "transparent huge pages are off ({THP_ENABLED_PATH} is never): DMA buffers sit in scattered 4 KiB pages, so block \
             reads reach the disk as more, smaller requests (docs/BENCHMARKS.md, \"Huge pages for DMA buffers\")"
        );
    }

    {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("kvtier-signals".into())
            .spawn(move || {
                let mut count = 0;
                for signal in signals.forever() {
                    if signal == signal_hook::consts::SIGHUP {
                        match &shared.tenancy {
                            Some(t) => {
                                tracing::info!("SIGHUP: reloading the tenants file {}", t.path().display());
                                t.request_reload();
                            }
                            None => tracing::info!("SIGHUP ignored: no --tenants file to reload"),
                        }
                        continue;
                    }
                    count += 1;
                    if count > 1 {
                        eprintln!("kvtier: second signal {signal}, exiting now");
                        std::process::exit(130);
                    }
                    tracing::info!(signal, "shutting down: no new connections, draining in-flight requests");
                    shared.shutdown.request();
                }
            })
            .map_err(|e| format!("starting the signal thread: {e}"))?;
    }
    let outcome = engine.join().map_err(|_| "engine thread panicked".to_string())?;
    if let Some(s) = &stalls {
        // The shards are gone: the last stalls are logged before the exit.
        s.stop();
    }
    if let Some(publisher) = &events {
        // The shards' last events are queued: sent as the last batch.
        publisher.stop();
    }
    if let Some(l) = &local {
        // The socket file goes with the server that made it.
        let _ = fs::remove_file(&l.path);
    }
    if let Some(tier) = &s3_tier {
        let left = tier.drain(kvtier_s3::DRAIN_MAX);
        if left > 0 {
            tracing::warn!("{left} write-behind uploads still queued or in flight after {:?}; not uploaded", kvtier_s3::DRAIN_MAX);
        }
    }
    outcome.map_err(|e| e.to_string())?;
    tracing::info!("stopped cleanly");
    Ok(())
}
