//! Starting the store: one pinned executor per shard ([`run`]), each
//! opening its shard, joining the channel mesh and serving, with the
//! shard's background loops (answering peers, periodic index snapshots,
//! health, trace flushes) beside it until it stops; then the close. What
//! start-up waits for, its one-line log and the memory warm-up after
//! serving are [`crate::startup`]'s.

use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use glommio::channels::channel_mesh::{MeshBuilder, Receivers};
use glommio::{LocalExecutorBuilder, Placement, Task};

use super::mesh::{execute, Request, MESH_QUEUE_DEPTH};
use super::{Store, StoreConfig};
use crate::error::{Error, Result};
use crate::recover;
use crate::remote::Remote;
use crate::shard::{Hold, Shard};
use crate::startup;
use crate::trace::ShardTrace;

/// How often each shard evaluates its tiers' health (and logs a change).
const HEALTH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Opens the store described by `config` and runs `serve` on every shard.
/// Returns, in shard order, what each `serve` returned, once every shard has
/// finished serving, answered its peers' last requests and closed its files.
///
/// `serve` is called once per shard on that shard's executor; when it
/// returns, the shard stops sending, keeps answering peers until they stop
/// too, then closes.
///
/// Start-up does only what serving needs: each executor starts with its
/// I/O memory allocated but not registered with io_uring (Linux 6.0+, see
/// [`crate::startup`]), the shard recovers, and once every
/// shard is open (logged in one line with what each step took) it serves.
/// Meanwhile a helper thread faults the I/O memory in, the shard registers
/// it, and then the RAM tier is faulted in ([`crate::populate`] says why
/// not before: up to 2.6 s for 1 GiB on a VM).
///
/// # Errors
/// [`Error::GeometryMismatch`] and [`Error::Config`] before any shard starts;
/// the first shard's open error (every shard then returns without serving).
pub fn run<F, Fut, T>(config: StoreConfig, serve: F) -> Result<Vec<T>>
where
    F: Fn(Rc<Store>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    if config.shards == 0 {
        return Err(Error::Config("shards must be at least 1".into()));
    }
    if config.segment_bytes < 2 * crate::slot::PAGE_BYTES {
        return Err(Error::Config(format!("segment_bytes {} is too small", config.segment_bytes)));
    }
    let started = Instant::now();
    let layout = config.layout();
    // Devices added on this start: the shards placed anew drop their
    // segments where they were, before any store.json names the new device
    // list (a start that stops midway drops them again, then finds the
    // longer list and rewrites the shorter ones below).
    for (shard, before) in layout.moved_shards(config.shards) {
        let now: Vec<u32> = layout.devices_of(shard, config.shards).iter().map(|d| d.index).collect();
        let why = format!(
            "devices were added ({} to {}), so shard {shard} is placed on device(s) {now:?} now; its segments where it was are discarded",
            layout.devices_before,
            layout.devices.len()
        );
        crate::recover::discard_log(&before, shard as u32, &why)?;
        let kept = layout.shard_dirs(shard, config.shards);
        for dir in before.iter().filter(|d| !kept.contains(d)) {
            // Empty now; a directory someone put files in stays.
            let _ = std::fs::remove_dir(dir);
        }
    }
    let mut manifest = None;
    for device in layout.devices.iter().filter(|d| d.absent.is_none()) {
        let wanted = config.manifest_for(&layout, device.index);
        let mut m = wanted.create_or_check(&device.dir)?;
        if m.devices.len() < wanted.devices.len() {
            // A device list from before devices were added.
            wanted.write(&device.dir)?;
            tracing::info!("device {} ({}): store.json now lists {} devices", device.index, device.dir.display(), wanted.devices.len());
            m = wanted;
        }
        manifest.get_or_insert(m);
    }
    // `Layout::resolve` leaves a device absent only beside one present.
    let manifest = manifest.expect("a layout has a present device");
    for device in layout.absent() {
        tracing::warn!(
            "device {} is absent ({}): shards {:?} serve from RAM and S3 with their log down and answer PUTs 503 device_down; restart with the device's directory to bring their logs back",
            device.index,
            device.absent.as_deref().unwrap_or_default(),
            layout.shards_on(device.index as usize, config.shards)
        );
    }
    for index in &layout.replaced {
        let device = &layout.devices[*index as usize];
        tracing::warn!(
            "device {index} is the empty directory {} in place of a missing one: shards {:?} start with an empty log",
            device.dir.display(),
            layout.shards_on(*index as usize, config.shards)
        );
    }
    let shard_dirs: Arc<Vec<std::path::PathBuf>> = Arc::new((0..config.shards).map(|s| layout.shard_dir(s)).collect());
    let device_dirs: Arc<Vec<std::path::PathBuf>> = Arc::new(layout.devices.iter().map(|d| d.dir.clone()).collect());
    let mesh: MeshBuilder<Request, _> = MeshBuilder::full(config.shards, MESH_QUEUE_DEPTH);
    let failed = Arc::new(AtomicBool::new(false));
    let serve = Arc::new(serve);
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let defer_registration = startup::io_memory_registration_can_wait();
    let starts = Arc::new(startup::StartLog::new(config.shards, defer_registration, config.io_memory_shard_bytes()));
    let mut handles = Vec::with_capacity(config.shards);
    for shard_id in 0..config.shards {
        let (mesh, failed, serve, starts) = (mesh.clone(), failed.clone(), serve.clone(), starts.clone());
        let (shard_cfg, manifest, shard_dirs) = (config.shard_config_in(&layout, shard_id), manifest.clone(), shard_dirs.clone());
        let device_dirs = device_dirs.clone();
        let (shards, snapshot_secs) = (config.shards, config.snapshot_secs);
        let io_memory_shard_bytes = config.io_memory_shard_bytes();
        let remote = config.remote.clone();
        let recorder = config.trace.clone();
        let parallelism = remote.as_ref().map_or(1, |r| r.parallelism());
        let placement = if config.pin_cpus { Placement::Fixed(shard_id % cpus) } else { Placement::Unbound };
        let handle = LocalExecutorBuilder::new(placement)
            .name(&format!("kvtier-shard-{shard_id}"))
            .io_memory(io_memory_shard_bytes)
            .defer_io_memory_registration(defer_registration)
            .preempt_timer(crate::stall::PREEMPT_BUDGET)
            .detect_stalls(config.stalls.as_ref().map(|s| s.handler(shard_id)))
            .spawn(move || async move {
                let executor_up = started.elapsed();
                let opened = recover::open_shard(shard_cfg).await;
                let recovered = started.elapsed();
                if opened.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                // Joining the mesh is also a barrier: every shard has opened
                // (or failed to) before any serves.
                let (senders, mut receivers) = mesh.join().await.map_err(|_| Error::ShuttingDown)?;
                let shard = match opened {
                    Ok(s) => Some(s.share()),
                    Err(e) => {
                        senders.close();
                        return Err(e);
                    }
                };
                let shard = shard.expect("opened");
                // The first segment (or the next) is made before a write
                // needs it, off the shard's thread.
                shard.prepare_spare();
                // Chunks of forwarded GETs come back here to be freed.
                glommio::spawn_local(crate::stream::return_chunks_home()).detach();
                starts.note(shard_id, startup::ShardStart { executor_up, recovered, joined: started.elapsed() });
                // Fault in and register the I/O memory and fault in the RAM
                // tier now that the shard serves (not before: see
                // `crate::populate`).
                let warm_up = startup::WarmUp::start(&shard, defer_registration);
                let trace = recorder.map(|r| Rc::new(ShardTrace::new(r)));
                let answering = answer_peers(&mut receivers, &shard, &trace, parallelism);
                let snapshots = (snapshot_secs > 0).then(|| snapshot_loop(&shard, snapshot_secs));
                let health = health_loop(&shard, remote.clone().filter(|_| shard_id == 0));
                let trace_flush = trace.clone().map(trace_flush_loop);
                let events = events_loop(shard.residency().clone());
                let store = Rc::new(Store {
                    shard: Hold::new(&shard),
                    senders,
                    shards,
                    manifest,
                    shard_dirs,
                    device_dirs,
                    remote,
                    trace: trace.clone(),
                });
                let out = if failed.load(Ordering::SeqCst) { None } else { Some(serve(store.clone()).await) };
                store.senders.close();
                futures::future::join_all(answering).await;
                drop(store);
                if let Some(task) = snapshots {
                    task.cancel().await;
                }
                health.cancel().await;
                events.cancel().await;
                if let Some(task) = trace_flush {
                    task.cancel().await;
                }
                if let Some(t) = &trace {
                    t.flush();
                }
                warm_up.stop().await;
                // Requests from peers, streamed reads and S3 installs may
                // still be finishing: their tasks hold the shard; its files
                // close once the last has ended.
                shard.tasks_ended().await;
                shard.close().await;
                // What the close moved (write-back blocks to the log) is
                // published too.
                shard.residency().flush();
                out.ok_or(Error::ShuttingDown)
            })
            .map_err(|e| Error::Config(format!("starting executor for shard {shard_id}: {e}")))?;
        handles.push(handle);
    }
    let mut outputs = Vec::with_capacity(handles.len());
    let mut first_error = None;
    for handle in handles {
        match handle.join() {
            Ok(Ok(out)) => outputs.push(out),
            Ok(Err(e)) => {
                if first_error.is_none() || matches!(first_error, Some(Error::ShuttingDown)) {
                    first_error = Some(e);
                }
            }
            Err(e) => first_error = first_error.or(Some(Error::Config(format!("shard executor failed: {e}")))),
        }
    }
    if let Some(recorder) = &config.trace {
        // Every shard has flushed its buffer: close the file.
        futures::executor::block_on(recorder.stop(async {}));
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(outputs),
    }
}

/// One task per peer shard answering what it sends: each request runs in a
/// task of its own ([`execute`]). The tasks end once every peer has closed
/// its senders.
fn answer_peers(
    receivers: &mut Receivers<Request>,
    shard: &Rc<Shard>,
    trace: &Option<Rc<ShardTrace>>,
    parallelism: usize,
) -> Vec<Task<()>> {
    receivers
        .streams()
        .into_iter()
        .map(|(_, receiver)| {
            let (shard, trace) = (shard.clone(), trace.clone());
            glommio::spawn_local(async move {
                while let Some(request) = receiver.recv().await {
                    let trace = trace.clone();
                    shard.spawn_holding(|shard| async move {
                        execute(&shard, trace.as_deref(), request, parallelism).await;
                    });
                }
            })
        })
        .collect()
}

/// Writes an index snapshot every `snapshot_secs` while the shard lives.
fn snapshot_loop(shard: &Rc<Shard>, snapshot_secs: u64) -> Task<()> {
    let shard = Rc::downgrade(shard);
    glommio::spawn_local(async move {
        let every = std::time::Duration::from_secs(snapshot_secs);
        loop {
            glommio::timer::sleep(every).await;
            let Some(shard) = shard.upgrade() else { return };
            if let Err(e) = shard.write_snapshot().await {
                tracing::warn!(shard = shard.id(), "periodic index snapshot failed: {e}");
            }
        }
    })
}

/// Health is evaluated every second whatever the traffic, so a change of
/// state is logged when it happens, not when someone asks; shard 0 also
/// watches the remote tier (`remote` is `Some` there only).
fn health_loop(shard: &Rc<Shard>, remote: Option<Arc<dyn Remote>>) -> Task<()> {
    let shard = Rc::downgrade(shard);
    glommio::spawn_local(async move {
        loop {
            glommio::timer::sleep(HEALTH_EVERY).await;
            let Some(shard) = shard.upgrade() else { return };
            shard.health();
            if let Some(r) = &remote {
                r.health();
            }
        }
    })
}

/// Hands the shard's tier changes to the KV event sink once per
/// [`crate::events::FLUSH_EVERY`] while there are any; without a sink, stops
/// tracking blocks no tier holds.
fn events_loop(residency: Rc<crate::events::Residency>) -> Task<()> {
    glommio::spawn_local(async move {
        loop {
            residency.until_pending().await;
            glommio::timer::sleep(crate::events::FLUSH_EVERY).await;
            residency.flush();
        }
    })
}

/// A partly filled trace buffer reaches the file within a second.
fn trace_flush_loop(trace: Rc<ShardTrace>) -> Task<()> {
    glommio::spawn_local(async move {
        loop {
            glommio::timer::sleep(crate::trace::FLUSH_EVERY).await;
            trace.flush();
        }
    })
}
