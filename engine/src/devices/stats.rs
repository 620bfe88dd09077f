//! Each device's state for `/v1/stats`, `/readyz` and `/metrics`, from
//! every shard's stats and the placement of [`super::devices_of_shard`].

use std::path::PathBuf;

use serde::Serialize;

use super::{devices_of_shard, shards_on_device};

/// One device's state, for `/v1/stats` (`devices`), `/readyz` and
/// `kvtier_device_up`: its shards' blocks and the worst of their NVMe
/// tiers' health (a device that fails shows as its shards' logs failing).
#[derive(Debug, Clone, Serialize)]
pub struct DeviceStats {
    /// Its index in the store's device list.
    pub index: u32,
    /// Its data directory.
    pub dir: String,
    /// The shards whose logs it holds.
    pub shards: Vec<u32>,
    /// Blocks in those shards' indexes.
    pub blocks: u64,
    /// Blocks its segments can hold.
    pub capacity_blocks: u64,
    /// Bytes of segment files on it.
    pub disk_bytes: u64,
    /// `ok`, `degraded` or `down`: the worst of its shards' NVMe tiers.
    pub state: crate::health::HealthState,
    /// Why not `ok` (that shard's NVMe reason).
    pub reason: Option<String>,
}

/// Each of `device_dirs.len()` devices' state from every shard's stats
/// (placement as [`devices_of_shard`]): a device's blocks, capacity and
/// bytes are its share of each shard on it (the shard's counts on that
/// device, when it spans several), its state the worst of those shards'
/// NVMe tiers.
pub fn device_stats(device_dirs: &[PathBuf], shards: &[crate::ShardStats]) -> Vec<DeviceStats> {
    let devices = device_dirs.len().max(1);
    (0..devices)
        .map(|d| {
            let on: Vec<u32> = shards_on_device(d, shards.len(), devices);
            let mine: Vec<&crate::ShardStats> = shards.iter().filter(|s| on.contains(&s.shard)).collect();
            let mut worst: Option<crate::health::TierHealth> = None;
            for h in mine.iter().flat_map(|s| s.health.iter().filter(|h| h.tier == "nvme")) {
                match &mut worst {
                    Some(w) => w.merge(h),
                    None => worst = Some(h.clone()),
                }
            }
            // This device's lane of each shard on it, and how many lanes it has.
            let lane = |s: &crate::ShardStats| {
                let spans = devices_of_shard(s.shard as usize, shards.len(), devices);
                (spans.iter().position(|x| *x == d).unwrap_or(0), spans.len() as u64)
            };
            let share = |s: &crate::ShardStats, by_lane: &[u64], total: u64| {
                let (j, lanes) = lane(s);
                by_lane.get(j).copied().unwrap_or(total / lanes)
            };
            DeviceStats {
                index: d as u32,
                dir: device_dirs.get(d).map(|p| p.display().to_string()).unwrap_or_default(),
                shards: mine.iter().map(|s| s.shard).collect(),
                blocks: mine.iter().map(|s| share(s, &s.blocks_by_device, s.blocks)).sum(),
                capacity_blocks: mine.iter().map(|s| s.capacity_blocks / lane(s).1).sum(),
                disk_bytes: mine.iter().map(|s| share(s, &s.disk_bytes_by_device, s.disk_bytes)).sum(),
                state: worst.as_ref().map_or(crate::health::HealthState::Ok, |w| w.state),
                reason: worst.and_then(|w| w.reason),
            }
        })
        .collect()
}
