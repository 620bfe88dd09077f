//! The GPU tier's place in the shard's waterfall, GPU → RAM → NVMe (see
//! [`crate::gpu`]): placement of new and promoted blocks, moving the GPU's
//! least recently used blocks down into RAM, reads and prefetches from the
//! GPU, the write-back flush and the tier's stats.
//!
//! The memory tiers are exclusive: a block placed on the GPU leaves RAM,
//! and a block moved down from the GPU enters RAM (with its dirty state);
//! the log holds every block that is not dirty (write-through, or written
//! back). A block that cannot be placed on the GPU (no slot, out of device
//! memory, a failed copy) goes to RAM instead.

use std::time::Instant;

use bytes::Bytes;

use super::transit::{Placed, Ticket};
use super::Shard;
use crate::counter::{bump, record_us};
use crate::error::{Error, Result};
use crate::gpu::{GpuRead, GpuTier};
use crate::key::{BlockHash, StoredKey};
use crate::lru::Victim;
use crate::shard::ShardConfig;
use crate::tenant::QuotaTier;
use crate::tier::{Tier, TierStats};

/// Opens the shard's GPU tier when one is configured. A tier that cannot
/// open refuses the shard's start, unless the GPU is optional: then the
/// shard runs without it and says why in its stats.
///
/// # Errors
/// [`Error::Config`] naming the device and the driver's answer.
pub(super) fn open_gpu(cfg: &ShardConfig) -> Result<(Option<GpuTier>, Option<String>)> {
    let g = &cfg.gpu;
    if let Some(why) = &g.unavailable {
        return Ok((None, Some(why.reason.clone())));
    }
    let Some(device) = g.device.clone() else { return Ok((None, None)) };
    if g.blocks_per_shard == 0 {
        return Ok((None, None));
    }
    match GpuTier::new(device, g.blocks_per_shard, cfg.geometry.block_bytes) {
        Ok(t) => Ok((Some(t), None)),
        Err(e) if g.optional => {
            tracing::warn!(shard = cfg.shard_id, "GPU tier not available, running without it (--gpu-optional): {e}");
            Ok((None, Some(e.reason)))
        }
        Err(e) => Err(Error::Config(format!(
            "GPU tier of shard {}: {e}; lower --gpu-mem-gb, or pass --gpu-optional to run without the GPU tier",
            cfg.shard_id
        ))),
    }
}

impl Shard {
    /// Places a block in the fastest memory tier with room (GPU, else RAM)
    /// as its most recently used block, moving least recently used blocks
    /// down to make room, while `ticket` (the block's transit, which GETs
    /// are served from meanwhile) is current; older copies of the key leave
    /// only then. Returns the tier that took it, [`Placed::Superseded`] when
    /// a newer PUT of the key came first, [`Placed::NoRoom`] when neither
    /// tier could take it.
    ///
    /// # Errors
    /// Writing a demoted write-back block to the log failed.
    pub(super) async fn place(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        parts: &[&[u8]],
        dirty: bool,
        ticket: &Ticket<'_>,
    ) -> Result<Placed> {
        let wanted = || ticket.is_current();
        if !wanted() {
            return Ok(Placed::Superseded);
        }
        if let Some(gpu) = &self.gpu {
            // An older copy in RAM leaves first, so the GPU victim this
            // block displaces can take its slot.
            if let Some(ram) = &self.ram {
                ram.borrow_mut().remove(&hash);
            }
            match self.cache_gpu(gpu, key, hash, parts, dirty, &wanted).await? {
                Placed::NoRoom if wanted() => {}
                Placed::NoRoom => return Ok(Placed::Superseded),
                placed => return Ok(placed),
            }
            // Not on the GPU: an older copy there must not shadow this one.
            gpu.remove(&hash);
        }
        self.cache(key, hash, parts, dirty, &wanted).await
    }

    /// Drops any copy of `hash` from the memory tiers.
    pub(super) fn drop_from_memory(&self, hash: &BlockHash) {
        if let Some(gpu) = &self.gpu {
            gpu.remove(hash);
        }
        if let Some(ram) = &self.ram {
            ram.borrow_mut().remove(hash);
        }
    }

    /// Places a block on the GPU while `wanted()` holds (checked before an
    /// older copy leaves and again at the install), moving the tier's least
    /// recently used blocks down one tier while it has no free slot.
    /// [`Placed::NoRoom`] when no slot could be had or the copy failed
    /// (counted and logged by the tier).
    async fn cache_gpu(
        &self,
        gpu: &GpuTier,
        key: &StoredKey,
        hash: BlockHash,
        parts: &[&[u8]],
        dirty: bool,
        wanted: &dyn Fn() -> bool,
    ) -> Result<Placed> {
        let started = Instant::now();
        if !wanted() {
            return Ok(Placed::Superseded);
        }
        gpu.release_if_idle(&hash);
        let owner = self.owner_of(key);
        loop {
            if let Some(slot) = gpu.take_free(owner).await {
                if !wanted() {
                    gpu.give_back(slot);
                    return Ok(Placed::Superseded);
                }
                return Ok(match gpu.write(slot, key, hash, owner, parts, dirty, wanted).await {
                    Err(_) => Placed::NoRoom,
                    Ok(false) => Placed::Superseded,
                    Ok(true) => {
                        bump(&self.gpu_counters.bytes_in, self.cfg.geometry.block_bytes);
                        record_us(&self.gpu_counters.write_us, started.elapsed().as_micros());
                        Placed::In(Tier::Gpu)
                    }
                });
            }
            let Some(victim) = gpu.victim_for(owner) else { return Ok(Placed::NoRoom) };
            let victim_owner = victim.owner;
            self.demote_gpu(gpu, victim).await?;
            self.count_eviction(QuotaTier::Gpu, victim_owner, owner);
        }
    }

    /// Moves a GPU victim down: into RAM (keeping its dirty state), else to
    /// the log when it is dirty, else it is just dropped (the log has it).
    /// A victim whose copy back fails is dropped; if it was dirty it is lost
    /// (counted and logged).
    ///
    /// # Errors
    /// A dirty victim could not be written to the log (it stays on the GPU).
    pub(super) async fn demote_gpu(&self, gpu: &GpuTier, v: Victim) -> Result<()> {
        if !v.dirty && self.ram.is_none() {
            gpu.evict(v.slot);
            bump(&self.gpu_counters.demotions, 1);
            return Ok(());
        }
        let bytes = match gpu.begin_demotion(&v, &self.read_buffers).await {
            Ok(b) => b,
            Err(()) => {
                gpu.end_demotion(v.slot, true);
                if v.dirty {
                    bump(&gpu.faults.blocks_lost, 1);
                    tracing::error!(
                        shard = self.id(),
                        key = v.key.as_str(),
                        "write-back block held only on the GPU lost: its copy back failed"
                    );
                }
                return Ok(());
            }
        };
        // Deleted or replaced (or a newer block of the key on its way in)
        // while it was copied back: nothing to move (moving the old bytes
        // down would later overwrite the new ones in the log).
        let still_held = || gpu.holds(v.slot, &v.hash) && !self.transits.contains(&v.hash);
        if !still_held() {
            gpu.end_demotion(v.slot, true);
            return Ok(());
        }
        let into_ram = match &self.ram {
            Some(_) => self.cache(&v.key, v.hash, &[&bytes], v.dirty, &still_held).await,
            None => Ok(Placed::NoRoom),
        };
        let moved = match into_ram {
            Ok(Placed::In(_) | Placed::Superseded) => true,
            _ if !still_held() => true,
            _ if v.dirty => {
                let written = self.put_nvme(&v.key, v.hash, &[bytes], false).await;
                if written.is_ok() {
                    bump(&self.nvme_counters.promotions, 1);
                }
                gpu.end_demotion(v.slot, written.is_ok());
                written?;
                bump(&self.gpu_counters.demotions, 1);
                return Ok(());
            }
            _ => true,
        };
        gpu.end_demotion(v.slot, moved);
        bump(&self.gpu_counters.demotions, 1);
        Ok(())
    }

    /// A GET's look at the GPU: the CRC-checked block, or `None` (not there,
    /// or its copy back failed and it was dropped: the read goes on to RAM
    /// and the log, which hold it unless it was a write-back block held only
    /// on the GPU; then an older block of the key in the log is dropped from
    /// the index too and the GET is a miss).
    pub(super) async fn read_gpu(&self, key: &StoredKey, hash: BlockHash) -> Option<Bytes> {
        let gpu = self.gpu.as_ref()?;
        let started = Instant::now();
        match gpu.read(key, &hash, &self.read_buffers).await {
            GpuRead::Hit(bytes) => {
                let c = &self.gpu_counters;
                bump(&c.hits, 1);
                bump(&c.bytes_out, bytes.len() as u64);
                record_us(&c.read_us, started.elapsed().as_micros());
                Some(bytes)
            }
            GpuRead::Miss | GpuRead::Failed { lost: false } => {
                bump(&self.gpu_counters.misses, 1);
                None
            }
            GpuRead::Failed { lost: true } => {
                bump(&self.gpu_counters.misses, 1);
                // The newest bytes of the key are gone: an older block under
                // it in the log must not be served in their place (as after
                // a crash, a restart may find that older block again).
                let entry = self.index.borrow().get(&hash);
                if let Some(e) = entry {
                    self.index.borrow_mut().remove_exact(&hash, e);
                }
                None
            }
        }
    }

    /// A block just served from RAM moves up to the GPU (`--promote on`).
    /// Returns the bytes to serve: with a GPU tier, a copy, so that the RAM
    /// slot is not pinned by the response and the GPU victim displaced can
    /// take it.
    pub(super) async fn promote_from_ram(&self, key: &StoredKey, hash: BlockHash, bytes: Bytes) -> Bytes {
        if self.gpu.is_none() {
            return bytes;
        }
        let owned = self.read_buffers.copy_parts(&[&bytes[..]], |_| {});
        drop(bytes);
        self.move_up_from_ram(key, hash, &owned).await;
        owned
    }

    /// Moves a block from RAM (`bytes`, a copy of its slot) to the GPU. It
    /// leaves RAM first, so the GPU victim it displaces can take its RAM
    /// slot (the caller holds no pin on it), and is served from its transit
    /// until it lands; if the GPU does not take it, it goes back to RAM (a
    /// dirty block must not be lost). A PUT of the key meanwhile wins: the
    /// move then changes nothing (a DELETE waits for the move to land).
    async fn move_up_from_ram(&self, key: &StoredKey, hash: BlockHash, bytes: &Bytes) {
        let (Some(gpu), Some(ram)) = (&self.gpu, &self.ram) else { return };
        let (dirty, demoting) = {
            let r = ram.borrow();
            (r.is_dirty(&hash), r.is_demoting(&hash))
        };
        if demoting || self.transits.contains(&hash) {
            return;
        }
        let ticket = self.transits.begin(key, hash, vec![bytes.clone()]);
        let wanted = || ticket.is_current();
        ram.borrow_mut().remove(&hash);
        match self.cache_gpu(gpu, key, hash, &[bytes], dirty, &wanted).await {
            Ok(Placed::In(_)) => bump(&self.gpu_counters.promotions, 1),
            Ok(Placed::Superseded) => {}
            _ => {
                let back = self.cache(key, hash, &[bytes], dirty, &wanted).await;
                if !matches!(back, Ok(Placed::In(_) | Placed::Superseded)) && dirty && wanted() {
                    // Neither tier took it back: write it to the log.
                    if let Err(e) = self.put_nvme(key, hash, std::slice::from_ref(bytes), false).await {
                        bump(&gpu.faults.blocks_lost, 1);
                        tracing::error!(shard = self.id(), key = key.as_str(), "write-back block lost moving up from RAM: {e}");
                    }
                }
            }
        }
    }

    /// Prefetch with a GPU tier: a block on the GPU becomes most recently
    /// used; one in RAM or only in the log is copied up to the GPU (CRC
    /// checked on the way). Returns whether the block is stored.
    pub(super) async fn prefetch_gpu(&self, key: &StoredKey, hash: BlockHash) -> bool {
        let Some(gpu) = &self.gpu else { return false };
        if gpu.touch(key, &hash) {
            return true;
        }
        let in_ram = self.ram.as_ref().and_then(|r| r.borrow_mut().get(key, &hash));
        if let Some(bytes) = in_ram {
            let owned = self.read_buffers.copy_parts(&[&bytes[..]], |_| {});
            drop(bytes);
            self.move_up_from_ram(key, hash, &owned).await;
            return true;
        }
        self.read_to_promote(key, hash).await
    }

    /// Removes `hash` from the GPU for a DELETE, after any move down of it
    /// in flight. Returns whether it was there.
    pub(super) async fn delete_from_gpu(&self, hash: &BlockHash) -> bool {
        let Some(gpu) = &self.gpu else { return false };
        gpu.demotion_ended.until(|| !gpu.is_demoting(hash)).await;
        gpu.remove(hash)
    }

    /// Writes every block held only on the GPU (write-back) to the log; they
    /// stay on the GPU, now clean. Returns how many.
    ///
    /// # Errors
    /// The first failed log write.
    pub(super) async fn flush_gpu(&self) -> Result<u64> {
        let Some(gpu) = &self.gpu else { return Ok(0) };
        let mut written = 0;
        for v in gpu.dirty_blocks() {
            let bytes = match gpu.begin_demotion(&v, &self.read_buffers).await {
                Ok(b) => b,
                Err(()) => {
                    gpu.end_flush(v.slot, false);
                    bump(&gpu.faults.blocks_lost, 1);
                    tracing::error!(
                        shard = self.id(),
                        key = v.key.as_str(),
                        "write-back block on the GPU lost at flush: its copy back failed"
                    );
                    continue;
                }
            };
            let r = self.put_nvme(&v.key, v.hash, &[bytes], false).await;
            gpu.end_flush(v.slot, r.is_ok());
            r?;
            written += 1;
        }
        Ok(written)
    }

    /// The GPU's entry in the shard's tier stats: the tier's counters, or an
    /// empty entry saying why it is absent (`--gpu-optional`).
    pub(super) fn gpu_tier_stats(&self) -> Option<TierStats> {
        let (capacity, used, info) = match (&self.gpu, &self.gpu_unavailable) {
            (Some(g), _) => (g.capacity_blocks(), g.used_blocks(), g.info()),
            (None, Some(why)) => (0, 0, crate::gpu::GpuInfo { unavailable: Some(why.clone()), ..Default::default() }),
            (None, None) => return None,
        };
        let mut t = TierStats::from_counters(Tier::Gpu, &self.gpu_counters, capacity, used, None);
        t.gpu = Some(info);
        Some(t)
    }

    /// GPU keys, most recently used first (tests).
    pub fn gpu_lru_keys(&self) -> Vec<String> {
        self.gpu.as_ref().map(|g| g.lru_keys()).unwrap_or_default()
    }
}
