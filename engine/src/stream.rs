//! A block on its way to a client: whole, or as verified chunks.
//!
//! A block read from the log is not sent after the whole of it has been read
//! and checked: the shard that owns it reads its chunks (format 2 slots carry
//! a CRC-32 per chunk, `crate::slot::CHUNK_BYTES_DEFAULT` = 1 MiB), checks
//! each as soon as it is read and hands it over at once, with the next reads
//! already in flight, so device time and network time overlap. A
//! [`ChunkStream`] is the receiving end. A GET that arrived on another
//! shard gets every chunk at once, once all have passed on the owner: one
//! message across the shard mesh, not one per chunk.
//!
//! A chunk from the log is the DMA buffer the device read it into, not a
//! copy ([`dma_chunk`]): its CRC-32 is computed over that buffer and the
//! network send reads it from there, on whichever shard sends it. Such a
//! buffer belongs to its shard's executor and is freed there: a chunk
//! dropped on another shard's thread is sent home and dropped by its
//! shard's [`return_chunks_home`] task. Only a chunk whose shard has
//! stopped (or that was read outside a shard) is leaked instead, and
//! counted ([`dma_chunks_leaked`]).
//!
//! A chunk that fails its CRC-32 never leaves the shard: the stream yields
//! [`Error::Corrupt`] instead (the block has been dropped and counted), and
//! the HTTP layer resets the response (HTTP/2 `RST_STREAM`, HTTP/1.1 closes
//! the connection before the declared `Content-Length`), which clients treat
//! as a miss.

use std::cell::RefCell;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::thread::{self, ThreadId};

use bytes::{Bytes, BytesMut};
use futures::channel::mpsc;
use futures::{Stream, StreamExt};
use glommio::io::ReadResult;

use crate::error::{Error, Result};

/// DMA chunks dropped on a thread other than their shard's, and leaked.
static DMA_CHUNKS_LEAKED: AtomicU64 = AtomicU64::new(0);

/// DMA chunks dropped on a thread other than their shard's and sent home.
static DMA_CHUNKS_SENT_HOME: AtomicU64 = AtomicU64::new(0);

/// A read on its way back to the thread that owns it, to be dropped there.
struct Homebound(ReadResult);

// SAFETY: a `Homebound` is only moved (never read, cloned or dropped) on
// the way: its sender moves it into the channel, and the owning thread's
// `return_chunks_home` task takes it out and drops it, so the `Rc` inside
// and the executor's allocator are only ever touched on that thread.
unsafe impl Send for Homebound {}

thread_local! {
    /// This thread's way home for its DMA chunks, once its shard runs
    /// [`return_chunks_home`].
    static HOME: RefCell<Option<mpsc::UnboundedSender<Homebound>>> = const { RefCell::new(None) };
}

/// Makes this thread (a shard's executor) the home of the DMA chunks it
/// reads from now on, and returns the task to spawn on it for as long as
/// the shard serves: it drops those chunks that were dropped on other
/// threads (a GET forwarded from another shard is sent from the owner's
/// DMA buffers by the shard that took the request). The task ends only
/// with its executor; chunks dropped elsewhere after that are leaked.
pub fn return_chunks_home() -> impl std::future::Future<Output = ()> {
    let (tx, mut rx) = mpsc::unbounded::<Homebound>();
    HOME.with(|h| *h.borrow_mut() = Some(tx));
    async move {
        while let Some(read) = rx.next().await {
            drop(read);
        }
    }
}

/// How many chunks dropped on another shard's thread were sent home and
/// freed there (the normal end of a chunk of a forwarded GET).
pub fn dma_chunks_sent_home() -> u64 {
    DMA_CHUNKS_SENT_HOME.load(Ordering::Relaxed)
}

/// How many chunks were dropped away from the shard thread that read them
/// and could not be sent home (their shard had stopped, or they were read
/// outside a shard), and so were leaked instead of freed (0 while every
/// shard serves).
pub fn dma_chunks_leaked() -> u64 {
    DMA_CHUNKS_LEAKED.load(Ordering::Relaxed)
}

/// The `range` of a completed glommio read as [`Bytes`], without a copy.
///
/// glommio's [`ReadResult`] is not `Send`: it holds its I/O source by `Rc`,
/// and its buffer (often from the executor's registered I/O memory) goes
/// back to that executor's allocator when the last reference drops. The
/// owner here lets the bytes travel as `Bytes` (reading them from any
/// thread is sound: a completed read's buffer is never written again while
/// referenced), and makes the drop safe: on the thread that read it, the
/// buffer is freed as usual; anywhere else it is leaked, counted in
/// [`dma_chunks_leaked`] and logged, never freed from a foreign thread.
///
/// # Panics
/// If `range` is not within the read.
pub fn dma_chunk(read: ReadResult, range: Range<usize>) -> Bytes {
    let home = HOME.with(|h| h.borrow().clone());
    Bytes::from_owner(ShardLocalRead { read: Some(read), thread: thread::current().id(), home }).slice(range)
}

/// The owner behind [`dma_chunk`].
struct ShardLocalRead {
    read: Option<ReadResult>,
    thread: ThreadId,
    /// The reading thread's [`return_chunks_home`] task, if it runs one.
    home: Option<mpsc::UnboundedSender<Homebound>>,
}

// SAFETY: another thread can only call `as_ref` (reads the buffer's pointer
// and length, never the `Rc` count) and `drop`, which off the owning thread
// moves the read home untouched, or leaks it, instead of touching its `Rc`
// or its executor's allocator.
unsafe impl Send for ShardLocalRead {}
// SAFETY: `as_ref` only reads immutable state (see `Send`).
unsafe impl Sync for ShardLocalRead {}

impl AsRef<[u8]> for ShardLocalRead {
    fn as_ref(&self) -> &[u8] {
        self.read.as_deref().expect("held until dropped")
    }
}

impl Drop for ShardLocalRead {
    fn drop(&mut self) {
        if thread::current().id() != self.thread {
            let read = self.read.take().expect("held until dropped");
            let read = match &self.home {
                Some(home) => match home.unbounded_send(Homebound(read)) {
                    Ok(()) => {
                        DMA_CHUNKS_SENT_HOME.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(refused) => refused.into_inner().0,
                },
                None => read,
            };
            let bytes = read.len();
            std::mem::forget(read);
            DMA_CHUNKS_LEAKED.fetch_add(1, Ordering::Relaxed);
            tracing::error!(bytes, "a streamed chunk was dropped away from its shard thread; its DMA buffer is leaked");
        }
    }
}

/// The payload of a block read back.
#[derive(Debug)]
pub enum BlockBody {
    /// The whole block in one buffer: a RAM-tier slot (zero-copy), or a
    /// format 1 slot (whole-block CRC only, so checked before it is sent).
    Whole(Bytes),
    /// Verified chunks in order, the first already read.
    Chunks(ChunkStream),
}

impl BlockBody {
    /// Payload length in bytes (`block_bytes`).
    pub fn len(&self) -> u64 {
        match self {
            BlockBody::Whole(b) => b.len() as u64,
            BlockBody::Chunks(s) => s.len,
        }
    }

    /// Whether the payload is empty (never, for a stored block).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole payload in one buffer: free for [`BlockBody::Whole`], one
    /// copy of every chunk for [`BlockBody::Chunks`] (for callers that need
    /// contiguous bytes; the server sends the chunks as they come).
    ///
    /// # Errors
    /// The stream's error: [`Error::Corrupt`] when a chunk failed its check,
    /// [`Error::Io`] when a read failed or the stream ended short.
    pub async fn collect(self) -> Result<Bytes> {
        match self {
            BlockBody::Whole(b) => Ok(b),
            BlockBody::Chunks(mut s) => {
                let mut out = BytesMut::with_capacity(s.len as usize);
                while let Some(chunk) = s.next().await {
                    out.extend_from_slice(&chunk?);
                }
                Ok(out.freeze())
            }
        }
    }
}

/// Memory outside the store that a block is copied into: a client's
/// registered buffer on the same-host data plane (docs/LOCAL.md). The
/// engine calls it on the shard that owns the block, once per verified
/// chunk, in order, so a block from the log is copied once after the device
/// read and a block from RAM once in all.
pub trait BlockSink: Send + Sync {
    /// Copies `chunk` to `offset` bytes into the destination.
    ///
    /// # Errors
    /// The destination cannot take it (a client's file shrank under its
    /// registration); the read stops and fails with this error.
    fn write_at(&self, offset: u64, chunk: &[u8]) -> std::io::Result<()>;
}

impl BlockBody {
    /// Copies the payload into `sink`, chunk by chunk as it is verified;
    /// returns the bytes copied (`block_bytes`).
    ///
    /// # Errors
    /// As [`BlockBody::collect`]; [`Error::Io`] when the sink refused a chunk.
    pub async fn copy_into(self, sink: &dyn BlockSink) -> Result<u64> {
        let mut at = 0u64;
        let mut put = |chunk: &[u8]| -> Result<()> {
            sink.write_at(at, chunk).map_err(|e| Error::io(format!("copying {} bytes at {at} into a client's buffer", chunk.len()), e))?;
            at += chunk.len() as u64;
            Ok(())
        };
        match self {
            BlockBody::Whole(b) => put(&b)?,
            BlockBody::Chunks(mut s) => {
                while let Some(chunk) = s.next().await {
                    put(&chunk?)?;
                }
            }
        }
        Ok(at)
    }
}

/// Verified chunks of one block, in order. Yields `Ok(chunk)` until
/// [`ChunkStream::len`] bytes have come, then ends; or one `Err` and ends.
/// A stream the shard abandons (shutdown) yields an [`Error::Io`] naming
/// how far it got, never a silent short block.
#[derive(Debug)]
pub struct ChunkStream {
    len: u64,
    sent: u64,
    first: Option<Bytes>,
    rest: mpsc::Receiver<Result<Bytes>>,
    ended: bool,
}

impl ChunkStream {
    /// A stream of `len` bytes whose first chunk is `first`, the rest to
    /// come on `rest`.
    pub(crate) fn new(len: u64, first: Bytes, rest: mpsc::Receiver<Result<Bytes>>) -> Self {
        ChunkStream { len, sent: 0, first: Some(first), rest, ended: false }
    }

    /// A stream of `len` bytes already in memory as `parts` (a block in
    /// transit between tiers, such as a PUT's body frames), without a copy.
    pub(crate) fn from_parts(len: u64, parts: Vec<Bytes>) -> Self {
        let mut parts = parts.into_iter().filter(|p| !p.is_empty());
        let first = parts.next().unwrap_or_default();
        let rest: Vec<Bytes> = parts.collect();
        let (mut tx, rx) = mpsc::channel(rest.len());
        for p in rest {
            tx.try_send(Ok(p)).expect("the channel holds every part");
        }
        ChunkStream::new(len, first, rx)
    }

    /// Payload length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes not yet yielded.
    pub fn remaining(&self) -> u64 {
        self.len - self.sent
    }

    fn yielded(&mut self, item: Result<Bytes>) -> Poll<Option<Result<Bytes>>> {
        match &item {
            Ok(chunk) if self.sent + chunk.len() as u64 <= self.len => self.sent += chunk.len() as u64,
            Ok(chunk) => {
                self.ended = true;
                return Poll::Ready(Some(Err(short(format!(
                    "a chunk of {} bytes after {} of {} bytes overruns the block",
                    chunk.len(),
                    self.sent,
                    self.len
                )))));
            }
            Err(_) => self.ended = true,
        }
        Poll::Ready(Some(item))
    }
}

fn short(what: String) -> Error {
    Error::Io { context: "streaming a block".into(), source: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what) }
}

impl Stream for ChunkStream {
    type Item = Result<Bytes>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes>>> {
        if self.ended || self.sent == self.len && self.first.is_none() {
            return Poll::Ready(None);
        }
        if let Some(first) = self.first.take() {
            return self.yielded(Ok(first));
        }
        match self.rest.poll_next_unpin(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(item)) => self.yielded(item),
            Poll::Ready(None) => {
                self.ended = true;
                let what = format!("the shard stopped after {} of {} bytes", self.sent, self.len);
                Poll::Ready(Some(Err(short(what))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(len: u64, first: &'static [u8], rest: Vec<Result<Bytes>>) -> ChunkStream {
        let (mut tx, rx) = mpsc::channel(rest.len().max(1));
        for item in rest {
            tx.try_send(item).unwrap();
        }
        ChunkStream::new(len, Bytes::from_static(first), rx)
    }

    /// The tests that read the process-wide chunk counters, one at a time.
    static COUNTERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A file of 8 KiB for O_DIRECT reads, and its bytes.
    fn chunk_file(dir: &tempfile::TempDir) -> (std::path::PathBuf, Vec<u8>) {
        let path = dir.path().join("chunk.bin");
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&path).unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
        }
        (path, data)
    }

    /// A chunk made from a real O_DIRECT read holds exactly its range of the
    /// file; dropped on its own thread it is freed, dropped on another
    /// thread with no way home (read outside a shard) it is leaked and
    /// counted (and nothing crashes).
    #[test]
    fn a_dma_chunk_is_its_range_of_the_read_and_a_foreign_drop_leaks_it() {
        let _one = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = chunk_file(&dir);
        let expected = data[100..5000].to_vec();
        let leaked_before = dma_chunks_leaked();
        let (local, foreign) = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .spawn(move || async move {
                let file = glommio::io::DmaFile::open(&path).await.unwrap();
                let local = dma_chunk(file.read_at_aligned(0, 8192).await.unwrap(), 100..5000);
                let foreign = dma_chunk(file.read_at_aligned(0, 8192).await.unwrap(), 0..4096);
                let local_ok = local[..] == expected[..];
                drop(local);
                assert_eq!(dma_chunks_leaked(), leaked_before, "a chunk dropped on its own thread is freed");
                file.close().await.unwrap();
                (local_ok, foreign)
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(local, "the chunk's bytes are the read's range");
        assert_eq!(&foreign[..], &data[..4096], "readable from another thread");
        drop(foreign);
        assert_eq!(dma_chunks_leaked(), leaked_before + 1);
    }

    /// A chunk read on a thread that runs `return_chunks_home` (a shard),
    /// dropped on another thread (the shard that sent a forwarded GET), is
    /// sent home and freed there, while its executor is still serving:
    /// nothing leaks.
    #[test]
    fn a_dma_chunk_dropped_on_another_thread_goes_home() {
        let _one = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = chunk_file(&dir);
        let (leaked_before, home_before) = (dma_chunks_leaked(), dma_chunks_sent_home());
        let (chunk_tx, chunk_rx) = std::sync::mpsc::channel();
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = dropped.clone();
        let shard = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .spawn(move || async move {
                glommio::spawn_local(return_chunks_home()).detach();
                let file = glommio::io::DmaFile::open(&path).await.unwrap();
                chunk_tx.send(dma_chunk(file.read_at_aligned(0, 8192).await.unwrap(), 4096..8192)).unwrap();
                while !seen.load(Ordering::SeqCst) {
                    glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
                }
                // The home task's turn: it frees the chunk on this thread.
                glommio::timer::sleep(std::time::Duration::from_millis(20)).await;
                file.close().await.unwrap();
            })
            .unwrap();
        let chunk = chunk_rx.recv().unwrap();
        assert_eq!(&chunk[..], &data[4096..]);
        drop(chunk);
        dropped.store(true, Ordering::SeqCst);
        shard.join().unwrap();
        // At least: a store test running beside this one may send its own.
        assert!(dma_chunks_sent_home() > home_before, "sent home");
        assert_eq!(dma_chunks_leaked(), leaked_before, "not leaked");
    }

    #[test]
    fn chunks_come_in_order_and_the_stream_ends_at_the_length() {
        let s = stream(6, b"ab", vec![Ok(Bytes::from_static(b"cd")), Ok(Bytes::from_static(b"ef"))]);
        let got = futures::executor::block_on(BlockBody::Chunks(s).collect()).unwrap();
        assert_eq!(&got[..], b"abcdef");
    }

    #[test]
    fn parts_in_memory_stream_whole_skipping_empty_ones() {
        let parts = ["", "ab", "", "cde", "f"].map(|p| Bytes::from_static(p.as_bytes())).to_vec();
        let got = futures::executor::block_on(BlockBody::Chunks(ChunkStream::from_parts(6, parts)).collect()).unwrap();
        assert_eq!(&got[..], b"abcdef");
        let short = vec![Bytes::from_static(b"abc")];
        assert!(futures::executor::block_on(BlockBody::Chunks(ChunkStream::from_parts(6, short)).collect()).is_err());
    }

    #[test]
    fn an_error_or_a_short_stream_is_never_a_complete_block() {
        let s = stream(6, b"ab", vec![Err(Error::Corrupt { segment: 1, slot: 2 })]);
        let e = futures::executor::block_on(BlockBody::Chunks(s).collect()).unwrap_err();
        assert!(matches!(e, Error::Corrupt { segment: 1, slot: 2 }), "{e}");
        // The sender dropped after 4 of 6 bytes.
        let s = stream(6, b"ab", vec![Ok(Bytes::from_static(b"cd"))]);
        let e = futures::executor::block_on(BlockBody::Chunks(s).collect()).unwrap_err();
        assert!(e.to_string().contains("4 of 6 bytes"), "{e}");
        // Too many bytes.
        let s = stream(3, b"ab", vec![Ok(Bytes::from_static(b"cd"))]);
        assert!(futures::executor::block_on(BlockBody::Chunks(s).collect()).is_err());
    }
}
