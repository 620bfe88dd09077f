//! The health of the shard's tiers ([`crate::health`]): what each tier met
//! and its standing condition. The log is `down` while its last write failed
//! with an I/O error (the store cannot keep what it acknowledges) or, for
//! the whole run, when its device was absent at start, and
//! `degraded` while the filesystem is full (PUTs answer 507) or after read,
//! write, reclaim or snapshot errors; the GPU is `down` when it was
//! configured but is not there (`--gpu-optional`) and `degraded` after copy,
//! allocation or CRC faults, read off its fault counters.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use super::Shard;
use crate::error::{Error, Result};
use crate::health::{HealthState, HealthTracker, TierHealth};

/// How long a shard refuses writes after its log's last write failed with
/// an I/O error (a failed device) before it lets one through to see whether
/// the device is back.
pub const LOG_PROBE_EVERY: Duration = Duration::from_secs(1);

/// One tracker per local tier, and the log's standing condition.
pub(super) struct Trackers {
    gpu: HealthTracker,
    ram: HealthTracker,
    nvme: HealthTracker,
    /// The error of the log's last write and when, while no write has succeeded since.
    log_write_error: RefCell<Option<(String, std::time::Instant)>>,
    /// The GPU fault counters' sum when last evaluated.
    gpu_faults_seen: Cell<u64>,
}

impl Trackers {
    pub(super) fn new(shard: u32, window: Duration) -> Trackers {
        Trackers {
            gpu: HealthTracker::new("gpu", Some(shard), window),
            ram: HealthTracker::new("ram", Some(shard), window),
            nvme: HealthTracker::new("nvme", Some(shard), window),
            log_write_error: RefCell::new(None),
            gpu_faults_seen: Cell::new(0),
        }
    }
}

impl Shard {
    /// Notes the outcome of a log write (a block, a tombstone, a demotion):
    /// an I/O error takes the log down until a write succeeds again. Refusals
    /// (disk full, overload, shutdown) say nothing of the device.
    pub(super) fn note_log_write<T>(&self, result: &Result<T>) {
        match result {
            Ok(_) => {
                self.health.log_write_error.borrow_mut().take();
            }
            Err(e @ Error::Io { .. }) => {
                let message = format!("shard {}: {e}", self.id());
                self.health.nvme.error("write", message.clone());
                *self.health.log_write_error.borrow_mut() = Some((message, std::time::Instant::now()));
            }
            Err(_) => {}
        }
    }

    /// `Err(DeviceDown)` while the log's last write failed less than
    /// [`LOG_PROBE_EVERY`] ago: the write is refused without touching the
    /// device. After that one write is let through as a probe (others may
    /// follow it): its success brings the log back, its failure refuses
    /// writes for another interval.
    pub(super) fn log_accepts_writes(&self) -> Result<()> {
        if let Some(why) = &self.cfg.log_absent {
            return Err(Error::DeviceDown(format!(
                "shard {} has no log: {why}; its PUTs are refused until kvtier restarts with the device",
                self.id()
            )));
        }
        match &*self.health.log_write_error.borrow() {
            Some((message, at)) if at.elapsed() < LOG_PROBE_EVERY => Err(Error::DeviceDown(format!(
                "the device holding {} failed ({message}); writes to this shard are refused, retried every {} ms",
                self.cfg.log_dirs(),
                LOG_PROBE_EVERY.as_millis()
            ))),
            _ => Ok(()),
        }
    }

    /// Notes a failed log read, reclaim copy or snapshot of `kind`.
    pub(super) fn note_log_error(&self, kind: &str, e: &dyn std::fmt::Display) {
        self.health.nvme.error(kind, format!("shard {}: {e}", self.id()));
    }

    /// The health of this shard's tiers now, fastest first (GPU and RAM only
    /// when configured). Logs each change of state once.
    pub fn health(&self) -> Vec<TierHealth> {
        let h = &self.health;
        let mut out = Vec::with_capacity(3);
        if let Some(why) = &self.gpu_unavailable {
            out.push(h.gpu.evaluate(Some((HealthState::Down, format!("the GPU tier is configured but not available: {why}")))));
        } else if let Some(gpu) = &self.gpu {
            let i = gpu.info();
            let faults = i.copy_errors + i.out_of_memory + i.alloc_errors + i.corrupt_blocks + i.blocks_lost;
            let new = faults.saturating_sub(h.gpu_faults_seen.replace(faults));
            h.gpu.errors(
                "fault",
                new,
                format!(
                    "shard {}: {new} GPU faults (copy_errors {}, out_of_memory {}, alloc_errors {}, corrupt_blocks {}, blocks_lost {} since start)",
                    self.id(),
                    i.copy_errors,
                    i.out_of_memory,
                    i.alloc_errors,
                    i.corrupt_blocks,
                    i.blocks_lost
                ),
            );
            out.push(h.gpu.evaluate(None));
        }
        if self.ram.is_some() {
            out.push(h.ram.evaluate(None));
        }
        let condition = match (h.log_write_error.borrow().clone().map(|(e, _)| e), self.fs_full.get()) {
            _ if self.cfg.log_absent.is_some() => {
                Some((HealthState::Down, format!("shard {} has no log: {}", self.id(), self.cfg.log_absent.as_deref().unwrap_or_default())))
            }
            (Some(e), _) => Some((HealthState::Down, format!("the log's last write failed: {e}"))),
            (None, true) => Some((
                HealthState::Degraded,
                format!(
                    "{} is full: PUTs answer 507 disk_full until space frees",
                    self.cfg.device_names().unwrap_or_else(|| format!("the filesystem holding {}", self.cfg.log_dirs()))
                ),
            )),
            (None, false) => None,
        };
        out.push(h.nvme.evaluate(condition));
        out
    }
}
