//! Reclaim with second chance: when the log is full, the oldest segment is
//! emptied for reuse; blocks read since they were written survive (up to a
//! share of the segment) and are rewritten into the first slots of its new
//! life by a task of their own, while new writes go ahead after them
//! (docs/ARCHITECTURE.md, "Reclaim and second chance").

use std::rc::Rc;

use super::slots::{Compaction, InFlightSeq};
use super::Shard;
use crate::counter::bump;
use crate::error::Result;
use crate::index::Entry;
use crate::key::BlockHash;
use crate::segment::Segment;
use crate::signal::InFlight;
use crate::slot::{ChunkHasher, SlotHeader, PAGE_BYTES};
use crate::tenant::{OwnerId, QuotaTier};

/// At most this fraction of a reclaimed segment's slots is kept by second
/// chance, so every reclaim frees at least half a segment even when every
/// block in it is hot.
const SECOND_CHANCE_SHARE: u32 = 2;

impl Shard {
    /// Starts moving a reclaim's survivors in a task of its own: no writer
    /// waits for the whole move, and one that gives up waiting cannot leave
    /// it half done. The task holds the shard, so a close waits for it.
    /// (A shard not wrapped by [`Shard::share`] moves them inline.)
    pub(super) async fn run_compaction(&self, compaction: Compaction) {
        let shard = self.me.borrow().upgrade();
        match shard {
            Some(shard) => {
                shard.spawn_holding(|shard| async move { shard.move_survivors(compaction).await });
            }
            None => self.move_survivors(compaction).await,
        }
    }

    /// Empties the oldest segment for reuse, under the slot lock: waits for
    /// writes into it to land, drops its blocks from the index but the
    /// survivors, waits for reads of it to finish, then starts its new life
    /// with a new superblock and reserves the first slots and sequence
    /// numbers of that life for the survivors. Moving them is left to the
    /// caller ([`Shard::move_survivors`], without the lock); `None` when
    /// there are none.
    pub(super) async fn reclaim(&self, id: u32) -> Result<Option<Compaction>> {
        let segment = self.segment(id);
        // Writers include the survivor copy of this segment's previous
        // reclaim, should it still run.
        segment.writers.idle().await;
        // Blocks of owners holding no more than their reservation in the log
        // stay (but one slot is always freed); then second chance: blocks
        // read since they were written stay, up to a share of the segment.
        // The rest leave the index.
        let survivors = self.reclaim_survivors(&segment);
        let mut dropped_by_owner: Vec<u64> = Vec::new();
        let evicted = {
            let mut index = self.index.borrow_mut();
            let before = index.len();
            let mut held: Vec<u64> = (0..self.owners().len()).map(|o| index.owner_blocks(o as OwnerId)).collect();
            index.remove_segment(id);
            for (h, e) in &survivors {
                index.insert_if_newer(*h, *e);
            }
            for (o, was) in held.iter_mut().enumerate() {
                dropped_by_owner.push(was.saturating_sub(index.owner_blocks(o as OwnerId)));
            }
            before - index.len()
        };
        for (o, n) in dropped_by_owner.into_iter().enumerate() {
            self.count_owner(o as OwnerId, |c| c.evicted_by_other[QuotaTier::Nvme as usize] += n);
        }
        // Nothing else takes sequence numbers while we hold the slot lock:
        // this is the new life's first.
        let first_seq = self.next_seq.get();
        segment.compact_below_seq.set(first_seq);
        segment.compacting.set(true);
        segment.readers.idle().await;
        if let Err(e) = segment.write_superblock(&self.superblock(segment.id, first_seq)).await {
            // Drop the survivors; keep the segment for a retry.
            segment.compacting.set(false);
            segment.survivors_moved.notify();
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
            segment.survivors_moved.notify();
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
        segment.writers.add();
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
    pub(super) async fn move_survivors(&self, c: Compaction) {
        let Compaction { segment, survivors, first_seq } = c;
        let _writer = InFlight::adopt(&segment.writers);
        let block_bytes = self.cfg.geometry.block_bytes;
        for (j, (hash, old)) in survivors.iter().enumerate() {
            // However this survivor ends (moved, dropped), reads waiting
            // for it look again.
            let _done = NotifyOnDrop(&segment.survivors_moved);
            let seq = first_seq + j as u64;
            let _inflight = InFlightSeq { shard: self, seq };
            let next_old_slot = survivors.get(j + 1).map_or(u32::MAX, |(_, e)| e.slot);
            let j = j as u32;
            debug_assert!(j <= old.slot);
            let read = segment.read_slot(old.slot, self.slot_bytes).await;
            // The old slot is read: writes into it may go ahead.
            segment.copy_next_old_slot.set(next_old_slot);
            segment.survivors_moved.notify();
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
                    self.note_log_error("reclaim", &e);
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
            if header.drop_tag_past_room() {
                tracing::warn!(
                    shard = self.id(),
                    segment = segment.id,
                    slot = old.slot,
                    "a format 3 block's tag no longer fits its header; kept without it"
                );
            }
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
                self.note_log_error("reclaim", &e);
                continue;
            }
            self.note_seq(segment.id, seq);
            let moved = Entry { segment: segment.id, slot: j, seq, owner: old.owner };
            if self.index.borrow_mut().remove_exact(hash, *old) {
                self.index.borrow_mut().insert_if_newer(*hash, moved);
            }
            bump(&self.counters.second_chance_blocks, 1);
        }
        segment.copy_next_old_slot.set(u32::MAX);
        segment.compacting.set(false);
        segment.survivors_moved.notify();
    }

    /// The blocks of segment `segment` a reclaim keeps, sorted by slot:
    /// first those an owner needs to stay at its reservation in the log
    /// (its oldest beyond that go), at most all slots but one; then blocks
    /// read since they were written (second chance), up to
    /// `1/SECOND_CHANCE_SHARE` of the segment.
    fn reclaim_survivors(&self, segment: &Segment) -> Vec<(BlockHash, Entry)> {
        let index = self.index.borrow();
        let mut mine: Vec<(BlockHash, Entry)> = index.iter().filter(|(_, e)| e.segment == segment.id).collect();
        mine.sort_by_key(|(_, e)| e.slot);
        let reserved = self.nvme_reserved();
        // How many of each owner's blocks may still leave before it falls
        // under its reservation; oldest (lowest slot) leave first.
        let mut may_leave: Vec<u64> = (0..reserved.len().max(1))
            .map(|o| index.owner_blocks(o as OwnerId).saturating_sub(reserved.get(o).copied().unwrap_or(0)))
            .collect();
        let referenced = segment.referenced.borrow();
        let (mut kept, mut second_chance) = (Vec::new(), Vec::new());
        for (h, e) in mine {
            let room = may_leave.get_mut(e.owner as usize);
            match room {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    if referenced[e.slot as usize] {
                        second_chance.push((h, e));
                    }
                }
                None if referenced[e.slot as usize] => second_chance.push((h, e)),
                None => {}
                Some(_) => kept.push((h, e)),
            }
        }
        kept.truncate(self.slots_per_segment.saturating_sub(1) as usize);
        second_chance.truncate((self.slots_per_segment / SECOND_CHANCE_SHARE) as usize);
        kept.extend(second_chance);
        kept.truncate(self.slots_per_segment.saturating_sub(1).max(1) as usize);
        kept.sort_by_key(|(_, e)| e.slot);
        kept
    }
}

/// Fires a signal when dropped, on every exit path of a scope.
struct NotifyOnDrop<'a>(&'a crate::signal::Signal);

impl Drop for NotifyOnDrop<'_> {
    fn drop(&mut self) {
        self.0.notify();
    }
}
