//! Opening a shard: rebuild its index from the slot headers of its segments.
//!
//! Every slot position of every segment is read (headers only, 4 KiB each,
//! many in flight). A header counts when its CRC-32 holds, it belongs to
//! this key (hash and length consistent) and its sequence number is at least
//! the segment's `first_seq`; records are then applied in sequence order, so
//! the newest record of a key wins and a tombstone removes what came before
//! it. Payloads are not read here: a slot whose payload was torn by a crash
//! fails its CRC-32 when first read, and is dropped then, never served.

use std::fs;
use std::rc::Rc;
use std::time::Instant;

use futures::stream::{self, StreamExt};

use crate::error::{Error, Result};
use crate::index::Entry;
use crate::key::BlockHash;
use crate::segment::{self, Segment};
use crate::shard::{Shard, ShardConfig};
use crate::slot::{HeaderFault, RecordKind, SlotHeader, PAGE_BYTES};

/// Header reads in flight per shard during recovery.
const SCAN_DEPTH: usize = 64;

struct Record {
    seq: u64,
    kind: RecordKind,
    hash: BlockHash,
    segment: u32,
    slot: u32,
}

/// Opens (creating if needed) the shard directory and rebuilds the shard.
///
/// # Errors
/// [`Error::Io`] when the directory or a segment cannot be read;
/// [`Error::Config`] for settings that cannot work.
pub async fn open_shard(cfg: ShardConfig) -> Result<Shard> {
    let started = Instant::now();
    fs::create_dir_all(&cfg.dir).map_err(|e| Error::io(format!("creating {}", cfg.dir.display()), e))?;
    let shard = Shard::new(cfg)?;
    let cfg = &shard.cfg;
    let mut report = shard.recovery.borrow().clone();

    let mut found: Vec<(u32, segment::Superblock, std::path::PathBuf)> = Vec::new();
    let entries = fs::read_dir(&cfg.dir).map_err(|e| Error::io(format!("listing {}", cfg.dir.display()), e))?;
    for dirent in entries {
        let dirent = dirent.map_err(|e| Error::io(format!("listing {}", cfg.dir.display()), e))?;
        let path = dirent.path();
        let name = dirent.file_name().to_string_lossy().into_owned();
        if name.ends_with(".kvt.tmp") {
            // A segment whose creation was interrupted; it was never used.
            let _ = fs::remove_file(&path);
            continue;
        }
        let Some(id) = segment::parse_segment_name(&name) else {
            report.foreign_files += 1;
            tracing::warn!(shard = cfg.shard_id, "ignoring foreign file {}", path.display());
            continue;
        };
        match segment::read_superblock(&path)? {
            Some(sb)
                if sb.shard == cfg.shard_id
                    && sb.segment_id == id
                    && sb.slot_bytes == shard.slot_bytes
                    && sb.segment_bytes == cfg.segment_bytes =>
            {
                found.push((id, sb, path))
            }
            other => {
                report.foreign_files += 1;
                tracing::warn!(
                    shard = cfg.shard_id,
                    "ignoring {}: not a segment of this store (superblock {other:?})",
                    path.display()
                );
            }
        }
    }
    found.sort_by_key(|(id, _, _)| *id);

    let mut records = Vec::new();
    let mut max_seq = 0u64;
    // (id, first_seq, highest slot used + 1, highest seq) of each segment.
    let mut lives: Vec<(u32, u64, u32, u64)> = Vec::new();
    for (id, sb, path) in &found {
        let segment = Rc::new(Segment::open(path, *id, sb.first_seq, shard.slot_bytes).await?);
        max_seq = max_seq.max(sb.first_seq);
        let slots = shard.slots_per_segment;
        let headers: Vec<(u32, Result<Result<SlotHeader, HeaderFault>>)> = stream::iter(0..slots)
            .map(|slot| {
                let segment = segment.clone();
                async move {
                    let page = segment.read_slot(slot, PAGE_BYTES).await;
                    (slot, page.map(|p| SlotHeader::decode(&p[..PAGE_BYTES as usize])))
                }
            })
            .buffer_unordered(SCAN_DEPTH)
            .collect()
            .await;
        let (mut used, mut seg_max_seq) = (0u32, 0u64);
        for (slot, header) in headers {
            report.headers_scanned += 1;
            let header = match header? {
                Ok(h) => h,
                Err(HeaderFault::Empty) => continue,
                Err(fault) => {
                    report.headers_invalid += 1;
                    tracing::warn!(shard = cfg.shard_id, segment = id, slot, "skipping invalid slot header ({fault:?})");
                    continue;
                }
            };
            if header.seq < sb.first_seq {
                continue; // left over from the segment's earlier life
            }
            let consistent = header.hash == BlockHash::of(&header.key)
                && match header.kind {
                    RecordKind::Block => header.payload_len == cfg.geometry.block_bytes,
                    RecordKind::Tombstone => header.payload_len == 0,
                };
            if !consistent {
                report.headers_invalid += 1;
                tracing::warn!(shard = cfg.shard_id, segment = id, slot, "skipping inconsistent slot header");
                continue;
            }
            match header.kind {
                RecordKind::Block => report.blocks_found += 1,
                RecordKind::Tombstone => report.tombstones_found += 1,
            }
            used = used.max(slot + 1);
            seg_max_seq = seg_max_seq.max(header.seq);
            max_seq = max_seq.max(header.seq);
            records.push(Record {
                seq: header.seq,
                kind: header.kind,
                hash: header.hash,
                segment: *id,
                slot,
            });
        }
        segment.slots_used.set(used);
        lives.push((*id, sb.first_seq, used, seg_max_seq));
        let mut segments = shard.segments.borrow_mut();
        if segments.len() <= *id as usize {
            segments.resize(*id as usize + 1, None);
        }
        segments[*id as usize] = Some(segment);
        report.segments += 1;
    }

    records.sort_unstable_by_key(|r| r.seq);
    {
        let mut index = shard.index.borrow_mut();
        for r in &records {
            match r.kind {
                RecordKind::Block => {
                    index.insert_if_newer(
                        r.hash,
                        Entry {
                            segment: r.segment,
                            slot: r.slot,
                            seq: r.seq,
                        },
                    );
                }
                RecordKind::Tombstone => {
                    index.remove_if_not_newer(&r.hash, r.seq);
                }
            }
        }
    }
    shard.next_seq.set(max_seq + 1);

    // The newest segment with room stays the head; other segments with
    // records are sealed oldest life first; the rest are free.
    let head = lives
        .iter()
        .filter(|l| l.2 > 0)
        .max_by_key(|l| l.3)
        .filter(|l| l.2 < shard.slots_per_segment)
        .map(|l| l.0);
    let mut sealed: Vec<&(u32, u64, u32, u64)> = lives.iter().filter(|l| l.2 > 0 && Some(l.0) != head).collect();
    sealed.sort_by_key(|l| l.1);
    shard.sealed.borrow_mut().extend(sealed.iter().map(|l| l.0));
    shard.free.borrow_mut().extend(lives.iter().filter(|l| l.2 == 0).map(|l| l.0).rev());
    shard.head.set(head);

    // A segment id past the disk share (the share shrank) still counts.
    report.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    tracing::info!(
        shard = cfg.shard_id,
        segments = report.segments,
        blocks = shard.index.borrow().len(),
        invalid_headers = report.headers_invalid,
        ms = report.duration_ms,
        "shard recovered"
    );
    *shard.recovery.borrow_mut() = report;
    Ok(shard)
}
