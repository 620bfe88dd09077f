//! The log's write path: a slot and a sequence number for each record, one
//! `O_DIRECT` write of the whole slot, then the index. The index changes
//! only after the write completes, so a reader sees the old block or the new
//! one, never a slot in flight. The slot and its sequence number come from
//! `slots.rs`.

use std::rc::Rc;
use std::time::Instant;

use bytes::Bytes;
use glommio::io::DmaBuffer;

use super::slots::InFlightSeq;
use super::{PutOutcome, Shard};
use crate::counter::{bump, record_us};
use crate::error::{Error, Result};
use crate::index::Entry;
use crate::key::{BlockHash, StoredKey};
use crate::signal::InFlight;
use crate::slot::{self, ChunkHasher, RecordKind, SlotHeader, PAGE_BYTES};
use crate::tenant::OwnerId;

impl Shard {
    /// Writes a block to the log only. `chunks` together are exactly
    /// `block_bytes` long ([`Shard::put`] checked; demotions pass a whole
    /// RAM slot); they are copied once, into the aligned buffer that is
    /// written.
    ///
    /// # Errors
    /// [`Error::DiskFull`], [`Error::Io`].
    pub(super) async fn put_nvme(&self, key: &StoredKey, hash: BlockHash, chunks: &[Bytes], refusable: bool) -> Result<PutOutcome> {
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
            key: key.as_str().as_bytes().to_vec(),
            scope_bytes: key.scope_bytes(),
            chunk_bytes: self.chunk_bytes,
            chunk_crcs,
            tag: self.residency.tag_of(&hash).map(|t| t.to_vec()).unwrap_or_default(),
        };
        let (entry, replaced) = self.append(buf, header, self.owner_of(key)).await?;
        bump(&self.counters.puts, 1);
        debug_assert_eq!(self.index.borrow().get(&hash).map(|e| e.seq >= entry.seq), Some(true));
        Ok(if replaced { PutOutcome::Replaced } else { PutOutcome::Created })
    }

    /// Takes a slot, stamps the header with its sequence number, writes the
    /// slot and applies the record to the index. Returns the new entry and
    /// whether the key was stored before. `owner` is the owner of the
    /// header's key ([`Shard::owner_of`]).
    pub(super) async fn append(&self, buf: DmaBuffer, header: SlotHeader, owner: OwnerId) -> Result<(Entry, bool)> {
        let written = self.write_record(buf, header, owner).await;
        self.note_log_write(&written);
        written
    }

    /// [`Shard::append`] without the health bookkeeping.
    async fn write_record(&self, mut buf: DmaBuffer, mut header: SlotHeader, owner: OwnerId) -> Result<(Entry, bool)> {
        let started = Instant::now();
        let (segment, slot, seq) = self.allocate_slot().await?;
        // `allocate_slot` counted us as a writer of the segment and recorded
        // our seq as in flight; the guards undo both on every exit path.
        let _writer = InFlight::adopt(&segment.writers);
        let _inflight = InFlightSeq { shard: self, seq };
        // Our slot may still hold a survivor of this segment's reclaim that
        // has not been read yet: wait until the copy is past it.
        segment.survivors_moved.until(|| segment.copy_next_old_slot.get() > slot).await;
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
        let entry = Entry { segment: segment.id, slot, seq, owner };
        self.note_seq(segment.id, seq);
        let existed = {
            let mut index = self.index.borrow_mut();
            match header.kind {
                RecordKind::Block => index.insert_if_newer(header.hash, entry).0.is_some(),
                RecordKind::Tombstone => index.remove_if_not_newer(&header.hash, seq).is_some(),
            }
        };
        if header.kind == RecordKind::Block {
            self.trim_nvme(owner);
        }
        Ok((entry, existed))
    }

    /// A slot-sized DMA buffer: a pooled one, or a new one when the pool is
    /// empty. Its contents are whatever the last write left.
    pub(super) fn take_write_buffer(&self) -> DmaBuffer {
        self.buffers.borrow_mut().pop().unwrap_or_else(|| glommio::allocate_dma_buffer(self.slot_bytes as usize))
    }

    /// Returns a slot-sized write buffer to the pool once its write is done.
    pub(super) fn recycle(&self, buf: Rc<DmaBuffer>) {
        if let Ok(buf) = Rc::try_unwrap(buf) {
            let mut pool = self.buffers.borrow_mut();
            if buf.len() as u64 == self.slot_bytes && pool.len() < self.cfg.io_depth_max {
                pool.push(buf);
            }
        }
    }
}
