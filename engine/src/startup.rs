//! Start-up of the shards: one line saying what it waited for, and the
//! memory warm-up that runs once a shard serves.
//!
//! Start-up does only what serving needs. Each executor starts with its I/O
//! memory allocated but not registered with io_uring (where the kernel can
//! register it later, Linux 6.0+); the shard recovers and serves; then a
//! helper thread faults the I/O memory in, the shard registers it (about
//! 1 ms with the pages present), and the RAM tier is faulted in. Registering
//! at start faulted in 256 MiB per shard before recovery could begin, one
//! shard after the other behind the process's memory-map lock: 30 ms to
//! 0.76 s per shard on a VM that hands freed memory back to the host, and
//! restarts of up to 3.6 s in the crash harness (docs/OPERATIONS.md,
//! "Restart time"). glommio is patched for this: vendor/glommio/KVTIER-PATCH.md.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::channel::oneshot;

use crate::shard::Shard;

/// Start-up slower than this (from [`run`]'s call to every shard open) is
/// logged as a warning naming the step that took the time; faster, at info.
/// Half the restart target of the crash harness (1 s).
pub const START_WARN_AFTER: Duration = Duration::from_millis(500);

/// Whether this kernel registers io_uring buffers without quiescing the
/// ring (Linux 6.0 and later; older kernels waited for every request in
/// flight, and an accept pending on the ring never completes), so that a
/// shard's I/O memory can be registered after it starts serving.
pub(crate) fn io_memory_registration_can_wait() -> bool {
    // SAFETY: utsname is plain bytes (all-zero is valid); uname fills it and
    // NUL-terminates `release`, which is read only when it succeeded.
    let release = unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return false;
        }
        std::ffi::CStr::from_ptr(u.release.as_ptr()).to_string_lossy().into_owned()
    };
    kernel_at_least(&release, (6, 0))
}

/// Whether a kernel release string ("6.18.44-fc-v669") is at least
/// `(major, minor)`.
fn kernel_at_least(release: &str, want: (u32, u32)) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty()).map(|p| p.parse::<u32>().unwrap_or(0));
    let major = parts.next().unwrap_or(0);
    let minor = parts.next().unwrap_or(0);
    (major, minor) >= want
}

/// When a shard's start-up steps ended, measured from [`run`]'s call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShardStart {
    /// Its executor ran our code: io_uring rings created (and, where the
    /// registration cannot wait, the I/O memory faulted in and pinned).
    pub executor_up: Duration,
    /// Recovery done ([`recover::open_shard`]).
    pub recovered: Duration,
    /// Every shard open (the mesh joined).
    pub joined: Duration,
}

/// The shards' [`ShardStart`]s; the last shard to note its own logs the
/// start-up in one line, naming what it waited for.
pub(crate) struct StartLog {
    shards: Mutex<Vec<Option<ShardStart>>>,
    registration_deferred: bool,
    io_memory_shard_bytes: usize,
}

impl StartLog {
    pub(crate) fn new(shards: usize, registration_deferred: bool, io_memory_shard_bytes: usize) -> StartLog {
        StartLog { shards: Mutex::new(vec![None; shards]), registration_deferred, io_memory_shard_bytes }
    }

    pub(crate) fn note(&self, shard_id: usize, start: ShardStart) {
        let mut shards = self.shards.lock().expect("start log lock");
        shards[shard_id] = Some(start);
        let all: Vec<ShardStart> = shards.iter().flatten().copied().collect();
        if all.len() == shards.len() {
            drop(shards);
            self.log(&all);
        }
    }

    fn log(&self, all: &[ShardStart]) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let total = all.iter().map(|s| s.joined).max().unwrap_or_default();
        let executors = all.iter().map(|s| s.executor_up).max().unwrap_or_default();
        let (slowest, recovery) =
            all.iter().enumerate().map(|(i, s)| (i, s.recovered.saturating_sub(s.executor_up))).max_by_key(|(_, d)| *d).unwrap_or_default();
        let executors_did = if self.registration_deferred {
            "io_uring rings".to_string()
        } else {
            format!(
                "io_uring rings, and {} MiB of I/O memory each faulted in and registered: this kernel cannot register it later",
                self.io_memory_shard_bytes >> 20
            )
        };
        let line = format!(
            "{} shards open {:.0} ms after the engine started: waited {:.0} ms for the shard executors ({executors_did}), \
             then {:.0} ms for recovery (slowest: shard {slowest})",
            all.len(),
            ms(total),
            ms(executors),
            ms(recovery)
        );
        if total > START_WARN_AFTER {
            tracing::warn!("{line}; over {START_WARN_AFTER:?}");
        } else {
            tracing::info!("{line}");
        }
    }
}

/// A shard's memory warm-up after start: its I/O memory faulted in on a
/// helper thread and then registered with io_uring (when that was
/// deferred), then its RAM tier faulted in ([`Shard::prefault_ram`]).
pub(crate) struct WarmUp {
    stop: Arc<AtomicBool>,
    helper: Rc<RefCell<Option<std::thread::JoinHandle<()>>>>,
    task: glommio::Task<()>,
}

impl WarmUp {
    pub(crate) fn start(shard: &Rc<Shard>, register_io_memory: bool) -> WarmUp {
        let stop = Arc::new(AtomicBool::new(false));
        let helper = Rc::new(RefCell::new(None));
        let task = glommio::spawn_local(warm_up(Rc::downgrade(shard), shard.id(), register_io_memory, stop.clone(), helper.clone()));
        WarmUp { stop, helper, task }
    }

    /// Stops the warm-up where it is (the helper thread within one
    /// [`crate::populate::CHUNK_BYTES`] chunk) and waits for it. The task
    /// is let finish, not cancelled: cancelled while the blocking pool
    /// started the helper, it lost the helper's handle (the helper then
    /// outlived the executor's I/O memory it faults in, and the pool's
    /// answer found no executor: "failed to send response", seen in a
    /// store life a few milliseconds long).
    pub(crate) async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await;
        let helper = self.helper.borrow_mut().take();
        if let Some(h) = helper {
            let _ = h.join();
        }
    }
}

async fn warm_up(
    shard: Weak<Shard>,
    shard_id: u32,
    register_io_memory: bool,
    stop: Arc<AtomicBool>,
    helper: Rc<RefCell<Option<std::thread::JoinHandle<()>>>>,
) {
    let executor = glommio::executor();
    if register_io_memory && !executor.io_memory_registered() {
        let (ptr, len) = executor.io_memory_region();
        let addr = ptr as usize;
        let began = Instant::now();
        let (done, populated) = oneshot::channel();
        let stop_helper = stop.clone();
        // Started from the blocking pool: a new thread's stack is mapped,
        // which can wait long for the memory-map lock (`Shard::prefault_ram`).
        let spawned = executor
            .spawn_blocking(move || {
                std::thread::Builder::new().name(format!("kvtier-io-prefault-{shard_id}")).spawn(move || {
                    crate::populate::run_in_background();
                    // The executor keeps the memory until `WarmUp::stop` joined us.
                    let _ = done.send(crate::populate::populate(addr, len, &stop_helper));
                })
            })
            .await;
        match spawned {
            Ok(h) => *helper.borrow_mut() = Some(h),
            Err(e) => tracing::warn!(shard = shard_id, "I/O memory prefault thread not started ({e}); registering faults it in"),
        }
        match populated.await {
            Ok(Ok(false)) => return,
            Ok(Err(e)) => tracing::debug!(shard = shard_id, "I/O memory prefault not available ({e}); registering faults it in"),
            Ok(Ok(true)) | Err(_) => {}
        }
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let faulted_in = began.elapsed();
        let pinning = Instant::now();
        if executor.register_io_memory() {
            tracing::info!(
                shard = shard_id,
                mib = len >> 20,
                faulted_in_ms = faulted_in.as_secs_f64() * 1e3,
                register_ms = pinning.elapsed().as_secs_f64() * 1e3,
                "I/O memory registered with io_uring; block reads and writes use fixed buffers from now"
            );
        } else {
            tracing::warn!(
                shard = shard_id,
                mib = len >> 20,
                "I/O memory could not be registered with io_uring (RLIMIT_MEMLOCK?); block reads and writes use it unregistered"
            );
        }
    }
    if stop.load(Ordering::Relaxed) {
        return;
    }
    if let Some(shard) = shard.upgrade() {
        shard.prefault_ram().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_compare_by_major_and_minor() {
        assert!(kernel_at_least("6.18.44-fc-v669", (6, 0)));
        assert!(kernel_at_least("6.0.0", (6, 0)));
        assert!(kernel_at_least("10.1", (6, 0)));
        assert!(!kernel_at_least("5.15.0-91-generic", (6, 0)));
        assert!(!kernel_at_least("garbage", (6, 0)));
    }
}
