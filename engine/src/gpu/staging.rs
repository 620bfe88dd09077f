//! Pinned staging: the host buffers every copy to or from the device goes
//! through, allocated with `CU_MEMHOSTALLOC_PORTABLE` (cudarc's default
//! pinned allocation is write-combined, slow for the CPU to read),
//! [`GPU_STAGING_BUFFERS`] per shard, each with the event of its last copy.
//! A buffer goes back to the pool when its guard drops, and is used again
//! only after that event completed (the tier waits for it), so a read
//! abandoned half way cannot have its buffer overwritten under the copy.

use std::cell::RefCell;

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use glommio::sync::Semaphore;

/// Pinned staging buffers (one block each) per shard: copies in flight at
/// once on the shard's stream.
pub const GPU_STAGING_BUFFERS: usize = 2;

/// A pinned host buffer of one block and the event of its last copy.
pub(super) struct Staging {
    ptr: *mut u8,
    len: usize,
    pub event: sys::CUevent,
}

impl Staging {
    pub fn new(len: usize) -> Result<Staging, DriverError> {
        // SAFETY: a fresh allocation; freed in Drop.
        let ptr = unsafe { cu::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }?.cast::<u8>();
        let event = match cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: allocated just above, not shared.
                let _ = unsafe { cu::free_host(ptr.cast()) };
                return Err(e);
            }
        };
        Ok(Staging { ptr, len, event })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated in `new`; only read after the copy
        // into it completed (see `GpuTier::wait`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; written only when no copy from it is in flight.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: the event and buffer from `new`. Synchronizing first: a
        // copy may still use the buffer.
        unsafe {
            let _ = cu::event::synchronize(self.event);
            let _ = cu::event::destroy(self.event);
            let _ = cu::free_host(self.ptr.cast());
        }
    }
}

/// A shard's staging buffers, [`GPU_STAGING_BUFFERS`] once the tier is
/// open, and a permit per buffer not taken.
pub(super) struct StagingPool {
    buffers: RefCell<Vec<Staging>>,
    free: Semaphore,
}

impl StagingPool {
    /// A pool with room for [`GPU_STAGING_BUFFERS`]; fill it with
    /// [`StagingPool::add`].
    pub fn new() -> StagingPool {
        StagingPool { buffers: RefCell::new(Vec::new()), free: Semaphore::new(GPU_STAGING_BUFFERS as u64) }
    }

    /// Adds a buffer (while the tier opens).
    pub fn add(&mut self, buf: Staging) {
        self.buffers.get_mut().push(buf);
    }

    /// Takes a buffer out of the pool, waiting for one to come back. Its
    /// last copy may still run: wait for its event before using it.
    pub async fn take(&self) -> StagingGuard<'_> {
        let permit = self.free.acquire_permit(1).await.expect("the staging semaphore is never closed");
        let buf = self.buffers.borrow_mut().pop().expect("a permit means a buffer");
        StagingGuard { pool: self, buf: Some(buf), _permit: permit }
    }

    /// Frees every buffer (each waits for its last copy first).
    pub fn clear(&mut self) {
        self.buffers.get_mut().clear();
    }
}

/// A staging buffer out of the pool; goes back on drop.
pub(super) struct StagingGuard<'a> {
    pool: &'a StagingPool,
    buf: Option<Staging>,
    _permit: glommio::sync::Permit<'a>,
}

impl StagingGuard<'_> {
    pub fn buf(&self) -> &Staging {
        self.buf.as_ref().expect("held until drop")
    }

    pub fn buf_mut(&mut self) -> &mut Staging {
        self.buf.as_mut().expect("held until drop")
    }
}

impl Drop for StagingGuard<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.buffers.borrow_mut().push(b);
        }
    }
}
