//! One owning shard's handle on the shared tier: its presence cache, reads,
//! existence checks, deletes and uploads, counted in its own counters.
//!
//! The engine sends every operation on a key to the shard that owns it, so
//! this shard's presence cache sees every PUT and DELETE of the keys it
//! remembers: a DELETE through any connection clears the entry that would
//! otherwise make the next PUT skip its upload.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::future::{FutureExt, LocalBoxFuture};
use kvtier_engine::key::StoredKey;
use kvtier_engine::remote::{Fetched, RemoteEvent, RemoteShard, UploadOutcome};
use object_store::path::Path as ObjectPath;
use object_store::ObjectStoreExt;

use crate::counters::{inc, record, ShardCounters};
use crate::object::decode_object;
use crate::upload::{self, Upload};
use crate::warn::Kind;
use crate::{S3Tier, S3WritePolicy};

/// Entries a shard's presence cache holds at most; past it expired entries
/// are dropped, then all.
const PRESENCE_ENTRIES_MAX: usize = 1 << 16;

/// What one shard knows of the bucket for a short while: key → (present,
/// when learned).
type PresenceCache = HashMap<StoredKey, (bool, Instant)>;

/// A shard's handle. Lives on the shard's executor (`!Send`).
pub(crate) struct S3Shard {
    tier: Arc<S3Tier>,
    shard: usize,
    counters: Arc<ShardCounters>,
    presence: RefCell<PresenceCache>,
}

impl S3Shard {
    pub(crate) fn new(tier: Arc<S3Tier>, shard: usize, counters: Arc<ShardCounters>) -> S3Shard {
        S3Shard { tier, shard, counters, presence: RefCell::new(HashMap::new()) }
    }

    fn known(&self, key: &StoredKey) -> Option<bool> {
        let ttl = self.tier.settings.presence_ttl;
        if ttl.is_zero() {
            return None;
        }
        self.presence.borrow().get(key).filter(|(_, at)| at.elapsed() < ttl).map(|(present, _)| *present)
    }

    fn learn(&self, key: &StoredKey, present: bool) {
        let ttl = self.tier.settings.presence_ttl;
        if ttl.is_zero() {
            return;
        }
        let mut p = self.presence.borrow_mut();
        if p.len() >= PRESENCE_ENTRIES_MAX {
            p.retain(|_, (_, at)| at.elapsed() < ttl);
            if p.len() >= PRESENCE_ENTRIES_MAX {
                p.clear();
            }
        }
        p.insert(key.clone(), (present, Instant::now()));
    }

    /// A failed S3 request: the breaker, the warning of its kind, the
    /// tier's health.
    fn failed(&self, kind: Kind, health_kind: &str, message: String) {
        self.tier.breaker.failure();
        self.tier.warnings.warn(kind, &message);
        self.tier.health.error(health_kind, message);
    }

    /// Uploads a block just stored locally, as the write policy says:
    /// `behind` queues it (never waits; a full queue drops it), `through`
    /// waits for the upload, `off` does nothing (`None`). A block this
    /// shard knows is in the bucket is not sent again.
    async fn upload(&self, key: &StoredKey, chunks: Vec<Bytes>, tag: Option<Bytes>) -> Option<UploadOutcome> {
        let tier = &self.tier;
        let c = &self.counters.c;
        if tier.settings.policy == S3WritePolicy::Off {
            return None;
        }
        if self.known(key) == Some(true) {
            inc(&c.uploads_present);
            return Some(UploadOutcome::Present);
        }
        let outcome = match tier.settings.policy {
            S3WritePolicy::Behind => {
                // Counted before the send: the worker may take it at once.
                c.uploads_pending.fetch_add(1, Ordering::Relaxed);
                return match tier.queues[self.shard].try_send(Upload { key: key.clone(), chunks, tag }) {
                    Ok(()) => {
                        c.uploads_queued_max.fetch_max(tier.queued(self.shard), Ordering::Relaxed);
                        Some(UploadOutcome::Queued)
                    }
                    Err(_) => {
                        c.uploads_pending.fetch_sub(1, Ordering::Relaxed);
                        inc(&c.uploads_dropped);
                        let why = format!(
                            "shard {} dropped the upload of {key} ({} blocks queued, --s3-upload-queue-mib)",
                            self.shard, tier.settings.queue_blocks
                        );
                        tier.warnings.warn(Kind::QueueFull, &why);
                        tier.health.error("queue_full", why);
                        Some(UploadOutcome::Dropped)
                    }
                };
            }
            S3WritePolicy::Through => {
                c.uploads_inflight.fetch_add(1, Ordering::Relaxed);
                let job = upload::job(tier, self.shard, key.clone(), chunks, tag);
                let outcome = tier.call(job).await.unwrap_or(UploadOutcome::Failed);
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

    /// Reads `key` from the bucket and checks it; [`Fetched::Failed`] on an
    /// error, a timeout or a bad object (each counted and logged; a bad
    /// object is deleted).
    async fn fetch(&self, key: &StoredKey) -> Fetched {
        let tier = &self.tier;
        let counters = &self.counters;
        let c = &counters.c;
        inc(&c.reads);
        if self.known(key) == Some(false) {
            inc(&c.presence_cache_hits);
            inc(&c.read_misses);
            return Fetched::Absent;
        }
        if !tier.breaker.allows() {
            inc(&c.read_errors);
            inc(&c.skipped_down);
            return Fetched::Failed;
        }
        let client = tier.client.clone();
        let path = tier.path(key);
        let timeout = tier.settings.timeout;
        let started = Instant::now();
        let answer = tier
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
                tier.breaker.success();
                c.read_bytes.fetch_add(object.len() as u64, Ordering::Relaxed);
                match decode_object(&object, key.as_str(), tier.block_bytes) {
                    Ok(object) => {
                        record(&counters.read_us, started);
                        inc(&c.read_hits);
                        self.learn(key, true);
                        Fetched::Block { payload: object.payload, tag: object.tag }
                    }
                    Err(fault) => {
                        inc(&c.read_corrupt);
                        tracing::error!(
                            shard = self.shard,
                            key = key.as_str(),
                            ?fault,
                            "S3 object failed its checks; not served, deleting it"
                        );
                        tier.health.error("corrupt", format!("the object of {key} failed its checks ({fault:?}); deleted"));
                        self.learn(key, false);
                        self.delete(key).await;
                        Fetched::Failed
                    }
                }
            }
            Some(Ok(Err(object_store::Error::NotFound { .. }))) => {
                tier.breaker.success();
                record(&counters.read_us, started);
                inc(&c.read_misses);
                self.learn(key, false);
                Fetched::Absent
            }
            Some(Ok(Err(e))) => {
                inc(&c.read_errors);
                self.failed(Kind::Read, "read", format!("GET of {key} failed, answered as a miss: {e}"));
                Fetched::Failed
            }
            Some(Err(_)) => {
                inc(&c.read_errors);
                inc(&c.timeouts);
                self.failed(Kind::Read, "timeout", format!("GET of {key} timed out after {} ms, answered as a miss", timeout.as_millis()));
                Fetched::Failed
            }
            None => {
                inc(&c.read_errors);
                Fetched::Failed
            }
        }
    }

    /// Whether each of `keys` is in the bucket (`None`: unknown after an
    /// error or timeout), from the presence cache or by HEAD requests, all
    /// at once on the runtime (callers bound the batch).
    async fn exists_many(&self, keys: &[&StoredKey]) -> Vec<Option<bool>> {
        let tier = &self.tier;
        let counters = &self.counters;
        let c = &counters.c;
        let mut answers: Vec<Option<bool>> = keys.iter().map(|k| self.known(k)).collect();
        let cached = answers.iter().filter(|a| a.is_some()).count() as u64;
        c.presence_cache_hits.fetch_add(cached, Ordering::Relaxed);
        let ask: Vec<(usize, ObjectPath)> =
            answers.iter().enumerate().filter(|(_, a)| a.is_none()).map(|(i, _)| (i, tier.path(keys[i]))).collect();
        if ask.is_empty() {
            return answers;
        }
        if !tier.breaker.allows() {
            c.skipped_down.fetch_add(ask.len() as u64, Ordering::Relaxed);
            return answers;
        }
        c.exists_checks.fetch_add(ask.len() as u64, Ordering::Relaxed);
        let client = tier.client.clone();
        let timeout = tier.settings.timeout;
        let started = Instant::now();
        let found = tier
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
                    tier.breaker.success();
                    Some(true)
                }
                Ok(Err(object_store::Error::NotFound { .. })) => {
                    tier.breaker.success();
                    Some(false)
                }
                Ok(Err(e)) => {
                    inc(&c.exists_errors);
                    self.failed(Kind::Exists, "exists", format!("HEAD of {} failed, counted as absent: {e}", keys[i]));
                    None
                }
                Err(_) => {
                    inc(&c.exists_errors);
                    inc(&c.timeouts);
                    self.failed(Kind::Exists, "timeout", format!("HEAD of {} timed out after {} ms", keys[i], timeout.as_millis()));
                    None
                }
            };
            if let Some(present) = answers[i] {
                self.learn(keys[i], present);
            }
        }
        answers
    }

    /// Deletes `key`'s object (best effort; errors are counted and logged)
    /// and remembers it as absent. Returns whether the delete was accepted.
    async fn delete(&self, key: &StoredKey) -> bool {
        let tier = &self.tier;
        let c = &self.counters.c;
        self.learn(key, false);
        if !tier.breaker.allows() {
            inc(&c.delete_errors);
            inc(&c.skipped_down);
            return false;
        }
        let client = tier.client.clone();
        let path = tier.path(key);
        let timeout = tier.settings.timeout;
        let r = tier.call(async move { tokio::time::timeout(timeout, client.delete(&path)).await }).await;
        match r {
            Some(Ok(Ok(()))) => {
                tier.breaker.success();
                inc(&c.deletes);
                true
            }
            Some(Ok(Err(e))) => {
                inc(&c.delete_errors);
                self.failed(Kind::Delete, "delete", format!("DELETE of {key} failed: {e}"));
                false
            }
            _ => {
                inc(&c.delete_errors);
                inc(&c.timeouts);
                self.failed(Kind::Delete, "timeout", format!("DELETE of {key} timed out after {} ms", timeout.as_millis()));
                false
            }
        }
    }
}

impl RemoteShard for S3Shard {
    fn fetch<'a>(&'a self, key: &'a StoredKey) -> LocalBoxFuture<'a, Fetched> {
        S3Shard::fetch(self, key).boxed_local()
    }

    fn upload<'a>(&'a self, key: &'a StoredKey, chunks: Vec<Bytes>, tag: Option<Bytes>) -> LocalBoxFuture<'a, Option<UploadOutcome>> {
        S3Shard::upload(self, key, chunks, tag).boxed_local()
    }

    fn exists_many<'a>(&'a self, keys: &'a [&'a StoredKey]) -> LocalBoxFuture<'a, Vec<Option<bool>>> {
        S3Shard::exists_many(self, keys).boxed_local()
    }

    fn delete<'a>(&'a self, key: &'a StoredKey) -> LocalBoxFuture<'a, bool> {
        S3Shard::delete(self, key).boxed_local()
    }

    fn count(&self, event: RemoteEvent) {
        let c = &self.counters.c;
        match event {
            RemoteEvent::ReadJoined => inc(&c.reads_joined),
            RemoteEvent::Installed => inc(&c.installs),
            RemoteEvent::InstallFailed(why) => {
                inc(&c.install_failures);
                self.tier.warnings.warn(Kind::Install, &why);
            }
            RemoteEvent::InstallSuperseded => inc(&c.install_superseded),
            RemoteEvent::Prefetched(n) => {
                c.prefetched.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}
