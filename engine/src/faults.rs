//! A test double for devices that fail at run time: while a device's switch
//! is on, every segment read, write, sync and creation on it fails with
//! `EIO` before it reaches the file, as on a drive that died; switched off,
//! they reach the file again. The store model fuzzer turns a device off in
//! the middle of a store's life (`fuzz/src/store_ops.rs`); the devices
//! tests fail a real filesystem instead (`server/tests/devices.rs`). A
//! store without it (`StoreConfig::device_faults` `None`, as every `kvtier
//! serve`) checks nothing. What it does not fail: the index snapshot and
//! `store.json`, written with `std::fs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

/// One switch per device of a store, by device index.
#[derive(Debug, Default)]
pub struct DeviceFaults {
    failing: Vec<AtomicBool>,
}

impl DeviceFaults {
    /// Switches for `devices` devices, all off.
    pub fn new(devices: usize) -> Arc<DeviceFaults> {
        Arc::new(DeviceFaults { failing: (0..devices).map(|_| AtomicBool::new(false)).collect() })
    }

    /// Turns device `device`'s failure on or off (a device the store does
    /// not have: nothing).
    pub fn set_failing(&self, device: usize, failing: bool) {
        if let Some(f) = self.failing.get(device) {
            f.store(failing, Ordering::SeqCst);
        }
    }

    /// Whether device `device` fails now.
    pub fn failing(&self, device: usize) -> bool {
        self.failing.get(device).is_some_and(|f| f.load(Ordering::SeqCst))
    }
}

/// The switch of the device one segment lives on.
#[derive(Debug, Clone)]
pub struct FaultSwitch {
    faults: Arc<DeviceFaults>,
    device: usize,
}

impl FaultSwitch {
    /// Device `device`'s switch in `faults`.
    pub fn new(faults: Arc<DeviceFaults>, device: usize) -> FaultSwitch {
        FaultSwitch { faults, device }
    }

    /// `Err(Io(EIO))` for `what` while the device fails.
    ///
    /// # Errors
    /// [`Error::Io`] with `EIO`, naming `what` and the injected failure.
    pub fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        if self.faults.failing(self.device) {
            return Err(Error::io(
                format!("{} (device {} failing: an injected fault)", what(), self.device),
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        Ok(())
    }
}
