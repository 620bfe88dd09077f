//! One shard: the keys whose `block_hash mod shards` is this shard's id, its
//! index, its segments and its sequence counter. A shard lives on one glommio
//! executor and takes no locks; `&self` methods use `Cell`/`RefCell` because
//! nothing else can touch it.
//!
//! Write path ([`Shard::put`]): copy the body into an aligned DMA buffer
//! (computing the payload CRC-32 as it goes), take the next slot and sequence
//! number, encode the header into the buffer's first page, one `O_DIRECT`
//! write of the whole slot, optional `fdatasync`, then point the index at it.
//! The index changes only after the write completes, so a reader sees the
//! old block or the new one, never a slot in flight.
//!
//! Read path ([`Shard::get`]): the slot's chunks are read with several reads
//! in flight; the first (with the header) is checked (header CRC, sequence
//! number, full key, the chunk's CRC-32) before the GET answers at all, and
//! each later chunk is sent as soon as its own CRC-32 matches
//! ([`crate::stream`]). A format 1 slot (whole-block CRC only) is read and
//! checked whole before it is sent.
//!
//! Above the log sits the RAM tier ([`crate::ram`], `ram_blocks` slots):
//! PUTs land there too (write-through: after the NVMe write; write-back:
//! instead of it, until demoted), GETs look there first, and an NVMe read
//! promotes its block into RAM when `promote` is on. A full RAM tier moves
//! its least recently used block down: dropped (its NVMe copy stays) or, if
//! it is only in RAM (write-back), written to the log first. A GPU tier
//! ([`crate::gpu`]) sits above RAM; its part of the waterfall is in
//! `shard/waterfall.rs`.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::channel::mpsc;
use futures::stream::{FuturesOrdered, StreamExt};
use glommio::io::{DmaBuffer, ReadResult};
use glommio::sync::Semaphore;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::geometry::Geometry;
use crate::index::snapshot::{self, EntryState, IndexSnapshot, SegmentState};
use crate::index::{Entry, Index};
use crate::key::BlockHash;
use crate::pool::BufferPool;
use crate::ram::RamTier;
use crate::segment::{self, InFlight, Segment, Superblock};
use crate::slot::{self, ChunkHasher, RecordKind, SlotHeader, PAGE_BYTES};
use crate::stream::{dma_chunk, BlockBody, ChunkStream};
use crate::tier::{bump, record_us, Tier, TierCounters, TierStats, WritePolicy};

mod remote;
mod transit;
mod waterfall;

pub use remote::PutReport;

use transit::{Placed, Transits};

/// How long reclaim sleeps between checks while it waits for reads and
/// writes of a segment to drain (and reads wait for a compaction).
const RECLAIM_POLL: Duration = Duration::from_micros(200);

/// Reads of one block in flight at once, one per chunk (1 MiB each, so a
/// 16 MiB block keeps the device busy with all of it, as fio's one 16 MiB
/// read does once the kernel splits it). Chunks are checked and sent in
/// order as the reads complete. One 16 MiB read ran at ~0.5× fio's
/// throughput here; split reads let the device work on several at once.
const READ_AHEAD_CHUNKS: usize = 16;

/// At most this fraction of a reclaimed segment's slots is kept by second
/// chance, so every reclaim frees at least half a segment even when every
/// block in it is hot.
const SECOND_CHANCE_SHARE: u32 = 2;

/// Settings of one shard, derived from the store's configuration.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// This shard's id, `0..shards`.
    pub shard_id: u32,
    /// `<data-dir>/shard-NNN`.
    pub dir: PathBuf,
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
    /// operation is refused ([`Error::Overloaded`]).
    pub io_queue_max: usize,
    /// Write an index snapshot this often (0: only at clean close).
    pub snapshot_secs: u64,
    /// Slots of the RAM tier (0: no RAM tier).
    pub ram_blocks: u32,
    /// When PUTs are acknowledged.
    pub write_policy: WritePolicy,
    /// Whether a read from NVMe promotes the block into RAM.
    pub promote: bool,
    /// The GPU tier above RAM (see [`crate::gpu`]).
    pub gpu: crate::gpu::GpuConfig,
    /// The remote tier below the log, shared by the process's shards (see
    /// [`crate::remote`]).
    pub remote: Option<Arc<dyn crate::remote::Remote>>,
}

impl ShardConfig {
    /// Bytes per slot for this geometry.
    pub fn slot_bytes(&self) -> u64 {
        slot::slot_bytes(self.geometry.block_bytes)
    }

    /// Slots that fit in one segment after its superblock.
    pub fn slots_per_segment(&self) -> u32 {
        ((self.segment_bytes.saturating_sub(PAGE_BYTES)) / self.slot_bytes()) as u32
    }
}

/// Counters of a shard, kept as plain cells on the shard's thread.
#[derive(Debug, Default)]
struct Counters {
    puts: Cell<u64>,
    gets: Cell<u64>,
    hits: Cell<u64>,
    misses: Cell<u64>,
    deletes: Cell<u64>,
    corrupt_blocks: Cell<u64>,
    disk_full_refusals: Cell<u64>,
    hash_collisions: Cell<u64>,
    reclaimed_segments: Cell<u64>,
    evicted_blocks: Cell<u64>,
    second_chance_blocks: Cell<u64>,
    bytes_written: Cell<u64>,
    bytes_read: Cell<u64>,
    io_in_flight: Cell<u64>,
    io_queued: Cell<u64>,
    io_queue_refusals: Cell<u64>,
    snapshots_written: Cell<u64>,
    forwarded_requests: Cell<u64>,
    transit_hits: Cell<u64>,
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
}

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
    pub(crate) index: RefCell<Index>,
    /// Open segments by id (`None` for ids not created).
    pub(crate) segments: RefCell<Vec<Option<Rc<Segment>>>>,
    /// Full segments, oldest life first: the reclaim order.
    pub(crate) sealed: RefCell<VecDeque<u32>>,
    /// The filesystem refused the last segment creation (log once).
    fs_full: Cell<bool>,
    /// Segments with no live slots, ready to become the head.
    pub(crate) free: RefCell<Vec<u32>>,
    /// The segment being appended to.
    pub(crate) head: Cell<Option<u32>>,
    pub(crate) next_seq: Cell<u64>,
    /// Sequence numbers taken by writes not yet complete, with their
    /// segment: a snapshot covers only what lies below the lowest.
    inflight: RefCell<BTreeMap<u64, (u32, u32)>>,
    /// Highest sequence number recorded per segment id (for snapshots).
    pub(crate) max_seq: RefCell<Vec<u64>>,
    alloc_lock: Semaphore,
    io_permits: Semaphore,
    /// The shard itself, once shared ([`Shard::share`]): survivor copies
    /// run as tasks of their own.
    me: RefCell<std::rc::Weak<Shard>>,
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
    pub(crate) recovery: RefCell<RecoveryReport>,
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
        let ram = match cfg.ram_blocks {
            0 => None,
            n => Some(RefCell::new(RamTier::new(n, cfg.geometry.block_bytes)?)),
        };
        let (gpu, gpu_unavailable) = waterfall::open_gpu(&cfg)?;
        let remote = cfg.remote.as_ref().map(|r| r.for_shard(cfg.shard_id as usize));
        Ok(Shard {
            slot_bytes,
            slots_per_segment,
            index: RefCell::new(Index::new(capacity_blocks.min(1 << 20), slots_per_segment)),
            segments: RefCell::new(Vec::new()),
            sealed: RefCell::new(VecDeque::new()),
            fs_full: Cell::new(false),
            free: RefCell::new(Vec::new()),
            head: Cell::new(None),
            next_seq: Cell::new(1),
            inflight: RefCell::new(BTreeMap::new()),
            max_seq: RefCell::new(Vec::new()),
            alloc_lock: Semaphore::new(1),
            me: RefCell::new(std::rc::Weak::new()),
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
        }
    }

    /// Stores a block. `chunks` together must be exactly `block_bytes` long.
    /// Write-through: written to the log (one copy, into the aligned buffer
    /// written), then copied into the RAM tier. Write-back: copied into the
    /// RAM tier only, and acknowledged; to the log when RAM has no slot to
    /// give (every slot pinned by responses in flight).
    ///
    /// # Errors
    /// [`Error::WrongSize`], [`Error::DiskFull`], [`Error::Io`] (write-back:
    /// also from writing a demoted block to the log to make room).
    pub async fn put(&self, key: &str, hash: BlockHash, chunks: &[Bytes]) -> Result<PutOutcome> {
        let block_bytes = self.cfg.geometry.block_bytes;
        let got: u64 = chunks.iter().map(|c| c.len() as u64).sum();
        if got != block_bytes {
            return Err(Error::WrongSize { expected: block_bytes, got });
        }
        let parts: Vec<&[u8]> = chunks.iter().map(|c| &c[..]).collect();
        let tiered = self.ram.is_some() || self.gpu.is_some();
        // From here until the block is placed, GETs are served from its
        // transit (see `shard/transit.rs`): in write-back the older copies
        // leave memory before the new one lands, and the log may have none.
        let mut ticket = None;
        if self.cfg.write_policy == WritePolicy::Back && tiered {
            let existed = self.contains(&hash).is_some();
            let t = ticket.insert(self.transits.begin(key, hash, chunks.to_vec()));
            if self.place(key, hash, &parts, true, t).await? != Placed::NoRoom {
                bump(&self.counters.puts, 1);
                return Ok(if existed { PutOutcome::Replaced } else { PutOutcome::Created });
            }
        }
        let outcome = self.put_nvme(key, hash, chunks, true).await?;
        if tiered {
            // Write-through: the transit starts once the log has the block,
            // so transits of concurrent PUTs begin in the order their log
            // writes completed.
            let t = ticket.get_or_insert_with(|| self.transits.begin(key, hash, chunks.to_vec()));
            if self.place(key, hash, &parts, false, t).await? == Placed::NoRoom && t.is_current() {
                // No memory slot to give: an older copy there must not
                // outlive the new block.
                self.drop_from_memory(&hash);
            }
        }
        Ok(outcome)
    }

    /// Places a block in the RAM tier as its most recently used block while
    /// `wanted()` holds (checked before an older copy leaves and at the
    /// install), moving least recently used blocks down to make room:
    /// dropped when the log has them, written to the log first when they are
    /// only in RAM (`dirty`, write-back). [`Placed::NoRoom`] when there is
    /// no RAM tier or every slot is pinned or being demoted.
    ///
    /// # Errors
    /// Writing a demoted block to the log failed (the block stays in RAM).
    async fn cache(&self, key: &str, hash: BlockHash, parts: &[&[u8]], dirty: bool, wanted: &dyn Fn() -> bool) -> Result<Placed> {
        let Some(ram) = &self.ram else { return Ok(Placed::NoRoom) };
        let started = Instant::now();
        loop {
            let victim = {
                if !wanted() {
                    return Ok(Placed::Superseded);
                }
                let mut r = ram.borrow_mut();
                r.release_if_idle(&hash);
                if let Some(slot) = r.take_free() {
                    r.install(slot, key, hash, parts, dirty);
                    bump(&self.ram_counters.bytes_in, self.cfg.geometry.block_bytes);
                    record_us(&self.ram_counters.write_us, started.elapsed().as_micros());
                    return Ok(Placed::In(Tier::Ram));
                }
                match r.victim() {
                    Some(v) if !v.dirty => {
                        r.evict(v.slot);
                        bump(&self.ram_counters.demotions, 1);
                        continue;
                    }
                    Some(v) => v,
                    None => return Ok(Placed::NoRoom),
                }
            };
            // Write-back: the victim is only in RAM; write it to the log
            // first. It stays readable from RAM meanwhile.
            let bytes = ram.borrow_mut().begin_demotion(victim.slot);
            let written = self.put_nvme(&victim.key, victim.hash, &[bytes], false).await;
            ram.borrow_mut().end_demotion(victim.slot, written.is_ok());
            written?;
            bump(&self.ram_counters.demotions, 1);
            bump(&self.nvme_counters.promotions, 1);
        }
    }

    /// Writes every block held only in RAM (write-back) to the log, least
    /// recently used first; they stay in RAM, now clean. Used at clean
    /// close, so a graceful stop loses nothing.
    ///
    /// # Errors
    /// The first failed log write.
    pub async fn flush_ram(&self) -> Result<u64> {
        let mut written = self.flush_gpu().await?;
        let Some(ram) = &self.ram else { return Ok(written) };
        let dirty = ram.borrow().dirty_blocks();
        for v in dirty {
            let bytes = ram.borrow_mut().begin_demotion(v.slot);
            let r = self.put_nvme(&v.key, v.hash, &[bytes], false).await;
            ram.borrow_mut().end_flush(v.slot, r.is_ok());
            r?;
            written += 1;
        }
        Ok(written)
    }

    /// Writes a block to the log only. `chunks` together are exactly
    /// `block_bytes` long ([`Shard::put`] checked; demotions pass a whole
    /// RAM slot); they are copied once, into the aligned buffer that is
    /// written.
    ///
    /// # Errors
    /// [`Error::DiskFull`], [`Error::Io`].
    async fn put_nvme(&self, key: &str, hash: BlockHash, chunks: &[Bytes], refusable: bool) -> Result<PutOutcome> {
        let block_bytes = self.cfg.geometry.block_bytes;
        debug_assert_eq!(chunks.iter().map(|c| c.len() as u64).sum::<u64>(), block_bytes);
        let _permit = self.io_permit(refusable).await?;
        let mut buf = self.take_write_buffer();
        let bytes = buf.as_bytes_mut();
        let mut crcs = ChunkHasher::new(self.chunk_bytes);
        let mut at = PAGE_BYTES as usize;
        for chunk in chunks {
            bytes[at..at + chunk.len()].copy_from_slice(chunk);
            crcs.update(chunk);
            at += chunk.len();
        }
        bytes[at..].fill(0);
        let (payload_crc, chunk_crcs) = crcs.finish();
        let header = SlotHeader {
            kind: RecordKind::Block,
            seq: 0,
            hash,
            payload_len: block_bytes,
            payload_crc,
            write_time_us: slot::now_us(),
            key: key.as_bytes().to_vec(),
            chunk_bytes: self.chunk_bytes,
            chunk_crcs,
        };
        let (entry, replaced) = self.append(buf, header).await?;
        bump(&self.counters.puts, 1);
        debug_assert_eq!(self.index.borrow().get(&hash).map(|e| e.seq >= entry.seq), Some(true));
        Ok(if replaced { PutOutcome::Replaced } else { PutOutcome::Created })
    }

    /// Takes a slot, stamps the header with its sequence number, writes the
    /// slot and applies the record to the index. Returns the new entry and
    /// whether the key was stored before.
    async fn append(&self, mut buf: DmaBuffer, mut header: SlotHeader) -> Result<(Entry, bool)> {
        let started = Instant::now();
        let (segment, slot, seq) = self.allocate_slot().await?;
        // `allocate_slot` counted us as a writer of the segment and recorded
        // our seq as in flight; the guards undo both on every exit path.
        let _writer = InFlight::adopt(&segment.writers);
        let _inflight = InFlightSeq { shard: self, seq };
        // Our slot may still hold a survivor of this segment's reclaim that
        // has not been read yet: wait until the copy is past it.
        while segment.copy_next_old_slot.get() <= slot {
            glommio::timer::sleep(RECLAIM_POLL).await;
        }
        header.seq = seq;
        header.encode(&mut buf.as_bytes_mut()[..PAGE_BYTES as usize]);
        let len = buf.len() as u64;
        bump(&self.counters.io_in_flight, 1);
        let buf = Rc::new(buf);
        let result = async {
            segment.write_slot(buf.clone(), slot).await?;
            if self.cfg.sync {
                segment.file.fdatasync().await.map_err(|e| Error::glommio(format!("fdatasync of segment {}", segment.id), e))?;
            }
            Ok::<_, Error>(())
        }
        .await;
        self.counters.io_in_flight.set(self.counters.io_in_flight.get() - 1);
        self.recycle(buf);
        result?;
        bump(&self.counters.bytes_written, len);
        record_us(&self.nvme_counters.write_us, started.elapsed().as_micros());
        let entry = Entry { segment: segment.id, slot, seq };
        self.note_seq(segment.id, seq);
        let mut index = self.index.borrow_mut();
        let existed = match header.kind {
            RecordKind::Block => index.insert_if_newer(header.hash, entry).0.is_some(),
            RecordKind::Tombstone => index.remove_if_not_newer(&header.hash, seq).is_some(),
        };
        Ok((entry, existed))
    }

    /// Hands out the next slot of the head segment, rolling to a new head
    /// (a free segment, a newly created one, or the oldest one reclaimed)
    /// when it is full. The caller is counted as a writer of the returned
    /// segment until it drops an [`InFlight::adopt`] guard of it.
    ///
    /// A reclaim that keeps survivors hands their copy to a task of its
    /// own and releases the slot lock first: writers, the one that
    /// triggered the reclaim included, take slots after the survivors'
    /// while they move, each waiting only until the copy has read the old
    /// slot it is about to overwrite (see [`Shard::append`]).
    async fn allocate_slot(&self) -> Result<(Rc<Segment>, u32, u64)> {
        loop {
            let compaction = {
                let _lock = self.alloc_lock.acquire_permit(1).await.map_err(|_| Error::ShuttingDown)?;
                match self.allocate_slot_locked().await? {
                    Ok(slot) => return Ok(slot),
                    Err(compaction) => compaction,
                }
            };
            self.run_compaction(compaction).await;
        }
    }

    /// [`Shard::allocate_slot`] under the slot lock: a slot, or the
    /// survivors a reclaim left to move (the head is then that segment, with
    /// their slots reserved).
    async fn allocate_slot_locked(&self) -> Result<std::result::Result<(Rc<Segment>, u32, u64), Compaction>> {
        // Bounded: each pass either returns or installs a new head with free
        // slots; the second pass always finds room.
        for _ in 0..3 {
            if let Some(id) = self.head.get() {
                let segment = self.segment(id);
                let used = segment.slots_used.get();
                if used < self.slots_per_segment {
                    segment.slots_used.set(used + 1);
                    segment.writers.set(segment.writers.get() + 1);
                    let seq = self.next_seq.get();
                    self.next_seq.set(seq + 1);
                    self.inflight.borrow_mut().insert(seq, (id, used));
                    return Ok(Ok((segment, used, seq)));
                }
                self.sealed.borrow_mut().push_back(id);
                self.head.set(None);
            }
            let (next, compaction) = self.next_head().await?;
            self.head.set(Some(next));
            if let Some(c) = compaction {
                return Ok(Err(c));
            }
        }
        unreachable!("a fresh head segment always has a free slot")
    }

    /// Starts moving a reclaim's survivors in a task of its own: no writer
    /// waits for the whole move, and one that gives up waiting cannot leave
    /// it half done. The task holds the shard, so a close waits for it.
    /// (A shard not wrapped by [`Shard::share`] moves them inline.)
    async fn run_compaction(&self, compaction: Compaction) {
        let shard = self.me.borrow().upgrade();
        match shard {
            Some(shard) => {
                glommio::spawn_local(async move { shard.move_survivors(compaction).await }).detach();
            }
            None => self.move_survivors(compaction).await,
        }
    }

    /// Finds the segment to append to next: a free one, else a new file if
    /// the disk share allows, else the oldest sealed segment, reclaimed.
    async fn next_head(&self) -> Result<(u32, Option<Compaction>)> {
        let free = self.free.borrow_mut().pop();
        if let Some(id) = free {
            let segment = self.segment(id);
            segment.slots_used.set(0);
            // A free segment may hold slots of an earlier life: move its
            // first_seq past them.
            if segment.first_seq.get() < self.next_seq.get() {
                segment.first_seq.set(self.next_seq.get());
                segment.write_superblock(&self.superblock(id, self.next_seq.get())).await?;
            }
            return Ok((id, None));
        }
        let created = self.segments.borrow().len() as u32;
        if created < self.cfg.segments_max {
            match self.create_segment(created).await {
                Ok(()) => {
                    if self.fs_full.replace(false) {
                        tracing::info!(shard = self.id(), "filesystem has room again: segment {created} created");
                    }
                    return Ok((created, None));
                }
                // The filesystem is full before our share is. Evicting the
                // oldest blocks would shrink the cache below what the
                // operator asked for without saying so: refuse the write
                // (507) and keep every stored block, unless the oldest
                // segment holds nothing live any more.
                Err(Error::DiskFull(why)) => {
                    let oldest = self.sealed.borrow().front().copied();
                    let reusable = oldest.filter(|id| !self.index.borrow().iter().any(|(_, e)| e.segment == *id));
                    let Some(id) = reusable else {
                        bump(&self.counters.disk_full_refusals, 1);
                        // Once per episode, not once per refused write.
                        if !self.fs_full.replace(true) {
                            tracing::warn!(
                                shard = self.id(),
                                "filesystem full: segment {created} not created ({why}); refusing writes with 507 until space frees"
                            );
                        }
                        return Err(Error::DiskFull(format!(
                            "the filesystem holding {} is full: shard {} could not add segment {created} of {} MiB ({why}); \
                             every stored block stays readable. Free space on the filesystem, or restart with a --disk-gb \
                             no larger than the space there so that the log reclaims its oldest segments",
                            self.cfg.dir.display(),
                            self.id(),
                            self.cfg.segment_bytes >> 20,
                        )));
                    };
                    tracing::warn!(shard = self.id(), "filesystem full: reusing segment {id}, which holds no live block");
                    self.sealed.borrow_mut().pop_front();
                    let compaction = self.reclaim(id).await?;
                    return Ok((id, compaction));
                }
                Err(e) => return Err(e),
            }
        }
        let oldest = self.sealed.borrow_mut().pop_front();
        match oldest {
            Some(id) => {
                let compaction = self.reclaim(id).await?;
                Ok((id, compaction))
            }
            None => Err(Error::DiskFull("no segment can be created or reclaimed".into())),
        }
    }

    async fn create_segment(&self, id: u32) -> Result<()> {
        let sb = self.superblock(id, self.next_seq.get());
        let path = segment::create_file(&self.cfg.dir, &sb)?;
        let segment = Segment::open(&path, id, sb.first_seq, self.slot_bytes, self.slots_per_segment).await?;
        let mut segments = self.segments.borrow_mut();
        if segments.len() <= id as usize {
            segments.resize(id as usize + 1, None);
        }
        segments[id as usize] = Some(Rc::new(segment));
        tracing::debug!(shard = self.id(), segment = id, "created segment");
        Ok(())
    }

    /// Empties the oldest segment for reuse, under the slot lock: waits for
    /// writes into it to land, drops its blocks from the index but the
    /// survivors, waits for reads of it to finish, then starts its new life
    /// with a new superblock and reserves the first slots and sequence
    /// numbers of that life for the survivors. Moving them is left to the
    /// caller ([`Shard::move_survivors`], without the lock); `None` when
    /// there are none.
    async fn reclaim(&self, id: u32) -> Result<Option<Compaction>> {
        let segment = self.segment(id);
        // Writers include the survivor copy of this segment's previous
        // reclaim, should it still run.
        while segment.writers.get() > 0 {
            glommio::timer::sleep(RECLAIM_POLL).await;
        }
        // Second chance: blocks read since they were written stay, up to a
        // share of the segment; the rest leave the index.
        let mut survivors: Vec<(BlockHash, Entry)> = {
            let referenced = segment.referenced.borrow();
            self.index.borrow().iter().filter(|(_, e)| e.segment == id && referenced[e.slot as usize]).collect()
        };
        survivors.sort_by_key(|(_, e)| e.slot);
        survivors.truncate((self.slots_per_segment / SECOND_CHANCE_SHARE) as usize);
        let evicted = {
            let mut index = self.index.borrow_mut();
            let before = index.len();
            index.remove_segment(id);
            for (h, e) in &survivors {
                index.insert_if_newer(*h, *e);
            }
            before - index.len()
        };
        // Nothing else takes sequence numbers while we hold the slot lock:
        // this is the new life's first.
        let first_seq = self.next_seq.get();
        segment.compact_below_seq.set(first_seq);
        segment.compacting.set(true);
        while segment.readers.get() > 0 {
            glommio::timer::sleep(RECLAIM_POLL).await;
        }
        if let Err(e) = segment.write_superblock(&self.superblock(segment.id, first_seq)).await {
            // Drop the survivors; keep the segment for a retry.
            segment.compacting.set(false);
            self.index.borrow_mut().remove_segment(id);
            segment.slots_used.set(self.slots_per_segment);
            self.sealed.borrow_mut().push_front(id);
            return Err(e);
        }
        segment.first_seq.set(first_seq);
        segment.referenced.borrow_mut().fill(false);
        bump(&self.counters.reclaimed_segments, 1);
        bump(&self.counters.evicted_blocks, evicted as u64);
        tracing::debug!(shard = self.id(), segment = id, evicted, kept = survivors.len(), "reclaimed segment");
        if survivors.is_empty() {
            segment.compacting.set(false);
            segment.slots_used.set(0);
            return Ok(None);
        }
        // Survivor j goes to slot j with sequence number first_seq + j, below
        // any write after this reclaim, so a newer PUT or DELETE of its key
        // wins on recovery whichever lands first. In flight until written, so
        // a snapshot taken meanwhile does not claim to cover them.
        let n = survivors.len() as u32;
        {
            let mut inflight = self.inflight.borrow_mut();
            for j in 0..n {
                inflight.insert(first_seq + j as u64, (id, j));
            }
        }
        self.next_seq.set(first_seq + n as u64);
        segment.slots_used.set(n);
        segment.copy_next_old_slot.set(survivors[0].1.slot);
        segment.writers.set(segment.writers.get() + 1);
        Ok(Some(Compaction { segment, survivors, first_seq }))
    }

    /// Rewrites a reclaim's survivors (sorted by old slot) into the first
    /// slots of the segment's new life, with the sequence numbers reserved
    /// for them. Slot `j` of the new life is never above the survivor's old
    /// slot `i`, so each survivor is read before anything overwrites it:
    /// the copy itself writes only slots below the next old slot it reads,
    /// and writers of later slots wait for that read
    /// (`copy_next_old_slot`). A survivor that fails its checks, or whose
    /// read or write fails, is dropped; a survivor whose key was written or
    /// deleted meanwhile is copied but stays superseded (its sequence
    /// number is the lower).
    async fn move_survivors(&self, c: Compaction) {
        let Compaction { segment, survivors, first_seq } = c;
        let _writer = InFlight::adopt(&segment.writers);
        let block_bytes = self.cfg.geometry.block_bytes;
        for (j, (hash, old)) in survivors.iter().enumerate() {
            let seq = first_seq + j as u64;
            let _inflight = InFlightSeq { shard: self, seq };
            let next_old_slot = survivors.get(j + 1).map_or(u32::MAX, |(_, e)| e.slot);
            let j = j as u32;
            debug_assert!(j <= old.slot);
            let read = segment.read_slot(old.slot, self.slot_bytes).await;
            // The old slot is read: writes into it may go ahead.
            segment.copy_next_old_slot.set(next_old_slot);
            let data = match read {
                Ok(d) => d,
                Err(e) => {
                    self.index.borrow_mut().remove_exact(hash, *old);
                    tracing::error!(
                        shard = self.id(),
                        segment = segment.id,
                        slot = old.slot,
                        "reading a survivor during reclaim failed; dropped: {e}"
                    );
                    continue;
                }
            };
            // Both CRCs are checked; a format 1 survivor gets chunk CRCs in
            // its new slot, so it streams from then on.
            let mut crcs = ChunkHasher::new(self.chunk_bytes);
            crcs.update(&data[PAGE_BYTES as usize..(PAGE_BYTES + block_bytes) as usize]);
            let (payload_crc, chunk_crcs) = crcs.finish();
            let header = SlotHeader::decode(&data[..PAGE_BYTES as usize])
                .ok()
                .filter(|h| h.seq == old.seq && payload_crc == h.payload_crc && (h.chunk_crcs.is_empty() || h.chunk_crcs == chunk_crcs));
            let Some(mut header) = header else {
                self.index.borrow_mut().remove_exact(hash, *old);
                bump(&self.counters.corrupt_blocks, 1);
                tracing::error!(shard = self.id(), segment = segment.id, slot = old.slot, "corrupt block dropped during reclaim");
                continue;
            };
            header.seq = seq;
            header.chunk_bytes = self.chunk_bytes;
            header.chunk_crcs = chunk_crcs;
            let mut buf = self.take_write_buffer();
            buf.as_bytes_mut()[PAGE_BYTES as usize..].copy_from_slice(&data[PAGE_BYTES as usize..self.slot_bytes as usize]);
            drop(data);
            header.encode(&mut buf.as_bytes_mut()[..PAGE_BYTES as usize]);
            let buf = Rc::new(buf);
            let written = segment.write_slot(buf.clone(), j).await;
            self.recycle(buf);
            if let Err(e) = written {
                self.index.borrow_mut().remove_exact(hash, *old);
                tracing::error!(
                    shard = self.id(),
                    segment = segment.id,
                    slot = j,
                    "writing a survivor during reclaim failed; dropped: {e}"
                );
                continue;
            }
            self.note_seq(segment.id, seq);
            let moved = Entry { segment: segment.id, slot: j, seq };
            if self.index.borrow_mut().remove_exact(hash, *old) {
                self.index.borrow_mut().insert_if_newer(*hash, moved);
            }
            bump(&self.counters.second_chance_blocks, 1);
        }
        segment.copy_next_old_slot.set(u32::MAX);
        segment.compacting.set(false);
    }

    /// A slot-sized DMA buffer: a pooled one, or a new one when the pool is
    /// empty. Its contents are whatever the last write left.
    fn take_write_buffer(&self) -> DmaBuffer {
        self.buffers.borrow_mut().pop().unwrap_or_else(|| glommio::allocate_dma_buffer(self.slot_bytes as usize))
    }

    /// Returns a slot-sized write buffer to the pool once its write is done.
    fn recycle(&self, buf: Rc<DmaBuffer>) {
        if let Ok(buf) = Rc::try_unwrap(buf) {
            let mut pool = self.buffers.borrow_mut();
            if buf.len() as u64 == self.slot_bytes && pool.len() < self.cfg.io_depth_max {
                pool.push(buf);
            }
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
    /// without, whole once every chunk has passed (for a GET forwarded from
    /// another shard: one message across threads instead of one per chunk,
    /// which cost 1.2 MB GETs at concurrency 1 about 1.4 ms more at p50).
    pub async fn get(&self, key: &str, hash: BlockHash, stream: bool) -> Result<(BlockBody, Tier)> {
        bump(&self.counters.gets, 1);
        let result = self.read_tiered(key, hash, stream).await;
        match &result {
            Ok(_) => bump(&self.counters.hits, 1),
            Err(Error::NotFound) | Err(Error::Corrupt { .. }) => bump(&self.counters.misses, 1),
            Err(_) => {}
        }
        result
    }

    /// GPU first, then RAM, then the log, then the remote tier; with
    /// `promote` on a block read from the log is promoted to the fastest
    /// memory tier (`waterfall.rs`), and a block read from the remote tier
    /// is installed locally (`shard/remote.rs`).
    async fn read_tiered(&self, key: &str, hash: BlockHash, stream: bool) -> Result<(BlockBody, Tier)> {
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
                if matches!(e, Error::NotFound | Error::Corrupt { .. }) {
                    bump(&self.nvme_counters.misses, 1);
                    if let Some(bytes) = self.read_remote(key, hash).await {
                        return Ok((BlockBody::Whole(bytes), Tier::Remote));
                    }
                }
                Err(e)
            }
        }
    }

    /// The body of a GET served from a block in transit: its buffers as they
    /// are (they may be this shard's DMA chunks), except for a GET forwarded
    /// from another shard (`!stream`), which gets one pooled copy that may
    /// cross threads.
    fn transit_body(&self, mut parts: Vec<Bytes>, stream: bool) -> BlockBody {
        if !stream {
            let slices: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            return BlockBody::Whole(self.read_buffers.copy_parts(&slices, |_| {}));
        }
        if parts.len() == 1 {
            return BlockBody::Whole(parts.pop().expect("one part"));
        }
        BlockBody::Chunks(ChunkStream::from_parts(self.cfg.geometry.block_bytes, parts))
    }

    /// Promotes a stored block into RAM (a prefetch): a block already in
    /// RAM becomes most recently used; one only in the log is read (CRC
    /// checked) into RAM. Returns whether the block is stored.
    pub async fn prefetch(&self, key: &str, hash: BlockHash) -> bool {
        if self.gpu.is_some() {
            return self.prefetch_gpu(key, hash).await;
        }
        let Some(ram) = &self.ram else { return self.contains(&hash).is_some() };
        if ram.borrow_mut().get(key, &hash).is_some() {
            return true;
        }
        self.read_to_promote(key, hash).await
    }

    /// Copies a block just read from the log into the fastest memory tier
    /// (GPU, else RAM), counted as a promotion there when a slot took it.
    /// Best effort: a failure to make room leaves the block in the log only.
    /// Used when no RAM slot could be taken before the read (a GPU tier
    /// takes promotions; or write-back: every RAM candidate is dirty and
    /// must be written to the log first) and for format 1 slots.
    async fn promote(&self, key: &str, hash: BlockHash, parts: &[Bytes], entry: Entry) {
        if !self.still_newest(&hash, entry) {
            return;
        }
        let ticket = self.transits.begin(key, hash, parts.to_vec());
        let slices: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        match self.place(key, hash, &slices, false, &ticket).await {
            Ok(Placed::In(Tier::Gpu)) => bump(&self.gpu_counters.promotions, 1),
            Ok(Placed::In(Tier::Ram)) => bump(&self.ram_counters.promotions, 1),
            _ => {}
        }
    }

    /// Whether a block read from `entry` may be promoted: the index still
    /// points at that record and no memory tier holds a copy, nor is one on
    /// its way there (a PUT or DELETE while the block was read must not be
    /// undone by an older copy; in write-back a newer copy may be in memory
    /// only).
    fn still_newest(&self, hash: &BlockHash, entry: Entry) -> bool {
        self.index.borrow().get(hash) == Some(entry) && !matches!(self.contains(hash), Some(Tier::Gpu | Tier::Ram))
    }

    /// Reads a block from the log with promotion, whole (every chunk
    /// checked before it answers; a prefetch). Returns whether it was read
    /// in full.
    pub(super) async fn read_to_promote(&self, key: &str, hash: BlockHash) -> bool {
        self.read_block(key, hash, true, false).await.is_ok()
    }

    /// A RAM slot to promote into, taken before the read so the chunks are
    /// copied straight into it: a free slot, or the least recently used
    /// block's if the log has it (clean). `None` when there is no RAM tier
    /// or the victim is only in RAM (write-back), which takes a log write
    /// to move: then the block is promoted after the read by [`Shard::promote`].
    fn take_ram_slot(&self) -> Option<u32> {
        let mut ram = self.ram.as_ref()?.borrow_mut();
        loop {
            if let Some(slot) = ram.take_free() {
                return Some(slot);
            }
            match ram.victim() {
                Some(v) if !v.dirty => {
                    ram.evict(v.slot);
                    bump(&self.ram_counters.demotions, 1);
                }
                _ => return None,
            }
        }
    }

    /// Starts reading a block from the log on a task of its own and waits
    /// for its first message: with `stream` its first chunk, else the whole
    /// block (with `promote`, filled into a RAM slot; see
    /// [`Shard::stream_slot`]).
    async fn read_block(&self, key: &str, hash: BlockHash, promote: bool, stream: bool) -> Result<BlockBody> {
        let me = self.me.borrow().upgrade().expect("a serving shard is shared");
        let block_bytes = self.cfg.geometry.block_bytes;
        let chunks = slot::chunk_count(block_bytes, self.chunk_bytes) as usize;
        let (tx, mut rx) = mpsc::channel(chunks);
        let key = key.to_string();
        glommio::spawn_local(async move { me.stream_slot(&key, hash, promote, stream, tx).await }).detach();
        match rx.next().await {
            Some(Ok(first)) if first.len() as u64 == block_bytes => Ok(BlockBody::Whole(first)),
            Some(Ok(first)) => Ok(BlockBody::Chunks(ChunkStream::new(block_bytes, first, rx))),
            Some(Err(e)) => Err(e),
            None => Err(Error::ShuttingDown),
        }
    }

    /// Reads the slot of `hash` and sends its payload on `tx` in order: with
    /// `stream` one message per verified chunk, else one message with the
    /// whole block once every chunk has passed; or one `Err` and nothing
    /// after it. The channel holds every chunk of a block, so the reads
    /// never wait for the client: the segment is released as soon as the
    /// device is done, whatever the network does. Reads are issued [`READ_AHEAD_CHUNKS`] at
    /// a time: the first covers the header page and chunk 0, each later one
    /// a chunk (all page-aligned: chunks are multiples of 4 KiB).
    ///
    /// A format 1 slot (no chunk CRCs) is read whole, checked against its
    /// whole-block CRC-32 and sent as one message.
    async fn stream_slot(&self, key: &str, hash: BlockHash, promote: bool, stream: bool, mut tx: mpsc::Sender<Result<Bytes>>) {
        // A segment being compacted moves its blocks: wait, then look again.
        let (entry, segment) = loop {
            let Some(entry) = self.index.borrow().get(&hash) else {
                let _ = tx.try_send(Err(Error::NotFound));
                return;
            };
            let segment = self.segment(entry.segment);
            // Only blocks of the old life wait: those still to be moved.
            if !(segment.compacting.get() && entry.seq < segment.compact_below_seq.get()) {
                break (entry, segment);
            }
            glommio::timer::sleep(RECLAIM_POLL).await;
        };
        let reader = InFlight::enter(&segment.readers);
        let permit = match self.io_permit(true).await {
            Ok(p) => p,
            Err(e) => {
                let _ = tx.try_send(Err(e));
                return;
            }
        };
        // Released once every read is done, before a promotion that may
        // itself need I/O permits (a write-back demotion): holding one
        // while waiting for another could starve the shard.
        let mut io_guards = Some((reader, permit));
        let started = Instant::now();
        let block_bytes = self.cfg.geometry.block_bytes;
        let chunk_bytes = self.chunk_bytes as u64;
        let chunks = slot::chunk_count(block_bytes, self.chunk_bytes) as usize;
        let padded = slot::round_up_page(block_bytes);
        // Slot byte range of read i: the header page travels with chunk 0.
        let range = |i: usize| {
            let from = PAGE_BYTES + i as u64 * chunk_bytes;
            let to = PAGE_BYTES + ((i as u64 + 1) * chunk_bytes).min(padded);
            if i == 0 {
                (0, to)
            } else {
                (from, to - from)
            }
        };
        // Payload bytes of chunk i within its read.
        let payload = move |i: usize, read: &ReadResult| -> std::ops::Range<usize> {
            let skip = if i == 0 { PAGE_BYTES as usize } else { 0 };
            let len = (block_bytes - i as u64 * chunk_bytes).min(chunk_bytes) as usize;
            skip..skip + len.min(read.len() - skip)
        };
        let mut reads = FuturesOrdered::new();
        let mut issued = 0;
        let issue = |reads: &mut FuturesOrdered<_>, issued: &mut usize| {
            if *issued < chunks {
                let (offset, len) = range(*issued);
                reads.push_back(segment.read_slot_range(entry.slot, offset, len));
                *issued += 1;
            }
        };
        for _ in 0..READ_AHEAD_CHUNKS {
            issue(&mut reads, &mut issued);
        }
        bump(&self.counters.io_in_flight, 1);
        let _io = InFlightIo(&self.counters.io_in_flight);
        let first = match reads.next().await.expect("one read issued") {
            Ok(r) => r,
            Err(e) => return self.end_stream(&mut tx, Err(e), &mut reads).await,
        };
        issue(&mut reads, &mut issued);
        let header = match SlotHeader::decode(&first[..PAGE_BYTES as usize]) {
            Ok(h) => h,
            Err(fault) => {
                let e = self.drop_corrupt(hash, entry, &format!("slot header invalid ({fault:?})"));
                return self.end_stream(&mut tx, Err(e), &mut reads).await;
            }
        };
        if header.seq != entry.seq || header.kind != RecordKind::Block || header.payload_len != block_bytes {
            let why = format!("slot holds seq {} kind {:?}, index expected seq {}", header.seq, header.kind, entry.seq);
            let e = self.drop_corrupt(hash, entry, &why);
            return self.end_stream(&mut tx, Err(e), &mut reads).await;
        }
        if header.key != key.as_bytes() {
            // Another key with the same 128-bit hash: never serve it.
            bump(&self.counters.hash_collisions, 1);
            tracing::warn!(shard = self.id(), key, "block hash collision; answering as a miss");
            return self.end_stream(&mut tx, Err(Error::NotFound), &mut reads).await;
        }
        if header.chunk_bytes as u64 != chunk_bytes || header.chunk_crcs.len() != chunks {
            // Format 1 (or another chunk size): check the whole block first.
            let mut all = vec![first];
            while let Some(read) = reads.next().await {
                issue(&mut reads, &mut issued);
                match read {
                    Ok(r) => all.push(r),
                    Err(e) => return self.end_stream(&mut tx, Err(e), &mut reads).await,
                }
            }
            let parts: Vec<&[u8]> = all.iter().enumerate().map(|(i, r)| &r[payload(i, r)]).collect();
            let mut crc = crc32fast::Hasher::new();
            let bytes = self.read_buffers.copy_parts(&parts, |step| crc.update(step));
            drop(parts);
            if crc.finalize() != header.payload_crc {
                let e = self.drop_corrupt(hash, entry, "payload CRC-32 mismatch");
                return self.end_stream(&mut tx, Err(e), &mut reads).await;
            }
            self.read_done(&segment, entry, started);
            drop(io_guards.take());
            if promote {
                self.promote(key, hash, std::slice::from_ref(&bytes), entry).await;
            }
            let _ = tx.try_send(Ok(bytes));
            return;
        }
        // A GPU tier takes promotions itself (after the read, `promote`).
        let mut ram_slot = if promote && self.gpu.is_none() && self.still_newest(&hash, entry) { self.take_ram_slot() } else { None };
        // Without a slot taken up front, chunks are kept for `promote`.
        let mut kept = Vec::new();
        // Whole, and not promoting into a RAM slot: one pooled buffer for
        // the block.
        let mut whole = (!stream && ram_slot.is_none()).then(|| self.read_buffers.filler());
        let mut next = Some(Ok(first));
        for i in 0..chunks {
            let read = match next.take() {
                Some(r) => r,
                None => {
                    let r = reads.next().await.expect("a read per chunk");
                    issue(&mut reads, &mut issued);
                    r
                }
            };
            let read = match read {
                Ok(r) => r,
                Err(e) => {
                    self.abandon_ram_slot(ram_slot.take());
                    return self.end_stream(&mut tx, Err(e), &mut reads).await;
                }
            };
            let range = payload(i, &read);
            let at = i * chunk_bytes as usize;
            let mut crc = crc32fast::Hasher::new();
            // Each chunk is copied at most once: into the RAM slot it is
            // promoted to (and sent from there) or into the block's one
            // pooled buffer; streamed, it is sent from the DMA buffer it
            // was read into, its CRC-32 computed there.
            let chunk = match (ram_slot, &mut whole) {
                (Some(s), _) => {
                    let c = self.ram.as_ref().expect("RAM tier").borrow_mut().fill_chunk(s, at, &read[range], |step| crc.update(step));
                    drop(read);
                    Some(c)
                }
                (None, Some(filler)) => {
                    filler.fill(at, &read[range], |step| crc.update(step));
                    drop(read);
                    None
                }
                (None, None) => {
                    crc.update(&read[range.clone()]);
                    Some(dma_chunk(read, range))
                }
            };
            if crc.finalize() != header.chunk_crcs[i] {
                drop(chunk);
                self.abandon_ram_slot(ram_slot.take());
                let e = self.drop_corrupt(hash, entry, &format!("CRC-32 mismatch in chunk {i} of {chunks}"));
                return self.end_stream(&mut tx, Err(e), &mut reads).await;
            }
            let last = i + 1 == chunks;
            // Whole: the block leaves after its last chunk has passed.
            let chunk = match chunk {
                Some(c) if stream => c,
                _ if !last => continue,
                _ => match (ram_slot, whole.take()) {
                    (Some(s), _) => self.ram.as_ref().expect("RAM tier").borrow().filled(s, block_bytes as usize),
                    (None, Some(filler)) => filler.freeze(block_bytes as usize),
                    (None, None) => unreachable!("a chunk of its own only when streaming"),
                },
            };
            if last {
                // Promotion lands before the last chunk leaves, so a client
                // that has the whole block finds it in RAM.
                self.read_done(&segment, entry, started);
                drop(io_guards.take());
                if let Some(s) = ram_slot.take() {
                    if self.still_newest(&hash, entry) {
                        self.ram.as_ref().expect("RAM tier").borrow_mut().install_filled(s, key, hash);
                        bump(&self.ram_counters.promotions, 1);
                        bump(&self.ram_counters.bytes_in, block_bytes);
                    } else {
                        self.abandon_ram_slot(Some(s));
                    }
                } else if promote {
                    kept.push(chunk.clone());
                    self.promote(key, hash, &kept, entry).await;
                }
            } else if promote && ram_slot.is_none() {
                kept.push(chunk.clone());
            }
            if tx.try_send(Ok(chunk)).is_err() {
                // The client went away: stop, and leave RAM as it was.
                self.abandon_ram_slot(ram_slot.take());
                return self.end_stream(&mut tx, Err(Error::NotFound), &mut reads).await;
            }
        }
    }

    /// Sends `result` (if the receiver still listens) and waits for reads
    /// still in flight, so no read outlives the segment guard it runs under.
    async fn end_stream<F>(&self, tx: &mut mpsc::Sender<Result<Bytes>>, result: Result<Bytes>, reads: &mut FuturesOrdered<F>)
    where
        F: std::future::Future,
    {
        let _ = tx.try_send(result);
        tx.close_channel();
        while reads.next().await.is_some() {}
    }

    fn abandon_ram_slot(&self, slot: Option<u32>) {
        if let (Some(s), Some(ram)) = (slot, &self.ram) {
            ram.borrow_mut().abandon(s);
        }
    }

    /// Bookkeeping of a block read in full and verified: second-chance
    /// flag, bytes read, read latency.
    fn read_done(&self, segment: &Segment, entry: Entry, started: Instant) {
        segment.referenced.borrow_mut()[entry.slot as usize] = true;
        bump(&self.counters.bytes_read, self.slot_bytes);
        record_us(&self.nvme_counters.read_us, started.elapsed().as_micros());
    }

    fn drop_corrupt(&self, hash: BlockHash, entry: Entry, why: &str) -> Error {
        self.index.borrow_mut().remove_exact(&hash, entry);
        bump(&self.counters.corrupt_blocks, 1);
        tracing::error!(shard = self.id(), segment = entry.segment, slot = entry.slot, seq = entry.seq, "corrupt block dropped: {why}");
        Error::Corrupt { segment: entry.segment, slot: entry.slot }
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
    pub async fn delete(&self, key: &str, hash: BlockHash) -> Result<()> {
        // A block on its way into a memory tier (a PUT being placed, a move
        // between tiers) is stored: let it land, then delete it wherever it
        // is. A newer PUT's transit is not waited for; it lands after.
        if let Some(seen) = self.transits.id_of(&hash) {
            while self.transits.id_of(&hash) == Some(seen) {
                glommio::timer::sleep(RECLAIM_POLL).await;
            }
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
            while ram.borrow().is_demoting(&hash) {
                glommio::timer::sleep(RECLAIM_POLL).await;
            }
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
            key: key.as_bytes().to_vec(),
            chunk_bytes: 0,
            chunk_crcs: Vec::new(),
        };
        let (_, existed) = self.append(buf, header).await?;
        if !existed {
            return Err(Error::NotFound);
        }
        bump(&self.counters.deletes, 1);
        Ok(())
    }

    /// Records that `segment` holds a record with sequence number `seq`.
    pub(crate) fn note_seq(&self, segment: u32, seq: u64) {
        let mut max_seq = self.max_seq.borrow_mut();
        if max_seq.len() <= segment as usize {
            max_seq.resize(segment as usize + 1, 0);
        }
        max_seq[segment as usize] = max_seq[segment as usize].max(seq);
    }

    /// The index and segment states now, as an [`IndexSnapshot`].
    pub fn snapshot_state(&self) -> IndexSnapshot {
        let inflight = self.inflight.borrow();
        let covered_seq = inflight.keys().next().copied().unwrap_or(self.next_seq.get());
        let max_seq = self.max_seq.borrow();
        let segments = self
            .segments
            .borrow()
            .iter()
            .flatten()
            .map(|seg| SegmentState {
                id: seg.id,
                first_seq: seg.first_seq.get(),
                slots_used: seg.slots_used.get(),
                max_seq: max_seq.get(seg.id as usize).copied().unwrap_or(0),
                rescan: self.head.get() == Some(seg.id)
                    || seg.writers.get() > 0
                    || seg.compacting.get()
                    || inflight.values().any(|(s, _)| *s == seg.id),
                // Writes the snapshot does not cover can only be in slots
                // from the lowest one in flight (or the next free one) on; a
                // compaction rewrites from slot 0.
                scan_from_slot: if seg.compacting.get() {
                    0
                } else {
                    inflight.values().filter(|(s, _)| *s == seg.id).map(|(_, slot)| *slot).min().unwrap_or(seg.slots_used.get())
                },
            })
            .collect();
        let entries = self
            .index
            .borrow()
            .iter()
            .map(|(h, e)| EntryState { hash_lo: h.0 as u64, hash_hi: (h.0 >> 64) as u64, segment: e.segment, slot: e.slot, seq: e.seq })
            .collect();
        IndexSnapshot { shard: self.id(), covered_seq, next_seq: self.next_seq.get(), segments, entries }
    }

    /// Writes `index.snapshot` atomically (temp file, fsync, rename, fsync of
    /// the directory) on glommio's blocking thread pool.
    ///
    /// # Errors
    /// [`Error::Io`] from the filesystem.
    pub async fn write_snapshot(&self) -> Result<()> {
        let started = Instant::now();
        let state = self.snapshot_state();
        let entries = state.entries.len();
        let bytes = snapshot::encode(&state);
        let dir = self.cfg.dir.clone();
        let written = glommio::executor()
            .spawn_blocking(move || -> Result<usize> {
                let tmp = dir.join(format!("{}.tmp", snapshot::FILE));
                let path = dir.join(snapshot::FILE);
                let len = bytes.len();
                std::fs::write(&tmp, &bytes)
                    .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
                    .and_then(|_| std::fs::rename(&tmp, &path))
                    .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
                crate::geometry::fsync_dir(&dir)?;
                Ok(len)
            })
            .await?;
        bump(&self.counters.snapshots_written, 1);
        tracing::debug!(shard = self.id(), entries, bytes = written, ms = started.elapsed().as_secs_f64() * 1e3, "index snapshot written");
        Ok(())
    }

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
            bytes_read: c.bytes_read.get(),
            io_in_flight: c.io_in_flight.get(),
            io_queued: c.io_queued.get(),
            io_queue_refusals: c.io_queue_refusals.get(),
            snapshots_written: c.snapshots_written.get(),
            forwarded_requests: c.forwarded_requests.get(),
            transit_hits: c.transit_hits.get(),
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
        }
    }

    fn tier_stats(&self) -> Vec<TierStats> {
        let mut tiers: Vec<TierStats> = self.gpu_tier_stats().into_iter().collect();
        if let Some(ram) = &self.ram {
            let r = ram.borrow();
            tiers.push(TierStats::from_counters(Tier::Ram, &self.ram_counters, r.capacity_blocks(), r.used_blocks(), Some(r.huge_pages())));
        }
        let c = &self.counters;
        let capacity = self.cfg.segments_max as u64 * self.slots_per_segment as u64;
        let nvme = TierStats::from_counters(Tier::Nvme, &self.nvme_counters, capacity, self.index.borrow().len() as u64, None);
        tiers.push(TierStats { evictions: c.evicted_blocks.get(), bytes_in: c.bytes_written.get(), bytes_out: c.bytes_read.get(), ..nvme });
        tiers
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
        while self.segments.borrow().iter().flatten().any(|s| s.compacting.get()) {
            glommio::timer::sleep(RECLAIM_POLL).await;
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

/// A reclaim's survivors, still to be moved into the first slots of the
/// segment's new life ([`Shard::move_survivors`]).
struct Compaction {
    segment: Rc<Segment>,
    /// Sorted by old slot.
    survivors: Vec<(BlockHash, Entry)>,
    /// The new life's first sequence number, reserved with the next
    /// `survivors.len()` for them.
    first_seq: u64,
}

/// Removes a write's sequence number from the in-flight set when dropped.
/// Counts a block read in `io_in_flight` until dropped.
struct InFlightIo<'a>(&'a Cell<u64>);

impl Drop for InFlightIo<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

struct InFlightSeq<'a> {
    shard: &'a Shard,
    seq: u64,
}

impl Drop for InFlightSeq<'_> {
    fn drop(&mut self) {
        let removed = self.shard.inflight.borrow_mut().remove(&self.seq);
        debug_assert!(removed.is_some());
    }
}
