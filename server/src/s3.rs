//! The shared tier below NVMe: blocks on S3-compatible object storage
//! (AWS S3, S3 Express, Ceph RGW, MinIO, Garage, GCS's S3 API), so a prefix
//! computed on one node is read on another and outlives any node's disk.
//!
//! Blocks are immutable and content-addressed, so nodes share the bucket
//! without a coherence protocol: an upload is create-only (`If-None-Match:
//! *`, [`PutMode::Create`]) and "already there" is success.
//!
//! Threads: the `object_store` client runs on one multi-threaded tokio
//! runtime owned by the process ([`S3Tier`], `--s3-threads` threads). A
//! shard (a glommio executor) never runs tokio: it spawns the request onto
//! the runtime and awaits the answer on a `futures` oneshot, whose wake
//! glommio delivers from the other thread. Write-behind uploads go through
//! a bounded tokio channel per shard, filled with `try_send`, so a PUT never
//! waits for S3; when the queue is full the upload is dropped and counted.
//!
//! Object layout (docs/FORMAT.md): `PREFIX/kvtier/v1/BLOCK_BYTES/XX/KEY`,
//! `XX` the key's block hash's low byte in hex (spreads keys over S3's
//! partitions); the object is a header (magic, block size, payload CRC-32,
//! key, header CRC-32) followed by the payload. A read checks all of it
//! before a byte is served.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use futures::FutureExt;
use hdrhistogram::Histogram;
use kvtier_engine::key::BlockHash;
use kvtier_engine::Store;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig};
use serde::Serialize;
use serde_json::{json, Value};

/// Tier name in `x-kvtier-tier` and lookup answers for blocks served from
/// the shared tier.
pub const TIER_NAME: &str = "s3";

/// Object header magic: "KVTS3" + format 1.
pub const OBJECT_MAGIC: [u8; 8] = *b"KVTS3\0\0\x01";

/// Fixed part of the object header before the key: magic (8), header
/// length (u32), block bytes (u64), payload CRC-32 (u32), key length (u16).
const HEADER_FIXED_BYTES: usize = 8 + 4 + 8 + 4 + 2;

/// Longest a clean stop waits for queued write-behind uploads.
pub const DRAIN_MAX: Duration = Duration::from_secs(10);

/// At most one warning per this interval per kind of S3 failure; the
/// others are counted and summarized in the next one.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Consecutive S3 failures (errors or timeouts, not "absent") after which
/// the tier is taken as down for [`DOWN_COOLDOWN`].
pub const DOWN_AFTER_FAILURES: u32 = 3;

/// While down, S3 reads, existence checks, deletes and uploads are not
/// sent: they answer as misses or failures at once (`skipped_down`). After
/// it, requests go out again; [`DOWN_AFTER_FAILURES`] more failures take
/// the tier down again.
pub const DOWN_COOLDOWN: Duration = Duration::from_secs(1);

/// Entries a shard's presence cache holds at most; past it expired entries
/// are dropped, then all.
const PRESENCE_ENTRIES_MAX: usize = 1 << 16;

/// `--s3-write-policy` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum S3WritePolicy {
    /// Acknowledge the PUT once stored locally; upload afterwards from a
    /// bounded queue per shard (dropped and counted when full).
    Behind,
    /// Acknowledge the PUT after the upload too (or after it failed or
    /// timed out: S3 never fails a PUT).
    Through,
    /// Never upload; still read from the shared tier.
    Off,
}

/// The shared-tier flags of `kvtier serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct S3Args {
    /// Shared tier below NVMe: s3://BUCKET[/PREFIX]. Credentials and region
    /// come from the standard AWS environment variables (AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION or
    /// AWS_DEFAULT_REGION, AWS_PROFILE), else from ~/.aws/credentials and
    /// ~/.aws/config (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE), else
    /// from the instance or container role. Unset: no shared tier.
    #[arg(long)]
    pub s3_url: Option<String>,
    /// Endpoint of a non-AWS S3-compatible store (MinIO, Ceph RGW, Garage,
    /// GCS, moto), e.g. http://127.0.0.1:9000; path-style requests. Default:
    /// AWS_ENDPOINT_URL, else AWS.
    #[arg(long, requires = "s3_url")]
    pub s3_endpoint: Option<String>,
    /// behind: a PUT is acknowledged when stored locally, and uploaded
    /// afterwards from a bounded queue per shard (dropped and counted when
    /// full). through: acknowledged after the upload as well (a failed or
    /// timed-out upload is counted, never fails the PUT). off: never
    /// upload; reads still fall through to S3.
    #[arg(long, value_enum, default_value_t = S3WritePolicy::Behind, requires = "s3_url")]
    pub s3_write_policy: S3WritePolicy,
    /// An S3 read, existence check or delete that takes longer than this is
    /// abandoned and answered as a miss (counted as a timeout), in ms.
    #[arg(long, default_value_t = 2000, requires = "s3_url")]
    pub s3_timeout_ms: u64,
    /// An upload that takes longer than this is abandoned and counted as
    /// failed, in ms.
    #[arg(long, default_value_t = 30_000, requires = "s3_url")]
    pub s3_upload_timeout_ms: u64,
    /// Block bytes each shard's write-behind queue holds, in MiB (at least
    /// one block). A PUT whose upload would not fit is still acknowledged;
    /// its upload is dropped and counted.
    #[arg(long, default_value_t = 256, requires = "s3_url")]
    pub s3_upload_queue_mib: u64,
    /// Uploads in flight per shard.
    #[arg(long, default_value_t = 4, requires = "s3_url")]
    pub s3_uploads_inflight: usize,
    /// Existence checks in flight at once for one lookup's tail, and
    /// objects fetched at once for one prefetch.
    #[arg(long, default_value_t = 16, requires = "s3_url")]
    pub s3_lookup_parallelism: usize,
    /// How long a shard remembers that a key is present or absent in the
    /// bucket, in ms (0: never), so a prefix lookup does not cost a round
    /// trip per block each time.
    #[arg(long, default_value_t = 5000, requires = "s3_url")]
    pub s3_presence_ttl_ms: u64,
    /// Threads of the tokio runtime that runs the S3 client.
    #[arg(long, default_value_t = 2, requires = "s3_url")]
    pub s3_threads: usize,
}

/// Where the shared tier lives, parsed from `--s3-url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Location {
    /// Bucket name.
    pub bucket: String,
    /// Prefix inside the bucket, without leading or trailing `/` (may be
    /// empty).
    pub prefix: String,
}

/// Parses `s3://BUCKET[/PREFIX]`.
///
/// # Errors
/// A message naming what is wrong: another scheme, no bucket, an empty
/// path segment.
pub fn parse_url(url: &str) -> Result<S3Location, String> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| format!("--s3-url {url:?} must look like s3://BUCKET[/PREFIX]"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(format!("--s3-url {url:?} names no bucket; expected s3://BUCKET[/PREFIX]"));
    }
    if !bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.') {
        return Err(format!("--s3-url {url:?}: bucket {bucket:?} may hold only a-z, 0-9, '-' and '.'"));
    }
    let prefix = prefix.trim_matches('/');
    if prefix.split('/').any(|s| s.is_empty() || s == "." || s == "..") && !prefix.is_empty() {
        return Err(format!("--s3-url {url:?}: the prefix {prefix:?} has an empty, '.' or '..' segment"));
    }
    Ok(S3Location { bucket: bucket.to_string(), prefix: prefix.to_string() })
}

/// The object name of `key` for blocks of `block_bytes`:
/// `PREFIX/kvtier/v1/BLOCK_BYTES/XX/KEY`.
pub fn object_name(prefix: &str, block_bytes: u64, key: &str) -> String {
    let spread = BlockHash::of(key.as_bytes()).0 as u8;
    let base = format!("kvtier/v1/{block_bytes}/{spread:02x}/{key}");
    if prefix.is_empty() {
        base
    } else {
        format!("{prefix}/{base}")
    }
}

/// The object header for `key` and a payload of `block_bytes` with CRC-32
/// `payload_crc` (docs/FORMAT.md).
pub fn encode_header(key: &str, block_bytes: u64, payload_crc: u32) -> Bytes {
    let header_len = HEADER_FIXED_BYTES + key.len() + 4;
    let mut b = BytesMut::with_capacity(header_len);
    b.put_slice(&OBJECT_MAGIC);
    b.put_u32_le(header_len as u32);
    b.put_u64_le(block_bytes);
    b.put_u32_le(payload_crc);
    b.put_u16_le(key.len() as u16);
    b.put_slice(key.as_bytes());
    let crc = crc32fast::hash(&b);
    b.put_u32_le(crc);
    b.freeze()
}

/// Why an object read back is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectFault {
    /// Shorter than its header says, or than the block.
    Truncated,
    /// Not a kvtier block object (magic or header CRC wrong).
    BadHeader,
    /// Holds another key (a wrong object name or a copied object).
    WrongKey,
    /// Written for another block size.
    WrongBlockBytes(u64),
    /// Longer than header + block.
    TrailingBytes,
    /// The payload's CRC-32 does not match the header's.
    PayloadCrc,
}

/// Checks an object read back and returns its payload (a slice of
/// `object`, no copy).
///
/// # Errors
/// The first check that failed.
pub fn decode_object(object: &Bytes, key: &str, block_bytes: u64) -> Result<Bytes, ObjectFault> {
    if object.len() < HEADER_FIXED_BYTES + 4 {
        return Err(ObjectFault::Truncated);
    }
    if object[..8] != OBJECT_MAGIC {
        return Err(ObjectFault::BadHeader);
    }
    let u32_at = |i: usize| u32::from_le_bytes(object[i..i + 4].try_into().expect("4 bytes"));
    let header_len = u32_at(8) as usize;
    let key_len = u16::from_le_bytes(object[24..26].try_into().expect("2 bytes")) as usize;
    if header_len != HEADER_FIXED_BYTES + key_len + 4 {
        return Err(ObjectFault::BadHeader);
    }
    if object.len() < header_len {
        return Err(ObjectFault::Truncated);
    }
    if crc32fast::hash(&object[..header_len - 4]) != u32_at(header_len - 4) {
        return Err(ObjectFault::BadHeader);
    }
    let stored_block_bytes = u64::from_le_bytes(object[12..20].try_into().expect("8 bytes"));
    if stored_block_bytes != block_bytes {
        return Err(ObjectFault::WrongBlockBytes(stored_block_bytes));
    }
    if &object[HEADER_FIXED_BYTES..HEADER_FIXED_BYTES + key_len] != key.as_bytes() {
        return Err(ObjectFault::WrongKey);
    }
    let end = header_len as u64 + block_bytes;
    if (object.len() as u64) < end {
        return Err(ObjectFault::Truncated);
    }
    if object.len() as u64 > end {
        return Err(ObjectFault::TrailingBytes);
    }
    let payload = object.slice(header_len..);
    if crc32fast::hash(&payload) != u32_at(20) {
        return Err(ObjectFault::PayloadCrc);
    }
    Ok(payload)
}

/// Counters of one shard's use of the shared tier. Atomics: uploads finish
/// on the runtime's threads.
#[derive(Default)]
struct Counters {
    /// Write-behind uploads handed to the queue and not yet in flight
    /// (for the drain at stop; the `uploads_queued` gauge is the channel's
    /// length, exact).
    uploads_pending: AtomicU64,
    uploads_queued_max: AtomicU64,
    uploads_inflight: AtomicU64,
    uploads_done: AtomicU64,
    uploads_present: AtomicU64,
    uploads_dropped: AtomicU64,
    uploads_failed: AtomicU64,
    upload_bytes: AtomicU64,
    reads: AtomicU64,
    read_hits: AtomicU64,
    read_misses: AtomicU64,
    read_errors: AtomicU64,
    read_corrupt: AtomicU64,
    read_bytes: AtomicU64,
    reads_joined: AtomicU64,
    installs: AtomicU64,
    install_failures: AtomicU64,
    exists_checks: AtomicU64,
    exists_errors: AtomicU64,
    presence_cache_hits: AtomicU64,
    prefetched: AtomicU64,
    deletes: AtomicU64,
    delete_errors: AtomicU64,
    timeouts: AtomicU64,
    skipped_down: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 2).expect("histogram bounds are valid")
}

/// One shard's counters and latency histograms (µs).
struct ShardCounters {
    c: Counters,
    read_us: Mutex<Histogram<u64>>,
    upload_us: Mutex<Histogram<u64>>,
    exists_us: Mutex<Histogram<u64>>,
}

impl ShardCounters {
    fn new() -> Self {
        ShardCounters {
            c: Counters::default(),
            read_us: Mutex::new(latency_histogram()),
            upload_us: Mutex::new(latency_histogram()),
            exists_us: Mutex::new(latency_histogram()),
        }
    }
}

fn record(h: &Mutex<Histogram<u64>>, since: Instant) {
    let us = since.elapsed().as_micros().max(1) as u64;
    let _ = h.lock().expect("histogram lock").record(us);
}

/// Rate-limited warnings: at most one per [`LOG_EVERY`], saying how many
/// were held back.
struct LogLimiter {
    last: Mutex<Option<Instant>>,
    held_back: AtomicU64,
}

impl LogLimiter {
    fn new() -> Self {
        LogLimiter { last: Mutex::new(None), held_back: AtomicU64::new(0) }
    }

    fn warn(&self, what: &str, detail: &dyn std::fmt::Display) {
        let mut last = self.last.lock().expect("log limiter lock");
        if last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            self.held_back.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *last = Some(Instant::now());
        let held = self.held_back.swap(0, Ordering::Relaxed);
        tracing::warn!(held_back = held, "S3 {what}: {detail} ({held} similar warnings held back in the last {LOG_EVERY:?})");
    }
}

/// Takes the tier down for [`DOWN_COOLDOWN`] after [`DOWN_AFTER_FAILURES`]
/// consecutive failures, so a dead or black-holed S3 costs each request
/// nothing rather than `--s3-timeout-ms`. Shared by every shard and the
/// runtime's threads.
struct Breaker {
    epoch: Instant,
    failures: std::sync::atomic::AtomicU32,
    /// Milliseconds since `epoch` until which the tier is down.
    down_until_ms: AtomicU64,
    trips: AtomicU64,
}

impl Breaker {
    fn new() -> Self {
        Breaker { epoch: Instant::now(), failures: Default::default(), down_until_ms: AtomicU64::new(0), trips: AtomicU64::new(0) }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether requests may go to S3 now.
    fn allows(&self) -> bool {
        self.now_ms() >= self.down_until_ms.load(Ordering::Relaxed)
    }

    fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    fn failure(&self) {
        if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= DOWN_AFTER_FAILURES {
            self.failures.store(0, Ordering::Relaxed);
            self.down_until_ms.store(self.now_ms() + DOWN_COOLDOWN.as_millis() as u64, Ordering::Relaxed);
            self.trips.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "S3 failed {DOWN_AFTER_FAILURES} times in a row: taken as down for {DOWN_COOLDOWN:?} (reads miss, uploads fail at once)"
            );
        }
    }
}

/// One block upload waiting in a shard's write-behind queue.
struct Upload {
    key: String,
    chunks: Vec<Bytes>,
}

/// What became of an upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UploadOutcome {
    /// Written now.
    Uploaded,
    /// The object was already there (create-only PUT refused with 412, or
    /// the shard knew it was present): success.
    Present,
    /// Queued for write-behind upload.
    Queued,
    /// The write-behind queue was full: not uploaded.
    Dropped,
    /// The upload failed or timed out (counted, logged).
    Failed,
}

impl UploadOutcome {
    /// Name in a PUT's answer (`"s3": ...`).
    pub fn as_str(&self) -> &'static str {
        match self {
            UploadOutcome::Uploaded => "uploaded",
            UploadOutcome::Present => "present",
            UploadOutcome::Queued => "queued",
            UploadOutcome::Dropped => "dropped",
            UploadOutcome::Failed => "failed",
        }
    }
}

/// What an S3 read found.
enum Fetched {
    Block(Bytes),
    Absent,
    /// Error, timeout or a bad object: a miss, already counted.
    Failed,
}

/// The shared tier of the process: the S3 client on its tokio runtime,
/// every shard's write-behind queue, counters. `Send + Sync`; each shard
/// uses it through its [`S3Shard`].
pub struct S3Tier {
    runtime: tokio::runtime::Runtime,
    client: Arc<AmazonS3>,
    location: S3Location,
    endpoint: Option<String>,
    block_bytes: u64,
    policy: S3WritePolicy,
    timeout: Duration,
    upload_timeout: Duration,
    parallelism: usize,
    presence_ttl: Duration,
    queue_blocks: usize,
    uploads_inflight_max: usize,
    queues: Vec<tokio::sync::mpsc::Sender<Upload>>,
    shards: Vec<Arc<ShardCounters>>,
    read_log: LogLimiter,
    write_log: LogLimiter,
    breaker: Arc<Breaker>,
}

impl S3Tier {
    /// Builds the client and the runtime, and starts each shard's upload
    /// worker. Does not contact S3 (a store that is down at start is a
    /// store that is down: reads miss, uploads fail, both counted);
    /// [`S3Tier::probe`] says whether it answers.
    ///
    /// # Errors
    /// A bad flag value or client configuration, named.
    pub fn new(args: &S3Args, shards: usize, block_bytes: u64) -> Result<Arc<S3Tier>, String> {
        let url = args.s3_url.as_deref().ok_or("--s3-url is not set")?;
        let location = parse_url(url)?;
        for (flag, v) in [("--s3-timeout-ms", args.s3_timeout_ms), ("--s3-upload-timeout-ms", args.s3_upload_timeout_ms)] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        for (flag, v) in [
            ("--s3-uploads-inflight", args.s3_uploads_inflight),
            ("--s3-lookup-parallelism", args.s3_lookup_parallelism),
            ("--s3-threads", args.s3_threads),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if args.s3_upload_queue_mib == 0 {
            return Err("--s3-upload-queue-mib must be at least 1".into());
        }
        let timeout = Duration::from_millis(args.s3_timeout_ms);
        let upload_timeout = Duration::from_millis(args.s3_upload_timeout_ms);
        // Client options first: `with_client_options` replaces them all,
        // `with_allow_http` included.
        let mut builder = AmazonS3Builder::from_env()
            .with_client_options(ClientOptions::new().with_timeout(upload_timeout).with_connect_timeout(timeout))
            .with_bucket_name(&location.bucket);
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if env("AWS_ACCESS_KEY_ID").is_none() {
            if let Some(creds) = shared_credentials() {
                builder = builder.with_access_key_id(creds.access_key_id).with_secret_access_key(creds.secret_access_key);
                if let Some(token) = creds.session_token {
                    builder = builder.with_token(token);
                }
            }
        }
        if env("AWS_REGION").is_none() && env("AWS_DEFAULT_REGION").is_none() {
            if let Some(region) = shared_config_region() {
                builder = builder.with_region(region);
            }
        }
        let endpoint = args.s3_endpoint.clone().or_else(|| env("AWS_ENDPOINT_URL_S3")).or_else(|| env("AWS_ENDPOINT_URL"));
        if let Some(e) = &endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!("the S3 endpoint {e:?} (--s3-endpoint, AWS_ENDPOINT_URL) must be an http:// or https:// URL"));
            }
            builder = builder.with_endpoint(e).with_allow_http(e.starts_with("http://"));
        }
        let client = builder
            .with_retry(RetryConfig { max_retries: 2, retry_timeout: upload_timeout, ..Default::default() })
            .build()
            .map_err(|e| format!("configuring the S3 client for {url}: {e}"))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.s3_threads)
            .thread_name("kvtier-s3")
            .enable_all()
            .build()
            .map_err(|e| format!("starting the S3 runtime: {e}"))?;
        let queue_blocks = ((args.s3_upload_queue_mib << 20) / block_bytes.max(1)).max(1) as usize;
        let shard_counters: Vec<_> = (0..shards).map(|_| Arc::new(ShardCounters::new())).collect();
        let mut tier = S3Tier {
            runtime,
            client: Arc::new(client),
            location,
            endpoint,
            block_bytes,
            policy: args.s3_write_policy,
            timeout,
            upload_timeout,
            parallelism: args.s3_lookup_parallelism,
            presence_ttl: Duration::from_millis(args.s3_presence_ttl_ms),
            queue_blocks,
            uploads_inflight_max: args.s3_uploads_inflight,
            queues: Vec::with_capacity(shards),
            shards: shard_counters,
            read_log: LogLimiter::new(),
            write_log: LogLimiter::new(),
            breaker: Arc::new(Breaker::new()),
        };
        let receivers: Vec<_> = (0..shards)
            .map(|_| {
                let (tx, rx) = tokio::sync::mpsc::channel(queue_blocks);
                tier.queues.push(tx);
                rx
            })
            .collect();
        let tier = Arc::new(tier);
        for (shard, rx) in receivers.into_iter().enumerate() {
            let weak = Arc::downgrade(&tier);
            tier.runtime.spawn(upload_worker(weak, shard, rx));
        }
        Ok(tier)
    }

    /// Whether the bucket answers a listing of the prefix within the read
    /// timeout; the error when it does not. For the start-up log line.
    pub fn probe(&self) -> Result<(), String> {
        let client = self.client.clone();
        let prefix = ObjectPath::from(self.location.prefix.as_str());
        let timeout = self.timeout;
        self.runtime.block_on(async move {
            match tokio::time::timeout(timeout, client.list_with_delimiter(Some(&prefix))).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
            }
        })
    }

    /// `s3://BUCKET/PREFIX` and the endpoint, for the start-up line.
    pub fn describe(&self) -> String {
        let mut s = format!("s3://{}", self.location.bucket);
        if !self.location.prefix.is_empty() {
            s.push('/');
            s.push_str(&self.location.prefix);
        }
        if let Some(e) = &self.endpoint {
            s.push_str(&format!(" at {e}"));
        }
        s.push_str(&format!(", write policy {}", self.policy_name()));
        s
    }

    fn policy_name(&self) -> &'static str {
        match self.policy {
            S3WritePolicy::Behind => "behind",
            S3WritePolicy::Through => "through",
            S3WritePolicy::Off => "off",
        }
    }

    fn path(&self, key: &str) -> ObjectPath {
        ObjectPath::from(object_name(&self.location.prefix, self.block_bytes, key))
    }

    /// Runs `fut` on the runtime and awaits its output from any executor
    /// (a glommio shard: the oneshot's wake crosses threads). `None` when
    /// the runtime is gone.
    async fn call<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Option<T> {
        let (tx, rx) = futures::channel::oneshot::channel();
        self.runtime.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.await.ok()
    }

    /// Uploads waiting in shard `shard`'s write-behind queue now.
    fn queued(&self, shard: usize) -> u64 {
        let q = &self.queues[shard];
        (q.max_capacity() - q.capacity()) as u64
    }

    /// Waits until every shard's write-behind queue is empty and no upload
    /// is in flight, for at most `max`. Returns the uploads left.
    pub fn drain(&self, max: Duration) -> u64 {
        let deadline = Instant::now() + max;
        loop {
            let left: u64 = self
                .shards
                .iter()
                .map(|s| s.c.uploads_pending.load(Ordering::Relaxed) + s.c.uploads_inflight.load(Ordering::Relaxed))
                .sum();
            if left == 0 || Instant::now() >= deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `/v1/stats` `"s3"`: settings, counters summed over shards, latency
    /// percentiles (largest shard's), and per shard.
    pub fn stats_json(&self) -> Value {
        let per_shard: Vec<Value> = self.shards.iter().enumerate().map(|(i, s)| shard_json(i, s, self.queued(i))).collect();
        let mut totals = serde_json::Map::new();
        for s in &per_shard {
            for (k, v) in s.as_object().expect("object") {
                if k == "shard" {
                    continue;
                }
                let n = v.as_u64().unwrap_or(0);
                let entry = totals.entry(k.clone()).or_insert(json!(0));
                let merged = if k.ends_with("_us_p50") || k.ends_with("_us_p99") || k.ends_with("_max") {
                    entry.as_u64().unwrap_or(0).max(n)
                } else {
                    entry.as_u64().unwrap_or(0) + n
                };
                *entry = json!(merged);
            }
        }
        json!({
            "url": format!("s3://{}/{}", self.location.bucket, self.location.prefix),
            "endpoint": self.endpoint,
            "write_policy": self.policy,
            "timeout_ms": self.timeout.as_millis() as u64,
            "upload_timeout_ms": self.upload_timeout.as_millis() as u64,
            "upload_queue_blocks": self.queue_blocks,
            "uploads_inflight_max": self.uploads_inflight_max,
            "lookup_parallelism": self.parallelism,
            "presence_ttl_ms": self.presence_ttl.as_millis() as u64,
            "down": !self.breaker.allows(),
            "down_trips": self.breaker.trips.load(Ordering::Relaxed),
            "totals": totals,
            "per_shard": per_shard,
        })
    }

    /// Registers the `kvtier_s3_*` metrics (per shard) in `registry`.
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        use prometheus_client::metrics::counter::Counter;
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        type Field = fn(&Counters) -> &AtomicU64;
        let queued = Family::<ShardLabel, Gauge>::default();
        for i in 0..self.shards.len() {
            queued.get_or_create(&ShardLabel { shard: i.to_string() }).set(self.queued(i) as i64);
        }
        registry.register("s3_uploads_queued", "Uploads waiting in the write-behind queue", queued);
        let gauges: [(&str, &str, Field); 2] = [
            ("s3_uploads_queued_max", "Most uploads the write-behind queue held at once since start", |c| &c.uploads_queued_max),
            ("s3_uploads_inflight", "Uploads in flight", |c| &c.uploads_inflight),
        ];
        for (name, help, f) in gauges {
            let family = Family::<ShardLabel, Gauge>::default();
            for (i, s) in self.shards.iter().enumerate() {
                family.get_or_create(&ShardLabel { shard: i.to_string() }).set(f(&s.c).load(Ordering::Relaxed) as i64);
            }
            registry.register(name, help, family);
        }
        let counters: [(&str, &str, Field); 21] = [
            ("s3_uploads_done", "Blocks uploaded", |c| &c.uploads_done),
            ("s3_uploads_present", "Uploads not needed: the object was already there", |c| &c.uploads_present),
            ("s3_uploads_dropped", "Write-behind uploads dropped because the queue was full", |c| &c.uploads_dropped),
            ("s3_uploads_failed", "Uploads that failed or timed out", |c| &c.uploads_failed),
            ("s3_upload_bytes", "Object bytes uploaded", |c| &c.upload_bytes),
            ("s3_reads", "Local misses looked up in S3", |c| &c.reads),
            ("s3_read_hits", "S3 reads that returned a valid block", |c| &c.read_hits),
            ("s3_read_misses", "S3 reads that found no object", |c| &c.read_misses),
            ("s3_read_errors", "S3 reads that failed or timed out (answered as misses)", |c| &c.read_errors),
            ("s3_read_corrupt", "S3 objects that failed their checks (never served)", |c| &c.read_corrupt),
            ("s3_read_bytes", "Object bytes read", |c| &c.read_bytes),
            ("s3_reads_joined", "Local misses that joined a read of the same key already in progress", |c| &c.reads_joined),
            ("s3_installs", "Blocks read from S3 and stored in the local tiers", |c| &c.installs),
            ("s3_install_failures", "Blocks read from S3 that the local tiers refused", |c| &c.install_failures),
            ("s3_exists_checks", "Existence checks (HEAD) sent for lookups", |c| &c.exists_checks),
            ("s3_exists_errors", "Existence checks that failed or timed out", |c| &c.exists_errors),
            ("s3_presence_cache_hits", "Lookups answered from the presence cache", |c| &c.presence_cache_hits),
            ("s3_prefetched", "Blocks a prefetch copied from S3 into the local tiers", |c| &c.prefetched),
            ("s3_deletes", "Objects deleted by DELETE", |c| &c.deletes),
            ("s3_timeouts", "S3 operations abandoned at their timeout", |c| &c.timeouts),
            ("s3_skipped_down", "S3 operations not sent because S3 was taken as down", |c| &c.skipped_down),
        ];
        for (name, help, f) in counters {
            let family = Family::<ShardLabel, Counter>::default();
            for (i, s) in self.shards.iter().enumerate() {
                family.get_or_create(&ShardLabel { shard: i.to_string() }).inc_by(f(&s.c).load(Ordering::Relaxed));
            }
            registry.register(name, help, family);
        }
        let latency = Family::<OpQuantileLabel, Gauge>::default();
        for (op, h) in [("read", 0), ("upload", 1), ("exists", 2)] {
            let mut merged = latency_histogram();
            for s in &self.shards {
                let hist = [&s.read_us, &s.upload_us, &s.exists_us][h].lock().expect("histogram lock");
                let _ = merged.add(&*hist);
            }
            for q in ["0.5", "0.99"] {
                let v = if merged.is_empty() { 0 } else { merged.value_at_quantile(q.parse().expect("quantile")) };
                latency.get_or_create(&OpQuantileLabel { op: op.into(), quantile: q.into() }).set(v as i64);
            }
        }
        registry.register("s3_latency_us", "S3 read, upload and existence-check latency percentiles in microseconds", latency);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ShardLabel {
    shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct OpQuantileLabel {
    op: String,
    quantile: String,
}

fn shard_json(i: usize, s: &ShardCounters, queued: u64) -> Value {
    let c = &s.c;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let pct = |h: &Mutex<Histogram<u64>>, q: f64| {
        let h = h.lock().expect("histogram lock");
        if h.is_empty() {
            0
        } else {
            h.value_at_quantile(q)
        }
    };
    json!({
        "shard": i,
        "uploads_queued": queued,
        "uploads_unfinished": g(&c.uploads_pending) + g(&c.uploads_inflight),
        "uploads_queued_max": g(&c.uploads_queued_max),
        "uploads_inflight": g(&c.uploads_inflight),
        "uploads_done": g(&c.uploads_done),
        "uploads_present": g(&c.uploads_present),
        "uploads_dropped": g(&c.uploads_dropped),
        "uploads_failed": g(&c.uploads_failed),
        "upload_bytes": g(&c.upload_bytes),
        "reads": g(&c.reads),
        "read_hits": g(&c.read_hits),
        "read_misses": g(&c.read_misses),
        "read_errors": g(&c.read_errors),
        "read_corrupt": g(&c.read_corrupt),
        "read_bytes": g(&c.read_bytes),
        "reads_joined": g(&c.reads_joined),
        "installs": g(&c.installs),
        "install_failures": g(&c.install_failures),
        "exists_checks": g(&c.exists_checks),
        "exists_errors": g(&c.exists_errors),
        "presence_cache_hits": g(&c.presence_cache_hits),
        "prefetched": g(&c.prefetched),
        "deletes": g(&c.deletes),
        "delete_errors": g(&c.delete_errors),
        "timeouts": g(&c.timeouts),
        "skipped_down": g(&c.skipped_down),
        "read_us_p50": pct(&s.read_us, 0.5),
        "read_us_p99": pct(&s.read_us, 0.99),
        "upload_us_p50": pct(&s.upload_us, 0.5),
        "upload_us_p99": pct(&s.upload_us, 0.99),
        "exists_us_p50": pct(&s.exists_us, 0.5),
        "exists_us_p99": pct(&s.exists_us, 0.99),
    })
}

/// One shard's write-behind worker, on the runtime: takes queued uploads
/// in order and runs up to `uploads_inflight_max` at once.
async fn upload_worker(tier: std::sync::Weak<S3Tier>, shard: usize, mut rx: tokio::sync::mpsc::Receiver<Upload>) {
    let permits = {
        let Some(t) = tier.upgrade() else { return };
        Arc::new(tokio::sync::Semaphore::new(t.uploads_inflight_max))
    };
    loop {
        // The permit first: a queued upload stays in the channel (and
        // counts against its bound) until it can start.
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let Some(up) = rx.recv().await else { return };
        let Some(t) = tier.upgrade() else { return };
        let counters = t.shards[shard].clone();
        // In flight before out of the queue: a drain never sees it in neither.
        counters.c.uploads_inflight.fetch_add(1, Ordering::Relaxed);
        counters.c.uploads_pending.fetch_sub(1, Ordering::Relaxed);
        let job = upload_job(&t, shard, up.key, up.chunks);
        drop(t);
        tokio::spawn(async move {
            job.await;
            counters.c.uploads_inflight.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
}

/// The future of one create-only upload, counted in `shard`'s counters.
/// Owns what it needs, so it runs on any runtime thread.
fn upload_job(tier: &S3Tier, shard: usize, key: String, chunks: Vec<Bytes>) -> impl Future<Output = UploadOutcome> + Send + 'static {
    let client = tier.client.clone();
    let path = tier.path(&key);
    let timeout = tier.upload_timeout;
    let counters = tier.shards[shard].clone();
    let block_bytes = tier.block_bytes;
    let breaker = tier.breaker.clone();
    async move {
        if !breaker.allows() {
            inc(&counters.c.uploads_failed);
            inc(&counters.c.skipped_down);
            return UploadOutcome::Failed;
        }
        let mut crc = crc32fast::Hasher::new();
        for c in &chunks {
            crc.update(c);
        }
        let header = encode_header(&key, block_bytes, crc.finalize());
        let object_bytes = (header.len() as u64) + block_bytes;
        let payload: PutPayload = std::iter::once(header).chain(chunks).collect();
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        let started = Instant::now();
        let c = &counters.c;
        match tokio::time::timeout(timeout, client.put_opts(&path, payload, opts)).await {
            Ok(Ok(_)) => {
                breaker.success();
                inc(&c.uploads_done);
                c.upload_bytes.fetch_add(object_bytes, Ordering::Relaxed);
                record(&counters.upload_us, started);
                UploadOutcome::Uploaded
            }
            Ok(Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. })) => {
                breaker.success();
                inc(&c.uploads_present);
                record(&counters.upload_us, started);
                UploadOutcome::Present
            }
            Ok(Err(e)) => {
                breaker.failure();
                inc(&c.uploads_failed);
                upload_log().warn("upload", &format!("upload of {key} failed: {e}"));
                UploadOutcome::Failed
            }
            Err(_) => {
                breaker.failure();
                inc(&c.uploads_failed);
                inc(&c.timeouts);
                upload_log().warn("upload", &format!("upload of {key} timed out after {} ms", timeout.as_millis()));
                UploadOutcome::Failed
            }
        }
    }
}

/// Upload failures are logged from the runtime's threads: one
/// process-wide limiter.
fn upload_log() -> &'static LogLimiter {
    static LIMITER: std::sync::OnceLock<LogLimiter> = std::sync::OnceLock::new();
    LIMITER.get_or_init(LogLimiter::new)
}

/// What one shard knows of the bucket for a short while: key → (present,
/// when learned).
type PresenceCache = HashMap<String, (bool, Instant)>;

/// A shard's handle on the shared tier: its write-behind queue, its
/// presence cache, its counters. Lives on the shard's executor (`!Send`).
pub struct S3Shard {
    tier: Arc<S3Tier>,
    shard: usize,
    presence: RefCell<PresenceCache>,
    /// Reads from the bucket in progress on this shard, by key.
    reading: RefCell<HashMap<String, SharedRead>>,
}

/// One read-through in progress, awaited by every request that missed the
/// key meanwhile.
type SharedRead = futures::future::Shared<futures::future::LocalBoxFuture<'static, Option<Bytes>>>;

impl S3Shard {
    /// The handle of shard `shard`.
    pub fn new(tier: Arc<S3Tier>, shard: usize) -> Rc<S3Shard> {
        Rc::new(S3Shard { tier, shard, presence: RefCell::new(HashMap::new()), reading: RefCell::new(HashMap::new()) })
    }

    /// The process's shared tier.
    pub fn tier(&self) -> &S3Tier {
        &self.tier
    }

    fn counters(&self) -> &ShardCounters {
        &self.tier.shards[self.shard]
    }

    fn known(&self, key: &str) -> Option<bool> {
        if self.tier.presence_ttl.is_zero() {
            return None;
        }
        let p = self.presence.borrow();
        p.get(key).filter(|(_, at)| at.elapsed() < self.tier.presence_ttl).map(|(present, _)| *present)
    }

    fn learn(&self, key: &str, present: bool) {
        if self.tier.presence_ttl.is_zero() {
            return;
        }
        let mut p = self.presence.borrow_mut();
        if p.len() >= PRESENCE_ENTRIES_MAX {
            let ttl = self.tier.presence_ttl;
            p.retain(|_, (_, at)| at.elapsed() < ttl);
            if p.len() >= PRESENCE_ENTRIES_MAX {
                p.clear();
            }
        }
        p.insert(key.to_string(), (present, Instant::now()));
    }

    /// Uploads a block just stored locally, as the write policy says:
    /// `behind` queues it (never waits; a full queue drops it), `through`
    /// waits for the upload, `off` does nothing (`None`). A block this
    /// shard knows is in the bucket is not sent again.
    pub async fn after_put(&self, key: &str, chunks: Vec<Bytes>) -> Option<UploadOutcome> {
        if self.tier.policy == S3WritePolicy::Off {
            return None;
        }
        let c = &self.counters().c;
        if self.known(key) == Some(true) {
            inc(&c.uploads_present);
            return Some(UploadOutcome::Present);
        }
        let outcome = match self.tier.policy {
            S3WritePolicy::Behind => {
                // Counted before the send: the worker may take it at once.
                c.uploads_pending.fetch_add(1, Ordering::Relaxed);
                match self.tier.queues[self.shard].try_send(Upload { key: key.to_string(), chunks }) {
                    Ok(()) => {
                        c.uploads_queued_max.fetch_max(self.tier.queued(self.shard), Ordering::Relaxed);
                        return Some(UploadOutcome::Queued);
                    }
                    Err(_) => {
                        c.uploads_pending.fetch_sub(1, Ordering::Relaxed);
                        inc(&c.uploads_dropped);
                        self.tier.write_log.warn(
                            "write-behind queue full",
                            &format!(
                                "shard {} dropped the upload of {key} ({} blocks queued, --s3-upload-queue-mib)",
                                self.shard, self.tier.queue_blocks
                            ),
                        );
                        return Some(UploadOutcome::Dropped);
                    }
                }
            }
            S3WritePolicy::Through => {
                c.uploads_inflight.fetch_add(1, Ordering::Relaxed);
                let job = upload_job(&self.tier, self.shard, key.to_string(), chunks);
                let outcome = self.tier.call(job).await.unwrap_or(UploadOutcome::Failed);
                c.uploads_inflight.fetch_sub(1, Ordering::Relaxed);
                outcome
            }
            S3WritePolicy::Off => unreachable!("handled above"),
        };
        if matches!(outcome, UploadOutcome::Uploaded | UploadOutcome::Present) {
            self.learn(key, true);
        }
        Some(outcome)
    }

    /// Reads `key` from the bucket and checks it; `Fetched::Failed` on an
    /// error, a timeout or a bad object (each counted and logged).
    async fn fetch(&self, key: &str) -> Fetched {
        let counters = self.counters();
        let c = &counters.c;
        inc(&c.reads);
        if self.known(key) == Some(false) {
            inc(&c.presence_cache_hits);
            inc(&c.read_misses);
            return Fetched::Absent;
        }
        if !self.tier.breaker.allows() {
            inc(&c.read_errors);
            inc(&c.skipped_down);
            return Fetched::Failed;
        }
        let client = self.tier.client.clone();
        let path = self.tier.path(key);
        let timeout = self.tier.timeout;
        let started = Instant::now();
        let answer = self
            .tier
            .call(async move {
                tokio::time::timeout(timeout, async move {
                    let got = client.get(&path).await?;
                    got.bytes().await
                })
                .await
            })
            .await;
        match answer {
            Some(Ok(Ok(object))) => {
                self.tier.breaker.success();
                c.read_bytes.fetch_add(object.len() as u64, Ordering::Relaxed);
                match decode_object(&object, key, self.tier.block_bytes) {
                    Ok(payload) => {
                        record(&counters.read_us, started);
                        inc(&c.read_hits);
                        self.learn(key, true);
                        Fetched::Block(payload)
                    }
                    Err(fault) => {
                        inc(&c.read_corrupt);
                        tracing::error!(shard = self.shard, key, ?fault, "S3 object failed its checks; not served, deleting it");
                        self.learn(key, false);
                        self.delete_object(key).await;
                        Fetched::Failed
                    }
                }
            }
            Some(Ok(Err(object_store::Error::NotFound { .. }))) => {
                self.tier.breaker.success();
                record(&counters.read_us, started);
                inc(&c.read_misses);
                self.learn(key, false);
                Fetched::Absent
            }
            Some(Ok(Err(e))) => {
                self.tier.breaker.failure();
                inc(&c.read_errors);
                self.tier.read_log.warn("read", &format!("GET of {key} failed, answered as a miss: {e}"));
                Fetched::Failed
            }
            Some(Err(_)) => {
                self.tier.breaker.failure();
                inc(&c.read_errors);
                inc(&c.timeouts);
                self.tier.read_log.warn("read", &format!("GET of {key} timed out after {} ms, answered as a miss", timeout.as_millis()));
                Fetched::Failed
            }
            None => {
                inc(&c.read_errors);
                Fetched::Failed
            }
        }
    }

    /// A local miss: reads `key` from the bucket, checks it, and installs
    /// it into the local tiers (a failure to install is counted and
    /// logged; the block is served anyway). `None`: not there, or S3 failed
    /// (a miss either way).
    ///
    /// Concurrent misses of one key on this shard share one read and one
    /// install (`reads_joined`): a popular prefix arriving at once costs
    /// one GET per block, not one per request.
    pub async fn read_through(self: &Rc<Self>, store: &Rc<Store>, key: &str) -> Option<Bytes> {
        let existing = self.reading.borrow().get(key).cloned();
        if let Some(read) = existing {
            inc(&self.counters().c.reads_joined);
            return read.await;
        }
        let (me, store, owned) = (self.clone(), store.clone(), key.to_string());
        let read = async move {
            let got = match me.fetch(&owned).await {
                Fetched::Block(payload) => {
                    me.install(&store, &owned, payload.clone()).await;
                    Some(payload)
                }
                Fetched::Absent | Fetched::Failed => None,
            };
            me.reading.borrow_mut().remove(&owned);
            got
        }
        .boxed_local()
        .shared();
        self.reading.borrow_mut().insert(key.to_string(), read.clone());
        read.await
    }

    async fn install(&self, store: &Store, key: &str, payload: Bytes) -> bool {
        let c = &self.counters().c;
        match store.put(key, vec![payload]).await {
            Ok(_) => {
                inc(&c.installs);
                true
            }
            Err(e) => {
                inc(&c.install_failures);
                self.tier.write_log.warn("install", &format!("storing {key} read from S3 in the local tiers failed: {e}"));
                false
            }
        }
    }

    /// Whether each of `keys` is in the bucket (`None`: unknown after an
    /// error or timeout), from the presence cache or by HEAD requests, all
    /// at once on the runtime (callers bound the batch).
    async fn exists_many(&self, keys: &[&str]) -> Vec<Option<bool>> {
        let counters = self.counters();
        let c = &counters.c;
        let mut answers: Vec<Option<bool>> = keys.iter().map(|k| self.known(k)).collect();
        let c_hits = answers.iter().filter(|a| a.is_some()).count() as u64;
        c.presence_cache_hits.fetch_add(c_hits, Ordering::Relaxed);
        let ask: Vec<(usize, ObjectPath)> =
            answers.iter().enumerate().filter(|(_, a)| a.is_none()).map(|(i, _)| (i, self.tier.path(keys[i]))).collect();
        if ask.is_empty() {
            return answers;
        }
        if !self.tier.breaker.allows() {
            c.skipped_down.fetch_add(ask.len() as u64, Ordering::Relaxed);
            return answers;
        }
        c.exists_checks.fetch_add(ask.len() as u64, Ordering::Relaxed);
        let client = self.tier.client.clone();
        let timeout = self.tier.timeout;
        let started = Instant::now();
        let found = self
            .tier
            .call(async move {
                let heads = ask.into_iter().map(|(i, path)| {
                    let client = client.clone();
                    async move { (i, tokio::time::timeout(timeout, client.head(&path)).await) }
                });
                futures::future::join_all(heads).await
            })
            .await
            .unwrap_or_default();
        record(&counters.exists_us, started);
        for (i, r) in found {
            answers[i] = match r {
                Ok(Ok(_)) => {
                    self.tier.breaker.success();
                    Some(true)
                }
                Ok(Err(object_store::Error::NotFound { .. })) => {
                    self.tier.breaker.success();
                    Some(false)
                }
                Ok(Err(e)) => {
                    self.tier.breaker.failure();
                    inc(&c.exists_errors);
                    self.tier.read_log.warn("existence check", &format!("HEAD of {} failed, counted as absent: {e}", keys[i]));
                    None
                }
                Err(_) => {
                    self.tier.breaker.failure();
                    inc(&c.exists_errors);
                    inc(&c.timeouts);
                    self.tier.read_log.warn("existence check", &format!("HEAD of {} timed out after {} ms", keys[i], timeout.as_millis()));
                    None
                }
            };
            if let Some(present) = answers[i] {
                self.learn(keys[i], present);
            }
        }
        answers
    }

    /// How many leading keys of `keys` the bucket holds: windows of
    /// `--s3-lookup-parallelism` keys checked at once, stopping at the
    /// first absent (or unknown) key.
    pub async fn count_present(&self, keys: &[&str]) -> usize {
        let mut n = 0;
        for window in keys.chunks(self.tier.parallelism) {
            let answers = self.exists_many(window).await;
            let present = answers.iter().take_while(|a| **a == Some(true)).count();
            n += present;
            if present < window.len() {
                break;
            }
        }
        n
    }

    /// Copies `keys` (not stored locally) from the bucket into the local
    /// tiers in a background task on this shard, `--s3-lookup-parallelism`
    /// at a time; absent keys are skipped.
    pub fn prefetch(self: &Rc<Self>, store: Rc<Store>, keys: Vec<String>) {
        let me = self.clone();
        glommio::spawn_local(async move {
            for window in keys.chunks(me.tier.parallelism) {
                let reads = window.iter().map(|k| me.read_through(&store, k));
                let got = futures::future::join_all(reads).await;
                let n = got.iter().filter(|g| g.is_some()).count() as u64;
                me.counters().c.prefetched.fetch_add(n, Ordering::Relaxed);
            }
        })
        .detach();
    }

    /// Deletes `key`'s object (best effort; errors are counted and logged)
    /// and remembers it as absent. Returns whether the delete was accepted.
    pub async fn delete_object(&self, key: &str) -> bool {
        let c = &self.counters().c;
        if !self.tier.breaker.allows() {
            inc(&c.delete_errors);
            inc(&c.skipped_down);
            return false;
        }
        let client = self.tier.client.clone();
        let path = self.tier.path(key);
        let timeout = self.tier.timeout;
        let r = self.tier.call(async move { tokio::time::timeout(timeout, client.delete(&path)).await }).await;
        self.learn(key, false);
        match r {
            Some(Ok(Ok(()))) => {
                self.tier.breaker.success();
                inc(&c.deletes);
                true
            }
            Some(Ok(Err(e))) => {
                self.tier.breaker.failure();
                inc(&c.delete_errors);
                self.tier.write_log.warn("delete", &format!("DELETE of {key} failed: {e}"));
                false
            }
            _ => {
                self.tier.breaker.failure();
                inc(&c.delete_errors);
                inc(&c.timeouts);
                self.tier.write_log.warn("delete", &format!("DELETE of {key} timed out after {} ms", timeout.as_millis()));
                false
            }
        }
    }

    /// Whether `key` is in the bucket (one existence check, or the cache).
    pub async fn exists(&self, key: &str) -> bool {
        self.exists_many(&[key]).await[0] == Some(true)
    }
}

/// Credentials from the shared credentials file.
struct SharedCredentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
}

fn home_file(env_var: &str, default: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env_var).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(default))
}

/// The `[section]` of an INI-style AWS file as key → value.
fn ini_section(text: &str, section: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
    }
    out
}

fn profile() -> String {
    std::env::var("AWS_PROFILE").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "default".into())
}

/// `aws_access_key_id`, `aws_secret_access_key` and `aws_session_token` of
/// the profile `AWS_PROFILE` (default `default`) in
/// `AWS_SHARED_CREDENTIALS_FILE` (default `~/.aws/credentials`).
fn shared_credentials() -> Option<SharedCredentials> {
    let text = std::fs::read_to_string(home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials")?).ok()?;
    let s = ini_section(&text, &profile());
    Some(SharedCredentials {
        access_key_id: s.get("aws_access_key_id")?.clone(),
        secret_access_key: s.get("aws_secret_access_key")?.clone(),
        session_token: s.get("aws_session_token").cloned(),
    })
}

/// `region` of the profile in `AWS_CONFIG_FILE` (default `~/.aws/config`;
/// section `[default]` or `[profile NAME]`).
fn shared_config_region() -> Option<String> {
    let text = std::fs::read_to_string(home_file("AWS_CONFIG_FILE", ".aws/config")?).ok()?;
    let p = profile();
    let section = if p == "default" { p } else { format!("profile {p}") };
    ini_section(&text, &section).get("region").cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_are_refused_with_the_reason() {
        assert_eq!(parse_url("s3://kv-cache").unwrap(), S3Location { bucket: "kv-cache".into(), prefix: "".into() });
        assert_eq!(parse_url("s3://kv-cache/fleet/a/").unwrap(), S3Location { bucket: "kv-cache".into(), prefix: "fleet/a".into() });
        assert!(parse_url("https://kv-cache").unwrap_err().contains("s3://BUCKET"));
        assert!(parse_url("s3://").unwrap_err().contains("names no bucket"));
        assert!(parse_url("s3:///prefix").unwrap_err().contains("names no bucket"));
        assert!(parse_url("s3://Kv_Cache").unwrap_err().contains("may hold only"));
        assert!(parse_url("s3://kv/a//b").unwrap_err().contains("empty"));
        assert!(parse_url("s3://kv/a/../b").unwrap_err().contains("'..'"));
    }

    #[test]
    fn object_names_carry_prefix_block_size_and_a_spread_byte() {
        let name = object_name("fleet", 65_536, "k-1");
        let spread = BlockHash::of(b"k-1").0 as u8;
        assert_eq!(name, format!("fleet/kvtier/v1/65536/{spread:02x}/k-1"));
        assert_eq!(object_name("", 65_536, "k-1"), format!("kvtier/v1/65536/{spread:02x}/k-1"));
    }

    fn object(key: &str, payload: &[u8]) -> Bytes {
        let mut b = encode_header(key, payload.len() as u64, crc32fast::hash(payload)).to_vec();
        b.extend_from_slice(payload);
        b.into()
    }

    #[test]
    fn an_object_round_trips_and_every_damage_is_refused() {
        let payload: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let good = object("k-1", &payload);
        assert_eq!(decode_object(&good, "k-1", 4096).unwrap(), &payload[..]);
        assert_eq!(decode_object(&good, "k-2", 4096), Err(ObjectFault::WrongKey));
        assert_eq!(decode_object(&good, "k-1", 8192), Err(ObjectFault::WrongBlockBytes(4096)));
        assert_eq!(decode_object(&good.slice(..good.len() - 1), "k-1", 4096), Err(ObjectFault::Truncated));
        assert_eq!(decode_object(&good.slice(..10), "k-1", 4096), Err(ObjectFault::Truncated));
        let mut longer = good.to_vec();
        longer.push(0);
        assert_eq!(decode_object(&longer.into(), "k-1", 4096), Err(ObjectFault::TrailingBytes));
        // A flipped payload byte, header byte, or magic byte.
        for (at, fault) in [(good.len() - 7, ObjectFault::PayloadCrc), (21, ObjectFault::BadHeader), (0, ObjectFault::BadHeader)] {
            let mut bad = good.to_vec();
            bad[at] ^= 0x5a;
            assert_eq!(decode_object(&bad.into(), "k-1", 4096), Err(fault), "flip at {at}");
        }
    }

    #[test]
    fn aws_files_are_read_by_profile() {
        let text = "[default]\naws_access_key_id = AK\naws_secret_access_key=SK\n\n[profile other]\nregion = eu-west-1\n[other]\nAWS_ACCESS_KEY_ID=OK\n";
        let d = ini_section(text, "default");
        assert_eq!((d["aws_access_key_id"].as_str(), d["aws_secret_access_key"].as_str()), ("AK", "SK"));
        assert_eq!(ini_section(text, "profile other")["region"], "eu-west-1");
        assert_eq!(ini_section(text, "other")["aws_access_key_id"], "OK");
        assert!(ini_section(text, "missing").is_empty());
    }
}
