//! The remote tier's place in the shard's waterfall, below the log
//! (GPU → RAM → NVMe → remote; see [`crate::remote`]): reading a local miss
//! through, installing what it read, uploading a PUT, deleting, counting a
//! lookup's remote tail and prefetching from it. Only the shard that owns a
//! key runs any of these for it.
//!
//! **One read per key.** Concurrent local misses of a key share one remote
//! read and one install ([`RemoteEvent::ReadJoined`]), so a popular prefix
//! arriving at once on every connection costs one fetch per block.
//!
//! **A newer write wins.** A PUT or DELETE of a key while it is read from
//! the remote tier marks that read superseded: its bytes are still handed to
//! the GETs that were waiting (they began before the write), but they are
//! not installed, so they never overwrite the newer block, in memory or in
//! the log (where a higher sequence number would win again after a
//! restart). Once an install has begun, a PUT or DELETE of the key waits
//! for it to land, so the install's log record always has the lower
//! sequence number.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;

use bytes::Bytes;
use futures::future::{FutureExt, LocalBoxFuture, Shared};

use super::{PutOutcome, PutSource, Shard};
use crate::error::{Error, Result};
use crate::events::Medium;
use crate::key::{BlockHash, StoredKey};
use crate::remote::{Fetched, RemoteEvent, UploadOutcome};

/// A remote read in flight on this shard, joined by every local miss of
/// its key meanwhile.
pub(super) struct RemoteRead {
    key: StoredKey,
    read: Shared<LocalBoxFuture<'static, Option<Bytes>>>,
    state: Rc<ReadState>,
}

/// What writes of the key did while it was read.
struct ReadState {
    /// A PUT or DELETE of the key came: do not install.
    superseded: Cell<bool>,
    /// The install has begun: writes of the key wait for it.
    installing: Cell<bool>,
    /// Fired when the install ends.
    installed: crate::signal::Signal,
}

impl Default for ReadState {
    fn default() -> Self {
        ReadState {
            superseded: Cell::new(false),
            installing: Cell::new(false),
            installed: crate::signal::Signal::new("an S3 install of the key ended"),
        }
    }
}

/// The shard's remote reads in flight, by block hash.
pub(super) type RemoteReads = std::cell::RefCell<HashMap<BlockHash, RemoteRead>>;

/// A PUT's outcome, locally and on the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutReport {
    /// Created or replaced in the local tiers.
    pub outcome: PutOutcome,
    /// What the remote tier did with it (`None`: no remote tier, or its
    /// write policy uploads nothing).
    pub upload: Option<UploadOutcome>,
}

impl Shard {
    /// Stores a block in the local tiers ([`Shard::put`]) and then uploads it
    /// to the remote tier as its write policy says. A remote read of the key
    /// in flight will not install its (older) bytes. Chunks in a client's
    /// memory ([`PutSource::ClientMemory`]) are copied first when a remote
    /// tier will read them again after the local write.
    ///
    /// # Errors
    /// As [`Shard::put`] ([`Error::Cancelled`] too, for a client's memory);
    /// the remote tier never fails a PUT.
    pub async fn put_block(
        &self,
        key: &StoredKey,
        hash: BlockHash,
        chunks: &[Bytes],
        tag: Option<Bytes>,
        source: PutSource,
    ) -> Result<PutReport> {
        let copy;
        let (chunks, source) = if source.is_client_memory() && self.remote.is_some() {
            copy = super::put::owned_copy(chunks);
            source.check_wanted()?;
            (&copy[..], PutSource::Owned)
        } else {
            (chunks, source)
        };
        self.supersede_remote_read(&hash).await;
        // Tracked from here, so the log writes the tag into the slot header
        // and the tiers' arrivals are published under it.
        let _putting = self.residency.begin_put(hash, tag.clone());
        let outcome = self.put_from(key, hash, chunks, &source).await?;
        let upload = match &self.remote {
            Some(remote) => remote.upload(key, chunks.to_vec(), tag).await,
            None => None,
        };
        if matches!(upload, Some(UploadOutcome::Uploaded | UploadOutcome::Present)) {
            self.residency.journal(Medium::S3).arrived(hash);
        }
        Ok(PutReport { outcome, upload })
    }

    /// Deletes a block from the local tiers and from the remote tier; a key
    /// stored only remotely is deleted there.
    ///
    /// # Errors
    /// [`Error::NotFound`] when neither holds it; as [`Shard::delete`].
    pub async fn delete_block(&self, key: &StoredKey, hash: BlockHash) -> Result<()> {
        self.supersede_remote_read(&hash).await;
        let local = self.delete(key, hash).await;
        let Some(remote) = &self.remote else { return local };
        match local {
            // The remote copy goes too, else the next GET would bring the
            // block back.
            Ok(()) => {
                if remote.delete(key).await {
                    self.residency.journal(Medium::S3).left(hash);
                }
                Ok(())
            }
            Err(Error::NotFound) if remote.exists_many(&[key]).await[0] == Some(true) && remote.delete(key).await => {
                self.residency.journal(Medium::S3).left(hash);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Marks a remote read of `hash` in flight superseded, and waits for an
    /// install of it that has already begun.
    async fn supersede_remote_read(&self, hash: &BlockHash) {
        loop {
            let state = self.remote_reads.borrow().get(hash).map(|r| r.state.clone());
            let Some(state) = state else { return };
            state.superseded.set(true);
            if !state.installing.get() {
                return;
            }
            state.installed.until(|| !state.installing.get()).await;
        }
    }

    /// A local miss of `key`: reads it from the remote tier (joining a read
    /// of it in flight), installs it in the local tiers unless a write of
    /// the key superseded the read, and returns its payload. `None`: no
    /// remote tier, not there, or the remote tier failed (a miss).
    pub(super) async fn read_remote(&self, key: &StoredKey, hash: BlockHash) -> Option<Bytes> {
        let remote = self.remote.clone()?;
        let joined = self.remote_reads.borrow().get(&hash).filter(|r| r.key == *key).map(|r| r.read.clone());
        if let Some(read) = joined {
            remote.count(RemoteEvent::ReadJoined);
            return read.await;
        }
        let me = self.me.borrow().upgrade().expect("a serving shard is shared");
        let state = Rc::new(ReadState::default());
        let (owned, flags) = (key.clone(), state.clone());
        // A task of its own: the read and its install finish even when the
        // GET that started them goes away.
        let task = me.spawn_holding(|me| async move {
            let got = match remote.fetch(&owned).await {
                Fetched::Block { payload, tag } => {
                    me.install_remote(&owned, hash, payload.clone(), tag, &flags).await;
                    Some(payload)
                }
                Fetched::Absent | Fetched::Failed => None,
            };
            me.remote_reads.borrow_mut().remove(&hash);
            got
        });
        let read = async move { task.await.flatten() }.boxed_local().shared();
        self.remote_reads.borrow_mut().insert(hash, RemoteRead { key: key.clone(), read: read.clone(), state });
        read.await
    }

    /// Stores a block read from the remote tier in the local tiers, unless a
    /// write of its key came while it was read. Not uploaded again.
    async fn install_remote(&self, key: &StoredKey, hash: BlockHash, payload: Bytes, tag: Option<Bytes>, state: &ReadState) {
        let remote = self.remote.as_ref().expect("a remote read has a remote tier");
        if state.superseded.get() {
            remote.count(RemoteEvent::InstallSuperseded);
            return;
        }
        state.installing.set(true);
        // The object's tag comes with it; the block is in the shared tier too.
        let _putting = self.residency.begin_put(hash, tag);
        self.residency.journal(Medium::S3).arrived(hash);
        let installed = match self.cfg.log_absent {
            None => self.put(key, hash, &[payload]).await.map(|_| true),
            Some(_) => self.cache_without_log(key, hash, payload).await,
        };
        match installed {
            Ok(true) => remote.count(RemoteEvent::Installed),
            Ok(false) => {}
            Err(e) => remote.count(RemoteEvent::InstallFailed(format!(
                "shard {}: storing {key}, read from the remote tier, in the local tiers failed: {e}",
                self.id()
            ))),
        }
        state.installing.set(false);
        state.installed.notify();
    }

    /// A block read from the remote tier, on a shard without a log
    /// ([`super::ShardConfig::log_absent`]): a clean copy in the memory
    /// tiers, which drop it when they need its slot (the remote tier still
    /// holds it). `Ok(false)` when no memory tier took it.
    ///
    /// # Errors
    /// As [`Shard::place`] (never, as nothing here is dirty).
    async fn cache_without_log(&self, key: &StoredKey, hash: BlockHash, payload: Bytes) -> Result<bool> {
        if self.ram.is_none() && self.gpu.is_none() {
            return Ok(false);
        }
        let ticket = self.transits.begin(key, hash, vec![payload.clone()]);
        let placed = self.place(key, hash, &[&payload[..]], false, &ticket).await?;
        Ok(matches!(placed, super::transit::Placed::In(_)))
    }

    /// Whether each of `keys` exists in the remote tier (`None`: unknown, or
    /// no remote tier).
    pub async fn remote_exists_many(&self, keys: &[&StoredKey]) -> Vec<Option<bool>> {
        match &self.remote {
            Some(remote) => remote.exists_many(keys).await,
            None => vec![None; keys.len()],
        }
    }

    /// Copies `keys` (not stored locally) from the remote tier into the
    /// local tiers, `parallelism` at a time; absent ones are skipped.
    pub(crate) async fn prefetch_remote(&self, keys: Vec<(StoredKey, BlockHash)>, parallelism: usize) {
        let Some(remote) = self.remote.clone() else { return };
        for window in keys.chunks(parallelism.max(1)) {
            let reads = window.iter().map(|(k, h)| self.read_remote(k, *h));
            let got = futures::future::join_all(reads).await;
            remote.count(RemoteEvent::Prefetched(got.iter().filter(|g| g.is_some()).count() as u64));
        }
    }

    /// Whether this shard has a remote tier below its log.
    pub fn has_remote(&self) -> bool {
        self.remote.is_some()
    }
}
