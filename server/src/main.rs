//! `kvtier`: the KV-cache block store sidecar.
//!
//! `kvtier serve` starts the block API on one port (HTTP/2 with prior
//! knowledge and HTTP/1.1); `kvtier info` describes a data directory.

use std::fs;
use std::net::SocketAddr;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};

use clap::{ArgAction, Args, Parser, Subcommand};
use kvtier_engine::geometry::{Geometry, StoreManifest, BLOCK_TOKENS_DEFAULT, MODEL_DEFAULT};
use kvtier_engine::store::{
    auto_segment_bytes, IO_DEPTH_DEFAULT, IO_MEMORY_BYTES_DEFAULT, IO_MEMORY_SHARD_BYTES_MIN, IO_QUEUE_MAX_DEFAULT, SNAPSHOT_SECS_DEFAULT,
    START_WARN_AFTER,
};
use kvtier_engine::StoreConfig;
use kvtier_server::{gpu, limits, local, metrics, server, tenants};

// jemalloc with transparent huge pages, so the DMA buffers block reads land
// in are 2 MiB runs (why, and the figures: `kvtier_engine::alloc`).
kvtier_engine::jemalloc_with_huge_pages!();

/// This machine's physical memory in bytes (`sysconf`), if known.
fn memory_total_bytes() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page_bytes) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && page_bytes > 0).then(|| pages as u64 * page_bytes as u64)
}

/// Where the kernel gives its transparent huge page mode.
const THP_ENABLED_PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// kvtier: a KV-cache block store that runs beside an LLM inference engine.
///
/// It stores fixed-size blocks of attention KV cache (128 tokens each by
/// default) in an O_DIRECT log on NVMe, and serves them over HTTP/2 (h2c,
/// prior knowledge) and HTTP/1.1 on one port. See docs/API.md.
#[derive(Parser, Debug)]
#[command(name = "kvtier", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start the sidecar: open (or create) the data directory and serve the
    /// block API until SIGTERM or SIGINT.
    Serve(Box<ServeArgs>),
    /// Print a data directory's geometry and segment usage, then exit.
    Info(InfoArgs),
    /// Verify every slot header and payload CRC-32 of a stopped store and
    /// list the damaged blocks. Exits 0 when clean, 1 when damage is found.
    Fsck(FsckArgs),
}

#[derive(Args, Debug)]
struct FsckArgs {
    /// Data directory to check (no server may have it open).
    #[arg(long, default_value = "./kvtier-data")]
    data_dir: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address to listen on. A non-loopback address requires
    /// --auth-token-file or --tenants.
    #[arg(long, default_value = "127.0.0.1:8085")]
    listen: SocketAddr,
    #[command(flatten)]
    store: StoreArgs,
    /// File holding a bearer token; every request must then send
    /// `Authorization: Bearer <token>`. Surrounding whitespace is ignored.
    #[arg(long, conflicts_with = "tenants")]
    auth_token_file: Option<PathBuf>,
    /// Tenants file (TOML; docs/OPERATIONS.md, "Tenants"): each tenant's
    /// token (or its SHA-256) and local-socket uids, the key space it
    /// reads and writes, shared namespaces, and per-tier reservations and
    /// limits (gpu_, ram_, nvme_ × reserved_gb, limit_gb). Every request
    /// must then carry a tenant's token (401 otherwise); a tenant's keys
    /// are its own. Reloaded on SIGHUP and by POST
    /// /v1/admin/tenants/reload (a refused file keeps the one in use).
    #[arg(long, value_name = "PATH")]
    tenants: Option<PathBuf>,
    /// Close a connection after this many seconds without a request in
    /// flight (HTTP/2 pings do not count as use).
    #[arg(long, default_value_t = limits::IDLE_TIMEOUT_DEFAULT.as_secs_f64())]
    idle_timeout_s: f64,
    /// HTTP/1.1 request headers must arrive within this many seconds (a
    /// client trickling them is disconnected).
    #[arg(long, default_value_t = limits::HEADER_READ_TIMEOUT.as_secs_f64())]
    header_timeout_s: f64,
    /// A request body must arrive in full within this many seconds, else
    /// 408 and nothing is stored.
    #[arg(long, default_value_t = limits::BODY_READ_TIMEOUT.as_secs_f64())]
    body_timeout_s: f64,
    /// PUT body bytes a shard admits at once (declared lengths of PUTs
    /// received on its connections and not yet answered), in MiB. A PUT
    /// past it is refused with 503 and Retry-After before its body is read;
    /// one PUT is always admitted.
    #[arg(long, default_value_t = limits::PUT_INFLIGHT_BYTES_DEFAULT >> 20)]
    put_inflight_mib: u64,
    /// Log filter: error, warn, info, debug, trace, or a tracing
    /// EnvFilter directive. Logs go to stderr.
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Record every block operation (time, operation, shard, block hash,
    /// serving tier; never keys or bytes) into trace files in this
    /// directory, from start-up; `POST /v1/admin/trace/stop` and `/start`
    /// stop and restart it. `kvtier-loadgen size` turns a trace into
    /// hit-ratio curves per tier size (docs/OPERATIONS.md, "Sizing the
    /// tiers"; format: docs/TRACE.md). Off by default.
    #[arg(long)]
    trace_dir: Option<PathBuf>,
    /// Bound on the trace files in --trace-dir together, in MiB (2^20
    /// bytes): a file is rotated at a quarter of it and the oldest trace
    /// files are deleted to stay under it (32 bytes per record: 1 GiB holds
    /// about 33 million operations).
    #[arg(long, default_value_t = kvtier_engine::trace::TRACE_MAX_MB_DEFAULT)]
    trace_max_mb: u64,
    #[command(flatten)]
    s3: kvtier_s3::S3Args,
    #[command(flatten)]
    local: local::LocalArgs,
}

#[derive(Args, Debug)]
struct StoreArgs {
    /// Data directory: store.json and shard-NNN/seg-NNNNNN.kvt segment files.
    #[arg(long, default_value = "./kvtier-data")]
    data_dir: PathBuf,
    /// Shards (one executor thread each). Default: the existing store's
    /// count, else the number of CPUs.
    #[arg(long)]
    shards: Option<usize>,
    /// Model preset fixing the block size (tiny-1b, mistral-7b, llama2-7b,
    /// llama3.1-8b, llama3.1-70b). Default: the existing store's, else
    /// llama3.1-8b (131,072 bytes/token, 16 MiB per 128-token block).
    #[arg(long)]
    model: Option<String>,
    /// Block size in bytes, instead of a model preset.
    #[arg(long, conflicts_with = "model")]
    block_bytes: Option<u64>,
    /// Tokens per block.
    #[arg(long, default_value_t = BLOCK_TOKENS_DEFAULT)]
    block_tokens: u32,
    /// Disk space for segments across all shards, in GiB (2^30 bytes);
    /// fractions allowed. When full, the oldest segment is reclaimed.
    #[arg(long, default_value_t = 16.0)]
    disk_gb: f64,
    /// Size of one segment file in MiB. Default: the existing store's, else
    /// the largest power of two up to 1024 that gives each shard at least 8
    /// segments of its --disk-gb share (and holds at least 4 blocks).
    #[arg(long)]
    segment_mib: Option<u64>,
    /// fdatasync after every write, for durability across power loss (a
    /// process crash loses nothing acknowledged even without it).
    #[arg(long)]
    sync: bool,
    /// Block reads and writes in flight per shard.
    #[arg(long, default_value_t = IO_DEPTH_DEFAULT)]
    io_depth: usize,
    /// Client block reads and writes allowed to wait for one of the
    /// --io-depth slots per shard; past it they are refused with 503 and
    /// Retry-After instead of queueing.
    #[arg(long, default_value_t = IO_QUEUE_MAX_DEFAULT)]
    io_queue_max: usize,
    /// DMA buffer memory for block reads and writes across all shards, in
    /// MiB, split evenly, at least 64 MiB per shard: allocated at start,
    /// faulted in on a helper thread and registered with io_uring (pinned)
    /// once the shards serve (on Linux before 6.0: at start). A streamed GET from
    /// NVMe keeps up to 16 MiB of chunk reads in flight; reads past this
    /// memory use heap buffers, which cost page faults (16 MiB GETs at
    /// concurrency 16 ran 1.18x slower with 64 MiB per shard).
    #[arg(long, default_value_t = IO_MEMORY_BYTES_DEFAULT >> 20)]
    io_memory_mib: u64,
    /// Pin shard i to CPU i (mod the CPU count).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pin_cpus: bool,
    /// Seconds between index snapshots (restart loads the newest and scans
    /// only what came after it); 0 writes one only at clean shutdown.
    #[arg(long, default_value_t = SNAPSHOT_SECS_DEFAULT)]
    snapshot_secs: u64,
    /// RAM tier across all shards, in GiB (2^30 bytes), mapped at start
    /// (2 MiB huge pages where available) and faulted in by a background
    /// thread once the shards serve; 0 turns it off. Each shard gets ram / shards / block_bytes slots.
    #[arg(long, default_value_t = 2.0)]
    ram_gb: f64,
    /// through: a PUT is acknowledged after its NVMe write (a crash loses
    /// nothing acknowledged). back: acknowledged from RAM; the block reaches
    /// NVMe when RAM demotes it or at a clean stop, and a crash loses blocks
    /// held only in RAM.
    #[arg(long, value_enum, default_value_t = WritePolicyArg::Through)]
    write_policy: WritePolicyArg,
    /// on: a read served from NVMe copies the block into the fastest memory
    /// tier (GPU, else RAM), and with a GPU tier a read served from RAM moves
    /// the block up to the GPU (promotion).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    promote: OnOff,
    /// How long an error keeps its tier "degraded" in /readyz, /v1/stats
    /// ("health") and /metrics (kvtier_tier_up), in ms. A tier is "ok" again
    /// once its last error is older than this and its condition (disk full,
    /// S3 circuit breaker open, GPU missing) has cleared.
    #[arg(long, default_value_t = 10_000)]
    health_window_ms: u64,
    #[command(flatten)]
    gpu: gpu::GpuArgs,
}

/// `--write-policy` values.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum WritePolicyArg {
    /// Acknowledge after the NVMe write.
    Through,
    /// Acknowledge from RAM.
    Back,
}

/// `--promote` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

#[derive(Args, Debug)]
struct InfoArgs {
    /// Data directory to describe.
    #[arg(long, default_value = "./kvtier-data")]
    data_dir: PathBuf,
}

impl StoreArgs {
    /// The store configuration, taking unset values from an existing
    /// store.json so `kvtier serve --data-dir D` reopens D as it was made.
    fn config(&self) -> Result<(StoreConfig, SegmentOrigin), String> {
        let stored = StoreManifest::read(&self.data_dir).ok();
        let geometry = match (&self.model, self.block_bytes, &stored) {
            (Some(model), _, _) => Geometry::from_model(model, self.block_tokens),
            (None, Some(bytes), _) => Geometry::from_block_bytes(bytes, self.block_tokens),
            (None, None, Some(m)) => Ok(m.geometry.clone()),
            (None, None, None) => Geometry::from_model(MODEL_DEFAULT, self.block_tokens),
        }
        .map_err(|e| e.to_string())?;
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let shards = self.shards.or(stored.as_ref().map(|m| m.shards as usize)).unwrap_or(cpus);
        if self.disk_gb.is_nan() || self.disk_gb <= 0.0 {
            return Err(format!("--disk-gb must be positive, got {}", self.disk_gb));
        }
        let disk_bytes = (self.disk_gb * (1u64 << 30) as f64) as u64;
        let (segment_bytes, segment_origin) = match (self.segment_mib, &stored) {
            (Some(mib), _) => (mib << 20, SegmentOrigin::Flag),
            (None, Some(m)) => (m.segment_bytes, SegmentOrigin::Stored),
            (None, None) => (auto_segment_bytes(disk_bytes, shards, geometry.block_bytes), SegmentOrigin::Chosen),
        };
        if self.ram_gb.is_nan() || self.ram_gb < 0.0 {
            return Err(format!("--ram-gb must be 0 or more, got {}", self.ram_gb));
        }
        if self.health_window_ms == 0 {
            return Err("--health-window-ms must be at least 1".into());
        }
        let io_memory_bytes = self.io_memory_mib.saturating_mul(1 << 20);
        if io_memory_bytes < IO_MEMORY_SHARD_BYTES_MIN {
            return Err(format!("--io-memory-mib must be at least {}, got {}", IO_MEMORY_SHARD_BYTES_MIN >> 20, self.io_memory_mib));
        }
        if let Some(total) = memory_total_bytes() {
            if io_memory_bytes > total / 2 {
                return Err(format!(
                    "--io-memory-mib {} is more than half of this machine's memory ({} MiB); it is pinned",
                    self.io_memory_mib,
                    total >> 20
                ));
            }
        }
        let config = StoreConfig {
            data_dir: self.data_dir.clone(),
            geometry,
            shards,
            disk_bytes,
            segment_bytes,
            sync: self.sync,
            io_depth_max: self.io_depth,
            io_queue_max: self.io_queue_max,
            pin_cpus: self.pin_cpus,
            snapshot_secs: self.snapshot_secs,
            io_memory_bytes,
            ram_bytes: (self.ram_gb * (1u64 << 30) as f64) as u64,
            write_policy: match self.write_policy {
                WritePolicyArg::Through => kvtier_engine::WritePolicy::Through,
                WritePolicyArg::Back => kvtier_engine::WritePolicy::Back,
            },
            promote: self.promote == OnOff::On,
            gpu: Default::default(),
            remote: None,
            health_window: std::time::Duration::from_millis(self.health_window_ms),
            trace: None,
            owners: Default::default(),
        };
        Ok((config, segment_origin))
    }
}

/// Where the segment size of a start came from (said in the start-up line).
#[derive(Debug, Clone, Copy)]
enum SegmentOrigin {
    /// `--segment-mib`.
    Flag,
    /// The existing store's `store.json`.
    Stored,
    /// Chosen from `--disk-gb` and the shard count for a new store.
    Chosen,
}

impl SegmentOrigin {
    fn describe(self) -> &'static str {
        match self {
            SegmentOrigin::Flag => "from --segment-mib",
            SegmentOrigin::Stored => "from store.json",
            SegmentOrigin::Chosen => "chosen from --disk-gb and the shard count",
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Info(args) => info(&args.data_dir),
        Command::Fsck(args) => match fsck(&args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::from(1),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How long a live server has to answer the start-up probe's
/// `GET /healthz` before the listener is taken for an orphan.
const PROBE_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// How long start-up waits for an orphaned listening socket (a killed
/// process's, which io_uring tears down asynchronously) to go away.
const ORPHAN_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// What answers on a port.
#[derive(Debug, PartialEq, Eq)]
enum PortState {
    /// Nothing accepts connections there.
    Free,
    /// A connection is accepted but nobody answers a request on it: the
    /// listening socket of a process that is gone (after `kill -9`,
    /// io_uring keeps it accepting for about a second).
    Orphaned,
    /// A live server answered.
    Live,
}

/// Connects to `probe` and, if that works, sends `GET /healthz` and waits up
/// to [`PROBE_ANSWER_TIMEOUT`] for any HTTP answer.
fn probe_port(probe: SocketAddr) -> PortState {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&probe, PROBE_ANSWER_TIMEOUT) else {
        return PortState::Free;
    };
    let _ = stream.set_read_timeout(Some(PROBE_ANSWER_TIMEOUT));
    let _ = stream.set_write_timeout(Some(PROBE_ANSWER_TIMEOUT));
    if stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: kvtier-start-probe\r\nConnection: close\r\n\r\n").is_err() {
        return PortState::Orphaned;
    }
    let mut answer = [0u8; 5];
    let mut got = 0;
    let deadline = std::time::Instant::now() + PROBE_ANSWER_TIMEOUT;
    while got < answer.len() && std::time::Instant::now() < deadline {
        match stream.read(&mut answer[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    // Any HTTP answer (even 401 from a server with a token) is a live server;
    // so is any other byte: some other program owns the port.
    if got > 0 {
        PortState::Live
    } else {
        PortState::Orphaned
    }
}

/// Binds the block API's listening socket, once for every shard, with
/// `SO_REUSEADDR` and without `SO_REUSEPORT`: the kernel then refuses the
/// address to any other process while this one listens (a check before
/// a shared bind could race with another start), and a restart right
/// after a stop still binds past the old connections in TIME-WAIT.
///
/// While the address is in use: a listener that answers `GET /healthz`
/// (anything, even 401) is a live server, refused at once; one that
/// accepts but does not answer is the orphaned socket of a killed
/// process (io_uring closes it within about a second): wait up to
/// [`ORPHAN_WAIT_MAX`] for it to go, then refuse.
fn bind_listener(addr: SocketAddr) -> Result<std::net::TcpListener, String> {
    let probe = match addr.ip() {
        ip if ip.is_unspecified() && addr.is_ipv4() => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        ip if ip.is_unspecified() => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port())),
        _ => addr,
    };
    let started = std::time::Instant::now();
    let mut warned = false;
    loop {
        let in_use = match try_bind(addr) {
            Ok(listener) => {
                if warned {
                    tracing::info!("the orphaned listener on {addr} closed after {} ms", started.elapsed().as_millis());
                }
                return Ok(listener);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => e,
            Err(e) => return Err(e.to_string()),
        };
        match probe_port(probe) {
            PortState::Live => return Err("a server already accepts connections there and answers requests".into()),
            _ if started.elapsed() >= ORPHAN_WAIT_MAX => {
                return Err(format!(
                    "the address is still in use after {ORPHAN_WAIT_MAX:?} ({in_use}) by a socket that does not answer requests; \
                     not listening beside it"
                ))
            }
            state => {
                if !warned {
                    let what = match state {
                        PortState::Orphaned => "accepts connections but does not answer (a killed process's socket, closing)",
                        _ => "is bound by a socket that does not accept connections",
                    };
                    tracing::warn!("a listener on {addr} {what}; waiting for it");
                    warned = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
}

/// One bind attempt: a TCP socket on `addr` with `SO_REUSEADDR`, listening
/// with a backlog of 1024 (glommio's own).
fn try_bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

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
fn lock_data_dir(dir: &Path) -> Result<fs::File, String> {
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

fn read_token(path: &Path) -> Result<Arc<[u8]>, String> {
    let raw = fs::read_to_string(path).map_err(|e| format!("cannot read --auth-token-file {}: {e}", path.display()))?;
    let token = raw.trim();
    if token.is_empty() {
        return Err(format!("--auth-token-file {} is empty", path.display()));
    }
    Ok(Arc::from(token.as_bytes()))
}

fn serve(args: ServeArgs) -> Result<(), String> {
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
    let _lock = lock_data_dir(&config.data_dir)?;
    steps.end("the data-directory lock");
    let listener = bind_listener(args.listen).map_err(|e| format!("cannot listen on {}: {e} (is another kvtier running?)", args.listen))?;
    steps.end("the listening socket");

    let local = args.local.open(&config.data_dir, config.shards)?;
    if local.is_some() {
        steps.end("the local socket");
    }

    let mut signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT, signal_hook::consts::SIGHUP])
            .map_err(|e| format!("installing signal handlers: {e}"))?;
    let (ready_tx, ready_rx) = mpsc::channel();
    let shared = Arc::new(server::Shared {
        listener,
        auth_token,
        tenancy: tenancy.clone(),
        shutdown: Default::default(),
        ready: Mutex::new(ready_tx),
        http: metrics::RequestStats::new(config.shards, &metrics::HTTP_ROUTE_NAMES),
        metrics: Default::default(),
        idle_timeout: std::time::Duration::from_secs_f64(args.idle_timeout_s),
        header_timeout: std::time::Duration::from_secs_f64(args.header_timeout_s),
        body_timeout: std::time::Duration::from_secs_f64(args.body_timeout_s),
        put_inflight_bytes_max: args.put_inflight_mib << 20,
        local: local.clone(),
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
    let (shards, geometry, data_dir, segment_bytes) =
        (config.shards, config.geometry.clone(), config.data_dir.clone(), config.segment_bytes);
    let engine = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("kvtier-engine".into())
            .spawn(move || kvtier_engine::run(config, move |store| server::serve_shard(store, shared.clone())))
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
        shared.shutdown.store(true, Ordering::SeqCst);
        let engine_error = engine.join().map_err(|_| "engine thread panicked".to_string())?.err().map(|e| e.to_string());
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
        data_dir.display()
    );
    if let Some(l) = &local {
        let _ = l.http_addr.set(addr);
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
                    shared.shutdown.store(true, Ordering::SeqCst);
                }
            })
            .map_err(|e| format!("starting the signal thread: {e}"))?;
    }
    let outcome = engine.join().map_err(|_| "engine thread panicked".to_string())?;
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

fn info(dir: &Path) -> Result<(), String> {
    let manifest = StoreManifest::read(dir).map_err(|e| e.to_string())?;
    let g = &manifest.geometry;
    println!("data dir      {}", dir.display());
    println!("format        {}", manifest.format_version);
    println!("model         {}", g.model);
    println!("block_tokens  {}", g.block_tokens);
    println!("bytes/token   {}", g.bytes_per_token);
    println!("block_bytes   {}", g.block_bytes);
    println!("shards        {}", manifest.shards);
    println!("segment_bytes {}", manifest.segment_bytes);
    for shard in 0..manifest.shards {
        let shard_dir = dir.join(format!("shard-{shard:03}"));
        let (mut segments, mut bytes) = (0u64, 0u64);
        if let Ok(entries) = fs::read_dir(&shard_dir) {
            for e in entries.flatten() {
                if kvtier_engine::segment::parse_segment_name(&e.file_name().to_string_lossy()).is_some() {
                    segments += 1;
                    bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                }
            }
        }
        println!("shard {shard:03}     {segments} segments, {bytes} bytes");
    }
    Ok(())
}

/// Runs fsck; `Ok(true)` when nothing is damaged.
fn fsck(args: &FsckArgs) -> Result<bool, String> {
    if !StoreManifest::path(&args.data_dir).exists() {
        return Err(format!("{} is not a kvtier data directory (no store.json)", args.data_dir.display()));
    }
    let _lock = lock_data_dir(&args.data_dir)?;
    let report = kvtier_engine::fsck::fsck(&args.data_dir).map_err(|e| e.to_string())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("report serializes"));
    } else {
        println!(
            "{} segments, {} blocks checked ({} bytes), {} live, {} tombstones, {} damaged, {} foreign files",
            report.segments,
            report.blocks_checked,
            report.bytes_read,
            report.live_blocks,
            report.tombstones,
            report.damaged.len(),
            report.foreign_files.len()
        );
        for d in &report.damaged {
            println!(
                "damaged: shard {} segment {} slot {} key {} seq {} live {}: {}",
                d.shard,
                d.segment,
                d.slot,
                d.key.as_deref().unwrap_or("?"),
                d.seq.map(|s| s.to_string()).unwrap_or_else(|| "?".into()),
                d.live,
                d.problem
            );
        }
        for f in &report.foreign_files {
            println!("foreign file (ignored): {}", f.display());
        }
    }
    Ok(report.damaged.is_empty())
}
