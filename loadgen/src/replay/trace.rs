//! The trace a replay writes with `--trace-out` (the format of
//! `kvtier serve --trace-dir`, docs/TRACE.md), as the client saw each
//! operation.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvtier_engine::key::BlockHash;
use kvtier_engine::trace::{Record, TraceHeader, TraceOp, TraceTier, TraceWriter};

use crate::target::Target;

/// The trace a replay writes (`--trace-out`).
pub(super) struct ClientTrace {
    writer: Option<TraceWriter>,
    path: PathBuf,
    started: Instant,
    shards: usize,
    error: Option<String>,
}

impl ClientTrace {
    /// Creates the trace file at `path` with the header of a replay against
    /// `target` of blocks `(block_bytes, block_tokens, model)`.
    ///
    /// # Errors
    /// `--trace-out PATH: reason` when the file cannot be created.
    pub(super) async fn create(path: &Path, target: &Target, block: (u64, u64, &str)) -> Result<Self, String> {
        let header = trace_header(target, block.0, block.1, block.2).await;
        let writer = TraceWriter::create(path, &header).map_err(|e| format!("--trace-out {}: {e}", path.display()))?;
        Ok(ClientTrace {
            writer: Some(writer),
            path: path.to_path_buf(),
            started: Instant::now(),
            shards: header.shards as usize,
            error: None,
        })
    }

    /// Flushes and closes the file; the first write error of the run, if
    /// any, as `--trace-out PATH: reason`.
    pub(super) fn finish(&mut self) -> Option<String> {
        if let Some(w) = self.writer.take() {
            if let Err(e) = w.finish() {
                self.error.get_or_insert(e.to_string());
            }
        }
        self.error.as_ref().map(|e| format!("--trace-out {}: {e}", self.path.display()))
    }

    /// Appends one call's records (a failed write is kept and reported at
    /// the end; the run goes on).
    pub(super) fn record<'a>(&mut self, op: TraceOp, keys: impl IntoIterator<Item = (&'a str, TraceTier)>) {
        let Some(writer) = self.writer.as_mut().filter(|_| self.error.is_none()) else { return };
        let time_us = self.started.elapsed().as_micros() as u64;
        let mut buf = Vec::new();
        for (pos, (key, tier)) in keys.into_iter().enumerate() {
            let hash = BlockHash::of(key.as_bytes());
            let shard = hash.shard(self.shards) as u16;
            Record { time_us, hash, op, tier, shard, pos: pos as u32 }.encode(&mut buf);
        }
        if let Err(e) = writer.write_encoded(&buf) {
            self.error = Some(e.to_string());
        }
    }
}

/// The trace header of a replay against `target`: the server's shards and
/// tier sizes when it is kvtier with `/v1/stats` (the local socket's shards
/// from its `HELLO` otherwise), one shard and no memory tiers for Redis and
/// the model target.
async fn trace_header(target: &Target, block_bytes: u64, block_tokens: u64, model: &str) -> TraceHeader {
    let stats = target.stats().await.ok();
    // The local socket's HELLO names the shards even without `?http=`.
    let hello_shards = match target {
        Target::Local(l) => Some(l.hello().shards),
        _ => None,
    };
    let shards = stats.as_ref().and_then(|v| v["shards"].as_u64()).or(hello_shards).unwrap_or(1).max(1);
    let capacity = |tier: &str| {
        stats.as_ref().and_then(|v| v["per_shard"][0]["tiers"].as_array()?.iter().find(|t| t["tier"] == tier)?["capacity_blocks"].as_u64())
    };
    TraceHeader {
        gpu_blocks_per_shard: capacity("gpu").unwrap_or(0),
        ram_blocks_per_shard: capacity("ram").unwrap_or(0),
        disk_bytes: stats.as_ref().and_then(|v| v["totals"]["disk_bytes"].as_u64()).unwrap_or(0),
        write_policy: stats.as_ref().and_then(|v| v["write_policy"].as_str().map(str::to_string)).unwrap_or_else(|| "through".into()),
        promote: stats.as_ref().and_then(|v| v["promote"].as_bool()).unwrap_or(true),
        ..TraceHeader::new(&format!("kvtier-loadgen replay ({})", target.url()), model, block_bytes, block_tokens as u32, shards as u32)
    }
}

/// The tier a read answered from, in the trace's terms.
pub(super) fn trace_tier(tier: &str) -> TraceTier {
    match tier {
        "gpu" => TraceTier::In(kvtier_engine::Tier::Gpu),
        "ram" => TraceTier::In(kvtier_engine::Tier::Ram),
        "nvme" => TraceTier::In(kvtier_engine::Tier::Nvme),
        "s3" => TraceTier::In(kvtier_engine::Tier::Remote),
        _ => TraceTier::None,
    }
}
