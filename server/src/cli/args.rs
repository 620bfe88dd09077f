//! The command line (clap): `kvtier serve`, `info`, `fsck`, their flags,
//! and a serve's store configuration merged from the flags and the data
//! directory's `store.json`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand};
use kvtier_engine::devices::{DeviceSpec, Layout};
use kvtier_engine::geometry::{Geometry, StoreManifest, BLOCK_TOKENS_DEFAULT, MODEL_DEFAULT};
use kvtier_engine::store::{
    auto_segment_bytes, IO_DEPTH_DEFAULT, IO_MEMORY_BYTES_DEFAULT, IO_MEMORY_SHARD_BYTES_MIN, IO_QUEUE_MAX_DEFAULT, SNAPSHOT_SECS_DEFAULT,
};
use kvtier_engine::StoreConfig;
use kvtier_server::{events, gpu, limits, local};

/// kvtier: a KV-cache block store that runs beside an LLM inference engine.
///
/// It stores fixed-size blocks of attention KV cache (128 tokens each by
/// default) in an O_DIRECT log on NVMe, and serves them over HTTP/2 (h2c,
/// prior knowledge) and HTTP/1.1 on one port. See docs/API.md.
#[derive(Parser, Debug)]
#[command(name = "kvtier", version, propagate_version = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Start the sidecar: open (or create) the data directory and serve the
    /// block API until SIGTERM or SIGINT.
    Serve(Box<ServeArgs>),
    /// Print a data directory's geometry and segment usage, then exit.
    Info(InfoArgs),
    /// Verify every slot header and payload CRC-32 of a stopped store and
    /// list the damaged blocks. Exits 0 when clean, 1 when damage is found
    /// or a device of the store is absent (its shards not checked).
    Fsck(FsckArgs),
}

#[derive(Args, Debug)]
pub(crate) struct FsckArgs {
    /// Data directory to check (no server may have it open); once per
    /// device of a store made over several, in any order.
    #[arg(long = "data-dir", default_value = "./kvtier-data", value_parser = device_spec)]
    pub(crate) data_dirs: Vec<DeviceSpec>,
    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// Address to listen on. A non-loopback address requires
    /// --auth-token-file or --tenants.
    #[arg(long, default_value = "127.0.0.1:8085")]
    pub(crate) listen: SocketAddr,
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// File holding a bearer token; every request must then send
    /// `Authorization: Bearer <token>`. Surrounding whitespace is ignored.
    #[arg(long, conflicts_with = "tenants")]
    pub(crate) auth_token_file: Option<PathBuf>,
    /// Tenants file (TOML; docs/OPERATIONS.md, "Tenants"): each tenant's
    /// token (or its SHA-256) and local-socket uids, the key space it
    /// reads and writes, shared namespaces, and per-tier reservations and
    /// limits (gpu_, ram_, nvme_ × reserved_gb, limit_gb). Every request
    /// must then carry a tenant's token (401 otherwise); a tenant's keys
    /// are its own. Reloaded on SIGHUP and by POST
    /// /v1/admin/tenants/reload (a refused file keeps the one in use).
    #[arg(long, value_name = "PATH")]
    pub(crate) tenants: Option<PathBuf>,
    /// Close a connection after this many seconds without a request in
    /// flight (HTTP/2 pings do not count as use).
    #[arg(long, default_value_t = limits::IDLE_TIMEOUT_DEFAULT.as_secs_f64())]
    pub(crate) idle_timeout_s: f64,
    /// HTTP/1.1 request headers must arrive within this many seconds (a
    /// client trickling them is disconnected).
    #[arg(long, default_value_t = limits::HEADER_READ_TIMEOUT.as_secs_f64())]
    pub(crate) header_timeout_s: f64,
    /// A request body must arrive in full within this many seconds, else
    /// 408 and nothing is stored.
    #[arg(long, default_value_t = limits::BODY_READ_TIMEOUT.as_secs_f64())]
    pub(crate) body_timeout_s: f64,
    /// PUT body bytes a shard admits at once (declared lengths of PUTs
    /// received on its connections and not yet answered), in MiB. A PUT
    /// past it is refused with 503 and Retry-After before its body is read;
    /// one PUT is always admitted.
    #[arg(long, default_value_t = limits::PUT_INFLIGHT_BYTES_DEFAULT >> 20)]
    pub(crate) put_inflight_mib: u64,
    /// Log filter: error, warn, info, debug, trace, or a tracing
    /// EnvFilter directive. Logs go to stderr.
    #[arg(long, default_value = "info")]
    pub(crate) log_level: String,
    /// Report a shard whose thread runs this many milliseconds without
    /// getting back to its I/O (a blocking call, a long computation: every
    /// request the shard owns waits meanwhile): a warning with the shard,
    /// the duration and the code it was in, counted in
    /// kvtier_shard_stalls_total and /v1/stats (docs/OPERATIONS.md, "Shard
    /// stalls"). At least 20; 0 turns the detector off.
    #[arg(long, default_value_t = kvtier_engine::stall::STALL_THRESHOLD_DEFAULT.as_millis() as u64)]
    pub(crate) stall_threshold_ms: u64,
    /// Also append each stall to this file, one JSON object per line
    /// (shard, duration_ms, frames, ...). `make test` sets it through
    /// KVTIER_STALL_LOG for every server a test starts.
    #[arg(long, env = "KVTIER_STALL_LOG", value_name = "FILE")]
    pub(crate) stall_log: Option<PathBuf>,
    /// Record every block operation (time, operation, shard, block hash,
    /// serving tier; never keys or bytes) into trace files in this
    /// directory, from start-up; `POST /v1/admin/trace/stop` and `/start`
    /// stop and restart it. `kvtier-loadgen size` turns a trace into
    /// hit-ratio curves per tier size (docs/OPERATIONS.md, "Sizing the
    /// tiers"; format: docs/TRACE.md). Off by default.
    #[arg(long)]
    pub(crate) trace_dir: Option<PathBuf>,
    /// Bound on the trace files in --trace-dir together, in MiB (2^20
    /// bytes): a file is rotated at a quarter of it and the oldest trace
    /// files are deleted to stay under it (32 bytes per record: 1 GiB holds
    /// about 33 million operations).
    #[arg(long, default_value_t = kvtier_engine::trace::TRACE_MAX_MB_DEFAULT)]
    pub(crate) trace_max_mb: u64,
    #[command(flatten)]
    pub(crate) s3: kvtier_s3::S3Args,
    #[command(flatten)]
    pub(crate) local: local::LocalArgs,
    // `--kv-events*`: KV events for routers (server/src/events/args.rs).
    #[command(flatten)]
    pub(crate) events: events::EventsArgs,
}

#[derive(Args, Debug)]
pub(crate) struct StoreArgs {
    /// Data directory: store.json and shard-NNN/seg-NNNNNN.kvt segment
    /// files. Repeat it, one per device (NVMe drive), to spread the store
    /// over several: shard s's log goes on directory s mod N (with fewer
    /// shards than directories, shard s's segments rotate over every
    /// directory d with d mod shards = s), each
    /// optionally PATH=SIZE_GB (else --disk-gb is split in proportion to
    /// each filesystem's free space when the store is made). A store's
    /// directories are recognised by the store id in their store.json, in
    /// any order; an empty directory stands in for a lost device (its
    /// shards start empty), and a device whose directory is not given,
    /// does not exist or cannot be read is absent (its shards serve RAM
    /// and S3 hits, their log down, PUTs refused with 503 device_down).
    /// docs/OPERATIONS.md, "Several devices".
    #[arg(long = "data-dir", default_value = "./kvtier-data", value_parser = device_spec)]
    pub(crate) data_dirs: Vec<DeviceSpec>,
    /// Add the --data-dir directories given past an existing store's
    /// devices as new devices (each an empty directory with its size,
    /// PATH=SIZE_GB; every existing device present). Keys stay on their
    /// shards, and the shards the new device list places elsewhere start
    /// empty there (their blocks on the devices they leave are dropped,
    /// logged). Needed once; later starts find the longer list.
    /// docs/OPERATIONS.md, "Adding a device".
    #[arg(long)]
    pub(crate) add_devices: bool,
    /// Shards (one executor thread each). Default: the existing store's
    /// count, else the number of CPUs.
    #[arg(long)]
    pub(crate) shards: Option<usize>,
    /// Model preset fixing the block size (tiny-1b, mistral-7b, llama2-7b,
    /// llama3.1-8b, llama3.1-70b, deepseek-v3: MLA, 70,272 bytes/token, one
    /// copy for every tensor-parallel rank). Default: the existing store's,
    /// else llama3.1-8b (131,072 bytes/token, 16 MiB per 128-token block).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Block size in bytes, instead of a model preset.
    #[arg(long, conflicts_with = "model")]
    pub(crate) block_bytes: Option<u64>,
    /// Tokens per block.
    #[arg(long, default_value_t = BLOCK_TOKENS_DEFAULT)]
    pub(crate) block_tokens: u32,
    /// Disk space for segments across all shards, in GiB (2^30 bytes);
    /// fractions allowed. When full, the oldest segment is reclaimed.
    #[arg(long, default_value_t = 16.0)]
    pub(crate) disk_gb: f64,
    /// Size of one segment file in MiB. Default: the existing store's, else
    /// the largest power of two up to 1024 that gives each shard at least 8
    /// segments of its --disk-gb share (and holds at least 4 blocks).
    #[arg(long)]
    pub(crate) segment_mib: Option<u64>,
    /// fdatasync after every write, for durability across power loss (a
    /// process crash loses nothing acknowledged even without it).
    #[arg(long)]
    pub(crate) sync: bool,
    /// Block reads and writes in flight per shard.
    #[arg(long, default_value_t = IO_DEPTH_DEFAULT)]
    pub(crate) io_depth: usize,
    /// Client block reads and writes allowed to wait for one of the
    /// --io-depth slots per shard; past it they are refused with 503 and
    /// Retry-After instead of queueing.
    #[arg(long, default_value_t = IO_QUEUE_MAX_DEFAULT)]
    pub(crate) io_queue_max: usize,
    /// DMA buffer memory for block reads and writes across all shards, in
    /// MiB, split evenly, at least 64 MiB per shard: allocated at start,
    /// faulted in on a helper thread and registered with io_uring (pinned)
    /// once the shards serve (on Linux before 6.0: at start). A streamed GET from
    /// NVMe keeps up to 16 MiB of chunk reads in flight; reads past this
    /// memory use heap buffers, which cost page faults (16 MiB GETs at
    /// concurrency 16 ran 1.18x slower with 64 MiB per shard).
    #[arg(long, default_value_t = IO_MEMORY_BYTES_DEFAULT >> 20)]
    pub(crate) io_memory_mib: u64,
    /// Pin shard i to CPU i (mod the CPU count).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub(crate) pin_cpus: bool,
    /// Seconds between index snapshots (restart loads the newest and scans
    /// only what came after it); 0 writes one only at clean shutdown.
    #[arg(long, default_value_t = SNAPSHOT_SECS_DEFAULT)]
    pub(crate) snapshot_secs: u64,
    /// RAM tier across all shards, in GiB (2^30 bytes), mapped at start
    /// (2 MiB huge pages where available) and faulted in by a background
    /// thread once the shards serve; 0 turns it off. Each shard gets ram / shards / block_bytes slots.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) ram_gb: f64,
    /// Whether the RAM tier's memory is a sealed memory file that clients on
    /// the local socket map read-only, to read leased blocks in place
    /// (docs/LOCAL.md, "Leases"). on (the default): always, with 4 KiB pages
    /// where shared memory gets no huge pages (/sys/kernel/mm/
    /// transparent_hugepage/shmem_enabled never, the kernel's default),
    /// measured to cost GET_INTO no more than noise (docs/BENCHMARKS.md);
    /// auto: only when that keeps the huge pages the tier would have
    /// unshared (reserved huge pages, or shmem_enabled not never); off: never
    /// (no leases; anonymous memory).
    #[arg(long, value_enum, default_value_t = RamSharedArg::On)]
    pub(crate) ram_shared: RamSharedArg,
    /// on: each shard keeps a table of the blocks its GPU, RAM and NVMe tiers
    /// hold, in shared memory that clients on the local socket map
    /// read-only, so existence and prefix lookups are answered in the
    /// client without a round trip (docs/LOCAL.md, "The shared index";
    /// advisory: a read checks again). Costs 64 to 128 bytes per block the
    /// shard can hold (32-byte buckets, twice as many as blocks rounded up
    /// to a power of two), allocated at start.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub(crate) shared_index: OnOff,
    /// through: a PUT is acknowledged after its NVMe write (a crash loses
    /// nothing acknowledged). back: acknowledged from RAM; the block reaches
    /// NVMe when RAM demotes it or at a clean stop, and a crash loses blocks
    /// held only in RAM.
    #[arg(long, value_enum, default_value_t = WritePolicyArg::Through)]
    pub(crate) write_policy: WritePolicyArg,
    /// on: a read served from NVMe copies the block into the fastest memory
    /// tier (GPU, else RAM), and with a GPU tier a read served from RAM moves
    /// the block up to the GPU (promotion).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub(crate) promote: OnOff,
    /// How long an error keeps its tier "degraded" in /readyz, /v1/stats
    /// ("health") and /metrics (kvtier_tier_up), in ms. A tier is "ok" again
    /// once its last error is older than this and its condition (disk full,
    /// S3 circuit breaker open, GPU missing) has cleared.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) health_window_ms: u64,
    #[command(flatten)]
    pub(crate) gpu: gpu::GpuArgs,
}

/// `--write-policy` values.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum WritePolicyArg {
    /// Acknowledge after the NVMe write.
    Through,
    /// Acknowledge from RAM.
    Back,
}

/// `--ram-shared` values (see the flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RamSharedArg {
    /// Shared when that keeps the tier's huge pages.
    Auto,
    /// Always shared.
    On,
    /// Never shared.
    Off,
}

impl From<RamSharedArg> for kvtier_engine::ram::RamShared {
    fn from(a: RamSharedArg) -> Self {
        match a {
            RamSharedArg::Auto => kvtier_engine::ram::RamShared::Auto,
            RamSharedArg::On => kvtier_engine::ram::RamShared::On,
            RamSharedArg::Off => kvtier_engine::ram::RamShared::Off,
        }
    }
}

/// `--promote` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum OnOff {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

#[derive(Args, Debug)]
pub(crate) struct InfoArgs {
    /// Data directory to describe; once per device of a store made over
    /// several, in any order.
    #[arg(long = "data-dir", default_value = "./kvtier-data", value_parser = device_spec)]
    pub(crate) data_dirs: Vec<DeviceSpec>,
}

/// `--data-dir PATH[=SIZE_GB]` ([`DeviceSpec`]).
fn device_spec(s: &str) -> Result<DeviceSpec, String> {
    s.parse()
}

/// The store's devices as the directories given name them, for `info`
/// and `fsck`: an existing store only.
pub(crate) fn existing_layout(specs: &[DeviceSpec]) -> Result<Layout, String> {
    if let Some(s) = specs.iter().find(|s| !StoreManifest::path(&s.dir).exists()) {
        if specs.len() == 1 {
            return Err(format!("{} is not a kvtier data directory (no store.json)", s.dir.display()));
        }
    }
    if specs.iter().all(|s| !StoreManifest::path(&s.dir).exists()) {
        return Err("none of the directories given is a kvtier data directory (no store.json)".into());
    }
    Layout::resolve(specs, 0, usize::MAX).map_err(|e| e.to_string())
}

impl StoreArgs {
    /// The store configuration, taking unset values from an existing
    /// store.json so `kvtier serve --data-dir D` reopens D as it was made.
    pub(crate) fn config(&self) -> Result<(StoreConfig, SegmentOrigin), String> {
        let stored = self.data_dirs.iter().find_map(|s| StoreManifest::read(&s.dir).ok());
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
        let layout = Layout::resolve_adding(&self.data_dirs, (self.disk_gb * (1u64 << 30) as f64) as u64, shards, self.add_devices)
            .map_err(|e| e.to_string())?;
        let disk_bytes = layout.capacity_bytes();
        // The smallest shard share sizes a new store's segments.
        let least_share = (0..shards).map(|s| layout.shard_capacity_bytes(s, shards)).min().unwrap_or(disk_bytes);
        let (segment_bytes, segment_origin) = match (self.segment_mib, &stored) {
            (Some(mib), _) => (mib << 20, SegmentOrigin::Flag),
            (None, Some(m)) => (m.segment_bytes, SegmentOrigin::Stored),
            (None, None) => {
                (auto_segment_bytes(least_share.saturating_mul(shards as u64), shards, geometry.block_bytes), SegmentOrigin::Chosen)
            }
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
            // The first present device's (the default local socket is made there).
            data_dir: layout.devices.iter().find(|d| d.absent.is_none()).unwrap_or(&layout.devices[0]).dir.clone(),
            layout: Some(layout),
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
            ram_shared: self.ram_shared.into(),
            shared_index: self.shared_index == OnOff::On,
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
            events: None,
            stalls: None,
            device_faults: None,
        };
        Ok((config, segment_origin))
    }
}

/// Where the segment size of a start came from (said in the start-up line).
#[derive(Debug, Clone, Copy)]
pub(crate) enum SegmentOrigin {
    /// `--segment-mib`.
    Flag,
    /// The existing store's `store.json`.
    Stored,
    /// Chosen from `--disk-gb` and the shard count for a new store.
    Chosen,
}

impl SegmentOrigin {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            SegmentOrigin::Flag => "from --segment-mib",
            SegmentOrigin::Stored => "from store.json",
            SegmentOrigin::Chosen => "chosen from --disk-gb and the shard count",
        }
    }
}

/// This machine's physical memory in bytes (`sysconf`), if known.
fn memory_total_bytes() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page_bytes) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    (pages > 0 && page_bytes > 0).then(|| pages as u64 * page_bytes as u64)
}
