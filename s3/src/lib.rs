//! # kvtier-s3
//!
//! The shared tier below NVMe: blocks on S3-compatible object storage (AWS
//! S3, S3 Express, Ceph RGW, MinIO, Garage, GCS's S3 API), so a prefix
//! computed on one node is read on another and outlives any node's disk.
//! It implements the engine's remote-tier traits ([`kvtier_engine::remote`]):
//! the engine decides when a block is fetched, uploaded, checked or deleted,
//! always on the shard that owns its key; this crate decides how.
//!
//! Blocks are immutable and content-addressed, so nodes share the bucket
//! without a coherence protocol: an upload is create-only (`If-None-Match:
//! *`) and "already there" is success.
//!
//! Threads: the `object_store` client runs on one multi-threaded tokio
//! runtime owned by the process ([`S3Tier`], `--s3-threads` threads). A
//! shard (a glommio executor) never runs tokio: it spawns the request onto
//! the runtime and awaits the answer on a `futures` oneshot, whose wake
//! glommio delivers from the other thread. Write-behind uploads go through
//! a bounded tokio channel per shard, filled with `try_send`, so a PUT never
//! waits for S3; when the queue is full the upload is dropped and counted.
//!
//! | module | what |
//! |---|---|
//! | [`args`] | the `--s3-*` flags and their checks |
//! | [`object`] | object names and the object format (docs/FORMAT.md) |
//! | `shard` | one owning shard's handle: presence cache, reads, existence checks, deletes, uploads |
//! | `upload` | the write-behind queue's worker and one upload |
//! | `counters` | counters and latencies per shard, `/v1/stats` and `/metrics` |
//! | [`breaker`] | the circuit breaker |
//! | `warn` | rate-limited warnings, one limiter per kind |
//! | `credentials` | credentials and region from the AWS SDK's default chain |
#![deny(missing_docs)]

pub mod args;
pub mod breaker;
mod counters;
mod credentials;
pub mod object;
mod shard;
mod upload;
mod warn;

use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_engine::health::{HealthState, HealthTracker, TierHealth};
use kvtier_engine::key::StoredKey;
use kvtier_engine::remote::{Remote, RemoteShard};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, RetryConfig};
use serde_json::{json, Value};

pub use args::{S3Args, S3WritePolicy};
pub use breaker::{DOWN_AFTER_FAILURES, DOWN_COOLDOWN};
use counters::ShardCounters;
pub use object::{decode_object, encode_header, object_name, parse_url, Object, ObjectFault, S3Location, OBJECT_MAGIC};

/// Tier name in `x-kvtier-tier`, lookup answers, a PUT's answer and
/// `/v1/stats`.
pub const TIER_NAME: &str = "s3";

/// Longest a clean stop waits for queued write-behind uploads.
pub const DRAIN_MAX: Duration = Duration::from_secs(10);

/// The shared tier of the process: the S3 client on its tokio runtime,
/// every shard's write-behind queue, counters, the circuit breaker and the
/// tier's health. `Send + Sync`; each shard uses it through the handle
/// [`Remote::for_shard`] gives it.
pub struct S3Tier {
    runtime: tokio::runtime::Runtime,
    client: Arc<AmazonS3>,
    settings: args::Settings,
    block_bytes: u64,
    queues: Vec<tokio::sync::mpsc::Sender<upload::Upload>>,
    shards: Vec<Arc<ShardCounters>>,
    warnings: Arc<warn::Warnings>,
    breaker: Arc<breaker::Breaker>,
    health: Arc<HealthTracker>,
    /// The `Arc` this tier lives in, for the shards' handles.
    me: std::sync::Weak<S3Tier>,
}

impl S3Tier {
    /// Builds the client and the runtime, and starts each shard's upload
    /// worker. Does not contact S3 (a store that is down at start is a
    /// store that is down: reads miss, uploads fail, both counted);
    /// [`S3Tier::probe`] says whether it answers.
    ///
    /// An error keeps the tier degraded for `health_window`.
    ///
    /// # Errors
    /// A bad flag value or client configuration, named.
    pub fn new(args: &S3Args, shards: usize, block_bytes: u64, health_window: Duration) -> Result<Arc<S3Tier>, String> {
        let settings = args.settings(block_bytes)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(settings.threads)
            .thread_name("kvtier-s3")
            .enable_all()
            .build()
            .map_err(|e| format!("starting the S3 runtime: {e}"))?;
        // Client options first: `with_client_options` replaces them all,
        // `with_allow_http` included.
        let mut builder = AmazonS3Builder::from_env()
            .with_client_options(ClientOptions::new().with_timeout(settings.upload_timeout).with_connect_timeout(settings.timeout))
            .with_bucket_name(&settings.location.bucket);
        // Credentials and region as every AWS tool finds them.
        let chain = credentials::load(&runtime);
        if let Some(provider) = chain.credentials {
            builder = builder.with_credentials(Arc::new(provider));
        }
        if let Some(region) = chain.region {
            builder = builder.with_region(region);
        }
        if let Some(e) = &settings.endpoint {
            builder = builder.with_endpoint(e).with_allow_http(e.starts_with("http://"));
        }
        let client = builder
            .with_retry(RetryConfig { max_retries: 2, retry_timeout: settings.upload_timeout, ..Default::default() })
            .build()
            .map_err(|e| format!("configuring the S3 client for {}: {e}", settings.url))?;
        let mut queues = Vec::with_capacity(shards);
        let receivers: Vec<_> = (0..shards)
            .map(|_| {
                let (tx, rx) = tokio::sync::mpsc::channel(settings.queue_blocks);
                queues.push(tx);
                rx
            })
            .collect();
        let tier = Arc::new_cyclic(|me| S3Tier {
            me: me.clone(),
            runtime,
            client: Arc::new(client),
            settings,
            block_bytes,
            queues,
            shards: (0..shards).map(|_| Arc::new(ShardCounters::new())).collect(),
            warnings: Arc::new(warn::Warnings::new()),
            breaker: Arc::new(breaker::Breaker::new()),
            health: Arc::new(HealthTracker::new(TIER_NAME, None, health_window)),
        });
        for (shard, rx) in receivers.into_iter().enumerate() {
            let weak = Arc::downgrade(&tier);
            tier.runtime.spawn(upload::worker(weak, shard, rx));
        }
        Ok(tier)
    }

    /// Whether the bucket answers a listing of the prefix within the read
    /// timeout; the error when it does not. For the start-up log line.
    pub fn probe(&self) -> Result<(), String> {
        let client = self.client.clone();
        let prefix = ObjectPath::from(self.settings.location.prefix.as_str());
        let timeout = self.settings.timeout;
        self.runtime.block_on(async move {
            match tokio::time::timeout(timeout, client.list_with_delimiter(Some(&prefix))).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
            }
        })
    }

    fn path(&self, key: &StoredKey) -> ObjectPath {
        ObjectPath::from(object_name(&self.settings.location.prefix, self.block_bytes, key))
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
}

impl Remote for S3Tier {
    fn name(&self) -> &'static str {
        TIER_NAME
    }

    /// `s3://BUCKET/PREFIX`, the endpoint and the write policy.
    fn describe(&self) -> String {
        let l = &self.settings.location;
        let mut s = format!("s3://{}", l.bucket);
        if !l.prefix.is_empty() {
            s.push('/');
            s.push_str(&l.prefix);
        }
        if let Some(e) = &self.settings.endpoint {
            s.push_str(&format!(" at {e}"));
        }
        s.push_str(&format!(", write policy {}", self.settings.policy.as_str()));
        s
    }

    fn for_shard(&self, shard: usize) -> Rc<dyn RemoteShard> {
        let tier = self.shards[shard].clone();
        Rc::new(shard::S3Shard::new(self.self_arc(), shard, tier))
    }

    fn parallelism(&self) -> usize {
        self.settings.parallelism
    }

    /// Settings, counters summed over shards (latency percentiles: the
    /// largest shard's), per shard, and the breaker's state.
    fn stats_json(&self) -> Value {
        let per_shard: Vec<Value> = self.shards.iter().enumerate().map(|(i, s)| counters::shard_json(i, s, self.queued(i))).collect();
        let s = &self.settings;
        json!({
            "url": format!("s3://{}/{}", s.location.bucket, s.location.prefix),
            "endpoint": s.endpoint,
            "write_policy": s.policy,
            "timeout_ms": s.timeout.as_millis() as u64,
            "upload_timeout_ms": s.upload_timeout.as_millis() as u64,
            "upload_queue_blocks": s.queue_blocks,
            "uploads_inflight_max": s.uploads_inflight_max,
            "lookup_parallelism": s.parallelism,
            "presence_ttl_ms": s.presence_ttl.as_millis() as u64,
            "down": !self.breaker.allows(),
            "down_trips": self.breaker.trips.load(Ordering::Relaxed),
            "totals": counters::totals(&per_shard),
            "per_shard": per_shard,
        })
    }

    fn register_metrics(&self, registry: &mut kvtier_engine::latency::Scrape<'_>) {
        counters::register_metrics(&self.shards, &|i| self.queued(i), registry);
    }

    /// Degraded while the circuit breaker is open or an S3 operation failed
    /// within the health window.
    fn health(&self) -> TierHealth {
        let condition = (!self.breaker.allows()).then(|| {
            (
                HealthState::Degraded,
                format!(
                    "S3 failed {DOWN_AFTER_FAILURES} times in a row: requests are not sent for {DOWN_COOLDOWN:?} (reads miss, uploads fail)"
                ),
            )
        });
        self.health.evaluate(condition)
    }
}

impl S3Tier {
    /// The `Arc` this tier lives in: every handle holds one, so the tier
    /// outlives the shards.
    fn self_arc(&self) -> Arc<S3Tier> {
        self.me.upgrade().expect("an S3Tier lives in the Arc S3Tier::new made")
    }
}
