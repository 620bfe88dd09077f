//! The store: one shard per glommio executor, and the handle that routes each
//! operation to the shard that owns its key.
//!
//! [`run`] starts one pinned `LocalExecutor` per shard. Each opens its shard
//! (rebuilding the index from disk), joins a full channel mesh with the other
//! shards, then runs the caller's `serve` future (the HTTP server) with a
//! [`Store`] handle. An operation on a key another shard owns travels to the
//! owner over the mesh as a message carrying `Bytes` handles (no payload
//! copy); the answer comes back on a oneshot channel typed by the operation
//! (`store/mesh.rs`), whose cross-thread wake glommio delivers through the
//! owner executor's notifier.

use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::channel::oneshot;
use glommio::channels::channel_mesh::{MeshBuilder, Senders};
use glommio::{LocalExecutorBuilder, Placement};

use crate::error::{Error, Result};
use crate::geometry::{Geometry, StoreManifest};
use crate::health::{merge_by_tier, TierHealth};
use crate::key::{self, BlockHash};
use crate::recover;
use crate::remote::Remote;
use crate::shard::{PutOutcome, PutReport, Shard, ShardStats};
use crate::startup;
pub use crate::startup::START_WARN_AFTER;
use crate::stream::{BlockBody, BlockSink};
use crate::tenant::Owners;
pub use crate::tier::{Tier, WritePolicy};
use crate::trace::{ShardTrace, TraceOp, TraceStatus, TraceTier};

/// How often each shard evaluates its tiers' health (and logs a change).
const HEALTH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

mod config;
mod mesh;
pub use config::*;
use mesh::{copy_block, execute, start_prefetch, Reply, Request, MESH_QUEUE_DEPTH};

/// What a prefetch started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchReport {
    /// Keys stored locally, being promoted toward the fastest tier.
    pub found: usize,
    /// Keys not stored locally, being copied from the remote tier (those it
    /// holds); 0 without a remote tier.
    pub remote_requested: usize,
}

/// A block read back.
#[derive(Debug, Clone)]
pub struct Block {
    /// The payload, `block_bytes` long.
    pub bytes: Bytes,
    /// Where it was served from.
    pub tier: Tier,
}

/// The handle a shard's tasks use to reach the whole store. Lives on one
/// executor (`!Send`); every shard has its own.
pub struct Store {
    shard: Rc<Shard>,
    senders: Senders<Request>,
    shards: usize,
    manifest: StoreManifest,
    remote: Option<Arc<dyn Remote>>,
    trace: Option<Rc<ShardTrace>>,
}

impl Store {
    /// This executor's shard id.
    pub fn shard_id(&self) -> usize {
        self.shard.id() as usize
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// The store's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.manifest.geometry
    }

    /// The store's manifest (`store.json`).
    pub fn manifest(&self) -> &StoreManifest {
        &self.manifest
    }

    /// The remote tier below the log, if configured (its name, stats and
    /// metrics; its blocks are reached through the calls below).
    pub fn remote(&self) -> Option<&Arc<dyn Remote>> {
        self.remote.as_ref()
    }

    /// Sends `request(reply)` to shard `owner` and waits for the answer on
    /// `reply`, typed by the operation.
    ///
    /// # Errors
    /// [`Error::ShuttingDown`] when the owner no longer takes requests or
    /// dropped this one unanswered.
    async fn forward<T>(&self, owner: usize, request: impl FnOnce(Reply<T>) -> Request) -> Result<T> {
        self.shard.count_forwarded();
        let (reply, answer) = oneshot::channel();
        self.senders.send_to(owner, request(reply)).await.map_err(|_| Error::ShuttingDown)?;
        answer.await.map_err(|_| Error::ShuttingDown)
    }

    /// Stores `chunks` (together exactly `block_bytes`) under `key`,
    /// acknowledged once the O_DIRECT write has completed on the owning shard.
    ///
    /// # Errors
    /// [`Error::InvalidKey`], [`Error::WrongSize`], [`Error::DiskFull`],
    /// [`Error::Io`], [`Error::ShuttingDown`].
    pub async fn put(&self, key: &str, chunks: Vec<Bytes>) -> Result<PutOutcome> {
        Ok(self.put_reporting(key, chunks).await?.outcome)
    }

    /// [`Store::put`], and then the upload to the remote tier as its write
    /// policy says (on the owning shard); reports both.
    ///
    /// # Errors
    /// As [`Store::put`]; the remote tier never fails a PUT.
    pub async fn put_reporting(&self, key: &str, chunks: Vec<Bytes>) -> Result<PutReport> {
        key::validate_stored(key)?;
        let got: u64 = chunks.iter().map(|c| c.len() as u64).sum();
        if got != self.geometry().block_bytes {
            return Err(Error::WrongSize { expected: self.geometry().block_bytes, got });
        }
        let hash = BlockHash::of(key.as_bytes());
        let owner = hash.shard(self.shards);
        let put = if owner == self.shard_id() {
            self.shard.put_block(key, hash, &chunks).await
        } else {
            self.forward(owner, |reply| Request::Put { key: key.to_string(), hash, chunks, reply }).await?
        };
        if put.is_ok() {
            self.trace(TraceOp::Put, [(hash, TraceTier::None)]);
        }
        put
    }

    /// Records one call's keys in this shard's trace buffer: nothing when
    /// there is no recorder or it is off.
    fn trace(&self, op: TraceOp, keys: impl IntoIterator<Item = (BlockHash, TraceTier)>) {
        if let Some(t) = &self.trace {
            t.record_call(op, self.shards, keys);
        }
    }

    fn tracing(&self) -> bool {
        self.trace.as_ref().is_some_and(|t| t.is_on())
    }

    /// Records a read's outcome: the tier that served it, a miss for a
    /// block absent or corrupt, nothing for other errors.
    fn trace_read<T>(&self, hash: BlockHash, read: &Result<(T, Tier)>) {
        let tier = match read {
            Ok((_, tier)) => TraceTier::In(*tier),
            Err(Error::NotFound | Error::Corrupt { .. }) => TraceTier::Miss,
            Err(_) => return,
        };
        self.trace(TraceOp::Get, [(hash, tier)]);
    }

    /// Reads the block stored under `key` into one buffer (a block from the
    /// log is collected from its chunks: one copy more than
    /// [`Store::get_stream`], which the server uses).
    ///
    /// # Errors
    /// [`Error::InvalidKey`], [`Error::NotFound`], [`Error::Corrupt`] (treat
    /// as a miss), [`Error::Io`], [`Error::ShuttingDown`].
    pub async fn get(&self, key: &str) -> Result<Block> {
        let (body, tier) = self.get_stream(key).await?;
        Ok(Block { bytes: body.collect().await?, tier })
    }

    /// Reads the block stored under `key`: whole from the GPU or RAM tier
    /// (zero-copy from RAM), or as a [`BlockBody::Chunks`] stream from the
    /// log, where the owning shard reads its chunks with several reads in
    /// flight, checks each chunk's CRC-32 as it arrives and sends it on at
    /// once: from the DMA buffer it was read into (no copy; such chunks
    /// must be dropped on this shard's thread, see
    /// [`crate::stream::dma_chunk`]), or from the RAM slot it is promoted
    /// to. A chunk that fails ends the stream with an error and nothing
    /// after it: the caller must treat a stream that ends short as a miss
    /// (the server resets the response). A key another shard owns
    /// comes back with every chunk at once, checked there, and ends the
    /// same way on damage: the chunks before the bad one, then the error
    /// ([`Shard::get`]).
    ///
    /// # Errors
    /// As [`Store::get`].
    pub async fn get_stream(&self, key: &str) -> Result<(BlockBody, Tier)> {
        key::validate_stored(key)?;
        let hash = BlockHash::of(key.as_bytes());
        let owner = hash.shard(self.shards);
        let read = if owner == self.shard_id() {
            self.shard.get(key, hash, true).await
        } else {
            self.forward(owner, |reply| Request::Get { key: key.to_string(), hash, reply }).await?
        };
        self.trace_read(hash, &read);
        read
    }

    /// Copies the block stored under `key` into `sink` (a client's
    /// registered memory), on the shard that owns the key: from RAM one
    /// copy, from the log one copy of each chunk as it is read and
    /// verified, from the GPU or S3 one copy after the fetch. Returns the
    /// bytes copied (`block_bytes`) and the tier served from. On an error
    /// the sink may hold part of the block.
    ///
    /// # Errors
    /// As [`Store::get`]; [`Error::Io`] when the sink refused a chunk.
    pub async fn get_into(&self, key: &str, sink: Arc<dyn BlockSink>) -> Result<(u64, Tier)> {
        key::validate_stored(key)?;
        let hash = BlockHash::of(key.as_bytes());
        let owner = hash.shard(self.shards);
        let read = if owner == self.shard_id() {
            copy_block(&self.shard, key, hash, &*sink).await
        } else {
            self.forward(owner, |reply| Request::GetInto { key: key.to_string(), hash, sink, reply }).await?
        };
        self.trace_read(hash, &read);
        read
    }

    /// Deletes the block under `key` (a tombstone is logged), and its copy in
    /// the remote tier; a key stored only there is deleted there.
    ///
    /// # Errors
    /// [`Error::InvalidKey`], [`Error::NotFound`], [`Error::DiskFull`],
    /// [`Error::Io`], [`Error::ShuttingDown`].
    pub async fn delete(&self, key: &str) -> Result<()> {
        key::validate_stored(key)?;
        let hash = BlockHash::of(key.as_bytes());
        let owner = hash.shard(self.shards);
        let deleted = if owner == self.shard_id() {
            self.shard.delete_block(key, hash).await
        } else {
            self.forward(owner, |reply| Request::Delete { key: key.to_string(), hash, reply }).await?
        };
        match &deleted {
            Ok(()) => self.trace(TraceOp::Delete, [(hash, TraceTier::None)]),
            Err(Error::NotFound) => self.trace(TraceOp::Delete, [(hash, TraceTier::Miss)]),
            Err(_) => {}
        }
        deleted
    }

    /// The fastest tier holding each key (`None`: not stored), in order. One
    /// message per shard that owns any of the keys, sent in parallel.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for the first invalid key; [`Error::ShuttingDown`].
    pub async fn contains_many(&self, keys: &[&str]) -> Result<Vec<Option<Tier>>> {
        for k in keys {
            key::validate_stored(k)?;
        }
        self.ask_owners(keys, |owner, mine| async move {
            let hashes: Vec<BlockHash> = mine.iter().map(|(_, h)| *h).collect();
            if owner == self.shard_id() {
                return Ok(hashes.iter().map(|h| self.shard.contains(h)).collect());
            }
            self.forward(owner, |reply| Request::Contains { hashes, reply }).await
        })
        .await
    }

    /// Asks each shard owning any of `keys` about its own, all shards in
    /// parallel, and returns the answers in key order. `ask(owner, mine)`
    /// gets the owner's keys as (index into `keys`, block hash) and answers
    /// one item per key, in that order.
    async fn ask_owners<'a, T, F, Fut>(&'a self, keys: &[&str], ask: F) -> Result<Vec<T>>
    where
        T: Clone + Default,
        F: Fn(usize, Vec<(usize, BlockHash)>) -> Fut,
        Fut: Future<Output = Result<Vec<T>>> + 'a,
    {
        let mut by_shard: Vec<Vec<(usize, BlockHash)>> = vec![Vec::new(); self.shards];
        for (i, k) in keys.iter().enumerate() {
            let hash = BlockHash::of(k.as_bytes());
            by_shard[hash.shard(self.shards)].push((i, hash));
        }
        let asks = by_shard.into_iter().enumerate().filter(|(_, mine)| !mine.is_empty()).map(|(owner, mine)| {
            let indices: Vec<usize> = mine.iter().map(|(i, _)| *i).collect();
            let answer = ask(owner, mine);
            async move { Ok::<_, Error>((indices, answer.await?)) }
        });
        let mut found = vec![T::default(); keys.len()];
        for result in futures::future::join_all(asks).await {
            let (indices, answer) = result?;
            debug_assert_eq!(indices.len(), answer.len(), "one answer per key");
            for (i, a) in indices.into_iter().zip(answer) {
                found[i] = a;
            }
        }
        Ok(found)
    }

    /// How many leading keys of a prefix chain are stored: the prefix hit
    /// count a connector uses to skip prefill for those blocks. The tail
    /// the local tiers lack is counted in the remote tier
    /// ([`Tier::Remote`]): windows of [`Remote::parallelism`] keys, each
    /// checked at once by the shards owning them, stopping at the first key
    /// absent (or unknown) there.
    ///
    /// # Errors
    /// As [`Store::contains_many`].
    pub async fn lookup_prefix(&self, keys: &[&str]) -> Result<Vec<Tier>> {
        let found = self.contains_many(keys).await?;
        let mut tiers: Vec<Tier> = found.into_iter().map_while(|t| t).collect();
        if let Some(remote) = &self.remote {
            for window in keys[tiers.len()..].chunks(remote.parallelism().max(1)) {
                let present = self.remote_exists_many(window).await?.iter().take_while(|a| **a == Some(true)).count();
                tiers.extend(std::iter::repeat_n(Tier::Remote, present));
                if present < window.len() {
                    break;
                }
            }
        }
        // Counted on this shard, each key under its owner (a chain may
        // start in a shared namespace and go on in the tenant's own keys).
        for (i, k) in keys.iter().enumerate() {
            let hit = u64::from(i < tiers.len());
            self.shard.count_owner(self.shard.owner_of(k), |c| {
                c.lookup_keys += 1;
                c.prefix_hits += hit;
            });
        }
        if self.tracing() {
            // Every key of the chain: those past the prefix hits as misses.
            let tier = |i: usize| tiers.get(i).map_or(TraceTier::Miss, |t| TraceTier::In(*t));
            self.trace(TraceOp::Lookup, keys.iter().enumerate().map(|(i, k)| (BlockHash::of(k.as_bytes()), tier(i))));
        }
        Ok(tiers)
    }

    /// The fastest tier holding `key`, the remote tier included (`None`: not
    /// stored anywhere).
    ///
    /// # Errors
    /// As [`Store::contains_many`].
    pub async fn contains(&self, key: &str) -> Result<Option<Tier>> {
        Ok(self.exists_many(&[key]).await?[0])
    }

    /// The fastest tier holding each key, the remote tier included (`None`:
    /// stored nowhere, or the remote tier could not say), in order: the
    /// local tiers first ([`Store::contains_many`]), then the remote tier
    /// for the keys they lack, in parallel.
    ///
    /// # Errors
    /// As [`Store::contains_many`].
    pub async fn exists_many(&self, keys: &[&str]) -> Result<Vec<Option<Tier>>> {
        let mut found = self.contains_many(keys).await?;
        if self.remote.is_some() {
            let missing: Vec<usize> = (0..keys.len()).filter(|i| found[*i].is_none()).collect();
            let asked: Vec<&str> = missing.iter().map(|i| keys[*i]).collect();
            if !asked.is_empty() {
                for (i, present) in missing.into_iter().zip(self.remote_exists_many(&asked).await?) {
                    found[i] = (present == Some(true)).then_some(Tier::Remote);
                }
            }
        }
        if self.tracing() {
            self.trace(TraceOp::Head, keys.iter().zip(&found).map(|(k, t)| (BlockHash::of(k.as_bytes()), TraceTier::found(*t))));
        }
        Ok(found)
    }

    /// Whether each of `keys` is in the remote tier, asked of the shards
    /// owning them, in parallel (`None`: unknown after an error).
    async fn remote_exists_many(&self, keys: &[&str]) -> Result<Vec<Option<bool>>> {
        self.ask_owners(keys, |owner, mine| async move {
            if owner == self.shard_id() {
                let mine: Vec<&str> = mine.iter().map(|(i, _)| keys[*i]).collect();
                return Ok(self.shard.remote_exists_many(&mine).await);
            }
            let keys = mine.iter().map(|(i, _)| keys[*i].to_string()).collect();
            self.forward(owner, |reply| Request::RemoteExists { keys, reply }).await
        })
        .await
    }

    /// Promotes the stored blocks among `keys` toward the fastest tier, and
    /// copies the others from the remote tier into the local tiers, in the
    /// background on each owning shard (see [`Shard::prefetch`]). Returns
    /// how many of the keys are stored locally now, and how many are asked
    /// of the remote tier.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for the first invalid key; [`Error::ShuttingDown`].
    pub async fn prefetch(&self, keys: &[&str]) -> Result<PrefetchReport> {
        let mut by_shard: Vec<Vec<(String, BlockHash)>> = vec![Vec::new(); self.shards];
        for k in keys {
            key::validate_stored(k)?;
            let hash = BlockHash::of(k.as_bytes());
            by_shard[hash.shard(self.shards)].push((k.to_string(), hash));
        }
        let parallelism = self.remote.as_ref().map_or(1, |r| r.parallelism());
        let asks = by_shard.into_iter().enumerate().filter(|(_, ks)| !ks.is_empty()).map(|(owner, keys)| async move {
            if owner == self.shard_id() {
                return Ok(start_prefetch(&self.shard, keys, parallelism));
            }
            self.forward(owner, |reply| Request::Prefetch { keys, reply }).await
        });
        if self.tracing() {
            self.trace(TraceOp::Prefetch, keys.iter().map(|k| (BlockHash::of(k.as_bytes()), TraceTier::None)));
        }
        let mut total = PrefetchReport::default();
        for r in futures::future::join_all(asks).await {
            let r = r?;
            total.found += r.found;
            total.remote_requested += r.remote_requested;
        }
        Ok(total)
    }

    /// The health of every tier, each merged over the shards (the worst
    /// state, errors summed; [`crate::health`]), fastest first, the remote
    /// tier last. Cheaper than [`Store::stats`]: for readiness probes.
    ///
    /// # Errors
    /// [`Error::ShuttingDown`] when a shard no longer answers.
    pub async fn health(&self) -> Result<Vec<TierHealth>> {
        let per_shard = self.ask_every_shard(Shard::health, Request::Health).await?;
        Ok(self.health_table(per_shard.iter().flatten()))
    }

    /// The health table from the shards' own tables (as
    /// [`ShardStats::health`] carries them): each tier merged over shards,
    /// the remote tier's added last. For a caller that has the shards' stats
    /// already: no second round of messages.
    pub fn health_table<'a>(&self, per_shard: impl IntoIterator<Item = &'a TierHealth>) -> Vec<TierHealth> {
        let mut merged = merge_by_tier(per_shard);
        merged.extend(self.remote.as_ref().map(|r| r.health()));
        merged
    }

    /// `local(shard)` of every shard, in shard order: this one's directly,
    /// the others' by sending them `request(reply)` and waiting on `reply`.
    async fn ask_every_shard<T>(&self, local: impl Fn(&Shard) -> T, request: impl Fn(Reply<T>) -> Request) -> Result<Vec<T>> {
        let (local, request) = (&local, &request);
        let asks = (0..self.shards).map(|owner| async move {
            if owner == self.shard_id() {
                return Ok(local(&self.shard));
            }
            self.forward(owner, request).await
        });
        futures::future::join_all(asks).await.into_iter().collect()
    }

    /// The trace recorder's state (`None`: no `--trace-dir`).
    pub fn trace_status(&self) -> Option<TraceStatus> {
        Some(self.trace.as_ref()?.recorder().status())
    }

    /// Starts recording block operations into a new trace file (a no-op
    /// when recording). `None`: no recorder is configured.
    ///
    /// # Errors
    /// The reason the file could not be started (the writer's error).
    pub async fn trace_start(&self) -> Option<std::result::Result<TraceStatus, String>> {
        Some(self.trace.as_ref()?.recorder().start().await)
    }

    /// Stops recording: every shard hands its buffer to the writer, which
    /// then closes the file. `None`: no recorder is configured.
    pub async fn trace_stop(&self) -> Option<TraceStatus> {
        let trace = self.trace.as_ref()?;
        let flush_all = async {
            trace.flush();
            let others = (0..self.shards).filter(|s| *s != self.shard_id()).map(|owner| self.forward(owner, Request::TraceFlush));
            futures::future::join_all(others).await;
        };
        Some(trace.recorder().stop(flush_all).await)
    }

    /// The block owners (tenants, shared namespaces) and quotas now.
    pub fn owners(&self) -> Arc<Owners> {
        self.shard.owners()
    }

    /// Sets the block owners and their quotas on every shard, keeping the
    /// ids of owners known now (build `owners` with [`Owners::reload`]
    /// from [`Store::owners`]). Owners over a lowered limit have their
    /// oldest blocks moved down in the background on each shard.
    ///
    /// # Errors
    /// [`Error::ShuttingDown`] when a shard no longer answers (the shards
    /// that answered have the new owners).
    pub async fn set_owners(&self, owners: Arc<Owners>) -> Result<()> {
        let local = |shard: &Shard| shard.set_owners(owners.clone());
        self.ask_every_shard(local, |reply| Request::SetOwners(owners.clone(), reply)).await.map(|_| ())
    }

    /// Statistics of every shard, in shard order.
    ///
    /// # Errors
    /// [`Error::ShuttingDown`] when a shard no longer answers.
    pub async fn stats(&self) -> Result<Vec<ShardStats>> {
        self.ask_every_shard(Shard::stats, Request::Stats).await
    }
}

/// Opens the store described by `config` and runs `serve` on every shard.
/// Returns, in shard order, what each `serve` returned, once every shard has
/// finished serving, answered its peers' last requests and closed its files.
///
/// `serve` is called once per shard on that shard's executor; when it
/// returns, the shard stops sending, keeps answering peers until they stop
/// too, then closes.
///
/// Start-up does only what serving needs: each executor starts with its
/// I/O memory allocated but not registered with io_uring (Linux 6.0+, see
/// [`crate::startup`]), the shard recovers, and once every
/// shard is open (logged in one line with what each step took) it serves.
/// Meanwhile a helper thread faults the I/O memory in, the shard registers
/// it, and then the RAM tier is faulted in ([`crate::populate`] says why
/// not before: up to 2.6 s for 1 GiB on a VM).
///
/// # Errors
/// [`Error::GeometryMismatch`] and [`Error::Config`] before any shard starts;
/// the first shard's open error (every shard then returns without serving).
pub fn run<F, Fut, T>(config: StoreConfig, serve: F) -> Result<Vec<T>>
where
    F: Fn(Rc<Store>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    if config.shards == 0 {
        return Err(Error::Config("shards must be at least 1".into()));
    }
    if config.segment_bytes < 2 * crate::slot::PAGE_BYTES {
        return Err(Error::Config(format!("segment_bytes {} is too small", config.segment_bytes)));
    }
    let started = Instant::now();
    let manifest = config.manifest().create_or_check(&config.data_dir)?;
    let mesh: MeshBuilder<Request, _> = MeshBuilder::full(config.shards, MESH_QUEUE_DEPTH);
    let failed = Arc::new(AtomicBool::new(false));
    let serve = Arc::new(serve);
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let defer_registration = startup::io_memory_registration_can_wait();
    let starts = Arc::new(startup::StartLog::new(config.shards, defer_registration, config.io_memory_shard_bytes()));
    let mut handles = Vec::with_capacity(config.shards);
    for shard_id in 0..config.shards {
        let (mesh, failed, serve, starts) = (mesh.clone(), failed.clone(), serve.clone(), starts.clone());
        let (shard_cfg, manifest) = (config.shard_config(shard_id), manifest.clone());
        let (shards, snapshot_secs) = (config.shards, config.snapshot_secs);
        let io_memory_shard_bytes = config.io_memory_shard_bytes();
        let remote = config.remote.clone();
        let recorder = config.trace.clone();
        let parallelism = remote.as_ref().map_or(1, |r| r.parallelism());
        let placement = if config.pin_cpus { Placement::Fixed(shard_id % cpus) } else { Placement::Unbound };
        let handle = LocalExecutorBuilder::new(placement)
            .name(&format!("kvtier-shard-{shard_id}"))
            .io_memory(io_memory_shard_bytes)
            .defer_io_memory_registration(defer_registration)
            .spawn(move || async move {
                let executor_up = started.elapsed();
                let opened = recover::open_shard(shard_cfg).await;
                let recovered = started.elapsed();
                if opened.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                // Joining the mesh is also a barrier: every shard has opened
                // (or failed to) before any serves.
                let (senders, mut receivers) = mesh.join().await.map_err(|_| Error::ShuttingDown)?;
                let shard = match opened {
                    Ok(s) => Some(s.share()),
                    Err(e) => {
                        senders.close();
                        return Err(e);
                    }
                };
                let shard = shard.expect("opened");
                // Chunks of forwarded GETs come back here to be freed.
                glommio::spawn_local(crate::stream::return_chunks_home()).detach();
                starts.note(shard_id, startup::ShardStart { executor_up, recovered, joined: started.elapsed() });
                // Fault in and register the I/O memory and fault in the RAM
                // tier now that the shard serves (not before: see
                // `crate::populate`).
                let warm_up = startup::WarmUp::start(&shard, defer_registration);
                let trace = recorder.map(|r| Rc::new(ShardTrace::new(r)));
                let answering: Vec<_> = receivers
                    .streams()
                    .into_iter()
                    .map(|(_, receiver)| {
                        let (shard, trace) = (shard.clone(), trace.clone());
                        glommio::spawn_local(async move {
                            while let Some(request) = receiver.recv().await {
                                let (shard, trace) = (shard.clone(), trace.clone());
                                glommio::spawn_local(async move {
                                    execute(&shard, trace.as_deref(), request, parallelism).await;
                                })
                                .detach();
                            }
                        })
                    })
                    .collect();
                let snapshots = (snapshot_secs > 0).then(|| {
                    let shard = Rc::downgrade(&shard);
                    glommio::spawn_local(async move {
                        let every = std::time::Duration::from_secs(snapshot_secs);
                        loop {
                            glommio::timer::sleep(every).await;
                            let Some(shard) = shard.upgrade() else { return };
                            if let Err(e) = shard.write_snapshot().await {
                                tracing::warn!(shard = shard.id(), "periodic index snapshot failed: {e}");
                            }
                        }
                    })
                });
                // Health is evaluated every second whatever the traffic, so a
                // change of state is logged when it happens, not when someone
                // asks; shard 0 also watches the remote tier.
                let health = {
                    let (shard, remote) = (Rc::downgrade(&shard), remote.clone().filter(|_| shard_id == 0));
                    glommio::spawn_local(async move {
                        loop {
                            glommio::timer::sleep(HEALTH_EVERY).await;
                            let Some(shard) = shard.upgrade() else { return };
                            shard.health();
                            if let Some(r) = &remote {
                                r.health();
                            }
                        }
                    })
                };
                // A partly filled trace buffer reaches the file within a second.
                let trace_flush = trace.clone().map(|t| {
                    glommio::spawn_local(async move {
                        loop {
                            glommio::timer::sleep(crate::trace::FLUSH_EVERY).await;
                            t.flush();
                        }
                    })
                });
                let store = Rc::new(Store { shard: shard.clone(), senders, shards, manifest, remote, trace: trace.clone() });
                let out = if failed.load(Ordering::SeqCst) { None } else { Some(serve(store.clone()).await) };
                store.senders.close();
                futures::future::join_all(answering).await;
                drop(store);
                if let Some(task) = snapshots {
                    task.cancel().await;
                }
                health.cancel().await;
                if let Some(task) = trace_flush {
                    task.cancel().await;
                }
                if let Some(t) = &trace {
                    t.flush();
                }
                warm_up.stop().await;
                // Requests from peers may still be finishing; wait for them
                // to release the shard before closing its files.
                while Rc::strong_count(&shard) > 1 {
                    glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
                }
                shard.close().await;
                out.ok_or(Error::ShuttingDown)
            })
            .map_err(|e| Error::Config(format!("starting executor for shard {shard_id}: {e}")))?;
        handles.push(handle);
    }
    let mut outputs = Vec::with_capacity(handles.len());
    let mut first_error = None;
    for handle in handles {
        match handle.join() {
            Ok(Ok(out)) => outputs.push(out),
            Ok(Err(e)) => {
                if first_error.is_none() || matches!(first_error, Some(Error::ShuttingDown)) {
                    first_error = Some(e);
                }
            }
            Err(e) => first_error = first_error.or(Some(Error::Config(format!("shard executor failed: {e}")))),
        }
    }
    if let Some(recorder) = &config.trace {
        // Every shard has flushed its buffer: close the file.
        futures::executor::block_on(recorder.stop(async {}));
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(outputs),
    }
}
