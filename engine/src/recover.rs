//! Opening a shard: rebuild its index from its index snapshot and the slot
//! headers the snapshot does not cover.
//!
//! Without a usable snapshot, every slot header of every segment is read
//! (4 KiB each, [`SCAN_DEPTH`] in flight). With one, its entries are loaded
//! and only these segments are scanned: those that were the head or had
//! writes in flight when it was taken (`rescan`), those whose `first_seq`
//! changed since (reclaimed: their snapshot entries are stale and dropped),
//! and those created since. Scanned records below the snapshot's
//! `covered_seq` are already reflected in it (re-applying them could revive a
//! deleted block) and are skipped.
//!
//! A header counts when its CRC-32 holds, its hash matches its key, its
//! length fits its kind, and its sequence number is at least its segment's
//! `first_seq`. Records apply in sequence order, so the newest record of a key
//! wins and a tombstone removes what came before it. Payloads are not read
//! here: a payload torn by a crash fails its CRC-32 when first read, and is
//! dropped then, never served.

use std::collections::HashMap;
use std::fs;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use futures::stream::{self, StreamExt};

use crate::error::{Error, Result};
use crate::index::snapshot::{self, IndexSnapshot, SegmentState};
use crate::index::Entry;
use crate::key::BlockHash;
use crate::segment::{self, Segment, Superblock};
use crate::shard::{RecoveredLog, RecoveryReport, Shard, ShardConfig};
use crate::slot::{HeaderFault, RecordKind, SlotHeader, PAGE_BYTES};
use crate::tenant::OwnerId;

/// A shard whose device is absent ([`ShardConfig::log_absent`]): an empty
/// log, nothing read or made in its directory.
fn open_without_log(cfg: ShardConfig) -> Result<Shard> {
    let shard = Shard::new(cfg)?;
    tracing::warn!(shard = shard.id(), "shard opened without its log: {}", shard.cfg.log_absent.as_deref().unwrap_or_default());
    let log = RecoveredLog {
        segments: Vec::new(),
        max_seq: Vec::new(),
        index: shard.empty_index(),
        next_seq: 1,
        sealed: Vec::new(),
        free: Vec::new(),
        head: None,
        report: RecoveryReport { log_absent: true, ..RecoveryReport::default() },
    };
    shard.restore(log);
    shard.set_owners(shard.cfg.owners.clone());
    Ok(shard)
}

/// Header reads in flight per shard during recovery.
pub const SCAN_DEPTH: usize = 64;

struct Record {
    seq: u64,
    kind: RecordKind,
    hash: BlockHash,
    segment: u32,
    slot: u32,
    owner: OwnerId,
    /// The block's encoded tag (empty: none).
    tag: Vec<u8>,
}

/// What a shard's directory holds, read on the blocking pool: its
/// segments ([`list_segments`]), its snapshot ([`load_snapshot`]), and what
/// reading them found.
struct Listing {
    found: Vec<(u32, Superblock, PathBuf)>,
    snap: Option<IndexSnapshot>,
    report: RecoveryReport,
}

/// Lists the shard's segments in each of its directories and reads its
/// snapshot (in `cfg.dir`) with std I/O on the executor's blocking pool
/// (directory listing, superblock reads, a truncated segment's `fallocate`
/// and fsync, a discarded log's deletions: never on the shard's thread).
async fn read_directory(cfg: &ShardConfig, slot_bytes: u64) -> Result<Listing> {
    let (dir, shard_id, segment_bytes, store_id) = (cfg.dir.clone(), cfg.shard_id, cfg.segment_bytes, cfg.store_id);
    let dirs = if cfg.segment_dirs.is_empty() { vec![dir.clone()] } else { cfg.segment_dirs.clone() };
    let discard = cfg.discard_log.clone();
    glommio::executor()
        .spawn_blocking(move || {
            let mut report = RecoveryReport::default();
            if let Some(why) = &discard {
                discard_log(&dirs, shard_id, why)?;
            }
            let mut found = Vec::new();
            for (lane, d) in dirs.iter().enumerate() {
                let lanes = (lane, dirs.len());
                found.extend(list_segments(d, lanes, shard_id, slot_bytes, segment_bytes, &store_id, &mut report)?);
            }
            found.sort_by_key(|(id, _, _)| *id);
            let snap = load_snapshot(&dir, shard_id, &mut report);
            Ok(Listing { found, snap, report })
        })
        .await
}

/// Deletes the shard's segment files and snapshot in each of `dirs`
/// (`ShardConfig::discard_log`, which says `why`), logging what it drops.
///
/// # Errors
/// [`Error::Io`] when a directory cannot be listed or a file removed.
pub(crate) fn discard_log(dirs: &[PathBuf], shard_id: u32, why: &str) -> Result<()> {
    let mut dropped = 0u64;
    for dir in dirs {
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
        };
        for dirent in entries {
            let dirent = dirent.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            let name = dirent.file_name().to_string_lossy().into_owned();
            if segment::parse_segment_name(&name).is_some() || name == snapshot::FILE {
                fs::remove_file(dirent.path()).map_err(|e| Error::io(format!("removing {}", dirent.path().display()), e))?;
                dropped += 1;
            }
        }
        crate::geometry::fsync_dir(dir)?;
    }
    tracing::warn!(shard = shard_id, files = dropped, "{why}: the shard starts with an empty log");
    Ok(())
}

/// Segment files of a shard directory whose superblock belongs to this
/// shard, geometry and store, and whose id belongs in this directory (lane
/// `lanes.0` of `lanes.1`: segment `i` in lane `i mod lanes.1`); others
/// are counted as foreign (a segment of another store is never read: its
/// blocks are not this store's).
fn list_segments(
    dir: &Path,
    lanes: (usize, usize),
    shard_id: u32,
    slot_bytes: u64,
    segment_bytes: u64,
    store_id: &crate::segment::StoreId,
    report: &mut RecoveryReport,
) -> Result<Vec<(u32, Superblock, PathBuf)>> {
    let mut found = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
    for dirent in entries {
        let dirent = dirent.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        let path = dirent.path();
        let name = dirent.file_name().to_string_lossy().into_owned();
        if name.ends_with(".kvt.tmp") || name == format!("{}.tmp", snapshot::FILE) {
            // Interrupted creation of a segment or a snapshot: never used.
            let _ = fs::remove_file(&path);
            continue;
        }
        if name == snapshot::FILE {
            continue;
        }
        let Some(id) = segment::parse_segment_name(&name) else {
            report.foreign_files += 1;
            tracing::warn!(shard = shard_id, "ignoring foreign file {}", path.display());
            continue;
        };
        match segment::read_superblock(&path)? {
            Some(sb) if id as usize % lanes.1 != lanes.0 => {
                report.foreign_files += 1;
                tracing::warn!(
                    shard = shard_id,
                    "ignoring {}: segment {} of this shard belongs on device lane {} of {}, not {} (superblock {sb:?})",
                    path.display(),
                    id,
                    id as usize % lanes.1,
                    lanes.1,
                    lanes.0
                );
            }
            Some(sb) if sb.belongs_to(shard_id, id, slot_bytes, segment_bytes, store_id) => {
                restore_length(&path, segment_bytes, shard_id, report)?;
                found.push((id, sb, path));
            }
            other => {
                report.foreign_files += 1;
                tracing::warn!(shard = shard_id, "ignoring {}: not a segment of this store (superblock {other:?})", path.display());
            }
        }
    }
    Ok(found)
}

/// A segment file shorter than `segment_bytes` was truncated (by hand, a
/// copy cut short, a filesystem repair): the slots past its end are gone.
/// Its length is restored (preallocated, else sparse) so that every slot
/// reads back, the lost ones as empty and the one cut in half as a block
/// whose CRC-32 fails; counted and logged.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or extended.
fn restore_length(path: &Path, segment_bytes: u64, shard_id: u32, report: &mut RecoveryReport) -> Result<()> {
    let io = |e| Error::io(format!("restoring the length of {}", path.display()), e);
    let f = fs::OpenOptions::new().write(true).open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len >= segment_bytes {
        return Ok(());
    }
    report.segments_truncated += 1;
    tracing::warn!(
        shard = shard_id,
        "{} is truncated ({len} of {segment_bytes} bytes): slots past byte {len} are lost; restoring its length",
        path.display()
    );
    // SAFETY: fallocate on an fd we own; mode 0 allocates and extends.
    let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, segment_bytes as libc::off_t) };
    if rc != 0 {
        f.set_len(segment_bytes).map_err(io)?;
    }
    f.sync_all().map_err(io)
}

/// Reads `index.snapshot`; `None` (counted, logged) when absent or unusable.
fn load_snapshot(dir: &Path, shard_id: u32, report: &mut RecoveryReport) -> Option<IndexSnapshot> {
    let path = dir.join(snapshot::FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            report.snapshot_invalid = true;
            tracing::warn!(shard = shard_id, "cannot read {}: {e}; scanning every header", path.display());
            return None;
        }
    };
    match snapshot::decode(&bytes) {
        Ok(s) if s.shard == shard_id => Some(s),
        Ok(s) => {
            report.snapshot_invalid = true;
            tracing::warn!(shard = shard_id, "{} belongs to shard {}; scanning every header", path.display(), s.shard);
            None
        }
        Err(why) => {
            report.snapshot_invalid = true;
            tracing::warn!(shard = shard_id, "ignoring damaged {} ({why}); scanning every header", path.display());
            None
        }
    }
}

/// Reads the slot headers of `segment` from `from_slot` on, returning the
/// valid records of its current life and counting the invalid ones.
async fn scan_segment(shard: &Shard, segment: &Rc<Segment>, from_slot: u32, report: &mut RecoveryReport) -> Result<Vec<Record>> {
    let first_seq = segment.first_seq.get();
    let headers: Vec<(u32, Result<Result<SlotHeader, HeaderFault>>)> = stream::iter(from_slot..shard.slots_per_segment)
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
    report.segments_scanned += 1;
    let mut records = Vec::new();
    for (slot, header) in headers {
        report.headers_scanned += 1;
        let header = match header? {
            Ok(h) => h,
            Err(HeaderFault::Empty) => continue,
            Err(fault) => {
                report.headers_invalid += 1;
                tracing::warn!(shard = shard.id(), segment = segment.id, slot, "skipping invalid slot header ({fault:?})");
                continue;
            }
        };
        if header.seq < first_seq {
            continue; // left over from the segment's earlier life
        }
        let key = match header.stored_key() {
            Some(key) if header.is_consistent(shard.cfg.geometry.block_bytes) => key,
            _ => {
                report.headers_invalid += 1;
                tracing::warn!(shard = shard.id(), segment = segment.id, slot, "skipping inconsistent slot header");
                continue;
            }
        };
        let owner = shard.owner_of(&key);
        records.push(Record { seq: header.seq, kind: header.kind, hash: header.hash, segment: segment.id, slot, owner, tag: header.tag });
    }
    Ok(records)
}

/// Opens (creating if needed) the shard directory and rebuilds the shard.
///
/// # Errors
/// [`Error::Io`] when the directory or a segment cannot be read;
/// [`Error::Config`] for settings that cannot work.
pub async fn open_shard(cfg: ShardConfig) -> Result<Shard> {
    if cfg.log_absent.is_some() {
        return open_without_log(cfg);
    }
    let dirs = if cfg.segment_dirs.is_empty() { vec![cfg.dir.clone()] } else { cfg.segment_dirs.clone() };
    glommio::executor()
        .spawn_blocking(move || {
            dirs.iter().try_for_each(|dir| fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e)))
        })
        .await?;
    // Mapping the RAM tier is set-up, not recovery: the clock starts after.
    let shard = Shard::new(cfg)?;
    let started = Instant::now();
    let Listing { found, snap, mut report } = read_directory(&shard.cfg, shard.slot_bytes).await?;
    report.snapshot_loaded = snap.is_some();
    let covered_seq = snap.as_ref().map_or(0, |s| s.covered_seq);
    let snap_segments: HashMap<u32, &SegmentState> = snap.iter().flat_map(|s| s.segments.iter().map(|g| (g.id, g))).collect();

    let mut next_seq = snap.as_ref().map_or(1, |s| s.next_seq);
    let mut segments: Vec<Option<Rc<Segment>>> = Vec::new();
    let mut max_seqs: Vec<u64> = Vec::new();
    let mut records = Vec::new();
    // Segments whose snapshot entries are valid, with their first_seq: an
    // entry below it was being moved by a compaction and is stale.
    let mut fresh: HashMap<u32, u64> = HashMap::new();
    // (id, first_seq, slots used, highest seq) of each segment.
    let mut lives: Vec<(u32, u64, u32, u64)> = Vec::new();
    for (id, sb, path) in &found {
        let fault = shard.cfg.fault_switch(*id);
        let segment = Rc::new(Segment::open(path, *id, sb.first_seq, shard.slot_bytes, shard.slots_per_segment, fault).await?);
        next_seq = next_seq.max(sb.first_seq);
        let same_life = snap_segments.get(id).filter(|s| s.first_seq == sb.first_seq);
        let (mut used, mut max_seq) = same_life.map_or((0, 0), |s| (s.slots_used, s.max_seq));
        if same_life.is_some() {
            fresh.insert(*id, sb.first_seq);
        }
        if same_life.is_none_or(|s| s.rescan) {
            let from_slot = same_life.map_or(0, |s| s.scan_from_slot);
            for r in scan_segment(&shard, &segment, from_slot, &mut report).await? {
                used = used.max(r.slot + 1);
                max_seq = max_seq.max(r.seq);
                if r.seq >= covered_seq {
                    records.push(r);
                }
            }
        }
        next_seq = next_seq.max(max_seq + 1);
        segment.slots_used.set(used);
        lives.push((*id, sb.first_seq, used, max_seq));
        if segments.len() <= *id as usize {
            segments.resize(*id as usize + 1, None);
            max_seqs.resize(*id as usize + 1, 0);
        }
        segments[*id as usize] = Some(segment);
        max_seqs[*id as usize] = max_seq;
        report.segments += 1;
    }

    records.sort_unstable_by_key(|r| r.seq);
    let mut index = shard.empty_index();
    {
        // The snapshot names owners by its own ids: map them through names
        // to this process's (an owner no longer known is the default one).
        let owner_ids: Vec<OwnerId> =
            snap.as_ref().map(|s| s.owners.iter().map(|name| shard.owners().id_of(name).unwrap_or(0)).collect()).unwrap_or_default();
        // Tags first, so the blocks' arrivals in the log are tracked (and
        // published once the shard serves: `crate::events`).
        let tag = |t: &[u8]| (!t.is_empty()).then(|| bytes::Bytes::copy_from_slice(t));
        for t in snap.iter().flat_map(|s| s.tags.iter()) {
            shard.residency().set_tag(BlockHash(((t.hash_hi as u128) << 64) | t.hash_lo as u128), tag(&t.tag));
        }
        for e in snap.iter().flat_map(|s| s.entries.iter()).filter(|e| fresh.get(&e.segment).is_some_and(|first| e.seq >= *first)) {
            let hash = BlockHash(((e.hash_hi as u128) << 64) | e.hash_lo as u128);
            let owner = owner_ids.get(e.owner as usize).copied().unwrap_or(0);
            index.insert_if_newer(hash, Entry { segment: e.segment, slot: e.slot, seq: e.seq, owner });
            report.snapshot_entries += 1;
        }
        for r in &records {
            match r.kind {
                RecordKind::Block => {
                    report.blocks_found += 1;
                    shard.residency().set_tag(r.hash, tag(&r.tag));
                    index.insert_if_newer(r.hash, Entry { segment: r.segment, slot: r.slot, seq: r.seq, owner: r.owner });
                }
                RecordKind::Tombstone => {
                    report.tombstones_found += 1;
                    index.remove_if_not_newer(&r.hash, r.seq);
                }
            }
        }
    }

    // The newest segment with room stays the head; other segments with
    // records are sealed oldest life first; the rest are free.
    let head = lives.iter().filter(|l| l.2 > 0).max_by_key(|l| l.3).filter(|l| l.2 < shard.slots_per_segment).map(|l| l.0);
    let mut sealed: Vec<&(u32, u64, u32, u64)> = lives.iter().filter(|l| l.2 > 0 && Some(l.0) != head).collect();
    sealed.sort_by_key(|l| l.1);
    let sealed: Vec<u32> = sealed.iter().map(|l| l.0).collect();
    let free: Vec<u32> = lives.iter().filter(|l| l.2 == 0).map(|l| l.0).rev().collect();

    report.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    tracing::info!(
        shard = shard.id(),
        segments = report.segments,
        scanned = report.segments_scanned,
        snapshot = report.snapshot_loaded,
        blocks = index.len(),
        invalid_headers = report.headers_invalid,
        ms = report.duration_ms,
        "shard recovered"
    );
    shard.restore(RecoveredLog { segments, max_seq: max_seqs, index, next_seq, sealed, free, head, report });
    shard.set_owners(shard.cfg.owners.clone());
    Ok(shard)
}
