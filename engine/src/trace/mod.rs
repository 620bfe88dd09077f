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

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::key::BlockHash;
use crate::tier::Tier;

mod recorder;
pub use recorder::{Recorder, ShardTrace, TraceStatus};

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

impl TraceHeader {
    /// The header of a store of `shards` shards and blocks of
    /// `block_bytes` bytes / `block_tokens` tokens, with no memory tiers,
    /// disk size unknown, write-through, promotion on, no remote tier; a
    /// caller that knows more sets those fields.
    pub fn new(source: &str, model: &str, block_bytes: u64, block_tokens: u32, shards: u32) -> Self {
        TraceHeader {
            source: source.to_string(),
            started_unix_ms: unix_ms_now(),
            file_index: 0,
            model: model.to_string(),
            block_bytes,
            block_tokens,
            shards,
            gpu_blocks_per_shard: 0,
            ram_blocks_per_shard: 0,
            disk_bytes: 0,
            write_policy: "through".into(),
            promote: true,
            remote: false,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> TraceHeader {
        TraceHeader { started_unix_ms: 1, ram_blocks_per_shard: 8, ..TraceHeader::new("test", "custom", 65536, 16, 2) }
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
}
