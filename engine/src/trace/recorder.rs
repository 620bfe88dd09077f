//! The recorder behind `kvtier serve --trace-dir`: each shard's buffer,
//! the writer thread, rotation and the bound on the directory (the module
//! above describes what it records and how).

use std::cell::RefCell;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;

use super::{
    unix_ms_now, Record, TraceHeader, TraceOp, TraceTier, TraceWriter, FILE_BYTES_MIN, FILE_SUFFIX, FLUSH_BYTES, RECORD_BYTES,
    WRITER_QUEUE_BUFFERS,
};
use crate::key::BlockHash;

/// The recorder's state, as `/v1/stats` (`trace`) and the admin route
/// show it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceStatus {
    /// Whether records are being taken now.
    pub recording: bool,
    /// The directory trace files go to.
    pub dir: PathBuf,
    /// Bound on the directory's trace files, bytes (`--trace-max-mb`).
    pub max_bytes: u64,
    /// A file is rotated at this size, bytes.
    pub file_bytes_max: u64,
    /// Records taken since start-up.
    pub records: u64,
    /// Records dropped since start-up: the writer's queue was full, or
    /// writing failed.
    pub dropped_records: u64,
    /// Bytes written to trace files since start-up.
    pub bytes_written: u64,
    /// Trace files deleted to stay under `max_bytes`.
    pub files_deleted: u64,
    /// Files of the current (or last) recording, oldest first, those
    /// deleted by rotation excluded.
    pub files: Vec<PathBuf>,
    /// The last write error, if any.
    pub last_error: Option<String>,
}

enum Msg {
    Start { header: TraceHeader, reply: futures::channel::oneshot::Sender<Result<PathBuf, String>> },
    Records(Vec<u8>),
    Stop { reply: futures::channel::oneshot::Sender<()> },
}

/// The recorder of one server: shared by every shard, one writer thread.
pub struct Recorder {
    dir: PathBuf,
    max_bytes: u64,
    file_bytes_max: u64,
    on: AtomicBool,
    origin: Instant,
    /// µs from `origin` to the current recording's start.
    base_us: AtomicU64,
    records: AtomicU64,
    dropped: AtomicU64,
    tx: SyncSender<Msg>,
    state: Arc<Mutex<WriterState>>,
    /// Serializes start and stop (an admin call on two shards at once).
    control: futures::lock::Mutex<()>,
    template: Mutex<Option<TraceHeader>>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder").field("dir", &self.dir).field("max_bytes", &self.max_bytes).field("on", &self.is_on()).finish()
    }
}

#[derive(Default)]
struct WriterState {
    bytes_written: u64,
    files_deleted: u64,
    files: Vec<PathBuf>,
    last_error: Option<String>,
}

impl Recorder {
    /// A recorder writing into `dir` (created if missing), its trace files
    /// bounded by `max_bytes` together; not recording until
    /// [`Recorder::start`]. Starts the writer thread.
    ///
    /// # Errors
    /// The directory cannot be created, or `max_bytes` is under 2 MiB.
    pub fn new(dir: &Path, max_bytes: u64) -> Result<Arc<Recorder>, String> {
        if max_bytes < 2 * FILE_BYTES_MIN {
            return Err(format!("--trace-max-mb must be at least {}, got {} MiB", (2 * FILE_BYTES_MIN) >> 20, max_bytes >> 20));
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create the trace directory {}: {e}", dir.display()))?;
        let file_bytes_max = (max_bytes / 4).max(FILE_BYTES_MIN);
        let (tx, rx) = sync_channel(WRITER_QUEUE_BUFFERS);
        let state = Arc::new(Mutex::new(WriterState::default()));
        let recorder = Arc::new(Recorder {
            dir: dir.to_path_buf(),
            max_bytes,
            file_bytes_max,
            on: AtomicBool::new(false),
            origin: Instant::now(),
            base_us: AtomicU64::new(0),
            records: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            tx,
            state: state.clone(),
            control: futures::lock::Mutex::new(()),
            template: Mutex::new(None),
        });
        let writer = Writer { dir: dir.to_path_buf(), max_bytes, file_bytes_max, state, recorder: Arc::downgrade(&recorder) };
        std::thread::Builder::new()
            .name("kvtier-trace".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| format!("cannot start the trace writer thread: {e}"))?;
        Ok(recorder)
    }

    /// Sets what every file's header says about the store (its
    /// `started_unix_ms` and `file_index` are filled in per file).
    pub fn set_header(&self, header: TraceHeader) {
        *self.template.lock().expect("trace template") = Some(header);
    }

    /// Whether records are being taken.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn now_us(&self) -> u64 {
        (self.origin.elapsed().as_micros() as u64).saturating_sub(self.base_us.load(Ordering::Relaxed))
    }

    /// Starts a recording into a new file (a no-op when recording).
    /// Returns the status.
    ///
    /// # Errors
    /// No header was set; the file cannot be created; the writer stopped.
    pub async fn start(&self) -> Result<TraceStatus, String> {
        let _control = self.control.lock().await;
        if self.is_on() {
            return Ok(self.status());
        }
        let mut header = self.template.lock().expect("trace template").clone().ok_or("the recorder has no header yet")?;
        header.started_unix_ms = unix_ms_now();
        let base = self.origin.elapsed().as_micros() as u64;
        let (reply, answer) = futures::channel::oneshot::channel();
        self.tx.send(Msg::Start { header, reply }).map_err(|_| "the trace writer has stopped")?;
        answer.await.map_err(|_| "the trace writer has stopped")??;
        self.base_us.store(base, Ordering::Relaxed);
        self.on.store(true, Ordering::SeqCst);
        Ok(self.status())
    }

    /// Stops taking records; `flush_all` must hand every shard's buffer to
    /// the writer; then the file is closed. Returns the status.
    pub async fn stop<F: std::future::Future<Output = ()>>(&self, flush_all: F) -> TraceStatus {
        let _control = self.control.lock().await;
        if !self.on.swap(false, Ordering::SeqCst) {
            return self.status();
        }
        flush_all.await;
        let (reply, answer) = futures::channel::oneshot::channel();
        if self.tx.send(Msg::Stop { reply }).is_ok() {
            let _ = answer.await;
        }
        self.status()
    }

    /// The recorder's counters and files.
    pub fn status(&self) -> TraceStatus {
        let s = self.state.lock().expect("trace state");
        TraceStatus {
            recording: self.is_on(),
            dir: self.dir.clone(),
            max_bytes: self.max_bytes,
            file_bytes_max: self.file_bytes_max,
            records: self.records.load(Ordering::Relaxed),
            dropped_records: self.dropped.load(Ordering::Relaxed),
            bytes_written: s.bytes_written,
            files_deleted: s.files_deleted,
            files: s.files.clone(),
            last_error: s.last_error.clone(),
        }
    }

    fn hand_over(&self, buf: Vec<u8>) {
        let n = (buf.len() / RECORD_BYTES) as u64;
        match self.tx.try_send(Msg::Records(buf)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

/// One shard's side of the recorder: its own buffer (`!Send`).
pub struct ShardTrace {
    recorder: Arc<Recorder>,
    buf: RefCell<Vec<u8>>,
}

impl ShardTrace {
    /// This shard's buffer for `recorder`.
    pub fn new(recorder: Arc<Recorder>) -> Self {
        ShardTrace { recorder, buf: RefCell::new(Vec::with_capacity(FLUSH_BYTES)) }
    }

    /// The shared recorder.
    pub fn recorder(&self) -> &Arc<Recorder> {
        &self.recorder
    }

    /// Whether records are being taken (check before building them).
    pub fn is_on(&self) -> bool {
        self.recorder.is_on()
    }

    /// Appends the records of one call: `(hash, tier)` for each of its
    /// keys, in order (`pos` is the index), all with one time; hands the
    /// buffer over when full. Nothing when the recorder is off.
    pub fn record_call(&self, op: TraceOp, shards: usize, keys: impl IntoIterator<Item = (BlockHash, TraceTier)>) {
        if !self.is_on() {
            return;
        }
        let time_us = self.recorder.now_us();
        let mut buf = self.buf.borrow_mut();
        let before = buf.len();
        for (pos, (hash, tier)) in keys.into_iter().enumerate() {
            let shard = hash.shard(shards.max(1)) as u16;
            Record { time_us, hash, op, tier, shard, pos: pos as u32 }.encode(&mut buf);
        }
        self.recorder.records.fetch_add(((buf.len() - before) / RECORD_BYTES) as u64, Ordering::Relaxed);
        if buf.len() >= FLUSH_BYTES {
            let full = std::mem::replace(&mut *buf, Vec::with_capacity(FLUSH_BYTES));
            drop(buf);
            self.recorder.hand_over(full);
        }
    }

    /// Hands whatever the buffer holds to the writer.
    pub fn flush(&self) {
        let mut buf = self.buf.borrow_mut();
        if buf.is_empty() {
            return;
        }
        let full = std::mem::replace(&mut *buf, Vec::with_capacity(FLUSH_BYTES));
        drop(buf);
        self.recorder.hand_over(full);
    }
}

/// The writer thread: owns the open file, rotates and bounds the files.
struct Writer {
    dir: PathBuf,
    max_bytes: u64,
    file_bytes_max: u64,
    state: Arc<Mutex<WriterState>>,
    recorder: std::sync::Weak<Recorder>,
}

struct OpenFile {
    writer: TraceWriter,
    header: TraceHeader,
}

impl Writer {
    fn run(self, rx: Receiver<Msg>) {
        let mut open: Option<OpenFile> = None;
        while let Ok(msg) = rx.recv() {
            match msg {
                Msg::Start { header, reply } => {
                    self.close(open.take());
                    self.state.lock().expect("trace state").files.clear();
                    let opened = self.open(header);
                    let answer = opened.as_ref().map(|f| self.path_of(&f.header)).map_err(Clone::clone);
                    open = opened.ok();
                    let _ = reply.send(answer);
                }
                Msg::Records(buf) => {
                    let Some(file) = open.as_mut() else {
                        self.drop_records(&buf);
                        continue;
                    };
                    if let Err(e) = file.writer.write_encoded(&buf) {
                        self.failed(format!("writing {}: {e}", self.path_of(&file.header).display()));
                        self.drop_records(&buf);
                        continue;
                    }
                    self.state.lock().expect("trace state").bytes_written += buf.len() as u64;
                    if file.writer.bytes() >= self.file_bytes_max {
                        let mut next = file.header.clone();
                        next.file_index += 1;
                        self.close(open.take());
                        open = self.open(next).ok();
                    }
                }
                Msg::Stop { reply } => {
                    self.close(open.take());
                    let _ = reply.send(());
                }
            }
        }
        self.close(open.take());
    }

    fn path_of(&self, header: &TraceHeader) -> PathBuf {
        self.dir.join(format!("trace-{}-{:04}{FILE_SUFFIX}", header.started_unix_ms, header.file_index))
    }

    fn drop_records(&self, buf: &[u8]) {
        if let Some(r) = self.recorder.upgrade() {
            r.dropped.fetch_add((buf.len() / RECORD_BYTES) as u64, Ordering::Relaxed);
        }
    }

    fn failed(&self, error: String) {
        let mut s = self.state.lock().expect("trace state");
        if s.last_error.as_deref() != Some(&error) {
            tracing::warn!("trace recorder: {error}; records are dropped (counted in /v1/stats trace.dropped_records)");
        }
        s.last_error = Some(error);
    }

    /// Deletes the oldest trace files of the directory until a new file of
    /// `file_bytes_max` fits under `max_bytes`, then creates it.
    fn open(&self, header: TraceHeader) -> Result<OpenFile, String> {
        let mut existing: Vec<(PathBuf, u64)> = std::fs::read_dir(&self.dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| {
                        e.file_name().to_string_lossy().starts_with("trace-") && e.file_name().to_string_lossy().ends_with(FILE_SUFFIX)
                    })
                    .filter_map(|e| Some((e.path(), e.metadata().ok()?.len())))
                    .collect()
            })
            .unwrap_or_default();
        // Names sort by start time, then file index: oldest first.
        existing.sort();
        let mut total: u64 = existing.iter().map(|(_, n)| n).sum();
        for (path, len) in existing {
            if total + self.file_bytes_max <= self.max_bytes {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
                let mut s = self.state.lock().expect("trace state");
                s.files_deleted += 1;
                s.files.retain(|f| f != &path);
            }
        }
        let path = self.path_of(&header);
        match TraceWriter::create(&path, &header) {
            Ok(writer) => {
                let mut s = self.state.lock().expect("trace state");
                s.bytes_written += writer.bytes();
                s.files.push(path);
                Ok(OpenFile { writer, header })
            }
            Err(e) => {
                let error = format!("cannot create {}: {e}", path.display());
                self.failed(error.clone());
                Err(error)
            }
        }
    }

    fn close(&self, file: Option<OpenFile>) {
        if let Some(f) = file {
            let path = self.path_of(&f.header);
            if let Err(e) = f.writer.finish() {
                self.failed(format!("closing {}: {e}", path.display()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{read, TraceHeader};

    #[test]
    fn the_recorder_rotates_and_bounds_its_files() {
        let dir = tempfile::tempdir().unwrap();
        // 4 MiB bound: files rotate at 1 MiB; 3 MiB of records keep the total under 4 MiB.
        let r = Recorder::new(dir.path(), 4 << 20).unwrap();
        r.set_header(TraceHeader::new("test", "custom", 65536, 16, 2));
        futures::executor::block_on(r.start()).unwrap();
        let shard = ShardTrace::new(r.clone());
        let n = 6 * (1 << 20) / RECORD_BYTES;
        for i in 0..n {
            shard.record_call(TraceOp::Put, 2, [(BlockHash(i as u128), TraceTier::None)]);
            if i % 20_000 == 0 {
                // Let the writer keep up: this test is not about drops.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        let status = futures::executor::block_on(r.stop(async { shard.flush() }));
        assert!(!status.recording);
        assert_eq!(status.records, n as u64);
        assert!(status.files_deleted >= 2, "{status:?}");
        let total: u64 = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
        assert!(total <= 4 << 20, "{total} bytes on disk");
        // Every kept file reads on its own, with its own header.
        let mut kept = 0;
        for f in &status.files {
            let t = read(f).unwrap();
            assert_eq!(t.header.file_index as usize, kept + status.files_deleted as usize);
            kept += 1;
            assert!(t.records.windows(2).all(|w| w[0].hash.0 < w[1].hash.0));
        }
        assert_eq!(kept, status.files.len());
        // Stopped: nothing more is taken.
        shard.record_call(TraceOp::Put, 2, [(BlockHash(1), TraceTier::None)]);
        assert_eq!(r.status().records, n as u64);
    }
}
