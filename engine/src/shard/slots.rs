//! The log's slots and sequence numbers: handing out the next slot of the
//! head segment with its sequence number, rolling to a new head (a free
//! segment, a new file, or the oldest one reclaimed: `reclaim.rs`), the
//! sequence numbers of writes in flight, and the survivors a reclaim hands
//! over to be moved ([`Compaction`]). The write path (`append.rs`) and
//! reclaim (`reclaim.rs`) both build on this file; neither imports the
//! other.

use std::rc::Rc;

use super::Shard;
use crate::counter::bump;
use crate::error::{Error, Result};
use crate::index::Entry;
use crate::key::BlockHash;
use crate::segment::{self, Segment};

/// Removes a write's sequence number from the in-flight set when dropped.
pub(super) struct InFlightSeq<'a> {
    pub shard: &'a Shard,
    pub seq: u64,
}

impl Drop for InFlightSeq<'_> {
    fn drop(&mut self) {
        let removed = self.shard.inflight.borrow_mut().remove(&self.seq);
        debug_assert!(removed.is_some());
    }
}

/// A reclaim's survivors, still to be moved into the first slots of the
/// segment's new life ([`Shard::move_survivors`]).
pub(super) struct Compaction {
    pub segment: Rc<Segment>,
    /// Sorted by old slot.
    pub survivors: Vec<(BlockHash, Entry)>,
    /// The new life's first sequence number, reserved with the next
    /// `survivors.len()` for them.
    pub first_seq: u64,
}

impl Shard {
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
    pub(super) async fn allocate_slot(&self) -> Result<(Rc<Segment>, u32, u64)> {
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
    pub(super) async fn allocate_slot_locked(&self) -> Result<std::result::Result<(Rc<Segment>, u32, u64), Compaction>> {
        // Bounded: each pass either returns or installs a new head with free
        // slots; the second pass always finds room.
        for _ in 0..3 {
            if let Some(id) = self.head.get() {
                let segment = self.segment(id);
                let used = segment.slots_used.get();
                if used < self.slots_per_segment {
                    segment.slots_used.set(used + 1);
                    segment.writers.add();
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

    /// Finds the segment to append to next: a free one, else a new file if
    /// the disk share allows, else the oldest sealed segment, reclaimed.
    pub(super) async fn next_head(&self) -> Result<(u32, Option<Compaction>)> {
        let free = self.free.borrow_mut().pop();
        if let Some(id) = free {
            let segment = self.segment(id);
            segment.slots_used.set(0);
            // A free segment starts a new life: a first_seq past the slots
            // of its earlier life, and above the one the last snapshot saw
            // it empty with, so a restart from that snapshot rescans it.
            // When no sequence number was taken since that life began (its
            // only writes never landed), one is skipped to make it so.
            let first_seq = self.next_seq.get().max(segment.first_seq.get() + 1);
            self.next_seq.set(first_seq);
            segment.first_seq.set(first_seq);
            segment.write_superblock(&self.superblock(id, first_seq)).await?;
            return Ok((id, None));
        }
        // A spare being created is waited for, not created twice.
        let _creating = self.create_lock.acquire_permit(1).await.map_err(|_| Error::ShuttingDown)?;
        if let Some(id) = self.spare.take() {
            // Never written, and its superblock's first_seq is at most the
            // next sequence number: its life starts as it is.
            self.segment(id).slots_used.set(0);
            drop(_creating);
            self.prepare_spare();
            return Ok((id, None));
        }
        let created = self.segments.borrow().len() as u32;
        if created < self.cfg.segments_max {
            match self.create_segment(created).await {
                Ok(()) => {
                    if self.fs_full.replace(false) {
                        tracing::info!(shard = self.id(), "filesystem has room again: segment {created} created");
                    }
                    drop(_creating);
                    self.prepare_spare();
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
                        let (whose, resize) = match self.cfg.device_names() {
                            // Several devices: that device's share is what to lower.
                            Some(devices) => (devices, "its --data-dir DIR=SIZE_GB"),
                            None => (format!("the filesystem holding {}", self.cfg.log_dirs()), "a --disk-gb"),
                        };
                        if !self.fs_full.replace(true) {
                            tracing::warn!(
                                shard = self.id(),
                                "filesystem full ({whose}): segment {created} not created ({why}); refusing writes with 507 until space frees"
                            );
                        }
                        return Err(Error::DiskFull(format!(
                            "{whose} is full: shard {} could not add segment {created} of {} MiB ({why}); \
                             every stored block stays readable. Free space on the filesystem, or restart with {resize} \
                             no larger than the space there so that the log reclaims its oldest segments",
                            self.id(),
                            self.cfg.segment_bytes >> 20,
                        )));
                    };
                    tracing::warn!(
                        shard = self.id(),
                        "filesystem full{}: reusing segment {id}, which holds no live block",
                        self.cfg.device_names().map(|d| format!(" ({d})")).unwrap_or_default()
                    );
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

    /// Starts creating the next segment file in a task of its own, unless
    /// a spare is there or on its way, a free segment is (it is the next
    /// head), the disk share holds no more segments, or the filesystem was
    /// found full. A rollover then takes it with no file to create and no
    /// fsync to wait for; a write that finds it still being created waits
    /// for it (other requests never do: the file is made on the blocking
    /// pool, [`Shard::create_segment`]).
    pub(crate) fn prepare_spare(&self) {
        if self.spare.get().is_some()
            || self.cfg.log_absent.is_some()
            || self.spare_pending.get()
            || !self.free.borrow().is_empty()
            || self.fs_full.get()
            || self.segments.borrow().len() as u32 >= self.cfg.segments_max
        {
            return;
        }
        let Some(me) = self.me.borrow().upgrade() else { return };
        self.spare_pending.set(true);
        // Detached already (`spawn_holding`); a close waits for it.
        me.spawn_holding(|shard| async move {
            if let Ok(_creating) = shard.create_lock.acquire_permit(1).await {
                let id = shard.segments.borrow().len() as u32;
                if shard.spare.get().is_none() && shard.free.borrow().is_empty() && id < shard.cfg.segments_max {
                    match shard.create_segment(id).await {
                        Ok(()) => shard.spare.set(Some(id)),
                        // The rollover that needs it creates it and says why
                        // it cannot (a full filesystem: 507).
                        Err(e) => tracing::debug!(shard = shard.id(), "spare segment {id} not created ahead: {e}"),
                    }
                }
            }
            shard.spare_pending.set(false);
        });
    }

    /// Creates segment file `id` (temp file, `fallocate`, superblock, two
    /// fsyncs, rename: [`segment::create_file`]) on the executor's blocking
    /// pool, never on the shard's thread, and opens it. The caller holds
    /// `create_lock`.
    ///
    /// # Errors
    /// As [`segment::create_file`] and [`Segment::open`].
    pub(super) async fn create_segment(&self, id: u32) -> Result<()> {
        // Nothing is ever made in an absent device's directory.
        if self.cfg.log_absent.is_some() {
            self.log_accepts_writes()?;
        }
        let fault = self.cfg.fault_switch(id);
        if let Some(f) = &fault {
            f.check(|| format!("creating segment {id}"))?;
        }
        let sb = self.superblock(id, self.next_seq.get());
        let dir = self.cfg.segment_dir(id).to_path_buf();
        let path = glommio::executor().spawn_blocking(move || segment::create_file(&dir, &sb)).await?;
        let segment = Segment::open(&path, id, sb.first_seq, self.slot_bytes, self.slots_per_segment, fault).await?;
        let mut segments = self.segments.borrow_mut();
        if segments.len() <= id as usize {
            segments.resize(id as usize + 1, None);
        }
        segments[id as usize] = Some(Rc::new(segment));
        tracing::debug!(shard = self.id(), segment = id, "created segment");
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
}
