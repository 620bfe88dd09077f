//! The PUT budget: block bytes a shard holds for PUTs being received, one
//! budget per shard shared by both front doors (`--put-inflight-mib`).
//! A PUT is admitted or refused before any of its bytes are read, so an
//! overloaded shard holds no more PUT bodies than its limit; one PUT always
//! gets in, whatever its size.

use std::cell::Cell;

/// One shard's PUT budget.
pub struct PutBudget {
    max_bytes: u64,
    held_bytes: Cell<u64>,
}

/// Why a PUT was refused: what the shard held and its limit, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutRefused {
    /// PUT bytes admitted and not yet done on the shard.
    pub held_bytes: u64,
    /// The shard's budget (`--put-inflight-mib`).
    pub max_bytes: u64,
}

/// An admitted PUT's share of the budget, given back when dropped, however
/// the PUT ends (a reset stream drops it mid-body).
pub struct PutAdmission<'a> {
    budget: &'a PutBudget,
    bytes: u64,
}

impl Drop for PutAdmission<'_> {
    fn drop(&mut self) {
        let held = &self.budget.held_bytes;
        held.set(held.get() - self.bytes);
    }
}

impl PutBudget {
    /// A budget of `max_bytes`.
    pub fn new(max_bytes: u64) -> Self {
        PutBudget { max_bytes, held_bytes: Cell::new(0) }
    }

    /// The budget, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Admits a PUT of `bytes` unless the shard already holds PUTs and this
    /// one would take it past its budget.
    ///
    /// # Errors
    /// [`PutRefused`] with what was held (the caller answers 503 /
    /// `OVERLOADED` and counts it in its own series).
    pub fn admit(&self, bytes: u64) -> Result<PutAdmission<'_>, PutRefused> {
        let held = self.held_bytes.get();
        if held > 0 && held + bytes > self.max_bytes {
            return Err(PutRefused { held_bytes: held, max_bytes: self.max_bytes });
        }
        self.held_bytes.set(held + bytes);
        Ok(PutAdmission { budget: self, bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_put_always_gets_in_and_the_budget_comes_back() {
        let b = PutBudget::new(100);
        let big = b.admit(500).expect("the first PUT gets in whatever its size");
        assert_eq!(b.admit(1).err(), Some(PutRefused { held_bytes: 500, max_bytes: 100 }));
        drop(big);
        let (x, y) = (b.admit(60).unwrap(), b.admit(40).unwrap());
        assert!(b.admit(1).is_err());
        drop((x, y));
        assert!(b.admit(100).is_ok());
    }
}
