//! Tier names, the write policy and per-tier counters (docs/ARCHITECTURE.md, "Tiers").
//!
//! Placement is a waterfall LRU, as in MLPerf Storage's KV-cache benchmark:
//! a new block goes to the fastest tier with room; a full tier moves its
//! least recently used block down one tier; a block falling off the NVMe log
//! is gone; a read from a slower tier promotes the block (`--promote on`).

use std::cell::{Cell, RefCell};

use serde::Serialize;

use crate::counter::Latency;
use crate::latency::LatencyBuckets;
use crate::ram::HugePages;

/// Which tier holds or served a block, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The shard's slots in GPU memory ([`crate::gpu`]).
    Gpu,
    /// The shard's RAM arena.
    Ram,
    /// The O_DIRECT segment log.
    Nvme,
    /// The shared tier below the log ([`crate::remote`]; S3-compatible
    /// object storage), named `s3` on the wire.
    #[serde(rename = "s3")]
    Remote,
}

impl Tier {
    /// Name used in `x-kvtier-tier` and in JSON: `gpu`, `ram`, `nvme`, `s3`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Ram => "ram",
            Tier::Nvme => "nvme",
            Tier::Remote => "s3",
        }
    }
}

/// When a PUT is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WritePolicy {
    /// After the block's NVMe write completed (and it is in RAM too): a
    /// process crash loses nothing acknowledged.
    #[default]
    Through,
    /// From memory: the block reaches NVMe only when the RAM tier demotes it
    /// (or at a clean shutdown). A crash loses blocks held only in RAM.
    Back,
}

impl std::str::FromStr for WritePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "through" => Ok(WritePolicy::Through),
            "back" => Ok(WritePolicy::Back),
            _ => Err(format!("unknown write policy {s:?}: expected through or back")),
        }
    }
}

/// Counters and latencies of one tier of one shard.
pub(crate) struct TierCounters {
    pub hits: Cell<u64>,
    pub misses: Cell<u64>,
    pub promotions: Cell<u64>,
    pub demotions: Cell<u64>,
    pub evictions: Cell<u64>,
    pub bytes_in: Cell<u64>,
    pub bytes_out: Cell<u64>,
    pub read_us: RefCell<Latency>,
    pub write_us: RefCell<Latency>,
}

impl Default for TierCounters {
    fn default() -> Self {
        TierCounters {
            hits: Cell::new(0),
            misses: Cell::new(0),
            promotions: Cell::new(0),
            demotions: Cell::new(0),
            evictions: Cell::new(0),
            bytes_in: Cell::new(0),
            bytes_out: Cell::new(0),
            read_us: RefCell::default(),
            write_us: RefCell::default(),
        }
    }
}

/// One tier of one shard (or summed over shards), for `/v1/stats` and
/// `/metrics`.
#[derive(Debug, Clone, Serialize)]
pub struct TierStats {
    /// The tier.
    pub tier: Tier,
    /// Blocks it can hold.
    pub capacity_blocks: u64,
    /// Blocks it holds.
    pub used_blocks: u64,
    /// Reads it served.
    pub hits: u64,
    /// Reads that looked here and went on to a slower tier (or missed).
    pub misses: u64,
    /// Blocks moved up into this tier by a read or a prefetch.
    pub promotions: u64,
    /// Blocks moved down out of this tier into the next (RAM: also a
    /// write-through block dropped from RAM while NVMe keeps it).
    pub demotions: u64,
    /// Blocks that left the store from this tier (NVMe: dropped by reclaim).
    pub evictions: u64,
    /// Block bytes written into this tier.
    pub bytes_in: u64,
    /// Block bytes served from this tier.
    pub bytes_out: u64,
    /// Median read latency in µs (0 before any).
    pub read_us_p50: u64,
    /// 99th percentile read latency in µs.
    pub read_us_p99: u64,
    /// Median write latency in µs.
    pub write_us_p50: u64,
    /// 99th percentile write latency in µs.
    pub write_us_p99: u64,
    /// Read latencies in Prometheus buckets (`/metrics`; not in the JSON).
    #[serde(skip)]
    pub read_latency: LatencyBuckets,
    /// Write latencies in Prometheus buckets (`/metrics`; not in the JSON).
    #[serde(skip)]
    pub write_latency: LatencyBuckets,
    /// RAM: how the arena is backed; `None` for other tiers.
    pub huge_pages: Option<HugePages>,
    /// RAM: whether the arena is a memory file clients map to read leased
    /// blocks (`--ram-shared`, docs/LOCAL.md "Leases"); `None` for other
    /// tiers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<bool>,
    /// GPU: the device, its memory and faults, or why the tier is absent;
    /// `None` for other tiers.
    pub gpu: Option<crate::gpu::GpuInfo>,
}

impl TierStats {
    pub(crate) fn from_counters(
        tier: Tier,
        c: &TierCounters,
        capacity_blocks: u64,
        used_blocks: u64,
        huge_pages: Option<HugePages>,
    ) -> Self {
        let pct = |h: &RefCell<Latency>, q: f64| {
            let h = &h.borrow().hdr;
            if h.is_empty() {
                0
            } else {
                h.value_at_quantile(q)
            }
        };
        TierStats {
            tier,
            capacity_blocks,
            used_blocks,
            hits: c.hits.get(),
            misses: c.misses.get(),
            promotions: c.promotions.get(),
            demotions: c.demotions.get(),
            evictions: c.evictions.get(),
            bytes_in: c.bytes_in.get(),
            bytes_out: c.bytes_out.get(),
            read_us_p50: pct(&c.read_us, 0.5),
            read_us_p99: pct(&c.read_us, 0.99),
            write_us_p50: pct(&c.write_us, 0.5),
            write_us_p99: pct(&c.write_us, 0.99),
            read_latency: c.read_us.borrow().buckets.clone(),
            write_latency: c.write_us.borrow().buckets.clone(),
            huge_pages,
            shared: None,
            gpu: None,
        }
    }

    /// Adds another shard's counters of the same tier (latency percentiles
    /// become the largest of the two: an upper bound, not a merge; the
    /// Prometheus buckets add exactly).
    pub fn add(&mut self, o: &TierStats) {
        self.capacity_blocks += o.capacity_blocks;
        self.used_blocks += o.used_blocks;
        self.hits += o.hits;
        self.misses += o.misses;
        self.promotions += o.promotions;
        self.demotions += o.demotions;
        self.evictions += o.evictions;
        self.bytes_in += o.bytes_in;
        self.bytes_out += o.bytes_out;
        self.read_us_p50 = self.read_us_p50.max(o.read_us_p50);
        self.read_us_p99 = self.read_us_p99.max(o.read_us_p99);
        self.write_us_p50 = self.write_us_p50.max(o.write_us_p50);
        self.write_us_p99 = self.write_us_p99.max(o.write_us_p99);
        self.read_latency.add(&o.read_latency);
        self.write_latency.add(&o.write_latency);
        if let (Some(a), Some(b)) = (&mut self.gpu, &o.gpu) {
            a.add(b);
        }
    }
}
