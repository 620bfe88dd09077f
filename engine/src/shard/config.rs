//! A shard's settings, derived from the store's configuration
//! ([`crate::store::StoreConfig`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::geometry::Geometry;
use crate::slot::{self, PAGE_BYTES};
use crate::tier::WritePolicy;

/// Settings of one shard, derived from the store's configuration.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// This shard's id, `0..shards`.
    pub shard_id: u32,
    /// `<data-dir>/shard-NNN` on its home device: its index snapshot, and
    /// its segments unless it spans several devices.
    pub dir: PathBuf,
    /// The directories its segments rotate over, one per device it spans
    /// (segment `i` in the `i mod len`-th; [`crate::devices`]); the first
    /// is `dir`. One, `dir`, unless the store has fewer shards than devices.
    pub segment_dirs: Vec<PathBuf>,
    /// The store's device index of each of `segment_dirs`, and how many
    /// devices the store has: messages name a device where there are
    /// several (`device 1 (/nvme1/kvtier)`).
    pub devices: (Vec<u32>, usize),
    /// Block geometry.
    pub geometry: Geometry,
    /// Size of each segment file in bytes.
    pub segment_bytes: u64,
    /// Most segment files this shard may create (its share of `--disk-gb`).
    pub segments_max: u32,
    /// `fdatasync` after every write, for power-loss durability.
    pub sync: bool,
    /// Most block reads and writes in flight at once on this shard.
    pub io_depth_max: usize,
    /// Most client block I/Os waiting for one of those; past it a client
    /// operation is refused ([`Error::Overloaded`](crate::error::Error::Overloaded)).
    pub io_queue_max: usize,
    /// Write an index snapshot this often (0: only at clean close).
    pub snapshot_secs: u64,
    /// Slots of the RAM tier (0: no RAM tier).
    pub ram_blocks: u32,
    /// Whether the RAM tier's memory is shared with clients (leases).
    pub ram_shared: crate::ram::RamShared,
    /// Whether the shard keeps an index table ([`crate::shared_index`]).
    pub shared_index: bool,
    /// When PUTs are acknowledged.
    pub write_policy: WritePolicy,
    /// Whether a read from NVMe promotes the block into RAM.
    pub promote: bool,
    /// The GPU tier above RAM (see [`crate::gpu`]).
    pub gpu: crate::gpu::GpuConfig,
    /// The remote tier below the log, shared by the process's shards (see
    /// [`crate::remote`]).
    pub remote: Option<Arc<dyn crate::remote::Remote>>,
    /// An error keeps its tier `degraded` this long ([`crate::health`]).
    pub health_window: Duration,
    /// Shards in the store (quotas are split evenly over them).
    pub shards: u32,
    /// Block owners and their quotas at open ([`crate::tenant`]).
    pub owners: Arc<crate::tenant::Owners>,
    /// Where this shard's KV events go ([`crate::events`]).
    pub events: Option<Arc<dyn crate::events::EventSink>>,
    /// The store its segments' superblocks name; a segment naming another
    /// is foreign ([`crate::segment::StoreId`]; none for a store made
    /// before store ids).
    pub store_id: crate::segment::StoreId,
    /// Why this shard runs without a log on this start: its device is
    /// absent ([`crate::devices::Device::absent`]). Nothing is read,
    /// made or written in `dir`; the shard serves its RAM and remote
    /// tiers and refuses PUTs ([`crate::error::Error::DeviceDown`]).
    pub log_absent: Option<String>,
    /// Why this shard starts with an empty log on every device it spans
    /// ([`crate::devices::Layout::shard_discards`]): recovery deletes its
    /// segments and snapshot first, and says so.
    pub discard_log: Option<String>,
    /// The test double for devices that fail ([`crate::faults`]), and the
    /// device of each of `segment_dirs` (its lanes); `None` in a served store.
    pub device_faults: Option<(Arc<crate::faults::DeviceFaults>, Vec<u32>)>,
}

impl ShardConfig {
    /// Bytes per slot for this geometry.
    pub fn slot_bytes(&self) -> u64 {
        slot::slot_bytes(self.geometry.block_bytes)
    }

    /// The device(s) the shard's log is on, for a message, in a store of
    /// several devices: `device 1 (/nvme1/kvtier)` (its data directory),
    /// comma-separated for a shard spanning several; `None` in a store of
    /// one device.
    pub fn device_names(&self) -> Option<String> {
        let (indices, of) = &self.devices;
        if *of < 2 {
            return None;
        }
        let named: Vec<String> = indices
            .iter()
            .zip(&self.segment_dirs)
            .map(|(d, dir)| format!("device {d} ({})", dir.parent().unwrap_or(dir).display()))
            .collect();
        Some(named.join(", "))
    }

    /// Where the shard's log is, for messages: `dir`, or for a shard
    /// spanning several devices `one of A, B`.
    pub fn log_dirs(&self) -> String {
        match self.segment_dirs.as_slice() {
            [] | [_] => self.dir.display().to_string(),
            all => format!("one of {}", all.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")),
        }
    }

    /// Segment `id`'s device's injected failure, if the store has the test
    /// double ([`ShardConfig::device_faults`]).
    pub fn fault_switch(&self, id: u32) -> Option<crate::faults::FaultSwitch> {
        let (faults, lanes) = self.device_faults.as_ref()?;
        let device = *lanes.get(id as usize % lanes.len().max(1))?;
        Some(crate::faults::FaultSwitch::new(faults.clone(), device as usize))
    }

    /// The directory of segment `id` ([`ShardConfig::segment_dirs`]).
    pub fn segment_dir(&self, id: u32) -> &std::path::Path {
        match self.segment_dirs.len() {
            0 => &self.dir,
            n => &self.segment_dirs[id as usize % n],
        }
    }

    /// Slots that fit in one segment after its superblock.
    pub fn slots_per_segment(&self) -> u32 {
        ((self.segment_bytes.saturating_sub(PAGE_BYTES)) / self.slot_bytes()) as u32
    }
}
