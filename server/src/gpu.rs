//! `--gpu-mem-gb`, `--gpu-device`, `--gpu-optional`: opening the GPU tier's
//! device before the shards start, and refusing the start with a message
//! that says what is missing (no driver, no device, too little memory)
//! unless the tier is optional.

use kvtier_engine::gpu::{GpuConfig, GpuDevice, GpuUnavailable, GpuUnavailableKind};
use kvtier_engine::StoreConfig;

/// The GPU flags of `kvtier serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuArgs {
    /// GPU tier across all shards, in GiB (2^30 bytes) of device memory,
    /// above the RAM tier (placement GPU → RAM → NVMe); 0 turns it off. Each
    /// shard gets gpu / shards / block_bytes slots, allocated with
    /// cuMemAlloc in up to 4 slabs as the tier fills. Needs the NVIDIA
    /// driver (libcuda.so.1) and a device: without them the server refuses
    /// to start, unless --gpu-optional.
    #[arg(long, default_value_t = 0.0)]
    pub gpu_mem_gb: f64,
    /// CUDA device ordinal of the GPU tier.
    #[arg(long, default_value_t = 0)]
    pub gpu_device: usize,
    /// With --gpu-mem-gb: when there is no driver or device, or the device
    /// cannot hold the tier, run without the GPU tier (said at start, in the
    /// log and in /v1/stats) instead of refusing to start.
    #[arg(long)]
    pub gpu_optional: bool,
}

impl GpuArgs {
    /// Opens the device for `config` (which has the geometry and shard
    /// count). Returns the GPU settings and a line for the start-up
    /// message (`None` when no tier was asked for).
    ///
    /// # Errors
    /// A flag out of range, or (without `--gpu-optional`) no driver, no
    /// device, or a device smaller than the tier.
    pub fn open(&self, config: &StoreConfig) -> Result<(GpuConfig, Option<String>), String> {
        if !(self.gpu_mem_gb.is_finite() && self.gpu_mem_gb >= 0.0) {
            return Err(format!("--gpu-mem-gb must be 0 or more, got {}", self.gpu_mem_gb));
        }
        if self.gpu_mem_gb == 0.0 {
            return Ok((GpuConfig::default(), None));
        }
        let bytes = (self.gpu_mem_gb * (1u64 << 30) as f64) as u64;
        let block_bytes = config.geometry.block_bytes;
        let blocks_per_shard = (bytes / config.shards.max(1) as u64 / block_bytes).min(u32::MAX as u64) as u32;
        if blocks_per_shard == 0 {
            return Err(format!(
                "--gpu-mem-gb {} gives each of the {} shards less than one block of {block_bytes} bytes; raise it or use 0",
                self.gpu_mem_gb, config.shards
            ));
        }
        let opened = GpuDevice::open(self.gpu_device).and_then(|d| {
            if d.total_bytes < bytes {
                Err(GpuUnavailable {
                    kind: GpuUnavailableKind::OutOfMemory,
                    reason: format!(
                        "CUDA device {} ({}) has {} bytes of memory, less than --gpu-mem-gb {} ({bytes} bytes)",
                        d.ordinal, d.name, d.total_bytes, self.gpu_mem_gb
                    ),
                })
            } else {
                Ok(d)
            }
        });
        match opened {
            Ok(device) => {
                if device.free_bytes_at_open < bytes {
                    tracing::warn!(
                        device = device.ordinal,
                        "CUDA device {} ({}) has {} bytes free now, less than the GPU tier's {bytes}: slabs past that fail and the tier stays smaller until memory frees",
                        device.ordinal,
                        device.name,
                        device.free_bytes_at_open
                    );
                }
                let line = format!(
                    "GPU tier on CUDA device {} ({}, {} bytes): {blocks_per_shard} blocks per shard",
                    device.ordinal, device.name, device.total_bytes
                );
                Ok((GpuConfig { device: Some(device), blocks_per_shard, optional: self.gpu_optional, unavailable: None }, Some(line)))
            }
            Err(e) if self.gpu_optional => {
                tracing::warn!("running without the GPU tier (--gpu-optional): {e}");
                let line = format!("GPU tier absent (--gpu-optional): {e}");
                Ok((GpuConfig { device: None, blocks_per_shard, optional: true, unavailable: Some(e) }, Some(line)))
            }
            Err(e) => {
                let what = match e.kind {
                    GpuUnavailableKind::NoDriver => "no CUDA driver was found",
                    GpuUnavailableKind::NoDevice => "the CUDA driver has no such device",
                    GpuUnavailableKind::OutOfMemory => "the device cannot hold it",
                    GpuUnavailableKind::DriverError => "the CUDA driver failed",
                };
                Err(format!(
                    "--gpu-mem-gb {} asks for a GPU tier on device {}, but {what} ({e}); pass --gpu-optional to run without the GPU tier",
                    self.gpu_mem_gb, self.gpu_device
                ))
            }
        }
    }
}

/// Registers the GPU tier's own metrics (when the store has a GPU tier
/// entry, present or absent): `kvtier_gpu_available` (1 or 0),
/// `kvtier_gpu_allocated_bytes`, and the fault counters
/// `kvtier_gpu_copy_errors_total`, `kvtier_gpu_out_of_memory_total`,
/// `kvtier_gpu_corrupt_blocks_total`, `kvtier_gpu_blocks_lost_total`.
pub fn register_metrics(registry: &mut kvtier_engine::latency::Scrape<'_>, tiers: &[kvtier_engine::TierStats]) {
    use prometheus_client::metrics::counter::ConstCounter;
    use prometheus_client::metrics::gauge::ConstGauge;
    let gauge = |v: u64| ConstGauge::new(v as i64);
    let Some(g) = tiers.iter().find_map(|t| t.gpu.as_ref()) else { return };
    registry.register(
        "gpu_available",
        "1 when the GPU tier is open, 0 when it was asked for but is absent",
        gauge(g.unavailable.is_none() as u64),
    );
    registry.register("gpu_allocated_bytes", "Device memory the GPU tier has allocated", gauge(g.allocated_bytes));
    registry.register("gpu_copy_errors", "Copies to or from the device that failed", ConstCounter::new(g.copy_errors));
    registry.register("gpu_out_of_memory", "Slab allocations refused for lack of device memory", ConstCounter::new(g.out_of_memory));
    registry.register(
        "gpu_corrupt_blocks",
        "Blocks copied back from the device that failed their CRC-32",
        ConstCounter::new(g.corrupt_blocks),
    );
    registry.register(
        "gpu_blocks_lost",
        "Write-back blocks held only on the device lost to a failed copy",
        ConstCounter::new(g.blocks_lost),
    );
}
