//! The index snapshot of a shard: what it covers (every record below the
//! lowest sequence number in flight), which segments a restart must rescan,
//! and the atomic write of `index.snapshot` ([`crate::index::snapshot`]).

use std::time::Instant;

use super::Shard;
use crate::counter::bump;
use crate::error::Result;
use crate::index::snapshot::{self, EntryState, IndexSnapshot, SegmentState, TagState};

impl Shard {
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
                // The spare is written after the snapshot with its
                // first_seq unchanged: a restart must scan it.
                rescan: self.head.get() == Some(seg.id)
                    || self.spare.get() == Some(seg.id)
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
            .map(|(h, e)| EntryState {
                hash_lo: h.0 as u64,
                hash_hi: (h.0 >> 64) as u64,
                segment: e.segment,
                slot: e.slot,
                seq: e.seq,
                owner: e.owner,
            })
            .collect();
        let owners = self.owners().specs.iter().map(|o| o.name.clone()).collect();
        let tags = self
            .index
            .borrow()
            .iter()
            .filter_map(|(h, _)| {
                let tag = self.residency.tag_of(&h)?;
                Some(TagState { hash_lo: h.0 as u64, hash_hi: (h.0 >> 64) as u64, tag: tag.to_vec() })
            })
            .collect();
        IndexSnapshot { shard: self.id(), covered_seq, next_seq: self.next_seq.get(), segments, entries, owners, tags }
    }

    /// Writes `index.snapshot` atomically (temp file, fsync, rename, fsync of
    /// the directory) on glommio's blocking thread pool.
    ///
    /// # Errors
    /// [`Error::Io`] from the filesystem.
    pub async fn write_snapshot(&self) -> Result<()> {
        if self.cfg.log_absent.is_some() {
            return Ok(()); // no log, nothing to snapshot
        }
        let started = Instant::now();
        let state = self.snapshot_state();
        let entries = state.entries.len();
        let bytes = snapshot::encode(&state);
        let dir = self.cfg.dir.clone();
        let written = glommio::executor()
            .spawn_blocking(move || -> Result<usize> {
                // off-shard: inside spawn_blocking (the executor's blocking pool).
                crate::geometry::write_durably(&dir, snapshot::FILE, &bytes)?;
                Ok(bytes.len())
            })
            .await;
        if let Err(e) = &written {
            self.note_log_error("snapshot", e);
        }
        let written = written?;
        bump(&self.counters.snapshots_written, 1);
        tracing::debug!(shard = self.id(), entries, bytes = written, ms = started.elapsed().as_secs_f64() * 1e3, "index snapshot written");
        Ok(())
    }
}
