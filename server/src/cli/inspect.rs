//! `kvtier info` and `kvtier fsck`: a stopped store's geometry and usage,
//! and its every block checked.

use std::fs;
use std::path::Path;

use kvtier_engine::geometry::StoreManifest;

use super::args::*;
use super::serve::lock_data_dir;

pub(crate) fn info(dir: &Path) -> Result<(), String> {
    let manifest = StoreManifest::read(dir).map_err(|e| e.to_string())?;
    let g = &manifest.geometry;
    println!("data dir      {}", dir.display());
    println!("format        {}", manifest.format_version);
    println!("model         {}", g.model);
    println!("block_tokens  {}", g.block_tokens);
    println!("bytes/token   {}", g.bytes_per_token);
    println!("block_bytes   {}", g.block_bytes);
    println!("shards        {}", manifest.shards);
    println!("segment_bytes {}", manifest.segment_bytes);
    for shard in 0..manifest.shards {
        let shard_dir = dir.join(format!("shard-{shard:03}"));
        let (mut segments, mut bytes) = (0u64, 0u64);
        if let Ok(entries) = fs::read_dir(&shard_dir) {
            for e in entries.flatten() {
                if kvtier_engine::segment::parse_segment_name(&e.file_name().to_string_lossy()).is_some() {
                    segments += 1;
                    bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                }
            }
        }
        println!("shard {shard:03}     {segments} segments, {bytes} bytes");
    }
    Ok(())
}

/// Runs fsck; `Ok(true)` when nothing is damaged.
pub(crate) fn fsck(args: &FsckArgs) -> Result<bool, String> {
    if !StoreManifest::path(&args.data_dir).exists() {
        return Err(format!("{} is not a kvtier data directory (no store.json)", args.data_dir.display()));
    }
    let _lock = lock_data_dir(&args.data_dir)?;
    let report = kvtier_engine::fsck::fsck(&args.data_dir).map_err(|e| e.to_string())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("report serializes"));
    } else {
        println!(
            "{} segments, {} blocks checked ({} bytes), {} live, {} tombstones, {} damaged, {} foreign files",
            report.segments,
            report.blocks_checked,
            report.bytes_read,
            report.live_blocks,
            report.tombstones,
            report.damaged.len(),
            report.foreign_files.len()
        );
        for d in &report.damaged {
            println!(
                "damaged: shard {} segment {} slot {} key {} seq {} live {}: {}",
                d.shard,
                d.segment,
                d.slot,
                d.key.as_deref().unwrap_or("?"),
                d.seq.map(|s| s.to_string()).unwrap_or_else(|| "?".into()),
                d.live,
                d.problem
            );
        }
        for f in &report.foreign_files {
            println!("foreign file (ignored): {}", f.display());
        }
    }
    Ok(report.damaged.is_empty())
}
