//! Block-operation traces (docs/TRACE.md): the file format, its reader and
//! writer, and the recorder behind `kvtier serve --trace-dir`.
//!
//! A trace names every block operation a store served (PUT, GET, HEAD,
//! lookup, DELETE, prefetch) by its block hash, never its key or bytes, so
//! `kvtier-loadgen size` can compute how the hit ratio grows with each
//! tier's capacity (miss-ratio curves) from a workload recorded once.
//!
//! **Format, version 1** (little-endian):
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVTTRACE` |
//! | 8 | 2 | format version ([`VERSION`]) |
//! | 10 | 2 | record size in bytes ([`RECORD_BYTES`], 32) |
//! | 12 | 4 | header length `H` in bytes, at most [`HEADER_BYTES_MAX`] |
//! | 16 | `H` | [`TraceHeader`] as JSON: geometry, tier sizes, start time |
//! | 16 + `H` | 32 each | records to the end of the file |
//!
//! A record ([`Record`]): `time_us` u64 (since the header's
//! `started_unix_ms`), `block_hash` u128 (xxh3-128 of the key, as the
//! index keeps it), `op` u8 ([`TraceOp`]), `tier` u8 ([`TraceTier`]),
//! `shard` u16 (the shard owning the key), `pos` u32 (the key's index in
//! its call: a lookup's chain, a HEAD batch, a prefetch; 0 otherwise).
//! A store has one block size, named in the header, so a record carries
//! none.
//!
//! **Recording.** Each shard appends records to its own buffer on the
//! request path (a relaxed atomic load when the recorder is off; 32 bytes
//! appended when on) and hands a full buffer ([`FLUSH_BYTES`]) to one
//! writer thread over a bounded channel; a buffer the channel has no room
//! for is dropped and its records counted ([`TraceStatus::dropped_records`]),
//! never waited for. Records of one call are appended together, so a
//! lookup's chain stays contiguous. The writer rotates files at a quarter
//! of `--trace-max-mb` and deletes the oldest trace files of the directory
//! to keep the total under it. Records from different shards reach the
//! file in buffer order: a reader sorts them by time ([`read`] does).

use std::cell::RefCell;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::key::BlockHash;
use crate::tier::Tier;

/// The first 8 bytes of every trace file.
pub const MAGIC: [u8; 8] = *b"KVTTRACE";

/// The format version this build writes and the newest it reads.
pub const VERSION: u16 = 1;

/// Bytes of one record.
pub const RECORD_BYTES: usize = 32;

/// Bytes before the header JSON: magic, version, record size, length.
pub const PREAMBLE_BYTES: usize = 16;

/// Longest header JSON accepted, in bytes (64 KiB; ours is ~400).
pub const HEADER_BYTES_MAX: u32 = 64 << 10;

/// A shard hands its buffer to the writer once it holds this many bytes
/// (2,048 records), and at least every [`FLUSH_EVERY`].
pub const FLUSH_BYTES: usize = 64 << 10;

/// How often a shard flushes a partly filled buffer.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Buffers queued for the writer before a shard's next one is dropped:
/// 256 × 64 KiB = 16 MiB, about 524,000 records.
pub const WRITER_QUEUE_BUFFERS: usize = 256;

/// Smallest file before rotation: 1 MiB.
pub const FILE_BYTES_MIN: u64 = 1 << 20;

/// Default bound on the trace directory's trace files, in MiB
/// (`--trace-max-mb`).
pub const TRACE_MAX_MB_DEFAULT: u64 = 1024;

/// File name suffix of trace files.
pub const FILE_SUFFIX: &str = ".kvtrace";

/// The operation a record names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum TraceOp {
    /// A block stored (`PUT`, local-socket put).
    Put = 1,
    /// A block read (`GET`, local-socket get).
    Get = 2,
    /// A presence check (`HEAD`, local-socket exists): nothing moves.
    Head = 3,
    /// One key of a prefix lookup's chain: nothing moves.
    Lookup = 4,
    /// A block deleted.
    Delete = 5,
    /// A key asked to be promoted or fetched from the remote tier.
    Prefetch = 6,
}

impl TraceOp {
    /// Every operation, in code order.
    pub const ALL: [TraceOp; 6] = [TraceOp::Put, TraceOp::Get, TraceOp::Head, TraceOp::Lookup, TraceOp::Delete, TraceOp::Prefetch];

    fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code).wrapping_sub(1)).copied()
    }

    /// `put`, `get`, `head`, `lookup`, `delete`, `prefetch`.
    pub fn as_str(self) -> &'static str {
        match self {
            TraceOp::Put => "put",
            TraceOp::Get => "get",
            TraceOp::Head => "head",
            TraceOp::Lookup => "lookup",
            TraceOp::Delete => "delete",
            TraceOp::Prefetch => "prefetch",
        }
    }
}

/// What a record says about where the block was: byte 25 of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceTier {
    /// Not found (code 0): a GET or HEAD miss, a lookup key past the
    /// prefix hits, a DELETE of an absent key.
    Miss,
    /// Found in (or served from) this tier (codes 1–4: GPU, RAM, NVMe, S3).
    In(Tier),
    /// Says nothing about a tier (code 255): a PUT, a DELETE that found
    /// the key, a prefetch.
    None,
}

impl TraceTier {
    fn code(self) -> u8 {
        match self {
            TraceTier::Miss => 0,
            TraceTier::In(Tier::Gpu) => 1,
            TraceTier::In(Tier::Ram) => 2,
            TraceTier::In(Tier::Nvme) => 3,
            TraceTier::In(Tier::Remote) => 4,
            TraceTier::None => 255,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => TraceTier::Miss,
            1 => TraceTier::In(Tier::Gpu),
            2 => TraceTier::In(Tier::Ram),
            3 => TraceTier::In(Tier::Nvme),
            4 => TraceTier::In(Tier::Remote),
            255 => TraceTier::None,
            _ => return None,
        })
    }

    /// `Miss` for `None`, else the tier.
    pub fn found(tier: Option<Tier>) -> Self {
        tier.map_or(TraceTier::Miss, TraceTier::In)
    }
}

/// One block operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Microseconds since the header's `started_unix_ms`.
    pub time_us: u64,
    /// The key's block hash.
    pub hash: BlockHash,
    /// The operation.
    pub op: TraceOp,
    /// Where the block was found, or not.
    pub tier: TraceTier,
    /// The shard owning the key (`hash mod shards`).
    pub shard: u16,
    /// The key's index in its call (a lookup's chain position); 0 for
    /// single-key calls.
    pub pos: u32,
}

impl Record {
    /// Appends the record's [`RECORD_BYTES`] bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.time_us.to_le_bytes());
        out.extend_from_slice(&self.hash.0.to_le_bytes());
        out.push(self.op as u8);
        out.push(self.tier.code());
        out.extend_from_slice(&self.shard.to_le_bytes());
        out.extend_from_slice(&self.pos.to_le_bytes());
    }

    /// Decodes one record.
    ///
    /// # Errors
    /// A reason naming the unknown operation or tier code.
    pub fn decode(b: &[u8; RECORD_BYTES]) -> Result<Record, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let op = TraceOp::from_code(b[24]).ok_or_else(|| format!("unknown operation code {}", b[24]))?;
        let tier = TraceTier::from_code(b[25]).ok_or_else(|| format!("unknown tier code {}", b[25]))?;
        Ok(Record {
            time_us: u64_at(0),
            hash: BlockHash(u128::from_le_bytes(b[8..24].try_into().expect("16 bytes"))),
            op,
            tier,
            shard: u16::from_le_bytes([b[26], b[27]]),
            pos: u32::from_le_bytes(b[28..32].try_into().expect("4 bytes")),
        })
    }
}

/// What a trace file says about the store that wrote it: JSON after the
/// preamble.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// What wrote it: `kvtier serve` or `kvtier-loadgen replay`.
    pub source: String,
    /// Wall-clock time records count from, ms since the Unix epoch.
    pub started_unix_ms: u64,
    /// Index of this file among the files of one recording (rotation).
    pub file_index: u32,
    /// Model preset of the geometry.
    pub model: String,
    /// Bytes of every block.
    pub block_bytes: u64,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Shards of the store (the LRU of each memory tier is per shard).
    pub shards: u32,
    /// GPU slots per shard (0: no GPU tier).
    pub gpu_blocks_per_shard: u64,
    /// RAM slots per shard (0: no RAM tier).
    pub ram_blocks_per_shard: u64,
    /// Disk share for segments across shards, bytes (0: not known, as in
    /// a trace written without a server).
    pub disk_bytes: u64,
    /// `through` or `back`.
    pub write_policy: String,
    /// Whether reads promote blocks to the fastest memory tier.
    pub promote: bool,
    /// Whether a remote (S3) tier was configured.
    pub remote: bool,
}

/// Encodes the preamble and header of a trace file.
pub fn encode_header(header: &TraceHeader) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("a header serializes");
    let mut out = Vec::with_capacity(PREAMBLE_BYTES + json.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(RECORD_BYTES as u16).to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// A trace file that cannot be read: which file, where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// The file.
    pub path: PathBuf,
    /// Byte offset of the first byte that could not be used.
    pub offset: u64,
    /// What is wrong there.
    pub reason: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: at byte {}: {}", self.path.display(), self.offset, self.reason)
    }
}

impl std::error::Error for TraceError {}

/// A trace file read whole.
#[derive(Debug, Clone)]
pub struct TraceFile {
    /// The file.
    pub path: PathBuf,
    /// Its header.
    pub header: TraceHeader,
    /// Its records, sorted by time (a stable sort: records of one call,
    /// appended together with one time, stay together and in order).
    pub records: Vec<Record>,
    /// Byte offset of the first record.
    pub records_offset: u64,
}

/// Reads and checks a trace file's preamble and header from its first
/// bytes; returns the header and the offset of the first record.
///
/// # Errors
/// [`TraceError`] at the offending offset: an empty or short file, another
/// magic, a newer format version, another record size, a header longer
/// than [`HEADER_BYTES_MAX`] or cut short, a header that is not the JSON of
/// a [`TraceHeader`].
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<(TraceHeader, usize), TraceError> {
    let err = |offset: usize, reason: String| TraceError { path: path.to_path_buf(), offset: offset as u64, reason };
    if bytes.is_empty() {
        return Err(err(0, "the file is empty: no trace header".into()));
    }
    if bytes.len() < PREAMBLE_BYTES {
        return Err(err(bytes.len(), format!("the file ends after {} bytes, inside the {PREAMBLE_BYTES}-byte preamble", bytes.len())));
    }
    if bytes[..8] != MAGIC {
        return Err(err(
            0,
            format!("not a kvtier trace: the file starts {:?}, a trace starts \"KVTTRACE\"", String::from_utf8_lossy(&bytes[..8])),
        ));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version > VERSION {
        return Err(err(
            8,
            format!("format version {version} is newer than this build reads (version {VERSION}); use a newer kvtier-loadgen"),
        ));
    }
    if version == 0 {
        return Err(err(8, "format version 0 does not exist".into()));
    }
    let record_bytes = u16::from_le_bytes([bytes[10], bytes[11]]);
    if usize::from(record_bytes) != RECORD_BYTES {
        return Err(err(10, format!("records of {record_bytes} bytes; version {version} records are {RECORD_BYTES} bytes")));
    }
    let len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
    if len > HEADER_BYTES_MAX {
        return Err(err(12, format!("a header of {len} bytes; the limit is {HEADER_BYTES_MAX}")));
    }
    let end = PREAMBLE_BYTES + len as usize;
    if bytes.len() < end {
        return Err(err(bytes.len(), format!("the file ends inside the {len}-byte header")));
    }
    let header: TraceHeader =
        serde_json::from_slice(&bytes[PREAMBLE_BYTES..end]).map_err(|e| err(PREAMBLE_BYTES, format!("the header is not valid: {e}")))?;
    if header.block_bytes == 0 || header.block_tokens == 0 || header.shards == 0 {
        return Err(err(PREAMBLE_BYTES, "the header names a zero block size, block token count or shard count".into()));
    }
    Ok((header, end))
}

/// Reads a whole trace file and sorts its records by time.
///
/// # Errors
/// As [`parse_header`]; a file that cannot be read (offset 0); a record
/// cut short (at its first byte) or with an unknown operation or tier
/// code, or a shard outside the header's count (at that record).
pub fn read(path: &Path) -> Result<TraceFile, TraceError> {
    let bytes = std::fs::read(path).map_err(|e| TraceError { path: path.to_path_buf(), offset: 0, reason: format!("cannot read: {e}") })?;
    let (header, start) = parse_header(path, &bytes)?;
    let body = &bytes[start..];
    let whole = body.len() / RECORD_BYTES * RECORD_BYTES;
    if whole != body.len() {
        return Err(TraceError {
            path: path.to_path_buf(),
            offset: (start + whole) as u64,
            reason: format!("the last record is cut short: {} of {RECORD_BYTES} bytes (a truncated trace)", body.len() - whole),
        });
    }
    let mut records = Vec::with_capacity(body.len() / RECORD_BYTES);
    for (i, chunk) in body.chunks_exact(RECORD_BYTES).enumerate() {
        let at = (start + i * RECORD_BYTES) as u64;
        let record = Record::decode(chunk.try_into().expect("a record")).map_err(|reason| TraceError {
            path: path.to_path_buf(),
            offset: at,
            reason,
        })?;
        if u32::from(record.shard) >= header.shards {
            return Err(TraceError {
                path: path.to_path_buf(),
                offset: at + 26,
                reason: format!("shard {} of a {}-shard store", record.shard, header.shards),
            });
        }
        records.push(record);
    }
    records.sort_by_key(|r| r.time_us);
    Ok(TraceFile { path: path.to_path_buf(), header, records, records_offset: start as u64 })
}

/// Writes a trace file: the header at once, then records as given.
pub struct TraceWriter {
    file: std::io::BufWriter<std::fs::File>,
    bytes: u64,
}

impl TraceWriter {
    /// Creates (or truncates) `path` and writes the header.
    ///
    /// # Errors
    /// The file cannot be created or written.
    pub fn create(path: &Path, header: &TraceHeader) -> std::io::Result<Self> {
        let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
        let head = encode_header(header);
        file.write_all(&head)?;
        Ok(TraceWriter { file, bytes: head.len() as u64 })
    }

    /// Appends encoded records (a multiple of [`RECORD_BYTES`]).
    ///
    /// # Errors
    /// The write failed (the file then ends at a record boundary or short
    /// of one; a reader names the offset).
    pub fn write_encoded(&mut self, records: &[u8]) -> std::io::Result<()> {
        debug_assert_eq!(records.len() % RECORD_BYTES, 0);
        self.file.write_all(records)?;
        self.bytes += records.len() as u64;
        Ok(())
    }

    /// Appends one record.
    ///
    /// # Errors
    /// As [`TraceWriter::write_encoded`].
    pub fn write(&mut self, record: &Record) -> std::io::Result<()> {
        let mut b = Vec::with_capacity(RECORD_BYTES);
        record.encode(&mut b);
        self.write_encoded(&b)
    }

    /// Bytes written so far, header included.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Flushes and syncs the file.
    ///
    /// # Errors
    /// The flush or sync failed.
    pub fn finish(self) -> std::io::Result<()> {
        let file = self.file.into_inner().map_err(|e| e.into_error())?;
        file.sync_data()
    }
}

/// Milliseconds since the Unix epoch now.
pub fn unix_ms_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

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

    fn header() -> TraceHeader {
        TraceHeader {
            source: "test".into(),
            started_unix_ms: 1,
            file_index: 0,
            model: "custom".into(),
            block_bytes: 65536,
            block_tokens: 16,
            shards: 2,
            gpu_blocks_per_shard: 0,
            ram_blocks_per_shard: 8,
            disk_bytes: 1 << 30,
            write_policy: "through".into(),
            promote: true,
            remote: false,
        }
    }

    #[test]
    fn records_round_trip_and_sort_by_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.kvtrace");
        let mut w = TraceWriter::create(&path, &header()).unwrap();
        let a = Record { time_us: 9, hash: BlockHash(u128::MAX - 3), op: TraceOp::Get, tier: TraceTier::In(Tier::Ram), shard: 0, pos: 0 };
        let b = Record { time_us: 2, hash: BlockHash(7), op: TraceOp::Lookup, tier: TraceTier::Miss, shard: 1, pos: 3 };
        let c = Record { time_us: 9, hash: BlockHash(8), op: TraceOp::Put, tier: TraceTier::None, shard: 0, pos: 0 };
        for r in [a, b, c] {
            w.write(&r).unwrap();
        }
        w.finish().unwrap();
        let t = read(&path).unwrap();
        assert_eq!(t.header, header());
        assert_eq!(t.records, [b, a, c], "sorted by time, ties in file order");
    }

    #[test]
    fn bad_files_name_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.kvtrace");
        let head = encode_header(&header());
        let mut one = Vec::new();
        Record { time_us: 1, hash: BlockHash(1), op: TraceOp::Put, tier: TraceTier::None, shard: 1, pos: 0 }.encode(&mut one);
        let check = |bytes: &[u8], offset: usize, says: &str| {
            std::fs::write(&path, bytes).unwrap();
            let e = read(&path).unwrap_err();
            assert_eq!((e.offset, e.path.as_path()), (offset as u64, path.as_path()), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        };
        check(b"", 0, "empty");
        check(b"KVTT", 4, "preamble");
        check(b"NOTATRACE-------", 0, "not a kvtier trace");
        let mut newer = head.clone();
        newer[8] = 2;
        check(&newer, 8, "newer");
        check(&head[..head.len() - 3], head.len() - 3, "inside the");
        let mut cut = head.clone();
        cut.extend_from_slice(&one);
        cut.extend_from_slice(&one[..20]);
        check(&cut, head.len() + RECORD_BYTES, "cut short");
        let mut bad_op = head.clone();
        bad_op.extend_from_slice(&one);
        bad_op[head.len() + 24] = 99;
        check(&bad_op, head.len(), "operation code 99");
        let mut bad_shard = head.clone();
        bad_shard.extend_from_slice(&one);
        bad_shard[head.len() + 26] = 5;
        check(&bad_shard, head.len() + 26, "shard 5 of a 2-shard store");
        let mut bad_json = head[..PREAMBLE_BYTES].to_vec();
        bad_json.extend(std::iter::repeat_n(b'x', head.len() - PREAMBLE_BYTES));
        check(&bad_json, PREAMBLE_BYTES, "header is not valid");
    }

    #[test]
    fn the_recorder_rotates_and_bounds_its_files() {
        let dir = tempfile::tempdir().unwrap();
        // 4 MiB bound: files rotate at 1 MiB; 3 MiB of records keep the total under 4 MiB.
        let r = Recorder::new(dir.path(), 4 << 20).unwrap();
        r.set_header(header());
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
