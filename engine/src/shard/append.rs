//! The log's write path: a slot and a sequence number for each record, one
//! `O_DIRECT` write of the whole slot, then the index. The index changes
//! only after the write completes, so a reader sees the old block or the new
//! one, never a slot in flight. The slot and its sequence number come from
//! `slots.rs`.
//!
//! **From the RAM tier.** A block that is in a RAM-tier slot (a write-through
//! PUT copies it there first, with its CRCs; a demotion or flush finds it
//! there) is written straight from that slot: the header page from a small
//! DMA buffer and the payload from the slot, two `O_DIRECT` writes, no copy
//! ([`RecordBody::FromRam`]). The slot is pinned, so not written, until both
//! complete. Other blocks are copied into a slot-sized DMA buffer
//! ([`RecordBody::Whole`]).

use std::rc::Rc;
use std::time::Instant;

use bytes::Bytes;
use glommio::io::DmaBuffer;

use super::slots::InFlightSeq;
use super::{PutOutcome, PutSource, Shard};
use crate::counter::{bump, record_us};
use crate::error::{Error, Result};
use crate::index::Entry;
use crate::key::{BlockHash, StoredKey};
use crate::signal::InFlight;
use crate::slot::{self, ChunkHasher, RecordKind, SlotHeader, PAGE_BYTES};
use crate::tenant::OwnerId;

impl Shard {
    /// Writes a block to the log only. `chunks` together are exactly
    /// `block_bytes` long ([`Shard::put`] checked); they are copied once,
    /// into the aligned buffer that is written.
    ///
    /// # Errors
    /// [`Error::DiskFull`], [`Error::Io`].
    pub(super) async fn put_nvme(&self, key: &StoredKey, hash: BlockHash, chunks: &[Bytes], refusable: bool) -> Result<PutOutcome> {
        self.put_nvme_from(key, hash, chunks, refusable, &PutSource::Owned).await
    }

    /// [`Shard::put_nvme`] of chunks in `source`'s memory: a client's memory
    /// is read once, into the aligned buffer, and the block is written only
    /// if the client still wants it once that copy is made.
    ///
    /// # Errors
    /// As [`Shard::put_nvme`]; [`Error::Cancelled`] when the client gave up
    /// on its memory (nothing written).
    pub(super) async fn put_nvme_from(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        chunks: &[Bytes],
        refusable: bool,
        source: &PutSource,
    ) -> Result<PutOutcome> {
        let block_bytes = self.cfg.geometry.block_bytes;
        debug_assert_eq!(chunks.iter().map(|c| c.len() as u64).sum::<u64>(), block_bytes);
        let _permit = self.io_permit(refusable).await?;
        let mut buf = self.take_write_buffer();
        let bytes = buf.as_bytes_mut();
        let mut crcs = ChunkHasher::new(self.chunk_bytes);
        let mut at = PAGE_BYTES as usize;
        for chunk in chunks {
            // The CRC reads the copy, not the source: it covers the bytes
            // written even if the source changes meanwhile.
            let to = &mut bytes[at..at + chunk.len()];
            to.copy_from_slice(chunk);
            crcs.update(to);
            at += chunk.len();
        }
        bytes[at..].fill(0);
        source.check_wanted()?;
        let header = self.block_header(key, hash, crcs);
        self.append_block(key, hash, RecordBody::Whole(buf), header).await
    }

    /// Whether blocks can be written to the log straight from RAM-tier
    /// slots: the block is a whole number of pages, so a slot's address
    /// and length meet `O_DIRECT`'s alignment.
    pub(super) fn writes_from_ram(&self) -> bool {
        self.ram.is_some() && self.cfg.geometry.block_bytes.is_multiple_of(PAGE_BYTES)
    }

    /// Writes a block held in a RAM-tier slot to the log straight from the
    /// slot. `payload` is the whole slot ([`crate::ram::RamTier::filled`] or
    /// [`crate::ram::RamTier::begin_demotion`]), pinned (unwritten) while it
    /// lives; `crcs` hashed exactly those bytes, or `None` to hash them
    /// here (a demotion: one read, no copy). Needs
    /// [`Shard::writes_from_ram`].
    ///
    /// # Errors
    /// As [`Shard::put_nvme`].
    pub(super) async fn put_nvme_from_ram(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        payload: Bytes,
        crcs: Option<ChunkHasher>,
        refusable: bool,
    ) -> Result<PutOutcome> {
        debug_assert!(self.writes_from_ram());
        debug_assert_eq!(payload.len() as u64, self.cfg.geometry.block_bytes);
        let crcs = crcs.unwrap_or_else(|| {
            let mut c = ChunkHasher::new(self.chunk_bytes);
            c.update(&payload);
            c
        });
        let _permit = self.io_permit(refusable).await?;
        let header = self.block_header(key, hash, crcs);
        let page = glommio::allocate_dma_buffer(PAGE_BYTES as usize);
        let put = self.append_block(key, hash, RecordBody::FromRam { header: page, payload }, header).await;
        if put.is_ok() {
            bump(&self.counters.writes_from_ram, 1);
        }
        put
    }

    /// A block record's header (its sequence number is stamped at the
    /// write).
    fn block_header(&self, key: &StoredKey, hash: BlockHash, crcs: ChunkHasher) -> SlotHeader {
        let (payload_crc, chunk_crcs) = crcs.finish();
        SlotHeader {
            kind: RecordKind::Block,
            seq: 0,
            hash,
            payload_len: self.cfg.geometry.block_bytes,
            payload_crc,
            write_time_us: slot::now_us(),
            key: key.as_str().as_bytes().to_vec(),
            scope_bytes: key.scope_bytes(),
            chunk_bytes: self.chunk_bytes,
            chunk_crcs,
            tag: self.residency.tag_of(&hash).map(|t| t.to_vec()).unwrap_or_default(),
        }
    }

    /// Appends a block record and counts the PUT.
    async fn append_block(&self, key: &StoredKey, hash: BlockHash, body: RecordBody, header: SlotHeader) -> Result<PutOutcome> {
        let (entry, replaced) = self.append(body, header, self.owner_of(key)).await?;
        bump(&self.counters.puts, 1);
        debug_assert_eq!(self.index.borrow().get(&hash).map(|e| e.seq >= entry.seq), Some(true));
        Ok(if replaced { PutOutcome::Replaced } else { PutOutcome::Created })
    }

    /// Takes a slot, stamps the header with its sequence number, writes the
    /// slot and applies the record to the index. Returns the new entry and
    /// whether the key was stored before. `owner` is the owner of the
    /// header's key ([`Shard::owner_of`]).
    /// While the device holding the log is failing, the write is refused
    /// ([`Shard::log_accepts_writes`]), and a write that meets an I/O error
    /// answers [`Error::DeviceDown`] naming it.
    pub(super) async fn append(&self, body: RecordBody, header: SlotHeader, owner: OwnerId) -> Result<(Entry, bool)> {
        self.log_accepts_writes()?;
        let written = self.write_record(body, header, owner).await;
        self.note_log_write(&written);
        written.map_err(|e| match e {
            Error::Io { .. } => Error::DeviceDown(format!("the device holding {} failed: {e}", self.cfg.log_dirs())),
            e => e,
        })
    }

    /// [`Shard::append`] without the health bookkeeping.
    async fn write_record(&self, body: RecordBody, mut header: SlotHeader, owner: OwnerId) -> Result<(Entry, bool)> {
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
        let (mut buf, payload) = match body {
            RecordBody::Whole(buf) => (buf, None),
            RecordBody::FromRam { header, payload } => (header, Some(payload)),
        };
        header.encode(&mut buf.as_bytes_mut()[..PAGE_BYTES as usize]);
        let len = buf.len() as u64 + payload.as_ref().map_or(0, |p| p.len() as u64);
        bump(&self.counters.io_in_flight, 1);
        let buf = Rc::new(buf);
        let result = async {
            match payload {
                None => segment.write_slot(buf.clone(), slot).await?,
                Some(payload) => segment.write_slot_split(buf.clone(), payload, slot).await?,
            }
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

    /// Returns a slot-sized write buffer to the pool once its write is done
    /// (a header page of [`RecordBody::FromRam`] is not pooled).
    pub(super) fn recycle(&self, buf: Rc<DmaBuffer>) {
        if let Ok(buf) = Rc::try_unwrap(buf) {
            let mut pool = self.buffers.borrow_mut();
            if buf.len() as u64 == self.slot_bytes && pool.len() < self.cfg.io_depth_max {
                pool.push(buf);
            }
        }
    }
}

/// What a log record's write is made of.
pub(super) enum RecordBody {
    /// A slot-sized DMA buffer: the header page, then the payload.
    Whole(DmaBuffer),
    /// A header page, and the payload written straight from a RAM-tier slot
    /// that stays pinned until the write completes.
    FromRam {
        /// [`PAGE_BYTES`] of DMA memory for the header.
        header: DmaBuffer,
        /// The whole RAM slot: `block_bytes`, page-aligned.
        payload: Bytes,
    },
}
