//! `kvtier info` and `kvtier fsck`: a stopped store's geometry and usage,
//! and its every block checked.

use std::fs;

use kvtier_engine::geometry::StoreManifest;

use super::args::*;
use super::serve::lock_data_dir;

pub(crate) fn info(specs: &[kvtier_engine::devices::DeviceSpec]) -> Result<(), String> {
    let layout = existing_layout(specs)?;
    let present = layout.devices.iter().find(|d| d.absent.is_none()).expect("a layout has a present device");
    let manifest = StoreManifest::read(&present.dir).map_err(|e| e.to_string())?;
    let g = &manifest.geometry;
    match layout.devices.as_slice() {
        [one] => println!("data dir      {}", one.dir.display()),
        all => {
            for d in all {
                if let Some(why) = &d.absent {
                    println!("data dir      absent: device {}, filesystem {} ({why})", d.index, d.fs_id);
                    continue;
                }
                println!(
                    "data dir      {} (device {}, filesystem {}, {} bytes of segments)",
                    d.dir.display(),
                    d.index,
                    d.fs_id,
                    d.capacity_bytes
                );
            }
        }
    }
    if let Some(id) = &manifest.store_id {
        println!("store id      {id}");
    }
    println!("format        {}", manifest.format_version);
    println!("model         {}", g.model);
    println!("block_tokens  {}", g.block_tokens);
    println!("bytes/token   {}", g.bytes_per_token);
    println!("block_bytes   {}", g.block_bytes);
    println!("shards        {}", manifest.shards);
    println!("segment_bytes {}", manifest.segment_bytes);
    let shards = manifest.shards as usize;
    for shard in 0..shards {
        if let Some(why) = layout.shard_absent(shard, shards) {
            println!("shard {shard:03}     absent: {why}");
            continue;
        }
        let (mut segments, mut bytes) = (0u64, 0u64);
        for shard_dir in layout.shard_dirs(shard, shards) {
            if let Ok(entries) = fs::read_dir(&shard_dir) {
                for e in entries.flatten() {
                    if kvtier_engine::segment::parse_segment_name(&e.file_name().to_string_lossy()).is_some() {
                        segments += 1;
                        bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
                    }
                }
            }
        }
        let devices: Vec<u32> = layout.devices_of(shard, shards).iter().map(|d| d.index).collect();
        let on = match devices.as_slice() {
            [one] => format!("device {one}"),
            all => format!("devices {all:?}"),
        };
        println!("shard {shard:03}     {segments} segments, {bytes} bytes ({on})");
    }
    Ok(())
}

/// Runs fsck; `Ok(true)` when nothing is damaged and no device is absent
/// (an absent device's shards were not checked).
pub(crate) fn fsck(args: &FsckArgs) -> Result<bool, String> {
    let layout = existing_layout(&args.data_dirs)?;
    let _locks = layout.devices.iter().filter(|d| d.absent.is_none()).map(|d| lock_data_dir(&d.dir)).collect::<Result<Vec<_>, _>>()?;
    for d in layout.absent() {
        eprintln!("device {} is absent ({}): its shards' segments are not checked", d.index, d.absent.as_deref().unwrap_or_default());
    }
    let report = kvtier_engine::fsck::fsck_layout(&layout).map_err(|e| e.to_string())?;
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
    Ok(report.damaged.is_empty() && report.devices_absent.is_empty())
}
