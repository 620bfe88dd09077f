//! Block owners (tenants, [`crate::tenant`]) in one shard: who owns a key,
//! each owner's quotas in the GPU, RAM and NVMe tiers in this shard's
//! blocks, the log's limit (trimming an owner's oldest blocks) and
//! reservation (kept through a reclaim, `reclaim.rs`), moving blocks of an
//! owner over a shrunken limit down in the background, and per-owner
//! counters.

use std::cell::RefCell;
use std::sync::Arc;

use serde::Serialize;

use super::Shard;
use crate::key::StoredKey;
use crate::tenant::{OwnerId, Owners, QuotaTier};

/// One owner's counters in one shard.
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct OwnerCounters {
    /// GETs answered with a block (any tier).
    pub hits: u64,
    /// GETs of a block not stored (or damaged).
    pub misses: u64,
    /// Keys asked by prefix lookups (`POST /v1/lookup`, the local LOOKUP).
    pub lookup_keys: u64,
    /// Of those, keys in the prefix found.
    pub prefix_hits: u64,
    /// Blocks moved out of a tier (by [`QuotaTier`]) to make room for this
    /// owner's own blocks, or to bring it under its limit.
    pub evicted_own: [u64; 3],
    /// Blocks moved out of a tier to make room for another owner's block
    /// (in the log: dropped by a reclaim of the oldest segment, which
    /// every writer's pressure causes).
    pub evicted_by_other: [u64; 3],
}

impl OwnerCounters {
    /// Adds `o` into `self`.
    pub fn add(&mut self, o: &OwnerCounters) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.lookup_keys += o.lookup_keys;
        self.prefix_hits += o.prefix_hits;
        for t in 0..3 {
            self.evicted_own[t] += o.evicted_own[t];
            self.evicted_by_other[t] += o.evicted_by_other[t];
        }
    }
}

/// One owner in one shard: blocks held, quotas and counters, tiers indexed
/// by [`QuotaTier`] (a tier the shard lacks shows 0s).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct OwnerShardStats {
    /// Owner id in this process.
    pub id: OwnerId,
    /// Its name (`default` for owner 0).
    pub name: String,
    /// Whether the tenants file names it now.
    pub configured: bool,
    /// Blocks held, by tier.
    pub blocks: [u64; 3],
    /// Blocks reserved in this shard, by tier.
    pub reserved_blocks: [u64; 3],
    /// Most blocks it may hold in this shard, by tier.
    pub limit_blocks: [u64; 3],
    /// Its counters.
    pub counters: OwnerCounters,
}

/// Owners' state in one shard.
pub(crate) struct OwnerState {
    owners: RefCell<Arc<Owners>>,
    counters: RefCell<Vec<OwnerCounters>>,
    /// The log's `(reserved, limit)` in blocks, by owner (none: no quota).
    nvme_quotas: RefCell<Vec<(u64, u64)>>,
}

impl OwnerState {
    /// `owners` known (their keys map to them); quotas apply once
    /// [`Shard::set_owners`] runs, after recovery.
    pub(crate) fn new(owners: Arc<Owners>) -> OwnerState {
        OwnerState { owners: RefCell::new(owners), counters: RefCell::default(), nvme_quotas: RefCell::default() }
    }
}

/// An owner over its limit in the log drops down to this share of it
/// below, so that trimming (one pass over the index) runs once per
/// `limit / NVME_TRIM_SLACK` blocks written, not at every write.
const NVME_TRIM_SLACK: u64 = 64;

impl Shard {
    /// The owners this shard knows now.
    pub fn owners(&self) -> Arc<Owners> {
        self.owner_state.owners.borrow().clone()
    }

    /// The owner of a stored key: its scope's owner ([`Owners::owner_of`]).
    pub(crate) fn owner_of(&self, key: &StoredKey) -> OwnerId {
        self.owner_state.owners.borrow().owner_of(key.scope())
    }

    /// Applies `f` to `owner`'s counters.
    pub(crate) fn count_owner(&self, owner: OwnerId, f: impl FnOnce(&mut OwnerCounters)) {
        let mut c = self.owner_state.counters.borrow_mut();
        if c.len() <= owner as usize {
            c.resize(owner as usize + 1, OwnerCounters::default());
        }
        f(&mut c[owner as usize]);
    }

    /// Counts a block of `victim` moved out of `tier` to make room for a
    /// block of `for_owner`.
    pub(crate) fn count_eviction(&self, tier: QuotaTier, victim: OwnerId, for_owner: OwnerId) {
        self.count_owner(victim, |c| {
            if victim == for_owner {
                c.evicted_own[tier as usize] += 1;
            } else {
                c.evicted_by_other[tier as usize] += 1;
            }
        });
    }

    /// Sets the owners and their quotas (at open, and when the tenants file
    /// is reloaded; owners of an older [`Owners::generation`] than the
    /// shard's are ignored), trims owners over their log limit at once, and moves
    /// blocks of owners over a memory tier's limit down in a task of its
    /// own (a shard not shared yet does that inline on its next writes).
    pub fn set_owners(&self, owners: Arc<Owners>) {
        if owners.generation < self.owners().generation {
            return;
        }
        let (block_bytes, shard, shards) = (self.cfg.geometry.block_bytes, self.cfg.shard_id as usize, self.cfg.shards.max(1) as usize);
        if let Some(ram) = &self.ram {
            let capacity = ram.borrow().capacity_blocks();
            ram.borrow_mut().set_quotas(&owners.shard_quotas(QuotaTier::Ram, block_bytes, shard, shards, capacity));
        }
        if let Some(gpu) = &self.gpu {
            gpu.set_quotas(&owners.shard_quotas(QuotaTier::Gpu, block_bytes, shard, shards, gpu.capacity_blocks()));
        }
        let nvme_capacity = self.cfg.segments_max as u64 * self.slots_per_segment as u64;
        *self.owner_state.nvme_quotas.borrow_mut() = owners.shard_quotas(QuotaTier::Nvme, block_bytes, shard, shards, nvme_capacity);
        let ids = owners.len() as OwnerId;
        *self.owner_state.owners.borrow_mut() = owners;
        for o in 0..ids {
            self.trim_nvme(o);
        }
        if let Some(shard) = self.me.borrow().upgrade() {
            shard.spawn_holding(|shard| async move { shard.enforce_memory_limits().await });
        }
    }

    /// The log's reservation of each owner in this shard, in blocks.
    pub(crate) fn nvme_reserved(&self) -> Vec<u64> {
        self.owner_state.nvme_quotas.borrow().iter().map(|q| q.0).collect()
    }

    /// Drops `owner`'s oldest blocks from the log's index while it holds
    /// more than its limit there, down to `1/NVME_TRIM_SLACK` of the limit
    /// below it. Their slots are reused when their segments are reclaimed.
    pub(crate) fn trim_nvme(&self, owner: OwnerId) {
        let Some(&(_, limit)) = self.owner_state.nvme_quotas.borrow().get(owner as usize) else { return };
        let held = self.index.borrow().owner_blocks(owner);
        if held <= limit {
            return;
        }
        let target = limit.saturating_sub(limit / NVME_TRIM_SLACK);
        let oldest = self.index.borrow().oldest_of(owner, (held - target) as usize);
        let mut index = self.index.borrow_mut();
        for (hash, entry) in oldest {
            if index.remove_exact(&hash, entry) {
                drop(index);
                self.count_eviction(QuotaTier::Nvme, owner, owner);
                index = self.index.borrow_mut();
            }
        }
    }

    /// Moves blocks of every owner over its limit in the GPU or RAM tier
    /// down a tier (written to the log first when only memory holds them),
    /// oldest first, until each is at its limit.
    pub async fn enforce_memory_limits(&self) {
        let ids = self.owners().len() as OwnerId;
        for o in 0..ids {
            // At most as many moves as blocks over the limit now: a move
            // that leaves its block in place (replaced or deleted meanwhile)
            // cannot keep the loop going.
            if let Some(gpu) = &self.gpu {
                let over = gpu.lru().over_limit_by(o);
                for _ in 0..over {
                    if gpu.lru().over_limit_by(o) == 0 {
                        break;
                    }
                    let Some(v) = gpu.lru().oldest_of(o) else { break };
                    if self.demote_gpu(gpu, v).await.is_err() {
                        break;
                    }
                    self.count_eviction(QuotaTier::Gpu, o, o);
                }
            }
            let Some(ram) = &self.ram else { continue };
            let over = ram.borrow().lru().over_limit_by(o);
            for _ in 0..over {
                if ram.borrow().lru().over_limit_by(o) == 0 {
                    break;
                }
                let Some(v) = ram.borrow().lru().oldest_of(o) else { break };
                if v.dirty {
                    let bytes = ram.borrow_mut().begin_demotion(v.slot);
                    let written = self.put_nvme(&v.key, v.hash, &[bytes], false).await;
                    ram.borrow_mut().end_demotion(v.slot, written.is_ok());
                    if written.is_err() {
                        break;
                    }
                } else {
                    ram.borrow_mut().evict(v.slot);
                }
                self.count_eviction(QuotaTier::Ram, o, o);
            }
        }
    }

    /// Every owner this shard knows: blocks held, quotas, counters.
    pub fn owner_stats(&self) -> Vec<OwnerShardStats> {
        let owners = self.owners();
        let counters = self.owner_state.counters.borrow();
        let nvme = self.owner_state.nvme_quotas.borrow();
        let index = self.index.borrow();
        let ram = self.ram.as_ref().map(|r| r.borrow());
        (0..owners.len())
            .map(|i| {
                let o = i as OwnerId;
                let mut s = OwnerShardStats {
                    id: o,
                    name: owners.display_name(o).to_string(),
                    configured: owners.specs[i].configured,
                    blocks: [0; 3],
                    reserved_blocks: [0; 3],
                    limit_blocks: [0; 3],
                    counters: counters.get(i).copied().unwrap_or_default(),
                };
                if let Some(gpu) = &self.gpu {
                    let l = gpu.lru();
                    s.blocks[0] = l.owner_blocks(o);
                    (s.reserved_blocks[0], s.limit_blocks[0]) = l.quota(o);
                }
                if let Some(r) = &ram {
                    s.blocks[1] = r.lru().owner_blocks(o);
                    (s.reserved_blocks[1], s.limit_blocks[1]) = r.lru().quota(o);
                }
                s.blocks[2] = index.owner_blocks(o);
                (s.reserved_blocks[2], s.limit_blocks[2]) = nvme.get(i).copied().unwrap_or((0, 0));
                s
            })
            .collect()
    }
}

/// Each owner's stats summed over shards ([`super::ShardStats::owners`]),
/// by owner id.
pub fn owner_totals(shards: &[super::ShardStats]) -> Vec<OwnerShardStats> {
    let mut totals: Vec<OwnerShardStats> = Vec::new();
    for s in shards {
        for o in &s.owners {
            match totals.get_mut(o.id as usize) {
                Some(t) => {
                    for i in 0..3 {
                        t.blocks[i] += o.blocks[i];
                        t.reserved_blocks[i] += o.reserved_blocks[i];
                        t.limit_blocks[i] += o.limit_blocks[i];
                    }
                    t.counters.add(&o.counters);
                }
                None => totals.push(o.clone()),
            }
        }
    }
    totals
}
