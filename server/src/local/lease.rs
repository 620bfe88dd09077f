//! Leases on the local socket (docs/LOCAL.md, "Leases"): `MAP_ARENA` hands
//! a client a read-only descriptor of a shard's RAM-tier arena, `LEASE`
//! pins blocks there for the client to read in place, `RELEASE` ends them.
//! A connection holds its leases (each a pin of its slot,
//! [`kvtier_engine::ram::LeasedSlot`]) until it releases them, closes, or
//! `--lease-ms` passes; then the pins drop and the slots may be reused.

use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtier_engine::LeaseOutcome;
use serde_json::{json, Value};

use super::proto::{self, code_of, Code, LeaseItem};
use super::session::Conn;

/// Leases one connection may hold at once; a `LEASE` item past it is
/// `LIMIT`.
pub const LEASES_PER_CONNECTION_MAX: usize = 16_384;

/// How long a lease lasts unless released first, by default (`--lease-ms`).
pub const LEASE_MS_DEFAULT: u64 = 30_000;

/// The lease counters every connection adds to (`/v1/stats` `local.leases`,
/// `/metrics` `kvtier_local_leases_*`).
#[derive(Default)]
pub struct LeaseCounters {
    /// Leases held now, over all connections.
    pub open: AtomicU64,
    /// Leases granted since start.
    pub granted: AtomicU64,
    /// Leases ended by `RELEASE`.
    pub released: AtomicU64,
    /// Leases ended by `--lease-ms`.
    pub expired: AtomicU64,
    /// Leases ended by their connection closing.
    pub dropped_at_close: AtomicU64,
    /// Arena descriptors handed out (`MAP_ARENA`).
    pub arenas_mapped: AtomicU64,
}

impl LeaseCounters {
    /// The counters as `/v1/stats` shows them.
    pub fn json(&self, lease_ms: u64) -> Value {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "lease_ms": lease_ms,
            "open": load(&self.open),
            "granted_total": load(&self.granted),
            "released_total": load(&self.released),
            "expired_total": load(&self.expired),
            "dropped_at_close_total": load(&self.dropped_at_close),
            "arenas_mapped_total": load(&self.arenas_mapped),
        })
    }
}

/// Why this connection cannot lease, if it cannot: the store has no
/// shared RAM tier, or the server has tenants (an arena holds every
/// tenant's blocks, so a tenant mapping one would see the others').
pub(super) fn why_not(conn: &Conn) -> Option<String> {
    if conn.service.access.tenancy().is_some() {
        return Some("the server runs with --tenants: a RAM-tier arena holds every tenant's blocks, so no tenant may map one".into());
    }
    conn.service.store.lease_support().err()
}

/// HELLO's `leases` object (version 3).
pub(super) fn hello_json(conn: &Conn) -> Value {
    let why = why_not(conn);
    let arenas = if why.is_none() { kvtier_engine::ram::shared_arena_ids() } else { Vec::new() };
    json!({
        "offered": why.is_none(),
        "why_not": why,
        "arenas": arenas,
        "lease_ms": conn.shared.lease_ms,
        "leases_max": LEASES_PER_CONNECTION_MAX,
    })
}

fn check_offered(conn: &Conn) -> Result<(), (Code, String)> {
    match why_not(conn) {
        Some(why) => Err((Code::LeasesOff, format!("no leases: {why}"))),
        None => Ok(()),
    }
}

/// `MAP_ARENA`: the arena's layout and a read-only descriptor of its file.
pub(super) fn map_arena(conn: &Conn, payload: &[u8]) -> Result<(Vec<u8>, OwnedFd), (Code, String)> {
    check_offered(conn)?;
    let id = proto::decode_map_arena(payload)?;
    let arena = kvtier_engine::ram::shared_arena(id).ok_or_else(|| (Code::NotFound, format!("no arena {id} in this server")))?;
    let fd = arena.read_only_fd().map_err(|e| (Code::IoError, format!("reopening arena {id} read-only: {e}")))?;
    let l = arena.layout();
    conn.shared.leases.arenas_mapped.fetch_add(1, Ordering::Relaxed);
    let body = proto::encode_arena(&proto::ArenaAnswer {
        file_bytes: l.file_bytes,
        slot_bytes: l.slot_bytes,
        slots: l.slots,
        generations_offset: l.generations_offset,
    });
    Ok((body, fd))
}

/// Why this connection cannot map the shared index, if it cannot:
/// `--shared-index off`, or tenants (a table lists every tenant's blocks by
/// hash, so a tenant could probe another's keys).
pub(super) fn why_no_index(conn: &Conn) -> Option<String> {
    if conn.service.access.tenancy().is_some() {
        return Some("the server runs with --tenants: the shared index lists every tenant's blocks, so no tenant may map it".into());
    }
    conn.service.store.index_table(0).is_none().then(|| "the server runs with --shared-index off".into())
}

/// HELLO's `shared_index` object (version 3).
pub(super) fn hello_index_json(conn: &Conn) -> Value {
    let why = why_no_index(conn);
    let remote_tier = conn.service.store.remote().is_some();
    json!({ "offered": why.is_none(), "why_not": why, "remote_tier": remote_tier })
}

/// `MAP_INDEX`: shard `shard`'s index table and a read-only descriptor
/// of its file.
pub(super) fn map_index(conn: &Conn, payload: &[u8]) -> Result<(Vec<u8>, OwnedFd), (Code, String)> {
    if let Some(why) = why_no_index(conn) {
        return Err((Code::LeasesOff, format!("no shared index: {why}")));
    }
    let shard = proto::decode_map_arena(payload)?;
    let shards = conn.service.store.shards();
    let table = (shard < shards as u32)
        .then(|| conn.service.store.index_table(shard as usize))
        .flatten()
        .ok_or_else(|| (Code::NotFound, format!("no shard {shard}: this store has {shards}")))?;
    let fd = table.read_only_fd().map_err(|e| (Code::IoError, format!("reopening shard {shard}'s index read-only: {e}")))?;
    let body = proto::encode_index(&proto::IndexAnswer { file_bytes: table.file_bytes(), buckets: table.buckets(), shards: shards as u32 });
    Ok((body, fd))
}

/// `LEASE`: each key's block pinned in its shard's RAM tier, or why not.
pub(super) async fn lease(conn: &Rc<Conn>, payload: &[u8]) -> Result<Vec<u8>, (Code, String)> {
    check_offered(conn)?;
    let keys = proto::decode_keys(payload)?;
    let service = &conn.service;
    let caller = conn.caller.borrow().clone();
    let scoped = service.scope_all(caller.as_deref(), &keys).map_err(|(i, e)| (Code::InvalidKey, format!("key {i}: {e}")))?;
    let outcomes = futures::future::join_all(scoped.iter().map(|k| service.lease(k))).await;
    let deadline = Instant::now() + Duration::from_millis(conn.shared.lease_ms);
    let counters = &conn.shared.leases;
    let mut items = Vec::with_capacity(outcomes.len());
    {
        let mut leases = conn.leases.borrow_mut();
        for outcome in outcomes {
            let none = LeaseItem { result: 0, tier: 0, arena: 0, offset: 0, generation: 0, lease: 0 };
            items.push(match outcome {
                Ok(LeaseOutcome::Leased(slot, tier)) if leases.len() < LEASES_PER_CONNECTION_MAX => {
                    let result = slot.bytes.len() as i64;
                    let (arena, offset, generation) = (slot.arena, slot.offset, slot.generation);
                    let lease = leases.hold(slot.bytes, deadline);
                    counters.granted.fetch_add(1, Ordering::Relaxed);
                    counters.open.fetch_add(1, Ordering::Relaxed);
                    LeaseItem { result, tier: proto::tier_code(Some(tier)), arena, offset, generation, lease }
                }
                // Over the limit: the pin drops here, unleased.
                Ok(LeaseOutcome::Leased(_, tier)) => LeaseItem { result: Code::Limit as i64, tier: proto::tier_code(Some(tier)), ..none },
                Ok(LeaseOutcome::NotInRam(tier)) => LeaseItem { result: Code::NotInRam as i64, tier: proto::tier_code(Some(tier)), ..none },
                Err(e) => LeaseItem { result: code_of(&e) as i64, ..none },
            });
        }
    }
    ensure_expiry(conn);
    Ok(proto::encode_leases(&items))
}

/// `RELEASE`: ends the connection's leases among the ids given.
pub(super) fn release(conn: &Conn, payload: &[u8]) -> Result<Vec<u8>, (Code, String)> {
    let ids = proto::decode_release(payload)?;
    let released = {
        let mut leases = conn.leases.borrow_mut();
        ids.iter().filter(|id| leases.end(**id)).count() as u64
    };
    conn.shared.leases.released.fetch_add(released, Ordering::Relaxed);
    conn.shared.leases.open.fetch_sub(released, Ordering::Relaxed);
    Ok(proto::encode_released(released as u32))
}

/// Ends every lease of a closing connection.
pub(super) fn drop_all(conn: &Conn) {
    let n = conn.leases.borrow_mut().clear();
    conn.shared.leases.dropped_at_close.fetch_add(n, Ordering::Relaxed);
    conn.shared.leases.open.fetch_sub(n, Ordering::Relaxed);
}

/// Starts the connection's expiry task unless it runs: it sleeps until the
/// earliest lease's end, ends those whose time is up, and stops when the
/// connection holds none.
fn ensure_expiry(conn: &Rc<Conn>) {
    {
        let mut leases = conn.leases.borrow_mut();
        if leases.sweeping || leases.len() == 0 {
            return;
        }
        leases.sweeping = true;
    }
    let conn = Rc::downgrade(conn);
    glommio::spawn_local(async move {
        loop {
            let Some(c) = conn.upgrade() else { return };
            let (ended, next) = c.leases.borrow_mut().expire(Instant::now());
            c.shared.leases.expired.fetch_add(ended, Ordering::Relaxed);
            c.shared.leases.open.fetch_sub(ended, Ordering::Relaxed);
            let Some(next) = next else {
                c.leases.borrow_mut().sweeping = false;
                return;
            };
            drop(c);
            glommio::timer::sleep(next.saturating_duration_since(Instant::now())).await;
        }
    })
    .detach();
}
