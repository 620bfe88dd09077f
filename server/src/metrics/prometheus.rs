//! The Prometheus side of [`super::Metrics`]: every series of one scrape,
//! written from the front doors' counters ([`super::Door`]) and the
//! engine's snapshot, and the text format 0.0.4 conversion.

use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_engine::health::{HealthState, TierHealth};
use kvtier_engine::latency::{HistogramFamily, Scrape};
use kvtier_engine::ShardStats;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::{Durations, EngineSnapshot, Parts};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierOpLabel {
    tier: String,
    op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabel {
    shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantTierLabel {
    tenant: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantEvictionLabel {
    tenant: String,
    tier: String,
    /// `own`: to make room for its own blocks or to meet its limit;
    /// `other`: for another owner's (in the log: a reclaim).
    cause: String,
}

/// Per block owner (tenant, namespace, `default`): the `tenant` label takes
/// only names from the tenants file (and `default`), never a value from a
/// request, so there are at most [`kvtier_engine::tenant::OWNERS_MAX`].
fn register_tenants(registry: &mut Scrape<'_>, engine: &[ShardStats], block_bytes: u64, tenancy: Option<&crate::tenants::Tenancy>) {
    use kvtier_engine::tenant::QuotaTier;
    let owners = kvtier_engine::shard::owner_totals(engine);
    let bytes = Family::<TenantTierLabel, Gauge>::default();
    let blocks = Family::<TenantTierLabel, Gauge>::default();
    let reserved = Family::<TenantTierLabel, Gauge>::default();
    let limit = Family::<TenantTierLabel, Gauge>::default();
    let evictions = Family::<TenantEvictionLabel, Counter>::default();
    let (hits, misses) = (Family::<TenantLabel, Counter>::default(), Family::<TenantLabel, Counter>::default());
    let (lookup_keys, prefix_hits) = (Family::<TenantLabel, Counter>::default(), Family::<TenantLabel, Counter>::default());
    for o in &owners {
        let tenant = o.name.clone();
        for t in QuotaTier::ALL {
            let (i, tier) = (t as usize, t.as_str().to_string());
            let l = TenantTierLabel { tenant: tenant.clone(), tier: tier.clone() };
            blocks.get_or_create(&l).set(o.blocks[i] as i64);
            bytes.get_or_create(&l).set((o.blocks[i] * block_bytes) as i64);
            reserved.get_or_create(&l).set((o.reserved_blocks[i] * block_bytes) as i64);
            limit.get_or_create(&l).set((o.limit_blocks[i] * block_bytes) as i64);
            for (cause, n) in [("own", o.counters.evicted_own[i]), ("other", o.counters.evicted_by_other[i])] {
                evictions.get_or_create(&TenantEvictionLabel { tenant: tenant.clone(), tier: tier.clone(), cause: cause.into() }).inc_by(n);
            }
        }
        let l = TenantLabel { tenant };
        hits.get_or_create(&l).inc_by(o.counters.hits);
        misses.get_or_create(&l).inc_by(o.counters.misses);
        lookup_keys.get_or_create(&l).inc_by(o.counters.lookup_keys);
        prefix_hits.get_or_create(&l).inc_by(o.counters.prefix_hits);
    }
    registry.register("tenant_blocks", "Blocks a tenant (or shared namespace) holds in a tier", blocks);
    registry.register("tenant_bytes", "Bytes a tenant holds in a tier", bytes);
    registry.register("tenant_reserved_bytes", "Bytes of a tier reserved for a tenant (whole blocks per shard)", reserved);
    registry.register("tenant_limit_bytes", "Most bytes a tenant may hold in a tier (the tier's size when it has no limit)", limit);
    registry.register("tenant_evictions", "Blocks of a tenant moved out of a tier, by cause (own pressure or limit; another's)", evictions);
    registry.register("tenant_hits", "GETs of a tenant answered with a block", hits);
    registry.register("tenant_misses", "GETs of a tenant that found no block", misses);
    registry.register("tenant_lookup_keys", "Keys a tenant's prefix lookups asked for", lookup_keys);
    registry.register("tenant_prefix_hits", "Of those, keys found in the prefix", prefix_hits);
    if let Some(t) = tenancy {
        let status = t.status();
        registry.register(
            "tenants_reloads",
            "Reloads of the tenants file that took effect (SIGHUP or the admin route)",
            ConstCounter::new(status.reloads),
        );
        registry.register(
            "tenants_reload_failures",
            "Reloads of the tenants file refused (the tenants in use were kept)",
            ConstCounter::new(status.reload_failures),
        );
        registry.register(
            "tenants_unauthorized",
            "Requests and local HELLOs refused because their token (or uid) is no tenant's",
            ConstCounter::new(t.unauthorized.load(Ordering::Relaxed)),
        );
    }
}

fn shard_counter(registry: &mut Scrape<'_>, name: &str, help: &str, engine: &[ShardStats], value: fn(&ShardStats) -> u64) {
    let family = Family::<ShardLabel, Counter>::default();
    for s in engine {
        family.get_or_create(&ShardLabel { shard: s.shard.to_string() }).inc_by(value(s));
    }
    registry.register(name, help, family);
}

fn shard_gauge(registry: &mut Scrape<'_>, name: &str, help: &str, engine: &[ShardStats], value: fn(&ShardStats) -> f64) {
    let family = Family::<ShardLabel, Gauge<f64, AtomicU64>>::default();
    for s in engine {
        family.get_or_create(&ShardLabel { shard: s.shard.to_string() }).set(value(s));
    }
    registry.register(name, help, family);
}

/// The same metrics in Prometheus' text exposition format 0.0.4, from
/// prometheus-client's OpenMetrics text (which is all it writes). The two
/// differ, for what kvtier exports, only in metadata: OpenMetrics names a
/// counter family without its `_total` suffix in `# HELP` and `# TYPE`
/// (0.0.4 names the sample, `_total` included), and ends with `# EOF`
/// (0.0.4 has no end marker; `# UNIT` lines do not exist there). Samples,
/// labels and histogram series are written alike by both.
pub fn openmetrics_to_text_0_0_4(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Writes every metric of one scrape.
pub(super) fn write_metrics(registry: &mut Scrape<'_>, parts: &Parts, snapshot: &EngineSnapshot) {
    let Parts { doors, geometry, remote, tenancy, stalls } = parts;
    let EngineSnapshot { engine, health, trace, devices } = snapshot;
    register_devices(registry, devices);
    register_tenants(registry, engine, geometry.block_bytes, tenancy.as_deref());
    let block = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    block.set(geometry.block_bytes as i64);
    registry.register("block_bytes", "Payload bytes of one block (fixed per store)", block);

    // Each front door's series; the latencies of all in one family.
    let mut durations = Durations::default();
    for door in doors {
        door.write_metrics(registry, &mut durations);
    }

    if let Some(t) = trace {
        let g = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        g.set(i64::from(t.recording));
        registry.register("trace_recording", "1 while the trace recorder takes records (--trace-dir), else 0", g);
        registry.register("trace_records", "Block operations recorded since start", ConstCounter::new(t.records));
        registry.register(
            "trace_dropped_records",
            "Records dropped since start: the trace writer's queue was full or a write failed",
            ConstCounter::new(t.dropped_records),
        );
        registry.register("trace_written_bytes", "Bytes written to trace files since start", ConstCounter::new(t.bytes_written));
    }

    registry.register(
        "dma_chunks_leaked",
        "Chunks read from the log dropped away from the shard thread that read them with no way home, their DMA buffers leaked (a bug if not 0 while serving)",
        ConstCounter::new(kvtier_engine::stream::dma_chunks_leaked()),
    );
    registry.register(
        "dma_chunks_sent_home",
        "Chunks read from the log for a GET forwarded from another shard, sent by that shard from the owner's DMA buffers and returned to the owner to be freed",
        ConstCounter::new(kvtier_engine::stream::dma_chunks_sent_home()),
    );

    // Engine, per shard.
    shard_gauge(registry, "shard_blocks", "Blocks stored", engine, |s| s.blocks as f64);
    shard_gauge(registry, "shard_capacity_blocks", "Blocks the shard's disk share holds", engine, |s| s.capacity_blocks as f64);
    shard_gauge(registry, "shard_disk_bytes", "Bytes of segment files", engine, |s| s.disk_bytes as f64);
    shard_gauge(registry, "shard_index_bytes", "Heap bytes of the index", engine, |s| s.index_bytes as f64);
    shard_gauge(registry, "shard_io_in_flight", "Block reads and writes in flight", engine, |s| s.io_in_flight as f64);
    shard_gauge(registry, "shard_io_queued", "Block reads and writes waiting for an I/O slot", engine, |s| s.io_queued as f64);
    shard_counter(
        registry,
        "shard_io_queue_refusals",
        "Block operations refused with 503 because --io-queue-max I/Os were already waiting",
        engine,
        |s| s.io_queue_refusals,
    );
    shard_gauge(registry, "shard_reactor_utilization", "Executor busy time over wall time since start", engine, |s| s.reactor_utilization);
    shard_counter(registry, "shard_puts", "Blocks stored", engine, |s| s.puts);
    shard_counter(registry, "shard_gets", "Block reads", engine, |s| s.gets);
    shard_counter(registry, "shard_hits", "Block reads that found the block", engine, |s| s.hits);
    shard_counter(registry, "shard_misses", "Block reads that did not", engine, |s| s.misses);
    shard_counter(registry, "shard_deletes", "Blocks deleted", engine, |s| s.deletes);
    shard_counter(registry, "shard_corrupt_blocks", "Blocks that failed their CRC-32 and were dropped", engine, |s| s.corrupt_blocks);
    shard_counter(
        registry,
        "shard_disk_full_refusals",
        "Writes refused (507) because the filesystem had no room for a new segment",
        engine,
        |s| s.disk_full_refusals,
    );
    shard_counter(registry, "shard_evicted_blocks", "Blocks dropped by reclaim", engine, |s| s.evicted_blocks);
    shard_counter(registry, "shard_second_chance_blocks", "Blocks kept by reclaim because they were read", engine, |s| {
        s.second_chance_blocks
    });
    shard_counter(registry, "shard_reclaimed_segments", "Segments reclaimed", engine, |s| s.reclaimed_segments);
    shard_counter(registry, "shard_bytes_read", "Bytes read from segments", engine, |s| s.bytes_read);
    shard_counter(registry, "shard_bytes_written", "Bytes written to segments", engine, |s| s.bytes_written);
    shard_counter(
        registry,
        "shard_writes_from_ram",
        "Block records written to the log straight from their RAM-tier slot, with no copy",
        engine,
        |s| s.writes_from_ram,
    );
    shard_counter(registry, "shard_forwarded_requests", "Operations sent to the shard owning the key", engine, |s| s.forwarded_requests);
    shard_counter(registry, "shard_transit_hits", "GETs served from a block on its way into a memory tier", engine, |s| s.transit_hits);
    registry.register(
        "request_duration_seconds",
        "Time from a request's arrival to its answer, in seconds, by front door (http, local) and route",
        durations,
    );

    // Per tier, summed over shards.
    let tiers = kvtier_engine::shard::tier_totals(engine);
    type TierField = fn(&kvtier_engine::TierStats) -> u64;
    let gauges: [(&str, &str, TierField); 2] = [
        ("tier_capacity_blocks", "Blocks the tier can hold", |t| t.capacity_blocks),
        ("tier_used_blocks", "Blocks the tier holds", |t| t.used_blocks),
    ];
    for (name, help, f) in gauges {
        let family = Family::<TierLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
        for t in &tiers {
            family.get_or_create(&TierLabel { tier: t.tier.as_str().into() }).set(f(t) as i64);
        }
        registry.register(name, help, family);
    }
    let counters: [(&str, &str, TierField); 7] = [
        ("tier_hits", "Reads the tier served", |t| t.hits),
        ("tier_misses", "Reads that looked in the tier and went on", |t| t.misses),
        ("tier_promotions", "Blocks moved up into the tier", |t| t.promotions),
        ("tier_demotions", "Blocks moved down out of the tier", |t| t.demotions),
        ("tier_evictions", "Blocks that left the store from the tier", |t| t.evictions),
        ("tier_bytes_in", "Block bytes written into the tier", |t| t.bytes_in),
        ("tier_bytes_out", "Block bytes served from the tier", |t| t.bytes_out),
    ];
    for (name, help, f) in counters {
        let family = Family::<TierLabel, Counter>::default();
        for t in &tiers {
            family.get_or_create(&TierLabel { tier: t.tier.as_str().into() }).inc_by(f(t));
        }
        registry.register(name, help, family);
    }
    let mut tier_latency = HistogramFamily::default();
    for t in &tiers {
        for (op, buckets) in [("read", &t.read_latency), ("write", &t.write_latency)] {
            tier_latency.series.push((TierOpLabel { tier: t.tier.as_str().into(), op: op.into() }, buckets.clone()));
        }
    }
    registry.register(
        "tier_service_duration_seconds",
        "Engine-side time of a tier's block reads and writes, in seconds, summed over shards",
        tier_latency,
    );
    if let Some(remote) = remote {
        remote.register_metrics(registry);
    }
    register_health(registry, health);
    crate::gpu::register_metrics(registry, &tiers);
    if let Some(stalls) = stalls {
        register_stalls(registry, stalls);
    }
}

/// `kvtier_shard_stalls_total{shard}`, `kvtier_shard_stall_duration_seconds{shard}`
/// and the threshold ([`kvtier_engine::stall`]), read from the shared
/// counters, not the shards: a stalled shard's show while it is stalled.
fn register_stalls(registry: &mut Scrape<'_>, stalls: &kvtier_engine::stall::Stalls) {
    let per_shard = stalls.shard_stats();
    let count = Family::<ShardLabel, Counter>::default();
    let mut durations = HistogramFamily::default();
    for s in &per_shard {
        let label = ShardLabel { shard: s.shard.to_string() };
        count.get_or_create(&label).inc_by(s.stalls);
        durations.series.push((label, s.durations.clone()));
    }
    registry.register(
        "shard_stalls",
        "Times a shard's thread ran past --stall-threshold-ms without getting back to its I/O (every request it owned waited)",
        count,
    );
    registry.register("shard_stall_duration_seconds", "How long each shard stall lasted, in seconds", durations);
    let threshold = Gauge::<f64, AtomicU64>::default();
    threshold.set(stalls.threshold().as_secs_f64());
    registry.register("shard_stall_threshold_seconds", "The stall threshold (--stall-threshold-ms), in seconds", threshold);
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierKindLabel {
    tier: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabel {
    device: String,
}

/// `kvtier_device_up{device}` (1 unless its shards' logs are down) and
/// `kvtier_device_blocks{device}`, per data directory
/// ([`kvtier_engine::devices`]).
fn register_devices(registry: &mut Scrape<'_>, devices: &[kvtier_engine::devices::DeviceStats]) {
    let up = Family::<DeviceLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    let blocks = Family::<DeviceLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    for d in devices {
        let label = DeviceLabel { device: d.index.to_string() };
        up.get_or_create(&label).set((d.state != HealthState::Down) as i64);
        blocks.get_or_create(&label).set(d.blocks as i64);
    }
    registry.register("device_up", "1 while the device's shards' logs serve, 0 while they are down (one per --data-dir)", up);
    registry.register("device_blocks", "Blocks in the logs of the device's shards", blocks);
}

/// `kvtier_tier_up{tier}` (1 unless down), `kvtier_tier_degraded{tier}` (1
/// when degraded) and `kvtier_tier_errors_total{tier,kind}`, from the health
/// table ([`kvtier_engine::health`]).
fn register_health(registry: &mut Scrape<'_>, health: &[TierHealth]) {
    let up = Family::<TierLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    let degraded = Family::<TierLabel, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
    let errors = Family::<TierKindLabel, Counter>::default();
    for h in health {
        let label = TierLabel { tier: h.tier.clone() };
        up.get_or_create(&label).set((h.state != HealthState::Down) as i64);
        degraded.get_or_create(&label).set((h.state == HealthState::Degraded) as i64);
        for (kind, n) in &h.errors {
            errors.get_or_create(&TierKindLabel { tier: h.tier.clone(), kind: kind.clone() }).inc_by(*n);
        }
    }
    registry.register("tier_up", "1 while the tier serves (ok or degraded), 0 while it is down", up);
    registry.register("tier_degraded", "1 while the tier is degraded (recent errors or a standing condition)", degraded);
    registry.register("tier_errors", "Errors each tier met since start, by kind", errors);
}
