//! The messages of the channel mesh: an operation on keys another shard
//! owns travels to that shard as a [`Request`], carrying `Bytes` handles
//! (no payload copy) and the oneshot channel its answer comes back on. Each
//! variant's channel carries that operation's own answer type, so the
//! asking shard gets its type back with nothing to unpack, and the owning
//! shard ([`execute`]) cannot answer one operation with another's reply.

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use futures::channel::oneshot;

use super::PrefetchReport;
use crate::error::Result;
use crate::health::TierHealth;
use crate::key::{BlockHash, StoredKey};
use crate::shard::{LeaseOutcome, PutReport, PutSource, Shard, ShardStats};
use crate::stream::{BlockBody, BlockSink};
use crate::tenant::Owners;
use crate::tier::Tier;
use crate::trace::ShardTrace;

/// Messages queued per shard pair before a sender waits.
pub(super) const MESH_QUEUE_DEPTH: usize = 1024;

/// Where the owning shard sends its answer of type `T`; the asking shard
/// waits on the other end ([`super::Store`]'s `forward`).
pub(super) type Reply<T> = oneshot::Sender<T>;

/// An operation sent to the owning shard, with the channel of its answer.
pub(super) enum Request {
    Put { key: StoredKey, hash: BlockHash, chunks: Vec<Bytes>, tag: Option<Bytes>, source: PutSource, reply: Reply<Result<PutReport>> },
    Get { key: StoredKey, hash: BlockHash, reply: Reply<Result<(BlockBody, Tier)>> },
    GetInto { key: StoredKey, hash: BlockHash, sink: Arc<dyn BlockSink>, reply: Reply<Result<(u64, Tier)>> },
    Delete { key: StoredKey, hash: BlockHash, reply: Reply<Result<()>> },
    Lease { key: StoredKey, hash: BlockHash, reply: Reply<Result<LeaseOutcome>> },
    Contains { hashes: Vec<BlockHash>, reply: Reply<Vec<Option<Tier>>> },
    RemoteExists { keys: Vec<StoredKey>, reply: Reply<Vec<Option<bool>>> },
    Prefetch { keys: Vec<(StoredKey, BlockHash)>, reply: Reply<PrefetchReport> },
    Stats(Reply<ShardStats>),
    Health(Reply<Vec<TierHealth>>),
    TraceFlush(Reply<()>),
    SetOwners(Arc<Owners>, Reply<()>),
}

/// Counts the stored keys among `keys` now and promotes them in a
/// background task on this shard; the others are copied from the remote
/// tier, `parallelism` at a time, when there is one.
pub(super) fn start_prefetch(shard: &Rc<Shard>, keys: Vec<(StoredKey, BlockHash)>, parallelism: usize) -> PrefetchReport {
    let (stored, elsewhere): (Vec<_>, Vec<_>) = keys.into_iter().partition(|(_, h)| shard.contains(h).is_some());
    let elsewhere = if shard.has_remote() { elsewhere } else { Vec::new() };
    let report = PrefetchReport { found: stored.len(), remote_requested: elsewhere.len() };
    shard.spawn_holding(|shard| async move {
        for (key, hash) in stored {
            shard.prefetch(&key, hash).await;
        }
        shard.prefetch_remote(elsewhere, parallelism).await;
    });
    report
}

/// [`super::Store::get_into`] on the owning shard.
pub(super) async fn copy_block(shard: &Rc<Shard>, key: &StoredKey, hash: BlockHash, sink: &dyn BlockSink) -> Result<(u64, Tier)> {
    let (body, tier) = shard.get(key, hash, true).await?;
    Ok((body.copy_into(sink).await?, tier))
}

/// Runs a request on the shard that owns its keys and sends the answer
/// back. An asker that has gone away (its future dropped) is not an error.
pub(super) async fn execute(shard: &Rc<Shard>, trace: Option<&ShardTrace>, request: Request, parallelism: usize) {
    match request {
        Request::Put { key, hash, chunks, tag, source, reply } => {
            let _ = reply.send(shard.put_block(&key, hash, &chunks, tag, source).await);
        }
        // Whole: one message back across threads, not one per chunk.
        Request::Get { key, hash, reply } => {
            let _ = reply.send(shard.get(&key, hash, false).await);
        }
        Request::GetInto { key, hash, sink, reply } => {
            let _ = reply.send(copy_block(shard, &key, hash, &*sink).await);
        }
        Request::Delete { key, hash, reply } => {
            let _ = reply.send(shard.delete_block(&key, hash).await);
        }
        Request::Lease { key, hash, reply } => {
            let _ = reply.send(shard.lease(&key, hash).await);
        }
        Request::Contains { hashes, reply } => {
            let _ = reply.send(hashes.iter().map(|h| shard.contains(h)).collect());
        }
        Request::RemoteExists { keys, reply } => {
            let keys: Vec<&StoredKey> = keys.iter().collect();
            let _ = reply.send(shard.remote_exists_many(&keys).await);
        }
        Request::Prefetch { keys, reply } => {
            let _ = reply.send(start_prefetch(shard, keys, parallelism));
        }
        Request::Stats(reply) => {
            let _ = reply.send(shard.stats());
        }
        Request::Health(reply) => {
            let _ = reply.send(shard.health());
        }
        Request::TraceFlush(reply) => {
            if let Some(t) = trace {
                t.flush();
            }
            let _ = reply.send(());
        }
        Request::SetOwners(owners, reply) => {
            shard.set_owners(owners);
            let _ = reply.send(());
        }
    }
}
