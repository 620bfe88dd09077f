//! The service layer: what both front doors (`http/`, `local/`) stand on
//! and neither owns. Per shard, a [`Service`]: who is calling ([`Access`]:
//! a bearer token, a HELLO token or a peer uid → one [`Caller`]), the key
//! each caller's key is stored under ([`Service::scope`] → [`ScopedKey`],
//! the only key the block operations take), the shard's PUT budget
//! ([`PutBudget`]) and the process's shutdown ([`Shutdown`], a broadcast).
//! A front door parses its wire format, asks the service, and encodes the
//! answer; it depends on this module and on no other front door.

mod access;
mod budget;
mod shutdown;

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use kvtier_engine::key::StoredKey;
use kvtier_engine::stream::BlockSink;
use kvtier_engine::{BlockBody, Result, Store, Tier};

pub use access::{tokens_equal, Access, Auth, Caller, Denied};
pub use budget::{PutAdmission, PutBudget, PutRefused};
pub use shutdown::Shutdown;

use crate::tenants::{stored_key, ScopeError, Tenant};

/// A client's key as its caller's tenant stores it (`tenants.rs`): made
/// only by [`Service::scope`], so a block operation cannot be handed a key
/// that skipped scoping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopedKey(StoredKey);

impl ScopedKey {
    /// The typed key the engine stores.
    pub fn stored(&self) -> &StoredKey {
        &self.0
    }

    /// Its persisted form ([`StoredKey::as_str`]), for logs and messages.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

/// One shard's service: its store handle and the rules both front doors
/// apply.
pub struct Service {
    /// This shard's store handle.
    pub store: Rc<Store>,
    /// Who may call.
    pub access: Access,
    /// PUT bytes this shard admits at once.
    pub put_budget: PutBudget,
    /// The process's shutdown.
    pub shutdown: Arc<Shutdown>,
}

impl Service {
    /// The service of the shard `store` belongs to.
    pub fn new(store: Rc<Store>, access: Access, put_budget_bytes: u64, shutdown: Arc<Shutdown>) -> Self {
        Service { store, access, put_budget: PutBudget::new(put_budget_bytes), shutdown }
    }

    /// The key `caller` stores `key` under; `write` for a PUT or DELETE.
    ///
    /// # Errors
    /// [`ScopeError::InvalidKey`] for a key that breaks the key rules;
    /// [`ScopeError::ReadOnly`] for a write into a namespace the caller
    /// only reads.
    pub fn scope(&self, caller: Option<&Tenant>, key: &str, write: bool) -> std::result::Result<ScopedKey, ScopeError> {
        stored_key(caller, key, write).map(ScopedKey)
    }

    /// [`Service::scope`] for reading, of each key in order.
    ///
    /// # Errors
    /// The index and error of the first key that cannot be used.
    pub fn scope_all<K: AsRef<str>>(
        &self,
        caller: Option<&Tenant>,
        keys: &[K],
    ) -> std::result::Result<Vec<ScopedKey>, (usize, ScopeError)> {
        keys.iter().enumerate().map(|(i, k)| self.scope(caller, k.as_ref(), false).map_err(|e| (i, e))).collect()
    }

    /// Stores a block with its encoded block tag, if any
    /// ([`Store::put_reporting`]).
    ///
    /// # Errors
    /// As [`Store::put_reporting`].
    pub async fn put(&self, key: &ScopedKey, chunks: Vec<Bytes>, tag: Option<Bytes>) -> Result<kvtier_engine::PutReport> {
        self.store.put_reporting(key.stored(), chunks, tag).await
    }

    /// Stores a block written in place: `chunks` are views of a same-host
    /// client's registered memory, read once by the owning shard
    /// ([`Store::put_in_place`]) and stored only if `wanted` says the client
    /// still wants it once read.
    ///
    /// # Errors
    /// As [`Store::put_in_place`].
    pub async fn put_in_place(
        &self,
        key: &ScopedKey,
        chunks: Vec<Bytes>,
        tag: Option<Bytes>,
        wanted: kvtier_engine::StillWanted,
    ) -> Result<kvtier_engine::PutReport> {
        self.store.put_in_place(key.stored(), chunks, tag, wanted).await
    }

    /// A block, whole or streamed ([`Store::get_stream`]).
    ///
    /// # Errors
    /// As [`Store::get_stream`].
    pub async fn get_stream(&self, key: &ScopedKey) -> Result<(BlockBody, Tier)> {
        self.store.get_stream(key.stored()).await
    }

    /// Copies a block into `sink` ([`Store::get_into`]).
    ///
    /// # Errors
    /// As [`Store::get_into`].
    pub async fn get_into(&self, key: &ScopedKey, sink: Arc<dyn BlockSink>) -> Result<(u64, Tier)> {
        self.store.get_into(key.stored(), sink).await
    }

    /// The fastest tier holding a block ([`Store::contains`]).
    ///
    /// # Errors
    /// As [`Store::contains`].
    pub async fn contains(&self, key: &ScopedKey) -> Result<Option<Tier>> {
        self.store.contains(key.stored()).await
    }

    /// Leases a block to a same-host client ([`Store::lease`]).
    ///
    /// # Errors
    /// As [`Store::lease`].
    pub async fn lease(&self, key: &ScopedKey) -> Result<kvtier_engine::LeaseOutcome> {
        self.store.lease(key.stored()).await
    }

    /// Deletes a block ([`Store::delete`]).
    ///
    /// # Errors
    /// As [`Store::delete`].
    pub async fn delete(&self, key: &ScopedKey) -> Result<()> {
        self.store.delete(key.stored()).await
    }

    /// The tier of each key ([`Store::exists_many`]).
    ///
    /// # Errors
    /// As [`Store::exists_many`].
    pub async fn exists_many(&self, keys: &[ScopedKey]) -> Result<Vec<Option<Tier>>> {
        self.store.exists_many(&stored_all(keys)).await
    }

    /// The tiers of the stored prefix of `keys` ([`Store::lookup_prefix`]).
    ///
    /// # Errors
    /// As [`Store::lookup_prefix`].
    pub async fn lookup_prefix(&self, keys: &[ScopedKey]) -> Result<Vec<Tier>> {
        self.store.lookup_prefix(&stored_all(keys)).await
    }

    /// Moves `keys` toward the fastest tier ([`Store::prefetch`]).
    ///
    /// # Errors
    /// As [`Store::prefetch`].
    pub async fn prefetch(&self, keys: &[ScopedKey]) -> Result<kvtier_engine::PrefetchReport> {
        self.store.prefetch(&stored_all(keys)).await
    }
}

/// The engine's keys of `keys` (reference-counted: no key is copied).
fn stored_all(keys: &[ScopedKey]) -> Vec<StoredKey> {
    keys.iter().map(|k| k.0.clone()).collect()
}
