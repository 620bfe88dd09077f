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
use std::sync::Arc;

use bytes::Bytes;
use futures::channel::oneshot;
use glommio::channels::channel_mesh::Senders;

use crate::error::{Error, Result};
use crate::geometry::{Geometry, StoreManifest};
use crate::health::{merge_by_tier, TierHealth};
use crate::key::{BlockHash, StoredKey};
use crate::remote::Remote;
use crate::shard::{Hold, LeaseOutcome, PutOutcome, PutReport, PutSource, Shard, ShardStats, StillWanted};
pub use crate::startup::START_WARN_AFTER;
use crate::stream::{BlockBody, BlockSink};
use crate::tenant::Owners;
pub use crate::tier::{Tier, WritePolicy};
use crate::trace::{ShardTrace, TraceOp, TraceStatus, TraceTier};

mod config;
mod mesh;
mod startup;
pub use config::*;
use mesh::{copy_block, start_prefetch, Reply, Request};
pub use startup::run;

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
    /// Counted: a close waits for the last `Store` (held by the front
    /// doors' connections) to drop ([`Shard::tasks_ended`]).
    shard: Hold,
    senders: Senders<Request>,
    shards: usize,
    manifest: StoreManifest,
    /// Every shard's directory (on its device, [`crate::devices`]).
    shard_dirs: Arc<Vec<std::path::PathBuf>>,
    /// Every device's data directory, by index ([`crate::devices`]).
    device_dirs: Arc<Vec<std::path::PathBuf>>,
    remote: Option<Arc<dyn Remote>>,
    trace: Option<Rc<ShardTrace>>,
}

impl Store {
    /// This executor's shard (the engine's own tests drive its internals).
    #[cfg(test)]
    pub(crate) fn shard_for_tests(&self) -> &Rc<Shard> {
        &self.shard
    }

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
    /// [`Error::WrongSize`], [`Error::DiskFull`],
    /// [`Error::Io`], [`Error::ShuttingDown`].
    pub async fn put(&self, key: &StoredKey, chunks: Vec<Bytes>) -> Result<PutOutcome> {
        Ok(self.put_reporting(key, chunks, None).await?.outcome)
    }

    /// [`Store::put`] with the block's `tag` (an encoded
    /// [`crate::events::BlockTag`]; `None`: untagged), and then the upload to
    /// the remote tier as its write policy says (on the owning shard);
    /// reports both. The tag is kept with the block in every tier and names
    /// it in KV events ([`crate::events`]); a PUT without one replaces the
    /// key's tag with none.
    ///
    /// # Errors
    /// As [`Store::put`]; [`Error::InvalidTag`] when the tag breaks its rules
    /// or is longer than this store's slot header holds
    /// ([`crate::slot::tag_room`]). The remote tier never fails a PUT.
    pub async fn put_reporting(&self, key: &StoredKey, chunks: Vec<Bytes>, tag: Option<Bytes>) -> Result<PutReport> {
        self.put_sourced(key, chunks, tag, PutSource::Owned).await
    }

    /// [`Store::put_reporting`] of a block written in place: `chunks` are
    /// views of a same-host client's registered memory, which it may write
    /// again at any time. The owning shard reads them exactly once, into a
    /// RAM-tier slot that the log is then written from (write-through, with
    /// a RAM tier), else into a copy of its own, before anything is stored:
    /// whatever the memory holds after that changes nothing stored
    /// ([`PutSource::ClientMemory`]; docs/LOCAL.md "Writes in place").
    ///
    /// The views must stay valid (mapped, not shrunk) while they live.
    /// `wanted` is asked once the block has been read out of them, before
    /// anything is stored: `false` (the client gave up on its memory
    /// meanwhile) fails the PUT with [`Error::Cancelled`], nothing stored.
    ///
    /// # Errors
    /// As [`Store::put_reporting`]; [`Error::Cancelled`].
    pub async fn put_in_place(&self, key: &StoredKey, chunks: Vec<Bytes>, tag: Option<Bytes>, wanted: StillWanted) -> Result<PutReport> {
        self.put_sourced(key, chunks, tag, PutSource::ClientMemory(wanted)).await
    }

    async fn put_sourced(&self, key: &StoredKey, chunks: Vec<Bytes>, tag: Option<Bytes>, source: PutSource) -> Result<PutReport> {
        let got: u64 = chunks.iter().map(|c| c.len() as u64).sum();
        if got != self.geometry().block_bytes {
            return Err(Error::WrongSize { expected: self.geometry().block_bytes, got });
        }
        if let Some(tag) = &tag {
            crate::events::BlockTag::decode(tag).map_err(Error::InvalidTag)?;
            let room = crate::slot::tag_room(self.geometry().block_bytes);
            if tag.len() > room {
                return Err(Error::InvalidTag(format!(
                    "the tag is {} bytes; a slot header of this store's {}-byte blocks holds {room}",
                    tag.len(),
                    self.geometry().block_bytes
                )));
            }
        }
        let hash = key.hash();
        let owner = hash.shard(self.shards);
        let put = if owner == self.shard_id() {
            self.shard.put_block(key, hash, &chunks, tag, source).await
        } else {
            self.forward(owner, |reply| Request::Put { key: key.clone(), hash, chunks, tag, source, reply }).await?
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
    /// [`Error::NotFound`], [`Error::Corrupt`] (treat
    /// as a miss), [`Error::Io`], [`Error::ShuttingDown`].
    pub async fn get(&self, key: &StoredKey) -> Result<Block> {
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
    pub async fn get_stream(&self, key: &StoredKey) -> Result<(BlockBody, Tier)> {
        let hash = key.hash();
        let owner = hash.shard(self.shards);
        let read = if owner == self.shard_id() {
            self.shard.get(key, hash, true).await
        } else {
            self.forward(owner, |reply| Request::Get { key: key.clone(), hash, reply }).await?
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
    pub async fn get_into(&self, key: &StoredKey, sink: Arc<dyn BlockSink>) -> Result<(u64, Tier)> {
        let hash = key.hash();
        let owner = hash.shard(self.shards);
        let read = if owner == self.shard_id() {
            copy_block(&self.shard, key, hash, &*sink).await
        } else {
            self.forward(owner, |reply| Request::GetInto { key: key.clone(), hash, sink, reply }).await?
        };
        self.trace_read(hash, &read);
        read
    }

    /// Leases the block stored under `key` to a same-host client, on the
    /// shard that owns the key: its slot in that shard's RAM tier stays
    /// pinned (neither evicted for reuse nor written) while the returned
    /// [`crate::ram::LeasedSlot`]'s bytes live. A block found only in a
    /// lower tier is read into RAM first, as a promoting GET reads it
    /// (docs/LOCAL.md, "Leases").
    ///
    /// # Errors
    /// As [`Store::get`]; [`Error::LeasesOff`] when the store cannot lease
    /// ([`Store::lease_support`]).
    pub async fn lease(&self, key: &StoredKey) -> Result<LeaseOutcome> {
        let hash = key.hash();
        let owner = hash.shard(self.shards);
        let leased = if owner == self.shard_id() {
            self.shard.lease(key, hash).await
        } else {
            self.forward(owner, |reply| Request::Lease { key: key.clone(), hash, reply }).await?
        };
        if self.tracing() {
            let tier = match &leased {
                Ok(LeaseOutcome::Leased(_, tier) | LeaseOutcome::NotInRam(tier)) => TraceTier::In(*tier),
                Err(Error::NotFound | Error::Corrupt { .. }) => TraceTier::Miss,
                Err(_) => return leased,
            };
            self.trace(TraceOp::Get, [(hash, tier)]);
        }
        leased
    }

    /// Each device's state from every shard's `stats` ([`crate::devices::device_stats`]).
    pub fn devices(&self, stats: &[ShardStats]) -> Vec<crate::devices::DeviceStats> {
        crate::devices::device_stats(&self.device_dirs, stats)
    }

    /// The index table of shard `shard` ([`crate::shared_index`]), when the
    /// store keeps them (`shared_index`) and that shard is open.
    pub fn index_table(&self, shard: usize) -> Option<Arc<crate::shared_index::IndexTable>> {
        crate::shared_index::index_table(self.shard_dirs.get(shard)?)
    }

    /// Whether this store can lease blocks: `Err` says why not (no RAM
    /// tier, or one clients cannot map). Every shard's RAM tier is made
    /// alike, so this shard answers for all.
    pub fn lease_support(&self) -> std::result::Result<(), String> {
        self.shard.lease_support()
    }

    /// Deletes the block under `key` (a tombstone is logged), and its copy in
    /// the remote tier; a key stored only there is deleted there.
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::DiskFull`],
    /// [`Error::Io`], [`Error::ShuttingDown`].
    pub async fn delete(&self, key: &StoredKey) -> Result<()> {
        let hash = key.hash();
        let owner = hash.shard(self.shards);
        let deleted = if owner == self.shard_id() {
            self.shard.delete_block(key, hash).await
        } else {
            self.forward(owner, |reply| Request::Delete { key: key.clone(), hash, reply }).await?
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
    /// [`Error::ShuttingDown`].
    pub async fn contains_many(&self, keys: &[StoredKey]) -> Result<Vec<Option<Tier>>> {
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
    async fn ask_owners<'a, T, F, Fut>(&'a self, keys: &[StoredKey], ask: F) -> Result<Vec<T>>
    where
        T: Clone + Default,
        F: Fn(usize, Vec<(usize, BlockHash)>) -> Fut,
        Fut: Future<Output = Result<Vec<T>>> + 'a,
    {
        let mut by_shard: Vec<Vec<(usize, BlockHash)>> = vec![Vec::new(); self.shards];
        for (i, k) in keys.iter().enumerate() {
            let hash = k.hash();
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
    pub async fn lookup_prefix(&self, keys: &[StoredKey]) -> Result<Vec<Tier>> {
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
            self.trace(TraceOp::Lookup, keys.iter().enumerate().map(|(i, k)| (k.hash(), tier(i))));
        }
        Ok(tiers)
    }

    /// The fastest tier holding `key`, the remote tier included (`None`: not
    /// stored anywhere).
    ///
    /// # Errors
    /// As [`Store::contains_many`].
    pub async fn contains(&self, key: &StoredKey) -> Result<Option<Tier>> {
        Ok(self.exists_many(std::slice::from_ref(key)).await?[0])
    }

    /// The fastest tier holding each key, the remote tier included (`None`:
    /// stored nowhere, or the remote tier could not say), in order: the
    /// local tiers first ([`Store::contains_many`]), then the remote tier
    /// for the keys they lack, in parallel.
    ///
    /// # Errors
    /// As [`Store::contains_many`].
    pub async fn exists_many(&self, keys: &[StoredKey]) -> Result<Vec<Option<Tier>>> {
        let mut found = self.contains_many(keys).await?;
        if self.remote.is_some() {
            let missing: Vec<usize> = (0..keys.len()).filter(|i| found[*i].is_none()).collect();
            let asked: Vec<StoredKey> = missing.iter().map(|i| keys[*i].clone()).collect();
            if !asked.is_empty() {
                for (i, present) in missing.into_iter().zip(self.remote_exists_many(&asked).await?) {
                    found[i] = (present == Some(true)).then_some(Tier::Remote);
                }
            }
        }
        if self.tracing() {
            self.trace(TraceOp::Head, keys.iter().zip(&found).map(|(k, t)| (k.hash(), TraceTier::found(*t))));
        }
        Ok(found)
    }

    /// Whether each of `keys` is in the remote tier, asked of the shards
    /// owning them, in parallel (`None`: unknown after an error).
    async fn remote_exists_many(&self, keys: &[StoredKey]) -> Result<Vec<Option<bool>>> {
        self.ask_owners(keys, |owner, mine| async move {
            if owner == self.shard_id() {
                let mine: Vec<&StoredKey> = mine.iter().map(|(i, _)| &keys[*i]).collect();
                return Ok(self.shard.remote_exists_many(&mine).await);
            }
            let keys = mine.iter().map(|(i, _)| keys[*i].clone()).collect();
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
    /// [`Error::ShuttingDown`].
    pub async fn prefetch(&self, keys: &[StoredKey]) -> Result<PrefetchReport> {
        let mut by_shard: Vec<Vec<(StoredKey, BlockHash)>> = vec![Vec::new(); self.shards];
        for k in keys {
            let hash = k.hash();
            by_shard[hash.shard(self.shards)].push((k.clone(), hash));
        }
        let parallelism = self.remote.as_ref().map_or(1, |r| r.parallelism());
        let asks = by_shard.into_iter().enumerate().filter(|(_, ks)| !ks.is_empty()).map(|(owner, keys)| async move {
            if owner == self.shard_id() {
                return Ok(start_prefetch(&self.shard, keys, parallelism));
            }
            self.forward(owner, |reply| Request::Prefetch { keys, reply }).await
        });
        if self.tracing() {
            self.trace(TraceOp::Prefetch, keys.iter().map(|k| (k.hash(), TraceTier::None)));
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
