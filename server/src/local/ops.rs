//! The same-host ops a connection answers: HELLO (who is calling, the
//! geometry), REGISTER and UNREGISTER (buffers), and the data ops (GET_INTO,
//! PUT_FROM and their vectored forms, EXISTS, LOOKUP, DELETE, PREFETCH),
//! each asking the shard's [`Service`].

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use kvtier_engine::PutOutcome;
use serde_json::json;

use super::proto::{self, code_of, Code, Item, Op};
use super::region::{gather, still_wanted, views, views_intact, wanted, ItemSink, Part, Region};
use super::session::Conn;
use crate::limits;
use crate::service::{PutRefused, ScopedKey};
use crate::tenants::ScopeError;

/// Registrations one connection may hold.
pub const REGISTRATIONS_MAX: usize = 4096;

/// Bytes of one batch's blocks in flight at once (GET_INTO, PUT_FROM and
/// their span forms): 128 MiB, eight 16 MiB blocks, the rest started as
/// those end, in order. Every block of a 63-block batch at once wanted
/// 1 GiB of DMA buffers, past the shards' `--io-memory-mib` (512 MiB), and
/// the reads past it landed in fresh heap pages the kernel zeroed: the
/// server spent 0.8–1.3 CPU-seconds per GiB loaded, 0.4 with room
/// (docs/BENCHMARKS.md, issue 54).
pub const BATCH_BYTES_IN_FLIGHT: u64 = 128 << 20;

pub(super) fn unregister(conn: &Conn, payload: &[u8]) -> Result<Vec<u8>, (Code, String)> {
    let mut c = proto::Cursor::new(payload);
    let handle = c.u64("a handle").map_err(|e| (Code::BadRequest, e))?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    let region = conn.regions.borrow_mut().remove(&handle);
    let region = region.ok_or_else(|| (Code::UnknownHandle, format!("handle {handle} is not registered on this connection")))?;
    // The client frees the memory once this is answered: items in flight on
    // it copy nothing more (they fail CANCELLED), and a copy running on
    // another shard ends before the answer goes.
    region.revoke();
    conn.shared.registrations_open.fetch_sub(1, Ordering::Relaxed);
    conn.shared.registered_bytes.fetch_sub(region.len(), Ordering::Relaxed);
    super::session::release_off_shard(vec![region]);
    Ok(Vec::new())
}

/// What a HELLO asks for (docs/LOCAL.md): the protocol version chosen
/// (the highest both sides speak), and the token, block size and model the
/// client expects, where it gave them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The version the connection will speak, from [`proto::VERSIONS`].
    pub version: u32,
    /// `token`, when a string.
    pub token: Option<String>,
    /// `block_bytes`, when an unsigned integer.
    pub block_bytes: Option<u64>,
    /// `model`, when a string.
    pub model: Option<String>,
}

/// Parses a HELLO payload: a JSON object whose `versions` lists the
/// protocol versions the client speaks. Fields of another type than the
/// one named above are ignored, as absent. Pure: the fuzz target
/// `local_frames` drives it.
///
/// # Errors
/// `BAD_REQUEST` for a payload that is not JSON, `UNSUPPORTED_VERSION`
/// when no listed version is one the server speaks.
pub fn parse_hello(payload: &[u8]) -> Result<Hello, (Code, String)> {
    let req: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| (Code::BadRequest, format!("HELLO payload is not JSON: {e}")))?;
    let versions: Vec<u32> = req.get("versions").and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
    let Some(version) = versions.iter().copied().filter(|v| proto::VERSIONS.contains(v)).max() else {
        return Err((Code::UnsupportedVersion, format!("client speaks versions {versions:?}, server speaks {:?}", proto::VERSIONS)));
    };
    Ok(Hello {
        version,
        token: req.get("token").and_then(|t| t.as_str()).map(str::to_string),
        block_bytes: req.get("block_bytes").and_then(|v| v.as_u64()),
        model: req.get("model").and_then(|v| v.as_str()).map(str::to_string),
    })
}

pub(super) fn hello(conn: &Conn, payload: &[u8]) -> Result<Vec<u8>, (Code, String)> {
    if conn.said_hello.get() {
        return Err((Code::BadRequest, "HELLO was already said on this connection".into()));
    }
    let req = parse_hello(payload)?;
    let access = &conn.service.access;
    match access.with(|auth| auth.identify_peer(req.token.as_deref().map(str::as_bytes), conn.peer_uid)) {
        Ok(caller) => *conn.caller.borrow_mut() = caller,
        Err(denied) => {
            access.count_refusal();
            return Err((Code::Unauthorized, denied.0));
        }
    }
    let g = conn.service.store.geometry();
    if let Some(want) = req.block_bytes {
        if want != g.block_bytes {
            return Err((
                Code::GeometryMismatch,
                format!(
                    "client expects block_bytes {want}, server has block_bytes {} (model {}, {} tokens per block)",
                    g.block_bytes, g.model, g.block_tokens
                ),
            ));
        }
    }
    if let Some(want) = &req.model {
        if *want != g.model {
            return Err((
                Code::GeometryMismatch,
                format!("client expects model {want:?}, server has model {:?} (block_bytes {})", g.model, g.block_bytes),
            ));
        }
    }
    let version = req.version;
    conn.said_hello.set(true);
    conn.version.set(version);
    let body = json!({
        "version": version,
        "epoch": conn.shared.epoch,
        "block_bytes": g.block_bytes,
        "model": g.model,
        "block_tokens": g.block_tokens,
        "bytes_per_token": g.bytes_per_token,
        "shards": conn.service.store.shards(),
        "max_items": proto::ITEMS_MAX,
        "max_payload_bytes": proto::PAYLOAD_BYTES_MAX,
        "max_registrations": REGISTRATIONS_MAX,
        "ops": Op::ALL.map(Op::name),
        "tenant": conn.caller.borrow().as_ref().map(|t| t.name.clone()),
        "leases": (version >= proto::VERSION_LEASES).then(|| super::lease::hello_json(conn)),
        "shared_index": (version >= proto::VERSION_LEASES).then(|| super::lease::hello_index_json(conn)),
        "server": concat!("kvtier ", env!("CARGO_PKG_VERSION")),
        "http": conn.shared.http_addr.get().map(|a| {
            // A wildcard listener is reached on loopback from this host.
            let ip = match a.ip() {
                std::net::IpAddr::V4(v4) if v4.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
                std::net::IpAddr::V6(v6) if v6.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
                ip => ip,
            };
            std::net::SocketAddr::new(ip, a.port()).to_string()
        }),
    });
    Ok(serde_json::to_vec(&body).expect("JSON"))
}

pub(super) fn register(conn: &Conn, payload: &[u8], fd: Result<OwnedFd, String>) -> Result<Vec<u8>, (Code, String)> {
    let fd = fd.map_err(|e| (Code::BadBuffer, e))?;
    let mut c = proto::Cursor::new(payload);
    let offset = c.u64("the offset").map_err(|e| (Code::BadRequest, e))?;
    let length = c.u64("the length").map_err(|e| (Code::BadRequest, e))?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    if conn.regions.borrow().len() >= REGISTRATIONS_MAX {
        return Err((Code::Limit, format!("this connection holds {REGISTRATIONS_MAX} registrations, the limit; unregister some")));
    }
    let region = Region::registered(fd, offset, length, conn.peer.clone()).map_err(|e| (Code::BadBuffer, e))?;
    let handle = conn.next_handle.get();
    conn.next_handle.set(handle + 1);
    let body = proto::encode_registered(handle, region.access() as u8);
    conn.shared.registrations_open.fetch_add(1, Ordering::Relaxed);
    conn.shared.registrations_total.fetch_add(1, Ordering::Relaxed);
    conn.shared.registered_bytes.fetch_add(length, Ordering::Relaxed);
    let region = Arc::new(region);
    conn.regions.borrow_mut().insert(handle, region.clone());
    // The pages the client holds, mapped in the server's page tables off the
    // shard's thread: a load's copies then take no first-touch faults.
    let mapping = glommio::executor().spawn_blocking(move || region.map_ahead());
    let shared = conn.shared.clone();
    glommio::spawn_local(async move {
        let bytes = mapping.await;
        shared.registered_bytes_mapped_ahead.fetch_add(bytes, Ordering::Relaxed);
    })
    .detach();
    Ok(body)
}

pub(super) type DataResult = (Result<(Vec<u8>, u32), (Code, String)>, u64, u64);

pub(super) async fn data_op(conn: &std::rc::Rc<Conn>, op: Op, payload: &[u8]) -> DataResult {
    let (service, store) = (&conn.service, &conn.service.store);
    let fail = |e: (Code, String)| (Err(e), 0, 0);
    let engine = |e: kvtier_engine::Error| (code_of(&e), e.to_string());
    match op {
        Op::GetInto | Op::PutFrom | Op::GetIntoV | Op::PutFromV => {
            let items = match proto::decode_op_items(op, conn.version.get(), payload) {
                Ok(i) => i,
                Err(e) => return fail(e),
            };
            let block_bytes = store.geometry().block_bytes;
            let futures = items.iter().map(|item| async move {
                let (key, parts, tag) = match item_parts(conn, item, block_bytes, op.is_get()) {
                    Ok(p) => p,
                    Err(code) => return (code as i64, 0u8),
                };
                if op.is_get() {
                    get_item(conn, &key, parts).await
                } else {
                    put_item(conn, &key, parts, tag, block_bytes).await
                }
            });
            let in_flight = (BATCH_BYTES_IN_FLIGHT / block_bytes.max(1)).max(1) as usize;
            let results: Vec<(i64, u8)> =
                futures::StreamExt::collect(futures::StreamExt::buffered(futures::stream::iter(futures), in_flight)).await;
            let cancelled = results.iter().filter(|(r, _)| *r == Code::Cancelled as i64).count() as u64;
            if cancelled > 0 {
                conn.shared.items_cancelled.fetch_add(cancelled, Ordering::Relaxed);
            }
            let moved: u64 = results.iter().filter(|(r, _)| *r >= 0).count() as u64 * block_bytes;
            let overloaded = results.iter().any(|(r, _)| *r == Code::Overloaded as i64);
            let retry = if overloaded { (limits::RETRY_AFTER_S * 1000) as u32 } else { 0 };
            let (bytes_in, bytes_out) = if op.is_get() { (0, moved) } else { (moved, 0) };
            (Ok((proto::encode_results(&results), retry)), bytes_in, bytes_out)
        }
        Op::Exists | Op::Lookup | Op::Delete | Op::Prefetch => {
            let keys = match proto::decode_keys(payload) {
                Ok(k) => k,
                Err(e) => return fail(e),
            };
            let caller = conn.caller.borrow().clone();
            let caller = caller.as_deref();
            if op == Op::Delete {
                // Per key: one that cannot be used answers its own code.
                let done = futures::future::join_all(keys.iter().map(|k| async move {
                    match service.scope(caller, k, true) {
                        Ok(stored) => service.delete(&stored).await.map_or_else(|e| code_of(&e) as i64, |_| 0),
                        Err(e) => scope_code(&e) as i64,
                    }
                }))
                .await;
                return (Ok((proto::encode_deleted(&done), 0)), 0, 0);
            }
            // The other ops refuse the request for its first unusable key.
            let keys = match service.scope_all(caller, &keys) {
                Ok(s) => s,
                Err((i, e)) => return fail((Code::InvalidKey, format!("key {i}: {e}"))),
            };
            let body = match op {
                Op::Exists => service
                    .exists_many(&keys)
                    .await
                    .map(|found| proto::encode_tiers(&found.into_iter().map(proto::tier_code).collect::<Vec<_>>())),
                Op::Lookup => service
                    .lookup_prefix(&keys)
                    .await
                    .map(|tiers| proto::encode_lookup(&tiers.into_iter().map(|t| proto::tier_code(Some(t))).collect::<Vec<_>>())),
                _ => service.prefetch(&keys).await.map(|report| proto::encode_prefetched(keys.len() as u32, report.found as u32)),
            };
            (body.map(|b| (b, 0)).map_err(engine), 0, 0)
        }
        Op::Lease => (super::lease::lease(conn, payload).await.map(|b| (b, 0)), 0, 0),
        Op::Release => (super::lease::release(conn, payload).map(|b| (b, 0)), 0, 0),
        Op::Hello | Op::Register | Op::Unregister | Op::MapArena | Op::MapIndex => unreachable!("answered by the reader"),
    }
}

/// The code of a key its caller cannot use: `INVALID_KEY`, or
/// `UNAUTHORIZED` for a write into a namespace it only reads.
fn scope_code(e: &ScopeError) -> Code {
    match e {
        ScopeError::InvalidKey(_) => Code::InvalidKey,
        ScopeError::ReadOnly(_) => Code::Unauthorized,
    }
}

/// The item's stored key (scoped to the caller, `tenants.rs`), its parts in
/// their regions and its block tag, after the checks every item gets (key,
/// then each part's handle and bounds in order, then the size: room for the
/// block for a get, exactly the block for a put; then a put's tag), so an
/// item that fails any of them copies nothing and stores nothing.
fn item_parts(conn: &Conn, item: &Item<'_>, block_bytes: u64, get: bool) -> Result<(ScopedKey, Vec<Part>, Option<Bytes>), Code> {
    let key = conn.service.scope(conn.caller.borrow().as_deref(), item.key, !get).map_err(|e| scope_code(&e))?;
    let parts = item
        .parts
        .iter()
        .map(|span| {
            let region = conn.regions.borrow().get(&span.handle).cloned().ok_or(Code::UnknownHandle)?;
            region.check(span.offset, span.length).map_err(|(c, _)| c)?;
            Ok(Part { region, at: span.offset, len: span.length })
        })
        .collect::<Result<Vec<_>, Code>>()?;
    let length = item.length();
    let size_ok = if get { length >= block_bytes } else { length == block_bytes };
    if !size_ok {
        return Err(Code::WrongSize);
    }
    Ok((key, parts, item_tag(item.tag, block_bytes)?))
}

/// A put item's block tag, checked before its bytes are copied or admitted
/// (the store checks it again): `None` for an empty one (untagged),
/// `INVALID_TAG` for one that does not decode
/// ([`kvtier_engine::events::BlockTag::decode`]) or is longer than this
/// store's slot header holds ([`kvtier_engine::slot::tag_room`]). The item's
/// code carries no message; a client that wants the reason checks its tag
/// first (the Python client's `BlockTag.validate`) or sends it over HTTP.
fn item_tag(tag: &[u8], block_bytes: u64) -> Result<Option<Bytes>, Code> {
    if tag.is_empty() {
        return Ok(None);
    }
    if kvtier_engine::events::BlockTag::decode(tag).is_err() || tag.len() > kvtier_engine::slot::tag_room(block_bytes) {
        return Err(Code::InvalidTag);
    }
    Ok(Some(Bytes::copy_from_slice(tag)))
}

/// Copies the block under `key` into the parts, unless the client gives up
/// on their memory first (`CANCELLED`: asked before the read, and by every
/// piece of the copy, `region.rs`).
async fn get_item(conn: &Conn, key: &ScopedKey, parts: Vec<Part>) -> (i64, u8) {
    if !wanted(&parts) {
        return (Code::Cancelled as i64, 0);
    }
    let sink = Arc::new(ItemSink::new(parts));
    match conn.service.get_into(key, sink.clone()).await {
        Ok((n, tier)) => (n as i64, proto::tier_code(Some(tier))),
        Err(_) if sink.shrunk.load(Ordering::Relaxed) => (Code::BufferShrunk as i64, 0),
        Err(_) if sink.cancelled.load(Ordering::Relaxed) => (Code::Cancelled as i64, 0),
        Err(e) => {
            if code_of(&e).is_server_side() {
                tracing::warn!(key = key.as_str(), "local GET_INTO failed: {e}");
            }
            (code_of(&e) as i64, 0)
        }
    }
}

/// Stores the block the parts hold (`block_bytes` together, checked) with
/// its block tag, if any (checked), unless the client gives up on their
/// memory before the block is copied out of it and stored (`CANCELLED`:
/// nothing stored).
async fn put_item(conn: &Conn, key: &ScopedKey, parts: Vec<Part>, tag: Option<Bytes>, block_bytes: u64) -> (i64, u8) {
    if !wanted(&parts) {
        return (Code::Cancelled as i64, 0);
    }
    // The shard's budget, shared with HTTP; refusals in the socket's own
    // series (kvtier_local_put_bytes_refusals_total).
    let _admitted = match conn.service.put_budget.admit(block_bytes) {
        Ok(a) => a,
        Err(PutRefused { .. }) => {
            conn.shared.stats.shard(conn.service.store.shard_id()).put_bytes_refusals.fetch_add(1, Ordering::Relaxed);
            return (Code::Overloaded as i64, 0);
        }
    };
    // All-or-nothing: the whole block is copied out of the client's memory
    // before anything is stored. From a mapped region the owning shard makes
    // that copy itself, straight into its RAM tier (writes in place,
    // docs/LOCAL.md); from other memory it is gathered here into buffers
    // of the server's own first. Either way the copy is stored only if the
    // client still wants it once it is made.
    let put = match views(&parts) {
        Some(views) => {
            let put = conn.service.put_in_place(key, views, tag, still_wanted(&parts)).await;
            if let Err((code, message)) = views_intact(&parts) {
                // The client's file shrank under the copy: the block may hold
                // zero pages where its bytes were. Not acknowledged; taken
                // back if stored, as a gathered item would have stored nothing.
                if put.is_ok() {
                    let _ = conn.service.delete(key).await;
                }
                tracing::debug!(key = key.as_str(), "local PUT_FROM: {message}");
                return (code as i64, 0);
            }
            put
        }
        None => {
            let bytes = match gather(&parts) {
                Ok(b) => b,
                Err((code, _)) => return (code as i64, 0),
            };
            if !wanted(&parts) {
                return (Code::Cancelled as i64, 0);
            }
            drop(parts);
            conn.service.put(key, bytes, tag).await
        }
    };
    match put {
        Ok(report) => (0, (report.outcome == PutOutcome::Created) as u8),
        Err(e) => {
            if code_of(&e).is_server_side() {
                tracing::warn!(key = key.as_str(), "local PUT_FROM failed: {e}");
            }
            (code_of(&e) as i64, 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_items_tag_is_checked_before_anything_is_copied() {
        assert_eq!(item_tag(&[], 65536), Ok(None), "empty: untagged");
        let tag = kvtier_engine::events::BlockTag {
            block_hashes: vec![vec![7; 32]; 10],
            parent_hash: None,
            block_size: 64,
            token_ids: vec![1; 640],
        };
        let bytes = tag.encode();
        assert_eq!(item_tag(&bytes, 16 << 20), Ok(Some(bytes.clone())));
        assert_eq!(item_tag(&bytes[..bytes.len() - 1], 16 << 20), Err(Code::InvalidTag), "cut");
        // 2,890 bytes: more than a 512 MiB block's slot header holds (1,688).
        assert_eq!(item_tag(&bytes, 512 << 20), Err(Code::InvalidTag), "too long for this store");
    }
}
