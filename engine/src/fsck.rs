//! Offline verification of a data directory: every slot header and every
//! payload CRC-32 of every segment, with the exact list of damaged records.
//!
//! Runs with std I/O on a store no process has open (the CLI holds the data
//! directory's lock while it runs). It reads what recovery reads, then also
//! every payload of the current life of each segment, and decides which
//! records are live (the newest record of their key, not deleted) the way
//! recovery does, so a damaged block that nothing would serve anyway is told
//! apart from one a client would miss.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::geometry::StoreManifest;
use crate::key::BlockHash;
use crate::segment::{self, Superblock};
use crate::slot::{self, HeaderFault, RecordKind, SlotHeader, PAGE_BYTES};

/// One damaged record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Damage {
    /// Shard id.
    pub shard: u32,
    /// Segment id.
    pub segment: u32,
    /// Slot index.
    pub slot: u32,
    /// The key, when the header was readable.
    pub key: Option<String>,
    /// The record's sequence number, when the header was readable.
    pub seq: Option<u64>,
    /// The record was the newest of its key: a client would have missed it.
    pub live: bool,
    /// What is wrong.
    pub problem: String,
}

/// What `fsck` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FsckReport {
    /// Segment files checked.
    pub segments: u64,
    /// Block records of current segment lives whose payload was checked.
    pub blocks_checked: u64,
    /// Blocks a restart would serve (newest record of their key, intact).
    pub live_blocks: u64,
    /// Tombstones found.
    pub tombstones: u64,
    /// Payload bytes read.
    pub bytes_read: u64,
    /// Damaged records, in shard, segment, slot order.
    pub damaged: Vec<Damage>,
    /// Files in shard directories that are not segments of this store.
    pub foreign_files: Vec<PathBuf>,
    /// Devices absent ([`crate::devices::Device::absent`]): their shards
    /// were not checked.
    pub devices_absent: Vec<u32>,
}

struct Record {
    seq: u64,
    hash: BlockHash,
    kind: RecordKind,
    at: (u32, u32),
    intact: bool,
}

/// Checks every segment of the store in `data_dir` (one directory).
///
/// # Errors
/// [`Error::Io`] when a file cannot be read; [`Error::Config`] when
/// `store.json` is missing or unreadable.
pub fn fsck(data_dir: &Path) -> Result<FsckReport> {
    fsck_layout(&crate::devices::Layout::single(data_dir, 0))
}

/// Checks every segment of the store on `layout`'s devices (each shard in
/// its device's directory; [`crate::devices::Layout::resolve`]); an absent
/// device's shards are not checked, and the device is listed in
/// `devices_absent`.
///
/// # Errors
/// As [`fsck`], for any of the directories.
pub fn fsck_layout(layout: &crate::devices::Layout) -> Result<FsckReport> {
    let present = layout.devices.iter().find(|d| d.absent.is_none()).unwrap_or(&layout.devices[0]);
    let manifest = StoreManifest::read(&present.dir)?;
    let block_bytes = manifest.geometry.block_bytes;
    let slot_bytes = slot::slot_bytes(block_bytes);
    let slots = ((manifest.segment_bytes - PAGE_BYTES) / slot_bytes) as u32;
    let store_id = crate::segment::store_id_bytes(manifest.store_id.as_deref());
    let mut report = FsckReport { devices_absent: layout.absent().map(|d| d.index).collect(), ..FsckReport::default() };
    let shards = manifest.shards as usize;
    for shard in 0..manifest.shards {
        if layout.shard_absent(shard as usize, shards).is_some() {
            continue; // a shard on an absent device has nothing here to check
        }
        // One directory per device the shard spans; segment i in the
        // (i mod lanes)-th (crate::devices).
        let dirs = layout.shard_dirs(shard as usize, shards);
        let mut files: Vec<(u32, PathBuf)> = Vec::new();
        for (lane, dir) in dirs.iter().enumerate() {
            let Ok(entries) = fs::read_dir(dir) else { continue };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                match segment::parse_segment_name(&name) {
                    Some(id) if id as usize % dirs.len() == lane => files.push((id, e.path())),
                    None if name == crate::index::snapshot::FILE || name == "LOCK" => {}
                    _ => report.foreign_files.push(e.path()),
                }
            }
        }
        files.sort();
        let mut records = Vec::new();
        let mut damaged = Vec::new();
        for (id, path) in files {
            let sb = match segment::read_superblock(&path)? {
                Some(sb) if sb.belongs_to(shard, id, slot_bytes, manifest.segment_bytes, &store_id) => sb,
                _ => {
                    report.foreign_files.push(path);
                    continue;
                }
            };
            report.segments += 1;
            check_segment(&path, &sb, shard, slots, block_bytes, &mut report, &mut records, &mut damaged)?;
        }
        // Decide liveness as recovery does: newest record per key wins.
        records.sort_unstable_by_key(|r| r.seq);
        let mut newest: HashMap<BlockHash, &Record> = HashMap::new();
        for r in &records {
            match r.kind {
                RecordKind::Block => {
                    newest.insert(r.hash, r);
                }
                RecordKind::Tombstone => {
                    newest.remove(&r.hash);
                }
            }
        }
        report.live_blocks += newest.values().filter(|r| r.intact).count() as u64;
        for d in &mut damaged {
            d.live = d.seq.is_some() && newest.values().any(|r| r.at == (d.segment, d.slot) && Some(r.seq) == d.seq);
        }
        report.damaged.extend(damaged);
    }
    Ok(report)
}

#[allow(clippy::too_many_arguments)]
fn check_segment(
    path: &Path,
    sb: &Superblock,
    shard: u32,
    slots: u32,
    block_bytes: u64,
    report: &mut FsckReport,
    records: &mut Vec<Record>,
    damaged: &mut Vec<Damage>,
) -> Result<()> {
    let file = fs::File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let len = file.metadata().map_err(|e| Error::io(format!("stat of {}", path.display()), e))?.len();
    let mut page = vec![0u8; PAGE_BYTES as usize];
    let mut payload = vec![0u8; block_bytes as usize];
    for slot in 0..slots {
        let at = PAGE_BYTES + slot as u64 * sb.slot_bytes;
        let damage = |problem: String, header: Option<&SlotHeader>| Damage {
            shard,
            segment: sb.segment_id,
            slot,
            key: header.map(|h| String::from_utf8_lossy(&h.key).into_owned()),
            seq: header.map(|h| h.seq),
            live: false,
            problem,
        };
        if at + PAGE_BYTES > len {
            break; // truncated file: nothing past here was written
        }
        file.read_exact_at(&mut page, at).map_err(|e| Error::io(format!("reading {} at {at}", path.display()), e))?;
        let header = match SlotHeader::decode(&page) {
            Ok(h) => h,
            Err(HeaderFault::Empty) => continue,
            Err(fault) => {
                damaged.push(damage(format!("slot header invalid ({fault:?})"), None));
                continue;
            }
        };
        if header.seq < sb.first_seq {
            continue; // an earlier life of the segment
        }
        match header.kind {
            RecordKind::Tombstone => report.tombstones += 1,
            RecordKind::Block => report.blocks_checked += 1,
        }
        if !header.is_consistent(block_bytes) {
            // Recovery skips such a record, so it takes no part in liveness.
            damaged.push(damage("slot header inconsistent with its key or the block size".into(), Some(&header)));
            continue;
        }
        let intact = match header.kind {
            RecordKind::Tombstone => true,
            RecordKind::Block => {
                if at + PAGE_BYTES + block_bytes > len {
                    damaged.push(damage("payload truncated".into(), Some(&header)));
                    false
                } else {
                    file.read_exact_at(&mut payload, at + PAGE_BYTES)
                        .map_err(|e| Error::io(format!("reading {} at {}", path.display(), at + PAGE_BYTES), e))?;
                    report.bytes_read += block_bytes;
                    let fault = slot::payload_fault(&header, &payload);
                    if let Some(why) = &fault {
                        damaged.push(damage(why.clone(), Some(&header)));
                    }
                    fault.is_none()
                }
            }
        };
        records.push(Record { seq: header.seq, hash: header.hash, kind: header.kind, at: (sb.segment_id, slot), intact });
    }
    Ok(())
}
