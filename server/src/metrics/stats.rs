//! `/v1/stats`: the engine's snapshot, every front door's counters
//! ([`super::Door`]), the remote tier's, the owners', as one JSON object
//! (docs/API.md).

use kvtier_engine::shard::{owner_totals, OwnerShardStats};
use kvtier_engine::tenant::QuotaTier;
use kvtier_engine::ShardStats;
use serde_json::{json, Value};

use super::{EngineSnapshot, Metrics, Parts};

impl Metrics {
    /// The `/v1/stats` body: `snapshot` (the store's `shard_count` shards),
    /// every door's section under its name, and `caller`, the calling
    /// tenant's name (null without `--tenants`).
    pub fn stats_json(&self, snapshot: &EngineSnapshot, shard_count: usize, caller: Option<&str>) -> Value {
        let Parts { doors, geometry, remote, stalls, .. } = self.parts();
        let EngineSnapshot { engine: shards, health, trace, devices } = snapshot;
        let sum = |f: fn(&ShardStats) -> u64| shards.iter().map(f).sum::<u64>();
        let body = json!({
            "geometry": geometry,
            "shards": shard_count,
            "totals": {
                "blocks": sum(|s| s.blocks),
                "capacity_blocks": sum(|s| s.capacity_blocks),
                "disk_bytes": sum(|s| s.disk_bytes),
                "puts": sum(|s| s.puts),
                "gets": sum(|s| s.gets),
                "hits": sum(|s| s.hits),
                "misses": sum(|s| s.misses),
                "deletes": sum(|s| s.deletes),
                "corrupt_blocks": sum(|s| s.corrupt_blocks),
                "disk_full_refusals": sum(|s| s.disk_full_refusals),
                "io_queue_refusals": sum(|s| s.io_queue_refusals),
                // Every front door's refusals (one budget per shard).
                "put_bytes_refusals": doors.iter().map(|d| d.put_bytes_refusals()).sum::<u64>(),
                "invalid_headers_at_start": sum(|s| s.recovery.headers_invalid),
                "foreign_files_at_start": sum(|s| s.recovery.foreign_files),
                "truncated_segments_at_start": sum(|s| s.recovery.segments_truncated),
                "invalid_snapshots_at_start": sum(|s| s.recovery.snapshot_invalid as u64),
                "evicted_blocks": sum(|s| s.evicted_blocks),
                "bytes_written": sum(|s| s.bytes_written),
                "writes_from_ram": sum(|s| s.writes_from_ram),
                "bytes_read": sum(|s| s.bytes_read),
            },
            "write_policy": shards.first().map(|s| s.write_policy),
            "promote": shards.first().map(|s| s.promote),
            "tiers": kvtier_engine::shard::tier_totals(shards),
            "health": health,
            "devices": devices,
            "per_shard": shards,
            "trace": trace,
            "tenants": owners_json(shards, geometry.block_bytes),
            // The calling tenant (its token's), null without --tenants.
            "tenant": caller,
        });
        let mut body = body;
        for door in doors {
            body[door.name()] = door.stats_json();
        }
        if let Some(remote) = remote {
            body[remote.name()] = remote.stats_json();
        }
        // Read from the shared counters: a stalled shard's show too.
        body["stalls"] = match stalls {
            Some(s) => {
                let per_shard = s.shard_stats();
                json!({
                    "threshold_ms": s.threshold().as_secs_f64() * 1e3,
                    "stalls": per_shard.iter().map(|p| p.stalls).sum::<u64>(),
                    "machine": per_shard.iter().map(|p| p.machine).sum::<u64>(),
                    "longest_ms": per_shard.iter().map(|p| p.longest_ms).fold(0.0, f64::max),
                    "reports_dropped": s.reports_dropped(),
                    "per_shard": per_shard,
                })
            }
            None => Value::Null,
        };
        body
    }
}

/// Each block owner summed over shards, as `/v1/stats` and the admin route
/// show it: per tier (`gpu`, `ram`, `nvme`) blocks and bytes held, bytes
/// reserved and the limit (this store's shares in whole blocks; a tier
/// without a limit shows its size), evictions by the owner's own pressure
/// or by another's; GETs' hits and misses; prefix lookups' keys asked and
/// hits, and the hit rates (null before any).
pub fn owners_json(shards: &[ShardStats], block_bytes: u64) -> Vec<Value> {
    owner_totals(shards).iter().map(|o| owner_json(o, block_bytes)).collect()
}

fn owner_json(o: &OwnerShardStats, block_bytes: u64) -> Value {
    let c = &o.counters;
    let rate = |n: u64, d: u64| if d == 0 { Value::Null } else { json!(n as f64 / d as f64) };
    let mut tiers = serde_json::Map::new();
    for t in QuotaTier::ALL {
        let i = t as usize;
        tiers.insert(
            t.as_str().into(),
            json!({
                "blocks": o.blocks[i],
                "bytes": o.blocks[i] * block_bytes,
                "reserved_bytes": o.reserved_blocks[i] * block_bytes,
                "limit_bytes": o.limit_blocks[i] * block_bytes,
                "evicted_own": c.evicted_own[i],
                "evicted_by_other": c.evicted_by_other[i],
            }),
        );
    }
    json!({
        "name": o.name,
        "configured": o.configured,
        "tiers": tiers,
        "hits": c.hits,
        "misses": c.misses,
        "hit_rate": rate(c.hits, c.hits + c.misses),
        "lookup_keys": c.lookup_keys,
        "prefix_hits": c.prefix_hits,
        "prefix_hit_rate": rate(c.prefix_hits, c.lookup_keys),
    })
}
