//! The verified `O_DIRECT` reader: a slot's chunks read with several reads
//! in flight, the header and each chunk checked (header CRC, sequence
//! number, full key, the chunk's CRC-32) before it is handed over; a damaged
//! block is dropped from the index and never served ([`crate::stream`]).

use std::cell::Cell;
use std::time::Instant;

use bytes::Bytes;
use futures::channel::mpsc;
use futures::stream::{FuturesOrdered, StreamExt};
use glommio::io::ReadResult;

use super::Shard;
use crate::counter::{bump, record_us};
use crate::error::{Error, Result};
use crate::index::Entry;
use crate::key::{BlockHash, StoredKey};
use crate::segment::Segment;
use crate::signal::InFlight;
use crate::slot::{self, RecordKind, SlotHeader, PAGE_BYTES};
use crate::stream::{dma_chunk, BlockBody, ChunkStream};

/// Reads of one block in flight at once, one per chunk (1 MiB each, so a
/// 16 MiB block keeps the device busy with all of it, as fio's one 16 MiB
/// read does once the kernel splits it). Chunks are checked and sent in
/// order as the reads complete. One 16 MiB read ran at ~0.5× fio's
/// throughput here; split reads let the device work on several at once.
const READ_AHEAD_CHUNKS: usize = 16;

impl Shard {
    /// Starts reading a block from the log on a task of its own and waits
    /// for its first message: with `stream` its first chunk, else the whole
    /// block (with `promote`, filled into a RAM slot; see
    /// [`Shard::stream_slot`]).
    pub(super) async fn read_block(&self, key: &StoredKey, hash: BlockHash, promote: bool, stream: bool) -> Result<BlockBody> {
        let me = self.me.borrow().upgrade().expect("a serving shard is shared");
        let block_bytes = self.cfg.geometry.block_bytes;
        let chunks = slot::chunk_count(block_bytes, self.chunk_bytes) as usize;
        let (tx, mut rx) = mpsc::channel(chunks);
        let key = key.clone();
        me.spawn_holding(|me| async move { me.stream_slot(&key, hash, promote, stream, tx).await });
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
    pub(super) async fn stream_slot(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        promote: bool,
        stream: bool,
        mut tx: mpsc::Sender<Result<Bytes>>,
    ) {
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
            // Until the block is moved (or deleted, or the compaction ends).
            segment.survivors_moved.until(|| !segment.compacting.get() || self.index.borrow().get(&hash) != Some(entry)).await;
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
        if header.key != key.as_str().as_bytes() {
            // Another key with the same 128-bit hash: never serve it.
            bump(&self.counters.hash_collisions, 1);
            tracing::warn!(shard = self.id(), key = key.as_str(), "block hash collision; answering as a miss");
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
        let mut ram_slot =
            if promote && self.gpu.is_none() && self.still_newest(&hash, entry) { self.take_ram_slot(self.owner_of(key)) } else { None };
        // Without a slot taken up front, chunks are kept for `promote`.
        let mut kept = Vec::new();
        // Whole: the verified chunks wait here and leave together after the
        // last, with no copy (promoting into a RAM slot, the filled slot
        // leaves instead). A chunk that fails sends those that passed
        // first, then the error: a forwarded GET ends where a streamed one
        // does (one GET semantics, docs/API.md "Damaged blocks").
        let mut held = Vec::new();
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
                    send_held(&mut tx, &mut held);
                    return self.end_stream(&mut tx, Err(e), &mut reads).await;
                }
            };
            let range = payload(i, &read);
            let at = i * chunk_bytes as usize;
            let mut crc = crc32fast::Hasher::new();
            // A chunk is copied at most once: into the RAM slot it is
            // promoted to (and sent from there); otherwise it is sent from
            // the DMA buffer it was read into, its CRC-32 computed there
            // (by another shard's connection, for a forwarded GET: the
            // buffer goes home when sent, `crate::stream::dma_chunk`).
            let chunk = match ram_slot {
                Some(s) => {
                    let c = self.ram.as_ref().expect("RAM tier").borrow_mut().fill_chunk(s, at, &read[range], |step| crc.update(step));
                    drop(read);
                    c
                }
                None => {
                    crc.update(&read[range.clone()]);
                    dma_chunk(read, range)
                }
            };
            if crc.finalize() != header.chunk_crcs[i] {
                drop(chunk);
                self.abandon_ram_slot(ram_slot.take());
                let e = self.drop_corrupt(hash, entry, &format!("CRC-32 mismatch in chunk {i} of {chunks}"));
                send_held(&mut tx, &mut held);
                return self.end_stream(&mut tx, Err(e), &mut reads).await;
            }
            let last = i + 1 == chunks;
            if promote && ram_slot.is_none() {
                kept.push(chunk.clone());
            }
            // Whole: the block leaves after its last chunk has passed.
            let out = match ram_slot {
                _ if stream => vec![chunk],
                None => {
                    held.push(chunk);
                    if !last {
                        continue;
                    }
                    std::mem::take(&mut held)
                }
                Some(_) if !last => {
                    held.push(chunk);
                    continue;
                }
                Some(s) => {
                    held.clear();
                    vec![self.ram.as_ref().expect("RAM tier").borrow().filled(s, block_bytes as usize)]
                }
            };
            if last {
                // Promotion lands before the last chunk leaves, so a client
                // that has the whole block finds it in RAM.
                self.read_done(&segment, entry, started);
                drop(io_guards.take());
                if let Some(s) = ram_slot.take() {
                    if self.still_newest(&hash, entry) {
                        self.ram.as_ref().expect("RAM tier").borrow_mut().install_filled(s, key, hash, self.owner_of(key));
                        bump(&self.ram_counters.promotions, 1);
                        bump(&self.ram_counters.bytes_in, block_bytes);
                    } else {
                        self.abandon_ram_slot(Some(s));
                    }
                } else if promote {
                    self.promote(key, hash, &kept, entry).await;
                }
            }
            for chunk in out {
                if tx.try_send(Ok(chunk)).is_err() {
                    // The client went away: stop, and leave RAM as it was.
                    self.abandon_ram_slot(ram_slot.take());
                    return self.end_stream(&mut tx, Err(Error::NotFound), &mut reads).await;
                }
            }
        }
    }

    /// Sends `result` (if the receiver still listens) and waits for reads
    /// still in flight, so no read outlives the segment guard it runs under.
    pub(super) async fn end_stream<F>(&self, tx: &mut mpsc::Sender<Result<Bytes>>, result: Result<Bytes>, reads: &mut FuturesOrdered<F>)
    where
        F: std::future::Future,
    {
        if let Err(e @ Error::Io { .. }) = &result {
            self.note_log_error("read", e);
        }
        let _ = tx.try_send(result);
        tx.close_channel();
        while reads.next().await.is_some() {}
    }

    /// Bookkeeping of a block read in full and verified: second-chance
    /// flag, bytes read, read latency.
    pub(super) fn read_done(&self, segment: &Segment, entry: Entry, started: Instant) {
        segment.referenced.borrow_mut()[entry.slot as usize] = true;
        bump(&self.counters.bytes_read, self.slot_bytes);
        record_us(&self.nvme_counters.read_us, started.elapsed().as_micros());
    }

    pub(super) fn drop_corrupt(&self, hash: BlockHash, entry: Entry, why: &str) -> Error {
        self.index.borrow_mut().remove_exact(&hash, entry);
        bump(&self.counters.corrupt_blocks, 1);
        tracing::error!(shard = self.id(), segment = entry.segment, slot = entry.slot, seq = entry.seq, "corrupt block dropped: {why}");
        self.note_log_error("corrupt", &format!("corrupt block dropped from segment {} slot {}: {why}", entry.segment, entry.slot));
        Error::Corrupt { segment: entry.segment, slot: entry.slot }
    }
}

/// Sends the chunks a whole (not streamed) read held back, before the
/// error that ends it: the receiver then sees the same prefix of verified
/// chunks and the same error as a streamed read of the same slot.
fn send_held(tx: &mut mpsc::Sender<Result<Bytes>>, held: &mut Vec<Bytes>) {
    for chunk in held.drain(..) {
        if tx.try_send(Ok(chunk)).is_err() {
            break;
        }
    }
}

/// Counts a block read in `io_in_flight` until dropped.
struct InFlightIo<'a>(&'a Cell<u64>);

impl Drop for InFlightIo<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}
