//! Reusable buffers for GET responses: whole blocks (format 1 slots) and
//! chunks (format 2 slots, streamed).
//!
//! A GET copies the verified payload out of the DMA read buffer into a
//! `Bytes` the HTTP layer can send from any thread. Allocating that buffer
//! fresh each time costs page faults on every 4 KiB of it: measured here,
//! 8–12 ms to fill a new 16 MiB buffer against ~2 ms for one already mapped,
//! half again the device read time. So buffers come from a pool and go back
//! to it when the last `Bytes` referring to them drops, on whichever thread
//! that is (forwarded GETs end on another shard), hence the mutex: it is
//! taken once per block, beside a multi-millisecond copy.

use std::sync::{Arc, Mutex};

use bytes::Bytes;

/// Bytes of idle buffers a pool keeps per shard: 128 MiB (8 blocks of the
/// default 16 MiB). Bursts beyond it allocate, and those buffers are freed.
pub const POOL_BYTES_MAX: u64 = 128 << 20;

/// A pool of buffers of `buffer_bytes` each.
#[derive(Debug)]
pub struct BufferPool {
    buffer_bytes: usize,
    idle_max: usize,
    idle: Mutex<Vec<Vec<u8>>>,
}

impl BufferPool {
    /// A pool of `buffer_bytes` buffers (a block, or a chunk), keeping at
    /// most [`POOL_BYTES_MAX`] of idle buffers (at least one).
    pub fn new(buffer_bytes: u64) -> Arc<Self> {
        let idle_max = (POOL_BYTES_MAX / buffer_bytes.max(1)).max(1) as usize;
        Arc::new(BufferPool { buffer_bytes: buffer_bytes as usize, idle_max, idle: Mutex::new(Vec::new()) })
    }

    /// Copies `parts` (together at most `buffer_bytes`) into a pooled buffer
    /// in cache-sized steps, handing each step to `inspect` just before it
    /// is copied, so a checksum and the copy read the bytes while they are
    /// hot in cache rather than in two passes over the whole block.
    pub fn copy_parts(self: &Arc<Self>, parts: &[&[u8]], mut inspect: impl FnMut(&[u8])) -> Bytes {
        let mut filler = self.filler();
        let mut at = 0;
        for part in parts {
            filler.fill(at, part, &mut inspect);
            at += part.len();
        }
        filler.freeze(at)
    }

    /// A pooled buffer to fill piece by piece ([`Filler::fill`]) and hand
    /// out once complete ([`Filler::freeze`]); dropped unfrozen, it goes
    /// back to the pool and nobody ever sees its bytes.
    pub fn filler(self: &Arc<Self>) -> Filler {
        let buf = self.idle.lock().expect("pool lock").pop().unwrap_or_else(|| vec![0u8; self.buffer_bytes]);
        Filler { buf: Some(buf), pool: self.clone() }
    }

    /// Idle buffers now.
    pub fn idle(&self) -> usize {
        self.idle.lock().expect("pool lock").len()
    }
}

/// A pooled buffer being filled (see [`BufferPool::filler`]).
pub struct Filler {
    buf: Option<Vec<u8>>,
    pool: Arc<BufferPool>,
}

impl Filler {
    /// Copies `bytes` to `at`, in cache-sized steps, handing each step to
    /// `inspect` just before it is copied (a CRC reads it while hot).
    ///
    /// # Panics
    /// If the bytes do not fit the pool's buffer size.
    pub fn fill(&mut self, at: usize, bytes: &[u8], mut inspect: impl FnMut(&[u8])) {
        const STEP_BYTES: usize = 256 << 10;
        let buf = self.buf.as_mut().expect("not frozen");
        assert!(at + bytes.len() <= buf.len(), "{} bytes at {at} do not fit a pooled buffer of {}", bytes.len(), buf.len());
        let mut to = at;
        for step in bytes.chunks(STEP_BYTES) {
            inspect(step);
            buf[to..to + step.len()].copy_from_slice(step);
            to += step.len();
        }
    }

    /// The first `len` bytes as a `Bytes`; the buffer returns to the pool
    /// when its last clone drops, on whichever thread.
    pub fn freeze(mut self, len: usize) -> Bytes {
        let buf = self.buf.take().expect("not frozen");
        assert!(len <= buf.len());
        Bytes::from_owner(Pooled { buf, len, pool: self.pool.clone() })
    }
}

impl Drop for Filler {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf);
        }
    }
}

impl BufferPool {
    fn give_back(&self, buf: Vec<u8>) {
        let mut idle = self.idle.lock().expect("pool lock");
        if idle.len() < self.idle_max {
            idle.push(buf);
        }
    }
}

struct Pooled {
    buf: Vec<u8>,
    len: usize,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_return_to_the_pool_from_any_thread() {
        let pool = BufferPool::new(4096);
        let a = pool.copy_parts(&[&[7u8; 4096]], |_| {});
        let b = a.slice(10..20);
        drop(a);
        assert_eq!(pool.idle(), 0, "a slice still holds the buffer");
        std::thread::spawn(move || drop(b)).join().unwrap();
        assert_eq!(pool.idle(), 1);
        let c = pool.copy_parts(&[&[9u8; 2048], &[9u8; 1000]], |_| {});
        assert_eq!(c.len(), 3048, "a short last chunk keeps its length");
        assert!(c.iter().all(|x| *x == 9));
        assert_eq!(pool.idle(), 0, "the idle buffer was reused");
    }
}
