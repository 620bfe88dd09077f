//! One shard: the keys whose `block_hash mod shards` is this shard's id, its
//! index, its segments, its share of each memory tier and its sequence
//! counter. A shard lives on one glommio executor and takes no locks; `&self`
//! methods use `Cell`/`RefCell` because nothing else can touch it.
//!
//! This file holds the shard itself and the calls the store makes of it
//! (put, get, delete, contains, close), which walk the waterfall
//! transit → GPU → RAM → NVMe log → remote. Each role has its own file:
//!
//! | file | role |
//! |---|---|
//! | `shard/config.rs` | a shard's settings, derived from the store's |
//! | `shard/append.rs` | the log's write path: one `O_DIRECT` write of a slot, then the index |
//! | `shard/slots.rs` | the log's slots and sequence numbers: the next slot, the next head segment, writes in flight, the survivors a reclaim hands over |
//! | `shard/reclaim.rs` | reclaiming the oldest segment, second chance, moving survivors |
//! | `shard/reader.rs` | the verified `O_DIRECT` reader: chunks read ahead, each CRC-checked before it is handed over |
//! | `shard/snapshot.rs` | the index snapshot and what it covers |
//! | `shard/placement.rs` | the RAM tier's policy: placement, demotion, promotion, prefetch, the write-back flush |
//! | `shard/waterfall.rs` | the GPU tier's policy: placement above RAM, moves down, reads, prefetch |
//! | `shard/transit.rs` | blocks on their way into a memory tier, served meanwhile |
//! | `shard/remote.rs` | the remote tier below the log: read-through, install, upload, delete |
//! | `shard/stats.rs` | counters and the `/v1/stats` view |
//! | [`crate::recover`] | rebuilding the log at open, handed over with [`Shard::restore`] |

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use glommio::io::DmaBuffer;
use glommio::sync::Semaphore;

use crate::counter::{bump, record_us};
use crate::error::{Error, Result};
use crate::events::{Medium, Residency};
use crate::index::Index;
use crate::key::{BlockHash, StoredKey};
use crate::pool::BufferPool;
use crate::ram::RamTier;
use crate::segment::{Segment, Superblock};
use crate::signal::InFlightCount;
use crate::slot::{self, RecordKind, SlotHeader, PAGE_BYTES};
use crate::stream::BlockBody;
use crate::tier::{Tier, TierCounters};

mod append;
mod config;
mod health;
#[cfg(test)]
mod interleavings;
mod lease;
mod owners;
mod placement;
mod put;
mod reader;
mod reclaim;
mod remote;
mod slots;
mod snapshot;
mod stats;
mod tasks;
mod transit;
mod waterfall;

pub use config::ShardConfig;
pub use health::LOG_PROBE_EVERY;
pub use lease::LeaseOutcome;
pub use owners::{owner_totals, OwnerCounters, OwnerShardStats};
pub use remote::PutReport;
use stats::Counters;
pub use stats::{tier_totals, RecoveryReport, ShardStats};
pub(crate) use tasks::Hold;

pub use put::{PutSource, StillWanted};
use transit::Transits;

/// Outcome of a successful PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The key was not stored before.
    Created,
    /// An older block under the key was replaced.
    Replaced,
}

/// One shard of the store. See the module docs for the write and read paths.
pub struct Shard {
    pub(crate) cfg: ShardConfig,
    pub(crate) slot_bytes: u64,
    pub(crate) slots_per_segment: u32,
    index: RefCell<Index>,
    /// Open segments by id (`None` for ids not created).
    segments: RefCell<Vec<Option<Rc<Segment>>>>,
    /// Full segments, oldest life first: the reclaim order.
    sealed: RefCell<VecDeque<u32>>,
    /// The filesystem refused the last segment creation (log once).
    fs_full: Cell<bool>,
    /// Segments with no live slots, ready to become the head.
    free: RefCell<Vec<u32>>,
    /// The segment being appended to.
    head: Cell<Option<u32>>,
    /// A segment created ahead of need, never written: the next head when
    /// no free segment is left (`shard/slots.rs`, [`Shard::prepare_spare`]).
    spare: Cell<Option<u32>>,
    /// A task is creating the spare.
    spare_pending: Cell<bool>,
    /// Held while a segment file is being created (by the spare's task or
    /// a rollover), so that two never take the same id.
    create_lock: Semaphore,
    next_seq: Cell<u64>,
    /// Sequence numbers taken by writes not yet complete, with their
    /// segment: a snapshot covers only what lies below the lowest.
    inflight: RefCell<BTreeMap<u64, (u32, u32)>>,
    /// Highest sequence number recorded per segment id (for snapshots).
    max_seq: RefCell<Vec<u64>>,
    alloc_lock: Semaphore,
    io_permits: Semaphore,
    /// The shard itself, once shared ([`Shard::share`]): survivor copies
    /// run as tasks of their own.
    me: RefCell<std::rc::Weak<Shard>>,
    /// Tasks holding the shard ([`Shard::spawn_holding`]), which a close
    /// waits out ([`Shard::tasks_ended`]).
    tasks: InFlightCount,
    /// Slot-sized DMA buffers kept between writes (at most `io_depth_max`),
    /// so steady-state PUTs allocate nothing.
    buffers: RefCell<Vec<DmaBuffer>>,
    /// Buffers GET responses of format 1 slots are copied into (see
    /// [`crate::pool`]).
    read_buffers: Arc<BufferPool>,
    /// Payload bytes per chunk CRC-32 of the slots this shard writes
    /// ([`slot::chunk_bytes_for`]).
    chunk_bytes: u32,
    counters: Counters,
    recovery: RefCell<RecoveryReport>,
    started: Instant,
    /// The RAM tier, if configured.
    ram: Option<RefCell<RamTier>>,
    ram_counters: TierCounters,
    /// The GPU tier, if configured and opened.
    gpu: Option<crate::gpu::GpuTier>,
    /// Why the configured GPU tier is absent (`--gpu-optional`).
    gpu_unavailable: Option<String>,
    /// Blocks on their way into a memory tier, served from here meanwhile.
    transits: Transits,
    gpu_counters: TierCounters,
    /// The log's tier counters: reads it served or missed, blocks demoted
    /// into it, block read and write latencies. Bytes and evictions are the
    /// segment counters in `counters`.
    nvme_counters: TierCounters,
    /// This shard's handle on the remote tier below the log, if any.
    remote: Option<Rc<dyn crate::remote::RemoteShard>>,
    /// Remote reads in flight, one per key (`shard/remote.rs`).
    remote_reads: remote::RemoteReads,
    /// What each local tier met (`shard/health.rs`).
    health: health::Trackers,
    /// Block owners, their quotas and counters (`owners.rs`).
    owner_state: owners::OwnerState,
    /// Which tiers hold each tagged block; KV events ([`crate::events`]).
    residency: Rc<Residency>,
}

/// What recovery rebuilt of a shard's log ([`crate::recover::open_shard`]),
/// handed to the shard in one piece ([`Shard::restore`]).
pub(crate) struct RecoveredLog {
    /// Open segments by id (`None` for ids not found).
    pub segments: Vec<Option<Rc<Segment>>>,
    /// Highest sequence number recorded per segment id.
    pub max_seq: Vec<u64>,
    /// The index of every live record.
    pub index: Index,
    /// The sequence number the next write takes.
    pub next_seq: u64,
    /// Segments holding records other than the head, oldest life first.
    pub sealed: Vec<u32>,
    /// Segments with nothing live.
    pub free: Vec<u32>,
    /// The newest segment with room, appended to next.
    pub head: Option<u32>,
    /// What recovery found.
    pub report: RecoveryReport,
}

impl Shard {
    /// A shard with no segments open yet; [`crate::recover::open_shard`]
    /// fills it from disk.
    pub(crate) fn new(cfg: ShardConfig) -> Result<Shard> {
        let slot_bytes = cfg.slot_bytes();
        let slots_per_segment = cfg.slots_per_segment();
        if slots_per_segment == 0 {
            return Err(Error::Config(format!(
                "a segment of {} bytes cannot hold one slot of {slot_bytes} bytes (4 KiB header + block); raise --segment-mib",
                cfg.segment_bytes
            )));
        }
        if cfg.segments_max < 2 {
            return Err(Error::Config(format!(
                "each shard needs room for at least 2 segments of {} bytes (one to write, one to reclaim); raise --disk-gb or lower --segment-mib",
                cfg.segment_bytes
            )));
        }
        let capacity_blocks = cfg.segments_max as usize * slots_per_segment as usize;
        if !Index::fits(cfg.segments_max as u64 * 2, slots_per_segment) {
            return Err(Error::Config(format!(
                "a shard of {} segments of {slots_per_segment} slots has more slots than its index addresses (2^32 slot numbers, with room for twice the segments); use more shards (--shards) or less disk per shard (--disk-gb)",
                cfg.segments_max
            )));
        }
        let residency = Residency::new(cfg.shard_id as usize, cfg.events.clone());
        let ram = match cfg.ram_blocks {
            0 => None,
            n => {
                let mut ram = RamTier::new(n, cfg.geometry.block_bytes, cfg.ram_shared)?;
                if cfg.shard_id == 0 {
                    let (shared, pages) = (ram.arena().is_shared(), ram.huge_pages());
                    tracing::info!(
                        shared,
                        huge_pages = ?pages,
                        "RAM tier {} to clients (--ram-shared {:?}: leases {})",
                        if shared { "shared" } else { "not shared" },
                        cfg.ram_shared,
                        if shared { "offered" } else { "off" }
                    );
                }
                ram.set_journal(residency.journal(Medium::Ram));
                Some(RefCell::new(ram))
            }
        };
        let (gpu, gpu_unavailable) = waterfall::open_gpu(&cfg)?;
        if let Some(gpu) = &gpu {
            gpu.set_journal(residency.journal(Medium::Gpu));
        }
        if cfg.shared_index {
            let listed = capacity_blocks as u64 + u64::from(cfg.ram_blocks) + gpu.as_ref().map_or(0, |g| g.capacity_blocks());
            residency.set_shared_index(crate::shared_index::IndexTable::new(listed, cfg.shard_id, cfg.shards, &cfg.dir)?);
        }
        let mut index = Index::new(capacity_blocks.min(1 << 20), slots_per_segment);
        index.set_journal(residency.journal(Medium::Nvme));
        index.set_lanes(cfg.segment_dirs.len());
        let remote = cfg.remote.as_ref().map(|r| r.for_shard(cfg.shard_id as usize));
        Ok(Shard {
            slot_bytes,
            slots_per_segment,
            index: RefCell::new(index),
            segments: RefCell::new(Vec::new()),
            sealed: RefCell::new(VecDeque::new()),
            fs_full: Cell::new(false),
            free: RefCell::new(Vec::new()),
            head: Cell::new(None),
            spare: Cell::new(None),
            spare_pending: Cell::new(false),
            create_lock: Semaphore::new(1),
            next_seq: Cell::new(1),
            inflight: RefCell::new(BTreeMap::new()),
            max_seq: RefCell::new(Vec::new()),
            alloc_lock: Semaphore::new(1),
            me: RefCell::new(std::rc::Weak::new()),
            tasks: InFlightCount::new("the tasks holding the shard ended"),
            io_permits: Semaphore::new(cfg.io_depth_max.max(1) as u64),
            buffers: RefCell::new(Vec::new()),
            read_buffers: BufferPool::new(cfg.geometry.block_bytes),
            chunk_bytes: slot::chunk_bytes_for(cfg.geometry.block_bytes),
            counters: Counters::default(),
            recovery: RefCell::new(RecoveryReport::default()),
            started: Instant::now(),
            ram,
            ram_counters: TierCounters::default(),
            gpu,
            gpu_unavailable,
            transits: Transits::default(),
            gpu_counters: TierCounters::default(),
            nvme_counters: TierCounters::default(),
            remote,
            remote_reads: Default::default(),
            health: health::Trackers::new(cfg.shard_id, cfg.health_window),
            owner_state: owners::OwnerState::new(cfg.owners.clone()),
            residency,
            cfg,
        })
    }

    /// Takes one of the `io_depth_max` I/O permits, waiting for it. A client
    /// operation (`refusable`) that would wait behind `io_queue_max` others
    /// is refused instead and counted, so the queue stays bounded; internal
    /// I/O (demotions, the flush at close) always waits.
    ///
    /// # Errors
    /// [`Error::Overloaded`], [`Error::ShuttingDown`].
    async fn io_permit(&self, refusable: bool) -> Result<glommio::sync::Permit<'_>> {
        let queued = self.counters.io_queued.get();
        if refusable && self.io_permits.available() == 0 && queued >= self.cfg.io_queue_max as u64 {
            bump(&self.counters.io_queue_refusals, 1);
            return Err(Error::Overloaded(format!(
                "shard {} has {} block I/Os in flight and {queued} waiting (--io-queue-max {}); retry shortly",
                self.id(),
                self.cfg.io_depth_max,
                self.cfg.io_queue_max
            )));
        }
        self.counters.io_queued.set(queued + 1);
        // Undone on every exit, including the waiting future being dropped.
        struct Waiting<'a>(&'a Cell<u64>);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.set(self.0.get() - 1);
            }
        }
        let _waiting = Waiting(&self.counters.io_queued);
        self.io_permits.acquire_permit(1).await.map_err(|_| Error::ShuttingDown)
    }

    /// An empty index sized for this shard's slots (up to 1 Mi entries to
    /// start; it grows past that).
    pub(crate) fn empty_index(&self) -> Index {
        let capacity_blocks = self.cfg.segments_max as usize * self.slots_per_segment as usize;
        let mut index = Index::new(capacity_blocks.min(1 << 20), self.slots_per_segment);
        index.set_journal(self.residency.journal(Medium::Nvme));
        index.set_lanes(self.cfg.segment_dirs.len());
        index
    }

    /// Which tiers hold each tagged block ([`crate::events`]).
    pub fn residency(&self) -> &Rc<Residency> {
        &self.residency
    }

    /// Takes over the log recovery rebuilt. Called once, before the shard
    /// serves.
    pub(crate) fn restore(&self, log: RecoveredLog) {
        debug_assert!(self.segments.borrow().is_empty() && self.head.get().is_none(), "restore runs once, on a new shard");
        *self.segments.borrow_mut() = log.segments;
        *self.max_seq.borrow_mut() = log.max_seq;
        *self.index.borrow_mut() = log.index;
        self.next_seq.set(log.next_seq);
        self.sealed.borrow_mut().extend(log.sealed);
        self.free.borrow_mut().extend(log.free);
        self.head.set(log.head);
        *self.recovery.borrow_mut() = log.report;
    }

    /// Starts faulting the RAM tier's memory in on a helper thread (once;
    /// after start-up, see [`crate::ram::Arena::prefault_in_background`]).
    /// The thread is started from the executor's blocking pool, not from
    /// the shard's thread: creating a thread maps its stack, and `mmap`
    /// waits for the process's memory-map lock, which other threads' page
    /// faults hold in turn (a shard's thread waited 630 ms for it while
    /// the other shards faulted their memory in and six vLLMs started).
    pub async fn prefault_ram(&self) {
        let Some(ram) = &self.ram else { return };
        let arena = ram.borrow().arena().clone();
        glommio::executor().spawn_blocking(move || arena.prefault_in_background()).await;
    }

    /// Wraps the opened shard in the `Rc` every task shares, so that it
    /// can run work that outlives the request that started it.
    pub fn share(self) -> Rc<Shard> {
        let shard = Rc::new(self);
        *shard.me.borrow_mut() = Rc::downgrade(&shard);
        shard
    }

    /// Counts an operation sent to another shard.
    pub fn count_forwarded(&self) {
        bump(&self.counters.forwarded_requests, 1);
    }

    /// This shard's id.
    pub fn id(&self) -> u32 {
        self.cfg.shard_id
    }

    fn segment(&self, id: u32) -> Rc<Segment> {
        self.segments.borrow()[id as usize].clone().expect("index points at an open segment")
    }

    fn superblock(&self, id: u32, first_seq: u64) -> Superblock {
        Superblock {
            shard: self.cfg.shard_id,
            segment_id: id,
            slot_bytes: self.slot_bytes,
            block_bytes: self.cfg.geometry.block_bytes,
            segment_bytes: self.cfg.segment_bytes,
            first_seq,
            store_id: self.cfg.store_id,
        }
    }

    /// Reads a block: from RAM (whole, zero-copy), else from the log as a
    /// stream of chunks, each checked against its CRC-32 before it is
    /// handed over. The answer comes once the header and the first chunk
    /// have passed their checks, so a block that is missing or whose start
    /// is damaged is an error here, never a started response.
    ///
    /// # Errors
    /// [`Error::NotFound`] when not stored; [`Error::Corrupt`] when the
    /// record fails its checks (the entry is dropped and counted);
    /// [`Error::Io`]; [`Error::Overloaded`]. A chunk failing later arrives
    /// as an `Err` item of the stream (see [`crate::stream`]).
    ///
    /// With `stream` a block from the log comes back as a
    /// [`BlockBody::Chunks`] stream, each chunk as soon as it has passed;
    /// without, every chunk at once after the last has passed (for a GET
    /// forwarded from another shard: one wake-up across threads instead of
    /// one per chunk, which cost 1.2 MB GETs at concurrency 1 about 1.4 ms
    /// more at p50). Both end alike on damage: the first chunk failing is
    /// an `Err` here; a later one arrives as the chunks that passed, then
    /// an `Err` item.
    pub async fn get(&self, key: &StoredKey, hash: BlockHash, stream: bool) -> Result<(BlockBody, Tier)> {
        bump(&self.counters.gets, 1);
        let result = self.read_tiered(key, hash, stream).await;
        match &result {
            Ok(_) => {
                bump(&self.counters.hits, 1);
                self.count_owner(self.owner_of(key), |c| c.hits += 1);
            }
            Err(Error::NotFound) | Err(Error::Corrupt { .. }) => {
                bump(&self.counters.misses, 1);
                self.count_owner(self.owner_of(key), |c| c.misses += 1);
            }
            Err(_) => {}
        }
        result
    }

    /// GPU first, then RAM, then the log, then the remote tier; with
    /// `promote` on a block read from the log is promoted to the fastest
    /// memory tier (`waterfall.rs`), and a block read from the remote tier
    /// is installed locally (`shard/remote.rs`).
    async fn read_tiered(&self, key: &StoredKey, hash: BlockHash, stream: bool) -> Result<(BlockBody, Tier)> {
        // A block on its way into a memory tier: its newest bytes, which no
        // tier may hold yet.
        if let Some(parts) = self.transits.get(key, &hash) {
            bump(&self.counters.transit_hits, 1);
            return Ok((self.transit_body(parts, stream), Tier::Ram));
        }
        if let Some(bytes) = self.read_gpu(key, hash).await {
            return Ok((BlockBody::Whole(bytes), Tier::Gpu));
        }
        if let Some(ram) = &self.ram {
            let started = Instant::now();
            let got = ram.borrow_mut().get(key, &hash);
            if let Some(bytes) = got {
                let c = &self.ram_counters;
                bump(&c.hits, 1);
                bump(&c.bytes_out, bytes.len() as u64);
                record_us(&c.read_us, started.elapsed().as_micros());
                let bytes = if self.cfg.promote { self.promote_from_ram(key, hash, bytes).await } else { bytes };
                return Ok((BlockBody::Whole(bytes), Tier::Ram));
            }
            bump(&self.ram_counters.misses, 1);
        }
        match self.read_block(key, hash, self.cfg.promote, stream).await {
            Ok(body) => {
                bump(&self.nvme_counters.hits, 1);
                Ok((body, Tier::Nvme))
            }
            Err(e) => {
                // A read the device failed (counted in the log's health) is
                // a miss too: the block may still be in the remote tier.
                if matches!(e, Error::NotFound | Error::Corrupt { .. } | Error::Io { .. }) {
                    bump(&self.nvme_counters.misses, 1);
                    if let Some(bytes) = self.read_remote(key, hash).await {
                        return Ok((BlockBody::Whole(bytes), Tier::Remote));
                    }
                }
                Err(if matches!(e, Error::Io { .. }) { Error::NotFound } else { e })
            }
        }
    }

    /// The fastest tier holding a block under `hash` (map lookups; no I/O,
    /// no LRU change); `ram` for a block on its way into a memory tier.
    pub fn contains(&self, hash: &BlockHash) -> Option<Tier> {
        if self.transits.contains(hash) {
            return Some(Tier::Ram);
        }
        if self.gpu.as_ref().is_some_and(|g| g.contains(hash)) {
            return Some(Tier::Gpu);
        }
        if self.ram.as_ref().is_some_and(|r| r.borrow().contains(hash)) {
            return Some(Tier::Ram);
        }
        self.index.borrow().contains(hash).then_some(Tier::Nvme)
    }

    /// Deletes a block by appending a tombstone, so it stays deleted after a
    /// restart.
    ///
    /// # Errors
    /// [`Error::NotFound`] when not stored; [`Error::DiskFull`], [`Error::Io`].
    pub async fn delete(&self, key: &StoredKey, hash: BlockHash) -> Result<()> {
        // A block on its way into a memory tier (a PUT being placed, a move
        // between tiers) is stored: let it land, then delete it wherever it
        // is. A newer PUT's transit is not waited for; it lands after.
        if let Some(seen) = self.transits.id_of(&hash) {
            self.transits.ended.until(|| self.transits.id_of(&hash) != Some(seen)).await;
        }
        if self.delete_from_gpu(&hash).await
            && !self.ram.as_ref().is_some_and(|r| r.borrow().contains(&hash))
            && !self.index.borrow().contains(&hash)
        {
            bump(&self.counters.deletes, 1);
            return Ok(());
        }
        if let Some(ram) = &self.ram {
            // A write-back demotion of this block in flight would land in
            // the log after the tombstone and bring it back: let it finish.
            let ended = ram.borrow().demotion_ended.clone();
            ended.until(|| !ram.borrow().is_demoting(&hash)).await;
            if ram.borrow_mut().remove(&hash) && !self.index.borrow().contains(&hash) {
                bump(&self.counters.deletes, 1);
                return Ok(());
            }
        }
        if !self.index.borrow().contains(&hash) {
            return Err(Error::NotFound);
        }
        let _permit = self.io_permit(true).await?;
        let buf = glommio::allocate_dma_buffer(PAGE_BYTES as usize);
        let header = SlotHeader {
            kind: RecordKind::Tombstone,
            seq: 0,
            hash,
            payload_len: 0,
            payload_crc: 0,
            write_time_us: slot::now_us(),
            key: key.as_str().as_bytes().to_vec(),
            scope_bytes: key.scope_bytes(),
            chunk_bytes: 0,
            chunk_crcs: Vec::new(),
            tag: Vec::new(),
        };
        let (_, existed) = self.append(append::RecordBody::Whole(buf), header, self.owner_of(key)).await?;
        if !existed {
            return Err(Error::NotFound);
        }
        bump(&self.counters.deletes, 1);
        Ok(())
    }

    /// Writes the write-back RAM blocks to the log, waits for any survivor
    /// move to finish, writes an index snapshot, then closes every segment
    /// file. Writes are already on the device (each was acknowledged after
    /// its `O_DIRECT` write completed).
    pub async fn close(&self) {
        match self.flush_ram().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(shard = self.id(), blocks = n, "write-back blocks written to the log at close"),
            Err(e) => tracing::error!(shard = self.id(), "writing write-back blocks to the log at close failed; they are lost: {e}"),
        }
        // That flush may have reclaimed a segment: let its survivors finish
        // moving before the snapshot and before the files close.
        let compacting: Vec<Rc<Segment>> = self.segments.borrow().iter().flatten().filter(|s| s.compacting.get()).cloned().collect();
        for segment in compacting {
            segment.survivors_moved.until(|| !segment.compacting.get()).await;
        }
        if let Err(e) = self.write_snapshot().await {
            tracing::warn!(shard = self.id(), "index snapshot at close failed (the next start scans headers): {e}");
        }
        let segments: Vec<Rc<Segment>> = self.segments.borrow_mut().drain(..).flatten().collect();
        for segment in segments {
            match Rc::try_unwrap(segment) {
                Ok(s) => {
                    if let Err(e) = s.file.close().await {
                        tracing::warn!(shard = self.id(), "closing segment: {e}");
                    }
                }
                Err(_) => tracing::warn!(shard = self.id(), "segment still in use at close"),
            }
        }
    }
}
