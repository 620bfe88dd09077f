//! Loading the driver and opening the device: cudarc's driver API with
//! `dynamic-loading`, libcuda opened at the first call. cudarc panics when
//! no library is found, so [`GpuDevice::open`] checks
//! [`cudarc::driver::sys::is_culib_present`] before any other call; what
//! went wrong is classed for the start-up refusal and `/v1/stats`
//! ([`GpuUnavailable`]).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use serde::Serialize;

/// Why no GPU tier could be opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuUnavailableKind {
    /// No `libcuda.so` the dynamic loader can find.
    NoDriver,
    /// The driver loaded but has no such device (`cuInit` or `cuDeviceGet`
    /// failed with "no device" or "invalid device").
    NoDevice,
    /// The device's memory could not hold the tier's first slab.
    OutOfMemory,
    /// Any other driver error.
    DriverError,
}

/// Why the GPU tier is absent, for the start-up refusal and `/v1/stats`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuUnavailable {
    /// The class of failure.
    pub kind: GpuUnavailableKind,
    /// What happened, in words.
    pub reason: String,
}

impl fmt::Display for GpuUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

impl std::error::Error for GpuUnavailable {}

/// A driver error met while opening the device or the tier, classed.
pub(super) fn driver_error(what: &str, e: DriverError) -> GpuUnavailable {
    let kind = match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_INVALID_DEVICE => GpuUnavailableKind::NoDevice,
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => GpuUnavailableKind::OutOfMemory,
        _ => GpuUnavailableKind::DriverError,
    };
    GpuUnavailable { kind, reason: format!("{what}: {}", describe(&e)) }
}

/// A driver error as `CUDA_ERROR_X (n): text`.
pub fn describe(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| "CUDA error".into());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name} ({}): {text}", e.0 as i32)
}

/// One CUDA device, opened once per process and shared by the shards.
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    /// Device ordinal (`--gpu-device`).
    pub ordinal: usize,
    /// `cuDeviceGetName`.
    pub name: String,
    /// Device memory in bytes (`cuDeviceTotalMem_v2`).
    pub total_bytes: u64,
    /// Free device memory in bytes when opened (`cuMemGetInfo_v2`).
    pub free_bytes_at_open: u64,
}

impl fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("total_bytes", &self.total_bytes)
            .finish()
    }
}

impl GpuDevice {
    /// Opens device `ordinal`: checks that a driver library can be loaded,
    /// then `cuInit`, the device, its primary context, name and memory.
    ///
    /// # Errors
    /// [`GpuUnavailableKind::NoDriver`] when no `libcuda.so` is found;
    /// [`GpuUnavailableKind::NoDevice`] when the driver has no such device;
    /// [`GpuUnavailableKind::DriverError`] for any other driver error.
    pub fn open(ordinal: usize) -> Result<Arc<GpuDevice>, GpuUnavailable> {
        // SAFETY: only tries to dlopen the candidate library names.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuUnavailable {
                kind: GpuUnavailableKind::NoDriver,
                reason: "no CUDA driver: libcuda.so (or libcuda.so.1) is not on the library path".into(),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_INVALID_DEVICE => {
                let count = CudaContext::device_count().unwrap_or(0);
                GpuUnavailable {
                    kind: GpuUnavailableKind::NoDevice,
                    reason: format!("no CUDA device {ordinal}: the driver reports {count} device(s)"),
                }
            }
            _ => driver_error(&format!("opening CUDA device {ordinal}"), e),
        })?;
        let name = ctx.name().map_err(|e| driver_error("cuDeviceGetName", e))?;
        let total_bytes = ctx.total_mem().map_err(|e| driver_error("cuDeviceTotalMem", e))? as u64;
        let (free, _) = ctx.mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok(Arc::new(GpuDevice { ctx, ordinal, name, total_bytes, free_bytes_at_open: free as u64 }))
    }

    /// Makes the device's context current on this thread (a no-op when it
    /// is).
    pub(super) fn bind(&self) -> Result<(), DriverError> {
        self.ctx.bind_to_thread()
    }

    /// Makes the device's context current on this thread, for callers that
    /// use cudarc's raw driver calls themselves (the GPU bench).
    ///
    /// # Errors
    /// The driver's.
    pub fn bind_to_thread(&self) -> Result<(), DriverError> {
        self.bind()
    }

    /// Free and total device memory now, in bytes.
    ///
    /// # Errors
    /// The driver's.
    pub fn mem_info(&self) -> Result<(u64, u64), DriverError> {
        let (free, total) = self.ctx.mem_get_info()?;
        Ok((free as u64, total as u64))
    }
}
