//! Block owners (tenants and shared namespaces) and their per-tier quotas.
//!
//! The server gives each tenant, and each shared namespace, a key space of
//! its own by scoping keys: the stored key is `SCOPE/KEY`, where `SCOPE` is
//! the owner's name and `KEY` the client's key (`/` is not a key byte, so a
//! client cannot spell another owner's stored key). Keys with no scope
//! belong to owner 0, the default owner: every block of a store run without
//! a tenants file, and blocks written before one was given.
//!
//! The engine learns who owns a block from its stored key alone
//! ([`Owners::owner_of`]), so the slot header, which keeps the full key,
//! is enough to rebuild every owner's accounting after a restart.
//!
//! Quotas are per tier (GPU, RAM, NVMe), in bytes for the whole store; each
//! shard holds an even share in whole blocks ([`share_blocks`]). Under its
//! reservation an owner's blocks are never moved out of a tier to make room
//! for another owner's; at its limit it makes room only by moving out its
//! own least recently used blocks (docs/OPERATIONS.md, "Tenants").

use std::collections::HashMap;

/// An owner's number in this process: an index into [`Owners::specs`].
/// Stable while the process runs (a reload keeps every known name's id);
/// not stored on disk as such (the snapshot maps ids through names).
pub type OwnerId = u16;

/// The default owner: keys with no scope.
pub const DEFAULT_OWNER: OwnerId = 0;

/// Most owners a store tracks (tenants and namespaces together, the
/// default owner included): the bound on per-owner metric labels.
pub const OWNERS_MAX: usize = 256;

/// Longest owner name, in bytes.
pub const OWNER_NAME_BYTES_MAX: usize = 32;

/// The tiers an owner has quotas in, as indexes into [`OwnerSpec::quotas`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaTier {
    /// The GPU tier.
    Gpu = 0,
    /// The RAM tier.
    Ram = 1,
    /// The NVMe log.
    Nvme = 2,
}

impl QuotaTier {
    /// Every tier with quotas, in order.
    pub const ALL: [QuotaTier; 3] = [QuotaTier::Gpu, QuotaTier::Ram, QuotaTier::Nvme];

    /// Its name in stats, metrics and the tenants file (`gpu`, `ram`, `nvme`).
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaTier::Gpu => "gpu",
            QuotaTier::Ram => "ram",
            QuotaTier::Nvme => "nvme",
        }
    }
}

/// One owner's reservation and limit in one tier, in bytes for the whole
/// store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Quota {
    /// Bytes of this tier no other owner can take from it.
    pub reserved_bytes: u64,
    /// Most bytes it may hold in this tier; `None`: no limit but the tier's
    /// size.
    pub limit_bytes: Option<u64>,
}

/// An owner as the server configured it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerSpec {
    /// Its name: the scope of its stored keys (`[a-z0-9_-]`, 1 to
    /// [`OWNER_NAME_BYTES_MAX`] bytes; empty for the default owner).
    pub name: String,
    /// Whether the tenants file names it now (a removed owner keeps its id
    /// and its blocks until they are evicted).
    pub configured: bool,
    /// Quotas by [`QuotaTier`].
    pub quotas: [Quota; 3],
}

/// Every owner a store knows, by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owners {
    /// By [`OwnerId`]; entry 0 is the default owner.
    pub specs: Vec<OwnerSpec>,
    by_name: HashMap<String, OwnerId>,
    /// Grows with each change the server makes: a shard given owners older
    /// than those it has (two changes crossing on the way) keeps its own.
    pub generation: u64,
}

impl Default for Owners {
    fn default() -> Self {
        Owners::new(Vec::new()).expect("no owners is valid")
    }
}

impl Owners {
    /// The default owner (id 0, no quota) followed by `specs` in order.
    ///
    /// # Errors
    /// A name that is empty, too long, has a byte outside `[a-z0-9_-]`, or
    /// is repeated; more than [`OWNERS_MAX`] owners.
    pub fn new(specs: Vec<OwnerSpec>) -> Result<Owners, String> {
        let mut all = vec![OwnerSpec { name: String::new(), configured: true, quotas: [Quota::default(); 3] }];
        let mut by_name = HashMap::new();
        for s in specs {
            check_name(&s.name)?;
            if by_name.insert(s.name.clone(), all.len() as OwnerId).is_some() {
                return Err(format!("owner name {:?} is given twice", s.name));
            }
            all.push(s);
        }
        if all.len() > OWNERS_MAX {
            return Err(format!("{} owners (tenants and namespaces); a store tracks at most {}", all.len() - 1, OWNERS_MAX - 1));
        }
        Ok(Owners { specs: all, by_name, generation: 0 })
    }

    /// The owners of `next` with the ids of `self` kept: a name known now
    /// keeps its id, a new one gets the next free id, and one no longer in
    /// `next` stays, marked not configured, with no quota.
    ///
    /// # Errors
    /// More than [`OWNERS_MAX`] owners would be tracked.
    pub fn reload(&self, next: &Owners) -> Result<Owners, String> {
        let mut specs: Vec<OwnerSpec> = self.specs[1..]
            .iter()
            .map(|s| match next.id_of(&s.name) {
                Some(id) => next.specs[id as usize].clone(),
                None => OwnerSpec { name: s.name.clone(), configured: false, quotas: [Quota::default(); 3] },
            })
            .collect();
        for s in &next.specs[1..] {
            if self.id_of(&s.name).is_none() {
                specs.push(s.clone());
            }
        }
        let mut next = Owners::new(specs)?;
        next.generation = self.generation + 1;
        Ok(next)
    }

    /// The id of the owner named `name`, if known.
    pub fn id_of(&self, name: &str) -> Option<OwnerId> {
        self.by_name.get(name).copied()
    }

    /// The owner of a stored key's scope ([`crate::key::StoredKey::scope`]):
    /// its id; [`DEFAULT_OWNER`] for no scope (empty) or one naming no known
    /// owner.
    pub fn owner_of(&self, scope: &str) -> OwnerId {
        match scope {
            "" => DEFAULT_OWNER,
            scope => self.id_of(scope).unwrap_or(DEFAULT_OWNER),
        }
    }

    /// The owner's display name: `default` for owner 0.
    pub fn display_name(&self, id: OwnerId) -> &str {
        match self.specs.get(id as usize) {
            Some(s) if id != DEFAULT_OWNER => &s.name,
            _ => "default",
        }
    }

    /// Number of owners, the default one included.
    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// Always false: the default owner is always there.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// One shard's quotas in `tier`, in whole blocks of `block_bytes`, by
    /// owner: `(reserved, limit)`, the limit capped at `capacity_blocks`.
    pub fn shard_quotas(&self, tier: QuotaTier, block_bytes: u64, shard: usize, shards: usize, capacity_blocks: u64) -> Vec<(u64, u64)> {
        self.specs
            .iter()
            .map(|s| {
                let q = s.quotas[tier as usize];
                let reserved = share_blocks(q.reserved_bytes / block_bytes, shard, shards);
                let limit = q.limit_bytes.map_or(capacity_blocks, |l| share_blocks(l / block_bytes, shard, shards).min(capacity_blocks));
                (reserved.min(capacity_blocks), limit)
            })
            .collect()
    }
}

/// Shard `shard`'s share of `blocks` spread over `shards` shards: an even
/// split, the first `blocks mod shards` shards one more, so the shares add
/// up to `blocks` exactly.
pub fn share_blocks(blocks: u64, shard: usize, shards: usize) -> u64 {
    let shards = shards.max(1) as u64;
    blocks / shards + u64::from((shard as u64) < blocks % shards)
}

/// Checks an owner name: 1 to [`OWNER_NAME_BYTES_MAX`] bytes of
/// `[a-z0-9_-]`.
///
/// # Errors
/// Says what is wrong with it.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > OWNER_NAME_BYTES_MAX {
        return Err(format!("name {name:?} must be 1 to {OWNER_NAME_BYTES_MAX} bytes"));
    }
    if let Some(b) = name.bytes().find(|b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))) {
        return Err(format!("name {name:?} has byte 0x{b:02x}; names use [a-z0-9_-]"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, ram_reserved: u64) -> OwnerSpec {
        let mut quotas = [Quota::default(); 3];
        quotas[QuotaTier::Ram as usize] = Quota { reserved_bytes: ram_reserved, limit_bytes: Some(ram_reserved * 2) };
        OwnerSpec { name: name.into(), configured: true, quotas }
    }

    #[test]
    fn owner_of_stored_keys() {
        let o = Owners::new(vec![spec("acme", 0), spec("beta", 0)]).unwrap();
        assert_eq!(o.owner_of("acme"), 1);
        assert_eq!(o.owner_of("beta"), 2);
        assert_eq!(o.owner_of(""), DEFAULT_OWNER);
        assert_eq!(o.owner_of("gone"), DEFAULT_OWNER);
        assert_eq!(o.display_name(0), "default");
        assert_eq!(o.display_name(2), "beta");
    }

    #[test]
    fn bad_names_and_duplicates_refused() {
        assert!(Owners::new(vec![spec("a", 0), spec("a", 0)]).unwrap_err().contains("given twice"));
        for bad in ["", "A", "a/b", "a.b", &"x".repeat(33)] {
            assert!(Owners::new(vec![spec(bad, 0)]).is_err(), "{bad:?} accepted");
        }
        let many: Vec<_> = (0..OWNERS_MAX).map(|i| spec(&format!("t{i}"), 0)).collect();
        assert!(Owners::new(many).unwrap_err().contains("at most"));
    }

    #[test]
    fn reload_keeps_ids_and_marks_removed() {
        let a = Owners::new(vec![spec("acme", 1), spec("beta", 2)]).unwrap();
        let b = Owners::new(vec![spec("gamma", 3), spec("acme", 5)]).unwrap();
        let c = a.reload(&b).unwrap();
        assert_eq!(c.id_of("acme"), Some(1));
        assert_eq!(c.id_of("beta"), Some(2));
        assert_eq!(c.id_of("gamma"), Some(3));
        assert!(!c.specs[2].configured);
        assert_eq!(c.specs[2].quotas, [Quota::default(); 3]);
        assert_eq!(c.specs[1].quotas[1].reserved_bytes, 5);
    }

    #[test]
    fn shares_add_up() {
        for blocks in [0, 1, 5, 7, 100] {
            let total: u64 = (0..3).map(|s| share_blocks(blocks, s, 3)).sum();
            assert_eq!(total, blocks);
        }
        let o = Owners::new(vec![spec("acme", 10 << 20)]).unwrap();
        // 10 blocks of 1 MiB reserved, limit 20, over 4 shards, shard 1.
        assert_eq!(o.shard_quotas(QuotaTier::Ram, 1 << 20, 1, 4, 100), vec![(0, 100), (3, 5)]);
        assert_eq!(o.shard_quotas(QuotaTier::Ram, 1 << 20, 3, 4, 4), vec![(0, 4), (2, 4)], "limit capped at capacity");
    }
}
