//! Leases (docs/LOCAL.md, "Leases"): a block pinned in this shard's RAM
//! tier for a same-host client that reads it in place from the arena it
//! mapped. A block found in a lower tier is read the way a promoting GET
//! reads it, which lands it in the RAM tier, and then leased there.

use futures::StreamExt;

use super::Shard;
use crate::counter::bump;
use crate::error::{Error, Result};
use crate::key::{BlockHash, StoredKey};
use crate::ram::LeasedSlot;
use crate::stream::BlockBody;
use crate::tier::Tier;

/// What a lease of one key came to.
#[derive(Clone)]
pub enum LeaseOutcome {
    /// Leased: the pinned slot, and the tier the block was found in (RAM,
    /// or NVMe when the read promoted it).
    Leased(LeasedSlot, Tier),
    /// Stored, but read from `Tier` without landing in the RAM tier (a GPU
    /// or remote-tier hit, a RAM tier full of pinned slots): the client
    /// reads it with `GET_INTO`.
    NotInRam(Tier),
}

impl Shard {
    /// Whether this shard can lease: `Err` says why not (no RAM tier, or
    /// one clients cannot map).
    pub fn lease_support(&self) -> std::result::Result<(), String> {
        match &self.ram {
            None => Err("there is no RAM tier (--ram-gb 0)".into()),
            Some(ram) if !ram.borrow().arena().is_shared() => Err(
                "the RAM tier is not shared with clients (--ram-shared off, or auto where shared memory gets no huge pages: /sys/kernel/mm/transparent_hugepage/shmem_enabled is never; --ram-shared on shares it)"
                    .into(),
            ),
            Some(_) => Ok(()),
        }
    }

    /// Leases `key`'s block in the RAM tier, reading it there first when it
    /// is only in a lower tier (the reads and checks of a promoting GET) and
    /// that read would land it in RAM; a block that a read would not (promotion
    /// off, or a GPU tier above RAM) is answered `NotInRam` unread.
    ///
    /// # Errors
    /// As [`Shard::get`]: [`Error::NotFound`], [`Error::Corrupt`] (a miss),
    /// [`Error::Io`]; [`Error::LeasesOff`] when this shard cannot lease.
    pub async fn lease(&self, key: &StoredKey, hash: BlockHash) -> Result<LeaseOutcome> {
        self.lease_support().map_err(Error::LeasesOff)?;
        let ram = self.ram.as_ref().expect("checked above");
        // A block on its way into a memory tier: let it land first.
        if let Some(seen) = self.transits.id_of(&hash) {
            self.transits.ended.until(|| self.transits.id_of(&hash) != Some(seen)).await;
        }
        let leased = ram.borrow_mut().lease(key, &hash);
        if let Some(slot) = leased {
            bump(&self.counters.gets, 1);
            bump(&self.counters.hits, 1);
            bump(&self.ram_counters.hits, 1);
            self.count_owner(self.owner_of(key), |c| c.hits += 1);
            return Ok(LeaseOutcome::Leased(slot, Tier::Ram));
        }
        // A read lands a block in RAM only when it promotes, and into RAM
        // only without a GPU tier above it. Otherwise say where the block is
        // instead of reading it: the client's GET_INTO would read it again.
        if !self.cfg.promote || self.gpu.is_some() {
            if let Some(tier) = self.contains(&hash) {
                return Ok(LeaseOutcome::NotInRam(tier));
            }
        }
        let (body, tier) = self.get(key, hash, true).await?;
        // The promotion installs the block once its last chunk has passed.
        if let BlockBody::Chunks(mut chunks) = body {
            while let Some(chunk) = chunks.next().await {
                chunk?;
            }
        }
        let leased = ram.borrow_mut().lease(key, &hash);
        Ok(match leased {
            Some(slot) => LeaseOutcome::Leased(slot, tier),
            None => LeaseOutcome::NotInRam(tier),
        })
    }
}
