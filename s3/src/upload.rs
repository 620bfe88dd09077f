//! Uploads: the write-behind queue's worker per shard, and one create-only
//! upload, counted in the owning shard's counters.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use bytes::Bytes;
use kvtier_engine::key::StoredKey;
use kvtier_engine::remote::UploadOutcome;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

use crate::counters::{inc, record};
use crate::object::encode_header;
use crate::warn::Kind;
use crate::S3Tier;

/// One block upload waiting in a shard's write-behind queue.
pub(crate) struct Upload {
    pub key: StoredKey,
    pub chunks: Vec<Bytes>,
    pub tag: Option<Bytes>,
}

/// One shard's write-behind worker, on the runtime: takes queued uploads
/// in order and runs up to `--s3-uploads-inflight` at once.
pub(crate) async fn worker(tier: Weak<S3Tier>, shard: usize, mut rx: tokio::sync::mpsc::Receiver<Upload>) {
    let permits = {
        let Some(t) = tier.upgrade() else { return };
        Arc::new(tokio::sync::Semaphore::new(t.settings.uploads_inflight_max))
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
        let job = job(&t, shard, up.key, up.chunks, up.tag);
        drop(t);
        tokio::spawn(async move {
            job.await;
            counters.c.uploads_inflight.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
}

/// The future of one create-only upload of `key`, counted in `shard`'s
/// counters. Owns what it needs, so it runs on any runtime thread.
pub(crate) fn job(
    tier: &S3Tier,
    shard: usize,
    key: StoredKey,
    chunks: Vec<Bytes>,
    tag: Option<Bytes>,
) -> impl Future<Output = UploadOutcome> + Send + 'static {
    let client = tier.client.clone();
    let path = tier.path(&key);
    let timeout = tier.settings.upload_timeout;
    let counters = tier.shards[shard].clone();
    let block_bytes = tier.block_bytes;
    let breaker = tier.breaker.clone();
    let warnings = tier.warnings.clone();
    let health = tier.health.clone();
    async move {
        let c = &counters.c;
        if !breaker.allows() {
            inc(&c.uploads_failed);
            inc(&c.skipped_down);
            return UploadOutcome::Failed;
        }
        let mut crc = crc32fast::Hasher::new();
        for chunk in &chunks {
            crc.update(chunk);
        }
        let header = encode_header(key.as_str(), block_bytes, crc.finalize(), tag.as_deref());
        let object_bytes = (header.len() as u64) + block_bytes;
        let payload: PutPayload = std::iter::once(header).chain(chunks).collect();
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        let started = Instant::now();
        let failed = |kind: &str, message: String| {
            breaker.failure();
            inc(&c.uploads_failed);
            warnings.warn(Kind::Upload, &message);
            health.error(kind, message);
            UploadOutcome::Failed
        };
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
            Ok(Err(e)) => failed("upload", format!("upload of {key} failed: {e}")),
            Err(_) => {
                inc(&c.timeouts);
                failed("timeout", format!("upload of {key} timed out after {} ms", timeout.as_millis()))
            }
        }
    }
}
