//! A shard's counters and the point-in-time view `/v1/stats` shows of it.

use std::cell::Cell;

use serde::Serialize;

use super::Shard;
use crate::health::TierHealth;
use crate::tier::{Tier, TierStats, WritePolicy};

/// Counters of a shard, kept as plain cells on the shard's thread.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub puts: Cell<u64>,
    pub gets: Cell<u64>,
    pub hits: Cell<u64>,
    pub misses: Cell<u64>,
    pub deletes: Cell<u64>,
    pub corrupt_blocks: Cell<u64>,
    pub disk_full_refusals: Cell<u64>,
    pub hash_collisions: Cell<u64>,
    pub reclaimed_segments: Cell<u64>,
    pub evicted_blocks: Cell<u64>,
    pub second_chance_blocks: Cell<u64>,
    pub bytes_written: Cell<u64>,
    pub writes_from_ram: Cell<u64>,
    pub bytes_read: Cell<u64>,
    pub io_in_flight: Cell<u64>,
    pub io_queued: Cell<u64>,
    pub io_queue_refusals: Cell<u64>,
    pub snapshots_written: Cell<u64>,
    pub forwarded_requests: Cell<u64>,
    pub transit_hits: Cell<u64>,
}

/// What recovery found when the shard opened.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RecoveryReport {
    /// Segment files opened.
    pub segments: u32,
    /// An index snapshot was loaded.
    pub snapshot_loaded: bool,
    /// A snapshot file was present but unusable (damaged, another shard's).
    pub snapshot_invalid: bool,
    /// Entries taken from the snapshot.
    pub snapshot_entries: u64,
    /// Segments whose headers were read.
    pub segments_scanned: u32,
    /// Slot headers read.
    pub headers_scanned: u64,
    /// Block records applied from the header scan.
    pub blocks_found: u64,
    /// Tombstones applied from the header scan.
    pub tombstones_found: u64,
    /// Headers that were torn, damaged or inconsistent, and skipped.
    pub headers_invalid: u64,
    /// Files in the shard directory that are not valid segments of this
    /// store (left untouched).
    pub foreign_files: u64,
    /// Segment files found shorter than a segment (their lost slots read
    /// as empty; their length is restored).
    pub segments_truncated: u64,
    /// Wall time of the recovery in milliseconds.
    pub duration_ms: f64,
    /// The shard's device was absent at start: it has no log this run
    /// ([`crate::shard::ShardConfig::log_absent`]).
    pub log_absent: bool,
}

/// A point-in-time view of one shard, for `/v1/stats`.
#[derive(Debug, Clone, Serialize)]
pub struct ShardStats {
    /// Shard id.
    pub shard: u32,
    /// Blocks in the index.
    pub blocks: u64,
    /// Slots the shard's whole disk share can hold.
    pub capacity_blocks: u64,
    /// Segment files created so far.
    pub segments: u32,
    /// Segment files this shard may create.
    pub segments_max: u32,
    /// Bytes of segment files on disk.
    pub disk_bytes: u64,
    /// `blocks` on each device the shard spans, in its
    /// [`crate::shard::ShardConfig::segment_dirs`] order (one entry unless
    /// the store has fewer shards than devices).
    pub blocks_by_device: Vec<u64>,
    /// `disk_bytes` on each device the shard spans, in the same order.
    pub disk_bytes_by_device: Vec<u64>,
    /// Index heap bytes.
    pub index_bytes: u64,
    /// Successful PUTs.
    pub puts: u64,
    /// GETs.
    pub gets: u64,
    /// GETs that found the block.
    pub hits: u64,
    /// GETs that did not.
    pub misses: u64,
    /// Successful DELETEs.
    pub deletes: u64,
    /// Reads whose CRC-32 failed; the block was dropped, never served.
    pub corrupt_blocks: u64,
    /// Writes refused with [`Error::DiskFull`] because the filesystem had
    /// no room for a new segment (HTTP 507).
    pub disk_full_refusals: u64,
    /// Reads whose header held another key with the same 128-bit hash.
    pub hash_collisions: u64,
    /// Segments reclaimed because the log was full.
    pub reclaimed_segments: u64,
    /// Blocks dropped by reclaim.
    pub evicted_blocks: u64,
    /// Blocks reclaim kept because they were read since written (second
    /// chance), rewritten into the segment's new life.
    pub second_chance_blocks: u64,
    /// Bytes written to segments (slot headers and payloads).
    pub bytes_written: u64,
    /// Block records written to the log straight from their RAM-tier slot
    /// (write-through PUTs, demotions and flushes; `shard/append.rs`), with
    /// no copy into a DMA buffer.
    pub writes_from_ram: u64,
    /// Bytes read from segments.
    pub bytes_read: u64,
    /// Block reads and writes in flight now.
    pub io_in_flight: u64,
    /// Block I/Os waiting for an I/O permit now.
    pub io_queued: u64,
    /// Client operations refused because `io_queue_max` I/Os were already
    /// waiting (HTTP 503 with Retry-After).
    pub io_queue_refusals: u64,
    /// Index snapshots written since start.
    pub snapshots_written: u64,
    /// Operations this shard's connections sent to the shard owning the key.
    pub forwarded_requests: u64,
    /// GETs served from a block on its way into a memory tier (a PUT being
    /// placed, a block moving between tiers; `shard/transit.rs`), reported
    /// as `ram`.
    pub transit_hits: u64,
    /// The shard's I/O memory (`--io-memory-mib`) is registered with
    /// io_uring: block reads and writes use fixed buffers from it. False
    /// for a moment after start, while it is faulted in
    /// ([`crate::populate`]).
    pub io_memory_registered: bool,
    /// Seconds the shard's executor spent running tasks since start.
    pub reactor_busy_s: f64,
    /// Seconds the shard's executor has existed.
    pub reactor_wall_s: f64,
    /// reactor_busy_s / reactor_wall_s: the shard nearest 1.0 saturates
    /// first.
    pub reactor_utilization: f64,
    /// Median block read latency (µs), 0 before any read.
    pub read_us_p50: u64,
    /// 99th percentile block read latency (µs).
    pub read_us_p99: u64,
    /// Median block write latency (µs), including `fdatasync` with `--sync`.
    pub write_us_p50: u64,
    /// 99th percentile block write latency (µs).
    pub write_us_p99: u64,
    /// What recovery found at open.
    pub recovery: RecoveryReport,
    /// When PUTs are acknowledged.
    pub write_policy: WritePolicy,
    /// Whether NVMe reads promote into RAM.
    pub promote: bool,
    /// Per tier, fastest first (GPU and RAM only when configured).
    pub tiers: Vec<TierStats>,
    /// Each local tier's health, fastest first ([`crate::health`]).
    pub health: Vec<TierHealth>,
    /// Each block owner's blocks, quotas and counters in this shard (not in
    /// the per-shard JSON: summed over shards with
    /// [`super::owner_totals`]).
    #[serde(skip)]
    pub owners: Vec<super::OwnerShardStats>,
    /// Blocks stored with a block tag that some tier of this shard holds
    /// (or a PUT is bringing): each keeps its tag in memory
    /// ([`crate::events`]; docs/OPERATIONS.md "KV events for routers").
    pub tagged_blocks: u64,
}

impl Shard {
    /// A snapshot of this shard's counters and sizes.
    pub fn stats(&self) -> ShardStats {
        let c = &self.counters;
        let segments = self.segments.borrow().iter().filter(|s| s.is_some()).count() as u32;
        let tiers = self.tier_stats();
        let nvme = tiers.last().expect("the log is always a tier");
        // Busy time is what glommio spent running tasks; wall time runs from
        // the shard's start.
        let busy_s = glommio::executor().executor_stats().executor_runtime().as_secs_f64();
        let wall_s = self.started.elapsed().as_secs_f64();
        ShardStats {
            shard: self.id(),
            blocks: nvme.used_blocks,
            capacity_blocks: nvme.capacity_blocks,
            segments,
            segments_max: self.cfg.segments_max,
            disk_bytes: segments as u64 * self.cfg.segment_bytes,
            blocks_by_device: self.index.borrow().lane_blocks().to_vec(),
            disk_bytes_by_device: {
                let lanes = self.cfg.segment_dirs.len().max(1);
                let mut bytes = vec![0u64; lanes];
                for s in self.segments.borrow().iter().flatten() {
                    bytes[s.id as usize % lanes] += self.cfg.segment_bytes;
                }
                bytes
            },
            index_bytes: self.index.borrow().heap_bytes() as u64,
            puts: c.puts.get(),
            gets: c.gets.get(),
            hits: c.hits.get(),
            misses: c.misses.get(),
            deletes: c.deletes.get(),
            corrupt_blocks: c.corrupt_blocks.get(),
            disk_full_refusals: c.disk_full_refusals.get(),
            hash_collisions: c.hash_collisions.get(),
            reclaimed_segments: c.reclaimed_segments.get(),
            evicted_blocks: c.evicted_blocks.get(),
            second_chance_blocks: c.second_chance_blocks.get(),
            bytes_written: c.bytes_written.get(),
            writes_from_ram: c.writes_from_ram.get(),
            bytes_read: c.bytes_read.get(),
            io_in_flight: c.io_in_flight.get(),
            io_queued: c.io_queued.get(),
            io_queue_refusals: c.io_queue_refusals.get(),
            snapshots_written: c.snapshots_written.get(),
            forwarded_requests: c.forwarded_requests.get(),
            transit_hits: c.transit_hits.get(),
            io_memory_registered: glommio::executor().io_memory_registered(),
            reactor_busy_s: busy_s,
            reactor_wall_s: wall_s,
            reactor_utilization: if wall_s > 0.0 { busy_s / wall_s } else { 0.0 },
            read_us_p50: nvme.read_us_p50,
            read_us_p99: nvme.read_us_p99,
            write_us_p50: nvme.write_us_p50,
            write_us_p99: nvme.write_us_p99,
            recovery: self.recovery.borrow().clone(),
            write_policy: self.cfg.write_policy,
            promote: self.cfg.promote,
            tiers,
            health: self.health(),
            owners: self.owner_stats(),
            tagged_blocks: self.residency.tracked() as u64,
        }
    }

    pub(super) fn tier_stats(&self) -> Vec<TierStats> {
        let mut tiers: Vec<TierStats> = self.gpu_tier_stats().into_iter().collect();
        if let Some(ram) = &self.ram {
            let r = ram.borrow();
            let mut ram =
                TierStats::from_counters(Tier::Ram, &self.ram_counters, r.capacity_blocks(), r.used_blocks(), Some(r.huge_pages()));
            ram.shared = Some(r.arena().is_shared());
            tiers.push(ram);
        }
        let c = &self.counters;
        let capacity = self.cfg.segments_max as u64 * self.slots_per_segment as u64;
        let nvme = TierStats::from_counters(Tier::Nvme, &self.nvme_counters, capacity, self.index.borrow().len() as u64, None);
        tiers.push(TierStats { evictions: c.evicted_blocks.get(), bytes_in: c.bytes_written.get(), bytes_out: c.bytes_read.get(), ..nvme });
        tiers
    }
}

/// Per-tier counters summed over shards, fastest tier first.
pub fn tier_totals(shards: &[ShardStats]) -> Vec<TierStats> {
    let mut totals: Vec<TierStats> = Vec::new();
    for s in shards {
        for t in &s.tiers {
            match totals.iter_mut().find(|x| x.tier == t.tier) {
                Some(x) => x.add(t),
                None => totals.push(t.clone()),
            }
        }
    }
    totals.sort_by_key(|t| t.tier);
    totals
}
