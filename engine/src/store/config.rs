//! How a store is opened: [`StoreConfig`], its defaults, and the segment
//! size chosen for a new store.

use std::path::PathBuf;
use std::sync::Arc;

use crate::devices::Layout;
use crate::geometry::{Geometry, StoreManifest, FORMAT_VERSION};
use crate::remote::Remote;
use crate::shard::ShardConfig;
use crate::tenant::Owners;
use crate::tier::WritePolicy;
use crate::trace::{Recorder, TraceHeader};

/// Default DMA buffer memory registered with io_uring across all shards:
/// 512 MiB (see [`StoreConfig::io_memory_bytes`]).
///
/// Sized for 16 MiB GETs from NVMe at concurrency 16 on two shards: each
/// streamed GET keeps up to 16 chunk reads of 1 MiB in flight, about 136 MiB
/// per shard there. With glommio's former 64 MiB per shard, half of those
/// reads fell back to heap buffers (a page fault and a 2 MiB zeroing per
/// huge page, and no fixed buffer), and 16 MiB GETs at concurrency 16 ran
/// 1.18× slower (docs/BENCHMARKS.md, "Registered I/O memory").
pub const IO_MEMORY_BYTES_DEFAULT: u64 = 512 << 20;

/// Least DMA buffer memory a shard registers: 64 MiB (glommio's own default
/// `io_memory` is 10 MiB, too little for 16 chunk reads in flight of a
/// 16 MiB block).
pub const IO_MEMORY_SHARD_BYTES_MIN: u64 = 64 << 20;

/// Default number of block reads and writes in flight per shard.
pub const IO_DEPTH_DEFAULT: usize = 32;

/// Default number of block I/Os allowed to wait for one of the `io_depth`
/// permits per shard; past it a client operation is refused
/// ([`Error::Overloaded`]) instead of queueing.
pub const IO_QUEUE_MAX_DEFAULT: usize = 1024;

/// Default interval between index snapshots, in seconds.
pub const SNAPSHOT_SECS_DEFAULT: u64 = 60;

/// Largest segment file size, and the one a large disk share gets: 1 GiB
/// (DESIGN §3).
pub const SEGMENT_BYTES_DEFAULT: u64 = 1 << 30;

/// Segments each shard gets at least when the segment size is chosen from
/// the disk share ([`auto_segment_bytes`]): reclaim then drops at most an
/// eighth of the shard's log at a time.
pub const SEGMENTS_PER_SHARD_AUTO: u64 = 8;

/// Slots a segment holds at least when its size is chosen from the disk
/// share, so a segment is never a handful of blocks.
pub const SEGMENT_SLOTS_MIN_AUTO: u64 = 4;

/// The segment size for a new store when none is given: the largest power
/// of two no larger than [`SEGMENT_BYTES_DEFAULT`] that gives each shard at
/// least [`SEGMENTS_PER_SHARD_AUTO`] segments of its `disk_bytes / shards`,
/// but never smaller than the power of two holding the superblock and
/// [`SEGMENT_SLOTS_MIN_AUTO`] slots of `block_bytes` (a disk share too small
/// for two of those is then refused by the shard, naming the sizes).
pub fn auto_segment_bytes(disk_bytes: u64, shards: usize, block_bytes: u64) -> u64 {
    let per_shard = disk_bytes / shards.max(1) as u64;
    let floor = (crate::slot::PAGE_BYTES + SEGMENT_SLOTS_MIN_AUTO * crate::slot::slot_bytes(block_bytes)).next_power_of_two();
    let mut segment = SEGMENT_BYTES_DEFAULT;
    while segment > floor && per_shard / segment < SEGMENTS_PER_SHARD_AUTO {
        segment /= 2;
    }
    segment.max(floor)
}

/// How a store is opened.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Data directory (`store.json`, `shard-NNN/`); with several devices,
    /// the first device's ([`StoreConfig::layout`]).
    pub data_dir: PathBuf,
    /// The store's devices, one data directory each ([`crate::devices`]);
    /// `None`: `data_dir` alone, holding `disk_bytes`.
    pub layout: Option<Layout>,
    /// Block geometry; must match `store.json` of an existing store.
    pub geometry: Geometry,
    /// Number of shards (executors); must match an existing store.
    pub shards: usize,
    /// Disk capacity for segments across all shards, in bytes (with a
    /// [`Layout`], the sum of its devices' capacities).
    pub disk_bytes: u64,
    /// Size of one segment file in bytes; must match an existing store.
    pub segment_bytes: u64,
    /// `fdatasync` after each write.
    pub sync: bool,
    /// Block I/Os in flight per shard.
    pub io_depth_max: usize,
    /// Client block I/Os allowed to wait for an I/O permit per shard;
    /// past it they are refused with [`Error::Overloaded`].
    pub io_queue_max: usize,
    /// Pin shard `i` to CPU `i mod cpus`.
    pub pin_cpus: bool,
    /// Write each shard's index snapshot this often, in seconds (0: only at
    /// clean close).
    pub snapshot_secs: u64,
    /// RAM tier across all shards, in bytes (0: none); each shard gets
    /// `ram_bytes / shards / block_bytes` slots.
    pub ram_bytes: u64,
    /// Whether the RAM tier's memory is a file same-host clients can map
    /// for leases (`--ram-shared`; [`crate::ram::RamShared`]).
    pub ram_shared: crate::ram::RamShared,
    /// Whether each shard keeps an index table clients map to answer
    /// existence and prefix lookups without a round trip
    /// (`--shared-index`; [`crate::shared_index`]).
    pub shared_index: bool,
    /// When PUTs are acknowledged.
    pub write_policy: WritePolicy,
    /// Whether NVMe reads promote blocks into RAM.
    pub promote: bool,
    /// The GPU tier above RAM (`blocks_per_shard` 0 or no device: none).
    pub gpu: crate::gpu::GpuConfig,
    /// DMA buffer memory registered with io_uring across all shards, in
    /// bytes ([`IO_MEMORY_BYTES_DEFAULT`]); each shard gets
    /// [`StoreConfig::io_memory_shard_bytes`]. It is allocated at start,
    /// then faulted in on a helper thread and registered (pinned) once the
    /// shard serves ([`run`]). Block reads and writes take their buffers
    /// from it (fixed buffers once registered, no page faults once faulted
    /// in) and fall back to the heap when it is used up.
    pub io_memory_bytes: u64,
    /// The remote tier below the log, shared by every shard (`None`: none).
    /// Each shard reaches it for the keys it owns ([`crate::remote`]).
    pub remote: Option<Arc<dyn Remote>>,
    /// An error keeps its tier `degraded` this long
    /// ([`crate::health::ERROR_WINDOW`] by default).
    pub health_window: std::time::Duration,
    /// The block-operation trace recorder (`--trace-dir`; `None`: no
    /// recorder). The caller sets its header
    /// ([`StoreConfig::trace_header`]) and starts and stops it
    /// ([`Store::trace_start`]); every shard records into its own buffer.
    pub trace: Option<Arc<Recorder>>,
    /// Block owners (tenants and shared namespaces) and their per-tier
    /// quotas ([`crate::tenant`]); [`Owners::default`]: the default owner
    /// alone, no quotas. Changed at run time with [`Store::set_owners`].
    pub owners: Arc<Owners>,
    /// Where KV events go (`--kv-events`; `None`: none published, block
    /// tags are still kept and written). See [`crate::events`].
    pub events: Option<Arc<dyn crate::events::EventSink>>,
    /// Stall detection on every shard's executor (`--stall-threshold-ms`;
    /// `None`: off). See [`crate::stall`].
    pub stalls: Option<Arc<crate::stall::Stalls>>,
    /// The test double for devices that fail at run time, by device index
    /// ([`crate::faults`]); `None` for a served store.
    pub device_faults: Option<Arc<crate::faults::DeviceFaults>>,
}

impl StoreConfig {
    /// DMA buffer memory one shard registers, in bytes:
    /// `io_memory_bytes / shards`, at least [`IO_MEMORY_SHARD_BYTES_MIN`],
    /// rounded up to a 2 MiB huge page.
    pub fn io_memory_shard_bytes(&self) -> usize {
        let per_shard = (self.io_memory_bytes / self.shards.max(1) as u64).max(IO_MEMORY_SHARD_BYTES_MIN);
        per_shard.next_multiple_of(2 << 20) as usize
    }

    /// The store's devices: [`StoreConfig::layout`], else `data_dir` alone
    /// holding `disk_bytes`.
    pub fn layout(&self) -> Layout {
        self.layout.clone().unwrap_or_else(|| Layout::single(&self.data_dir, self.disk_bytes))
    }

    /// The manifest this configuration describes (of a store's one
    /// directory, or of its first device's).
    pub fn manifest(&self) -> StoreManifest {
        self.manifest_for(&self.layout(), 0)
    }

    /// The manifest of device `device`'s directory: the store's id and
    /// device list beside the geometry (none of them for a store made
    /// before devices).
    pub fn manifest_for(&self, layout: &Layout, device: u32) -> StoreManifest {
        let ided = layout.store_id.is_some();
        StoreManifest {
            format_version: FORMAT_VERSION,
            geometry: self.geometry.clone(),
            shards: self.shards as u32,
            segment_bytes: self.segment_bytes,
            store_id: layout.store_id.clone(),
            devices: if ided { layout.records(self.shards) } else { Vec::new() },
            device_index: ided.then_some(device),
        }
    }

    pub(super) fn shard_config(&self, shard_id: usize) -> ShardConfig {
        self.shard_config_in(&self.layout(), shard_id)
    }

    pub(super) fn shard_config_in(&self, layout: &Layout, shard_id: usize) -> ShardConfig {
        // As many segments on each device the shard spans (one, unless
        // there are fewer shards than devices).
        let segment_dirs = layout.shard_dirs(shard_id, self.shards);
        let lane_segments = layout.shard_lane_bytes(shard_id, self.shards) / self.segment_bytes;
        ShardConfig {
            shard_id: shard_id as u32,
            dir: layout.shard_dir(shard_id),
            geometry: self.geometry.clone(),
            segment_bytes: self.segment_bytes,
            segments_max: (lane_segments * segment_dirs.len() as u64).min(u32::MAX as u64) as u32,
            segment_dirs,
            devices: (layout.devices_of(shard_id, self.shards).iter().map(|d| d.index).collect(), layout.devices.len()),
            sync: self.sync,
            io_depth_max: self.io_depth_max,
            io_queue_max: self.io_queue_max,
            snapshot_secs: self.snapshot_secs,
            ram_blocks: self.ram_blocks_per_shard(),
            ram_shared: self.ram_shared,
            shared_index: self.shared_index,
            write_policy: self.write_policy,
            promote: self.promote,
            gpu: self.gpu.clone(),
            remote: self.remote.clone(),
            health_window: self.health_window,
            shards: self.shards as u32,
            owners: self.owners.clone(),
            events: self.events.clone(),
            store_id: crate::segment::store_id_bytes(layout.store_id.as_deref()),
            log_absent: layout.shard_absent(shard_id, self.shards),
            discard_log: layout.shard_discards(shard_id, self.shards),
            device_faults: self.device_faults.clone().map(|f| {
                let lanes = layout.devices_of(shard_id, self.shards).iter().map(|d| d.index).collect();
                (f, lanes)
            }),
        }
    }

    /// What a trace file's header says about this store (`source`,
    /// `started_unix_ms` and `file_index` are the recorder's).
    pub fn trace_header(&self, source: &str) -> TraceHeader {
        let g = &self.geometry;
        TraceHeader {
            gpu_blocks_per_shard: self.gpu.blocks_per_shard as u64,
            ram_blocks_per_shard: u64::from(self.ram_blocks_per_shard()),
            disk_bytes: self.disk_bytes,
            write_policy: match self.write_policy {
                WritePolicy::Through => "through".into(),
                WritePolicy::Back => "back".into(),
            },
            promote: self.promote,
            remote: self.remote.is_some(),
            ..TraceHeader::new(source, &g.model, g.block_bytes, g.block_tokens, self.shards as u32)
        }
    }

    /// Blocks one shard's tiers hold, in [`crate::tenant::QuotaTier`]
    /// order: the GPU tier (0 without a device), the RAM tier, and the log
    /// less one segment (the head being written, which reservations cannot
    /// count on). Reservations are checked against these (their shares in
    /// whole blocks, [`crate::tenant::share_blocks`]).
    pub fn shard_capacity_blocks(&self) -> [u64; 3] {
        let shard = self.shard_config(0);
        let gpu = if self.gpu.device.is_some() { u64::from(self.gpu.blocks_per_shard) } else { 0 };
        let log = u64::from(shard.segments_max.saturating_sub(1)) * u64::from(shard.slots_per_segment());
        [gpu, u64::from(self.ram_blocks_per_shard()), log]
    }

    /// RAM-tier slots per shard: `ram_bytes / shards / block_bytes`.
    pub fn ram_blocks_per_shard(&self) -> u32 {
        (self.ram_bytes / self.shards.max(1) as u64 / self.geometry.block_bytes.max(1)).min(u32::MAX as u64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn auto_segment_size_gives_each_shard_eight_segments() {
        // The case: 1 GiB on 2 shards, 1.2 MB blocks: 64 MiB, 8 each.
        assert_eq!(auto_segment_bytes(GIB, 2, 1_228_800), 64 * MIB);
        assert_eq!(auto_segment_bytes(2 * GIB, 2, 1_228_800), 128 * MIB);
        // Large shares keep the 1 GiB default.
        assert_eq!(auto_segment_bytes(16 * GIB, 2, 16 * MIB), GIB);
        assert_eq!(auto_segment_bytes(1024 * GIB, 2, 16 * MIB), GIB);
        // Not a power of two of disk: still at least 8 segments a shard.
        let s = auto_segment_bytes(3 * GIB, 4, 65_536);
        assert!(s.is_power_of_two() && 3 * GIB / 4 / s >= SEGMENTS_PER_SHARD_AUTO, "{s}");
        assert!(3 * GIB / 4 / (2 * s) < SEGMENTS_PER_SHARD_AUTO, "{s} is not the largest");
    }

    #[test]
    fn auto_segment_size_never_drops_below_four_slots() {
        // 16 MiB blocks on a 1 GiB share of 2 shards: 512 MiB / 8 = 64 MiB
        // holds 3 slots, so the floor (4 slots + superblock → 128 MiB) wins.
        let s = auto_segment_bytes(GIB, 2, 16 * MIB);
        assert_eq!(s, 128 * MIB);
        assert!((s - crate::slot::PAGE_BYTES) / crate::slot::slot_bytes(16 * MIB) >= SEGMENT_SLOTS_MIN_AUTO);
        // A tiny share gets the floor (4 slots of 68 KiB + 4 KiB → 512 KiB);
        // the shard then refuses a share that does not hold two of them.
        assert_eq!(auto_segment_bytes(MIB, 2, 65_536), 512 << 10);
    }
}
