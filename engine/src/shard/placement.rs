//! The RAM tier's place in the waterfall: placing new and promoted blocks
//! (moving least recently used ones down to the log), promotion of blocks
//! read from the log, prefetch, the write-back flush, and serving blocks in
//! transit. The GPU's part is `waterfall.rs`; blocks between tiers,
//! `transit.rs`.

use std::time::Instant;

use bytes::Bytes;

use super::transit::Placed;
use super::{PutOutcome, PutSource, Shard};
use crate::counter::{bump, record_us};
use crate::error::Result;
use crate::index::Entry;
use crate::key::{BlockHash, StoredKey};
use crate::slot::ChunkHasher;
use crate::stream::{BlockBody, ChunkStream};
use crate::tenant::{OwnerId, QuotaTier};
use crate::tier::Tier;

impl Shard {
    /// Places a block in the RAM tier as its most recently used block while
    /// `wanted()` holds (checked before an older copy leaves and at the
    /// install), moving least recently used blocks down to make room:
    /// dropped when the log has them, written to the log first when they are
    /// only in RAM (`dirty`, write-back). [`Placed::NoRoom`] when there is
    /// no RAM tier or every slot is pinned or being demoted.
    ///
    /// # Errors
    /// Writing a demoted block to the log failed (the block stays in RAM).
    pub(super) async fn cache(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        parts: &[&[u8]],
        dirty: bool,
        wanted: &dyn Fn() -> bool,
    ) -> Result<Placed> {
        let Some(ram) = &self.ram else { return Ok(Placed::NoRoom) };
        let started = Instant::now();
        let owner = self.owner_of(key);
        loop {
            let victim = {
                if !wanted() {
                    return Ok(Placed::Superseded);
                }
                let mut r = ram.borrow_mut();
                r.release_if_idle(&hash);
                if let Some(slot) = r.take_free(owner) {
                    r.install(slot, key, hash, owner, parts, dirty);
                    bump(&self.ram_counters.bytes_in, self.cfg.geometry.block_bytes);
                    record_us(&self.ram_counters.write_us, started.elapsed().as_micros());
                    return Ok(Placed::In(Tier::Ram));
                }
                match r.victim_for(owner) {
                    Some(v) if !v.dirty => {
                        r.evict(v.slot);
                        bump(&self.ram_counters.demotions, 1);
                        drop(r);
                        self.count_eviction(QuotaTier::Ram, v.owner, owner);
                        continue;
                    }
                    Some(v) => v,
                    None => return Ok(Placed::NoRoom),
                }
            };
            // Write-back: the victim is only in RAM; write it to the log
            // first. It stays readable from RAM meanwhile.
            let bytes = ram.borrow_mut().begin_demotion(victim.slot);
            let written = self.demote_to_log(&victim.key, victim.hash, bytes).await;
            ram.borrow_mut().end_demotion(victim.slot, written.is_ok());
            written?;
            bump(&self.ram_counters.demotions, 1);
            self.count_eviction(QuotaTier::Ram, victim.owner, owner);
            bump(&self.nvme_counters.promotions, 1);
        }
    }

    /// A write-through PUT through a RAM slot: the block is copied once,
    /// into a RAM slot taken for it, with its CRCs computed from the slot as
    /// it is filled; the log record is written straight from that slot
    /// (`append.rs`); once the write completes the slot becomes the block's
    /// RAM copy, replacing an older one. Until then GETs see the older
    /// block. The client's buffer is read once: whatever it holds later
    /// changes nothing stored. `None` when no slot can be taken without a
    /// log write (every candidate pinned or dirty): the caller takes the
    /// copying path. From a client's memory (`source`), the block is stored
    /// only if the client still wants it once the slot is filled (else
    /// [`crate::Error::Cancelled`]).
    pub(super) async fn put_through_ram(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        chunks: &[Bytes],
        source: &PutSource,
    ) -> Option<Result<PutOutcome>> {
        let ram = self.ram.as_ref()?;
        let owner = self.owner_of(key);
        // As `cache`: the key's older copy gives its slot when no reader
        // holds it (GETs meanwhile read the older record from the log).
        ram.borrow_mut().release_if_idle(&hash);
        let slot = self.take_ram_slot(owner)?;
        // Given back on every exit but the install below, a cancelled PUT's
        // included (an HTTP client gone mid-write drops its future).
        let taken = TakenSlot { shard: self, slot: Some(slot) };
        let started = Instant::now();
        let mut crcs = ChunkHasher::new(self.chunk_bytes);
        let payload = {
            let mut r = ram.borrow_mut();
            let mut at = 0;
            for chunk in chunks {
                r.fill_checked(slot, at, chunk, |copied| crcs.update(copied));
                at += chunk.len();
            }
            r.filled(slot, at)
        };
        record_us(&self.ram_counters.write_us, started.elapsed().as_micros());
        // A client's memory, read: the block is stored only if the client
        // still wants it now (`taken` gives the slot back otherwise).
        if let Err(e) = source.check_wanted() {
            return Some(Err(e));
        }
        let written = self.put_nvme_from_ram(key, hash, payload.clone(), Some(crcs), true).await;
        if written.is_err() {
            return Some(written); // `taken` gives the slot back
        }
        // As the copying path: a transit begun once the log has the block
        // supersedes older PUTs of the key still on their way into RAM.
        let _ticket = self.transits.begin(key, hash, vec![payload]);
        ram.borrow_mut().commit_filled(taken.into_slot(), key, hash, owner);
        bump(&self.ram_counters.bytes_in, self.cfg.geometry.block_bytes);
        Some(written)
    }

    /// Writes a block being demoted from RAM (`bytes`, its whole slot) to
    /// the log: straight from the slot where the geometry allows
    /// ([`Shard::writes_from_ram`]), else through a DMA buffer.
    async fn demote_to_log(&self, key: &StoredKey, hash: BlockHash, bytes: Bytes) -> Result<PutOutcome> {
        if self.writes_from_ram() {
            self.put_nvme_from_ram(key, hash, bytes, None, false).await
        } else {
            self.put_nvme(key, hash, &[bytes], false).await
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
            let r = self.demote_to_log(&v.key, v.hash, bytes).await;
            ram.borrow_mut().end_flush(v.slot, r.is_ok());
            r?;
            written += 1;
        }
        Ok(written)
    }

    /// The body of a GET served from a block in transit: its buffers as they
    /// are (they may be this shard's DMA chunks), except for a GET forwarded
    /// from another shard (`!stream`), which gets one pooled copy that may
    /// cross threads.
    pub(super) fn transit_body(&self, mut parts: Vec<Bytes>, stream: bool) -> BlockBody {
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
    pub async fn prefetch(&self, key: &StoredKey, hash: BlockHash) -> bool {
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
    pub(super) async fn promote(&self, key: &StoredKey, hash: BlockHash, parts: &[Bytes], entry: Entry) {
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
    pub(super) fn still_newest(&self, hash: &BlockHash, entry: Entry) -> bool {
        self.index.borrow().get(hash) == Some(entry) && !matches!(self.contains(hash), Some(Tier::Gpu | Tier::Ram))
    }

    /// Reads a block from the log with promotion, whole (every chunk
    /// checked before it answers; a prefetch). Returns whether it was read
    /// in full.
    pub(super) async fn read_to_promote(&self, key: &StoredKey, hash: BlockHash) -> bool {
        self.read_block(key, hash, true, false).await.is_ok()
    }

    /// A RAM slot to promote into, taken before the read so the chunks are
    /// copied straight into it: a free slot, or the least recently used
    /// block's if the log has it (clean). `None` when there is no RAM tier
    /// or the victim is only in RAM (write-back), which takes a log write
    /// to move: then the block is promoted after the read by [`Shard::promote`].
    pub(super) fn take_ram_slot(&self, owner: OwnerId) -> Option<u32> {
        let ram = self.ram.as_ref()?;
        loop {
            let mut r = ram.borrow_mut();
            if let Some(slot) = r.take_free(owner) {
                return Some(slot);
            }
            match r.victim_for(owner) {
                Some(v) if !v.dirty => {
                    r.evict(v.slot);
                    bump(&self.ram_counters.demotions, 1);
                    drop(r);
                    self.count_eviction(QuotaTier::Ram, v.owner, owner);
                }
                _ => return None,
            }
        }
    }

    pub(super) fn abandon_ram_slot(&self, slot: Option<u32>) {
        if let (Some(s), Some(ram)) = (slot, &self.ram) {
            ram.borrow_mut().abandon(s);
        }
    }
}

/// A RAM slot taken for a block that is not installed yet: abandoned
/// ([`crate::ram::RamTier::abandon`]) when dropped before
/// [`TakenSlot::into_slot`].
struct TakenSlot<'a> {
    shard: &'a Shard,
    slot: Option<u32>,
}

impl TakenSlot<'_> {
    /// The slot, to install: no longer given back on drop.
    fn into_slot(mut self) -> u32 {
        self.slot.take().expect("taken once")
    }
}

impl Drop for TakenSlot<'_> {
    fn drop(&mut self) {
        self.shard.abandon_ram_slot(self.slot.take());
    }
}
