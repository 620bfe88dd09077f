//! A policy oracle: a pure, in-memory simulation of kvtier's placement
//! policy (DESIGN §4) with the server's tier capacities in blocks. Fed the
//! same operations in the same order, it predicts every lookup's prefix
//! hits and the tier every GET is served from, so a replay can show that no
//! block stored and not yet evicted by the policy is ever missed.
//!
//! The model, per shard (the shard of a key is `xxh3_128(key) mod shards`,
//! as the server routes it):
//! - PUT: the block becomes the most recently used in RAM; a full RAM moves
//!   its least recently used block down (write-through: it is already on
//!   NVMe; write-back: it is written there now). Write-through also puts it
//!   on NVMe. With no RAM tier it goes to NVMe.
//! - GET: RAM hit → most recently used; else NVMe hit → promoted into RAM
//!   when `promote` is on (moving RAM's LRU block down); else a miss.
//! - lookup: leading keys held in any tier; nothing moves.
//!
//! The NVMe log is modelled as never full: the log's reclaim order (oldest
//! segment first, with second chance) is not a block LRU, so an oracle run
//! must fit the log (the replay reports NVMe evictions to show it did).

use std::collections::{BTreeMap, HashMap, HashSet};

use kvtier_engine::key::BlockHash;

/// Where the oracle says a block is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The RAM tier.
    Ram,
    /// The NVMe log.
    Nvme,
}

impl Placement {
    /// `ram` or `nvme`, as `x-kvtier-tier` says.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Ram => "ram",
            Placement::Nvme => "nvme",
        }
    }
}

/// One shard's RAM LRU: key → tick and tick → key.
#[derive(Default)]
struct Lru {
    tick_of: HashMap<String, u64>,
    by_tick: BTreeMap<u64, String>,
}

impl Lru {
    fn contains(&self, key: &str) -> bool {
        self.tick_of.contains_key(key)
    }

    fn touch(&mut self, key: &str, tick: u64) {
        if let Some(old) = self.tick_of.insert(key.to_string(), tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(tick, key.to_string());
    }

    fn pop_lru(&mut self) -> Option<String> {
        let (_, key) = self.by_tick.pop_first()?;
        self.tick_of.remove(&key);
        Some(key)
    }

    fn len(&self) -> usize {
        self.tick_of.len()
    }
}

/// The simulation.
pub struct PolicyOracle {
    shards: usize,
    ram_blocks_per_shard: usize,
    write_back: bool,
    promote: bool,
    ram: Vec<Lru>,
    nvme: HashSet<String>,
    tick: u64,
}

impl PolicyOracle {
    /// An empty store of `shards` shards with `ram_blocks_per_shard` RAM
    /// slots each, the given write policy and promotion setting.
    pub fn new(shards: usize, ram_blocks_per_shard: usize, write_back: bool, promote: bool) -> Self {
        PolicyOracle {
            shards: shards.max(1),
            ram_blocks_per_shard,
            write_back,
            promote,
            ram: (0..shards.max(1)).map(|_| Lru::default()).collect(),
            nvme: HashSet::new(),
            tick: 0,
        }
    }

    fn shard(&self, key: &str) -> usize {
        BlockHash::of(key.as_bytes()).shard(self.shards)
    }

    /// Makes `key` RAM's most recently used block on its shard, moving LRU
    /// blocks down to make room. False when there is no RAM tier.
    fn place_in_ram(&mut self, key: &str) -> bool {
        if self.ram_blocks_per_shard == 0 {
            return false;
        }
        self.tick += 1;
        let s = self.shard(key);
        if !self.ram[s].contains(key) {
            while self.ram[s].len() >= self.ram_blocks_per_shard {
                let victim = self.ram[s].pop_lru().expect("a full tier has a block");
                if self.write_back {
                    self.nvme.insert(victim);
                }
            }
        }
        let tick = self.tick;
        self.ram[s].touch(key, tick);
        true
    }

    /// A PUT of `key`.
    pub fn put(&mut self, key: &str) {
        let in_ram = self.place_in_ram(key);
        if !self.write_back || !in_ram {
            self.nvme.insert(key.to_string());
        }
    }

    /// A GET of `key`: where it is served from, or `None` for a miss.
    pub fn get(&mut self, key: &str) -> Option<Placement> {
        let s = self.shard(key);
        if self.ram[s].contains(key) {
            self.tick += 1;
            let tick = self.tick;
            self.ram[s].touch(key, tick);
            return Some(Placement::Ram);
        }
        if !self.nvme.contains(key) {
            return None;
        }
        if self.promote {
            self.place_in_ram(key);
        }
        Some(Placement::Nvme)
    }

    /// A lookup: how many leading keys are held in any tier.
    pub fn lookup(&self, keys: &[String]) -> usize {
        keys.iter().take_while(|k| self.ram[self.shard(k)].contains(k) || self.nvme.contains(*k)).count()
    }

    /// Keys in RAM on `shard`, most recently used first.
    pub fn ram_keys(&self, shard: usize) -> Vec<String> {
        self.ram[shard].by_tick.values().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that all live on shard 0 of 1.
    #[test]
    fn waterfall_lru_with_promotion() {
        let mut o = PolicyOracle::new(1, 2, false, true);
        o.put("a");
        o.put("b");
        assert_eq!(o.get("a"), Some(Placement::Ram));
        o.put("c"); // b is LRU: down to NVMe (already there: write-through)
        assert_eq!(o.ram_keys(0), ["c", "a"]);
        assert_eq!(o.get("b"), Some(Placement::Nvme)); // promoted, a moves down
        assert_eq!(o.ram_keys(0), ["b", "c"]);
        assert_eq!(o.get("b"), Some(Placement::Ram));
        assert_eq!(o.get("zz"), None);
        assert_eq!(o.lookup(&["a".into(), "b".into(), "zz".into(), "c".into()]), 2);
    }

    #[test]
    fn write_back_reaches_nvme_only_when_demoted() {
        let mut o = PolicyOracle::new(1, 1, true, false);
        o.put("a");
        assert!(!o.nvme.contains("a"));
        o.put("b");
        assert!(o.nvme.contains("a") && !o.nvme.contains("b"));
        assert_eq!(o.get("a"), Some(Placement::Nvme));
        assert_eq!(o.get("a"), Some(Placement::Nvme), "no promotion");
        let mut none = PolicyOracle::new(1, 0, true, true);
        none.put("x");
        assert_eq!(none.get("x"), Some(Placement::Nvme), "no RAM tier: straight to NVMe");
    }
}
