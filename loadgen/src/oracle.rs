//! A policy oracle: a pure, in-memory simulation of kvtier's placement
//! policy (docs/ARCHITECTURE.md, "Tiers") with the server's tier capacities in blocks. Fed the
//! same operations in the same order, it predicts every lookup's prefix
//! hits and the tier every GET is served from, so a replay can show that no
//! block stored and not yet evicted by the policy is ever missed.
//!
//! The model, per shard (the shard of a key is `xxh3_128(key) mod shards`,
//! as the server routes it), with tiers GPU → RAM → NVMe (GPU and RAM
//! optional; GPU and RAM never hold the same block):
//! - PUT: the block becomes the most recently used in the fastest memory
//!   tier (leaving RAM if it was there and the GPU takes it); a full tier
//!   moves its least recently used block down one tier (GPU → RAM; RAM →
//!   NVMe: write-through, it is already there; write-back, it is written
//!   there now). Write-through also puts it on NVMe. With no memory tier it
//!   goes to NVMe.
//! - GET: GPU hit → most recently used; RAM hit → moved up to the GPU when
//!   there is one and `promote` is on (it leaves RAM first, so the GPU's
//!   LRU block takes its place), else most recently used in RAM; NVMe hit →
//!   promoted into the fastest memory tier when `promote` is on; else a
//!   miss.
//! - lookup: leading keys held in any tier; nothing moves.
//!
//! Tenants (docs/OPERATIONS.md, "Tenants"): a replay run as a tenant
//! ([`PolicyOracle::for_tenant`]) hashes its keys as the server stores them
//! (`TENANT/KEY`, so they land on the shards the server puts them on) and
//! sees as much of each memory tier as the tenant's limit gives it on that
//! shard. That is exactly the server's policy when the tenant is alone in
//! the store, or when its reservation equals its limit (its share is then
//! its own: no other tenant can take from it, and it evicts only its own).
//!
//! The NVMe log is modelled as never full: the log's reclaim order (oldest
//! segment first, with second chance) is not a block LRU, so an oracle run
//! must fit the log (the replay reports NVMe evictions to show it did).

use std::collections::{BTreeMap, HashMap, HashSet};

use kvtier_engine::key::BlockHash;

/// Where the oracle says a block is served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The GPU tier.
    Gpu,
    /// The RAM tier.
    Ram,
    /// The NVMe log.
    Nvme,
}

impl Placement {
    /// `gpu`, `ram` or `nvme`, as `x-kvtier-tier` says.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Gpu => "gpu",
            Placement::Ram => "ram",
            Placement::Nvme => "nvme",
        }
    }
}

/// A key as the oracle keeps it: its block hash (the server's own).
type Key = BlockHash;

/// One shard's LRU of a memory tier: key → tick and tick → key.
#[derive(Default)]
struct Lru {
    tick_of: HashMap<Key, u64>,
    by_tick: BTreeMap<u64, Key>,
}

impl Lru {
    fn contains(&self, key: &Key) -> bool {
        self.tick_of.contains_key(key)
    }

    fn touch(&mut self, key: Key, tick: u64) {
        if let Some(old) = self.tick_of.insert(key, tick) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(tick, key);
    }

    fn pop_lru(&mut self) -> Option<Key> {
        let (_, key) = self.by_tick.pop_first()?;
        self.tick_of.remove(&key);
        Some(key)
    }

    fn len(&self) -> usize {
        self.tick_of.len()
    }

    fn remove(&mut self, key: &Key) -> bool {
        match self.tick_of.remove(key) {
            Some(tick) => {
                self.by_tick.remove(&tick);
                true
            }
            None => false,
        }
    }
}

/// The simulation.
pub struct PolicyOracle {
    shards: usize,
    /// RAM and GPU slots this run may use, by shard.
    ram_blocks: Vec<usize>,
    gpu_blocks: Vec<usize>,
    /// The tenant's scope of stored keys (empty: no tenants).
    scope: String,
    write_back: bool,
    promote: bool,
    gpu: Vec<Lru>,
    ram: Vec<Lru>,
    nvme: HashSet<Key>,
    tick: u64,
}

impl PolicyOracle {
    /// An empty store of `shards` shards with `ram_blocks_per_shard` RAM
    /// slots each, the given write policy and promotion setting.
    pub fn new(shards: usize, ram_blocks_per_shard: usize, write_back: bool, promote: bool) -> Self {
        PolicyOracle {
            shards: shards.max(1),
            ram_blocks: vec![ram_blocks_per_shard; shards.max(1)],
            gpu_blocks: vec![0; shards.max(1)],
            scope: String::new(),
            write_back,
            promote,
            gpu: (0..shards.max(1)).map(|_| Lru::default()).collect(),
            ram: (0..shards.max(1)).map(|_| Lru::default()).collect(),
            nvme: HashSet::new(),
            tick: 0,
        }
    }

    /// The same store with a GPU tier of `gpu_blocks_per_shard` slots per
    /// shard above RAM.
    pub fn with_gpu(mut self, gpu_blocks_per_shard: usize) -> Self {
        self.gpu_blocks = vec![gpu_blocks_per_shard; self.shards];
        self
    }

    /// The same store seen by tenant `scope`: keys hashed as the server
    /// stores them (`SCOPE/KEY`), and each shard's RAM and GPU cut to the
    /// tenant's limit there (`ram_limit_blocks`, `gpu_limit_blocks`: its
    /// whole-store limits in blocks, `None` for none; each shard holds an
    /// even share, [`kvtier_engine::tenant::share_blocks`]).
    pub fn for_tenant(mut self, scope: &str, ram_limit_blocks: Option<u64>, gpu_limit_blocks: Option<u64>) -> Self {
        use kvtier_engine::tenant::share_blocks;
        self.scope = scope.to_string();
        let shards = self.shards;
        let cut = |blocks: &mut Vec<usize>, limit: Option<u64>| {
            if let Some(l) = limit {
                for (s, b) in blocks.iter_mut().enumerate() {
                    *b = (*b).min(share_blocks(l, s, shards) as usize);
                }
            }
        };
        cut(&mut self.ram_blocks, ram_limit_blocks);
        cut(&mut self.gpu_blocks, gpu_limit_blocks);
        self
    }

    /// The block hash the server gives a client's `key`: xxh3-128 of its
    /// stored key, `NAME/KEY` for a tenant's key and the key itself without
    /// one (docs/ARCHITECTURE.md, "Tenants"). Written here from that rule,
    /// not taken from the server's scoping, so a bug there shows as a
    /// mismatch instead of being repeated.
    pub fn hash(&self, key: &str) -> BlockHash {
        let stored = if self.scope.is_empty() { key.to_string() } else { format!("{}/{key}", self.scope) };
        BlockHash::of(stored.as_bytes())
    }

    fn shard(&self, key: &Key) -> usize {
        key.shard(self.shards)
    }

    /// Makes `key` RAM's most recently used block on its shard, moving LRU
    /// blocks down to make room. False when there is no RAM tier.
    fn place_in_ram(&mut self, key: Key) -> bool {
        let s = self.shard(&key);
        if self.ram_blocks[s] == 0 {
            return false;
        }
        self.tick += 1;
        if !self.ram[s].contains(&key) {
            while self.ram[s].len() >= self.ram_blocks[s] {
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

    /// Makes `key` the GPU's most recently used block on its shard (taking
    /// it out of RAM), moving the GPU's LRU blocks down into RAM (or, with
    /// no RAM tier, to NVMe under write-back). False when there is no GPU
    /// tier.
    fn place_on_gpu(&mut self, key: Key) -> bool {
        let s = self.shard(&key);
        if self.gpu_blocks[s] == 0 {
            return false;
        }
        self.ram[s].remove(&key);
        if !self.gpu[s].contains(&key) {
            while self.gpu[s].len() >= self.gpu_blocks[s] {
                let victim = self.gpu[s].pop_lru().expect("a full tier has a block");
                if !self.place_in_ram(victim) && self.write_back {
                    self.nvme.insert(victim);
                }
            }
        }
        self.tick += 1;
        let tick = self.tick;
        self.gpu[s].touch(key, tick);
        true
    }

    /// Places `key` in the fastest memory tier; false when there is none.
    fn place(&mut self, key: Key) -> bool {
        self.place_on_gpu(key) || self.place_in_ram(key)
    }

    /// A PUT of `key`.
    pub fn put(&mut self, key: &str) {
        self.put_hash(self.hash(key))
    }

    /// A PUT of the key with this block hash (as a trace names it).
    pub fn put_hash(&mut self, key: Key) {
        let in_memory = self.place(key);
        if !self.write_back || !in_memory {
            self.nvme.insert(key);
        }
    }

    /// A GET of `key`: where it is served from, or `None` for a miss.
    pub fn get(&mut self, key: &str) -> Option<Placement> {
        self.get_hash(self.hash(key))
    }

    /// A prefetch of a stored key: promoted as a GET would promote it
    /// (the server's prefetch reads it through the waterfall); nothing
    /// for a key not stored.
    pub fn prefetch_hash(&mut self, key: Key) {
        self.get_hash(key);
    }

    /// A DELETE: the key leaves every tier.
    pub fn delete_hash(&mut self, key: Key) {
        let s = self.shard(&key);
        self.gpu[s].remove(&key);
        self.ram[s].remove(&key);
        self.nvme.remove(&key);
    }

    /// A GET of the key with this block hash.
    pub fn get_hash(&mut self, key: Key) -> Option<Placement> {
        let s = self.shard(&key);
        if self.gpu[s].contains(&key) {
            self.tick += 1;
            let tick = self.tick;
            self.gpu[s].touch(key, tick);
            return Some(Placement::Gpu);
        }
        if self.ram[s].contains(&key) {
            if self.promote && self.gpu_blocks[s] > 0 {
                self.place_on_gpu(key);
            } else {
                self.tick += 1;
                let tick = self.tick;
                self.ram[s].touch(key, tick);
            }
            return Some(Placement::Ram);
        }
        if !self.nvme.contains(&key) {
            return None;
        }
        if self.promote {
            self.place(key);
        }
        Some(Placement::Nvme)
    }

    /// A lookup: how many leading keys are held in any tier.
    pub fn lookup(&self, keys: &[String]) -> usize {
        keys.iter().take_while(|k| self.holds(self.hash(k))).count()
    }

    /// Whether any tier holds the key with this block hash.
    pub fn holds(&self, key: Key) -> bool {
        let s = self.shard(&key);
        self.gpu[s].contains(&key) || self.ram[s].contains(&key) || self.nvme.contains(&key)
    }

    /// Block hashes on the GPU on `shard`, most recently used first.
    pub fn gpu_keys(&self, shard: usize) -> Vec<BlockHash> {
        self.gpu[shard].by_tick.values().rev().copied().collect()
    }

    /// Block hashes in RAM on `shard`, most recently used first.
    pub fn ram_keys(&self, shard: usize) -> Vec<BlockHash> {
        self.ram[shard].by_tick.values().rev().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block hashes of `keys`, for comparing with the LRU lists.
    fn h<const N: usize>(keys: [&str; N]) -> Vec<BlockHash> {
        keys.iter().map(|k| BlockHash::of(k.as_bytes())).collect()
    }

    /// Keys that all live on shard 0 of 1.
    #[test]
    fn waterfall_lru_with_promotion() {
        let mut o = PolicyOracle::new(1, 2, false, true);
        o.put("a");
        o.put("b");
        assert_eq!(o.get("a"), Some(Placement::Ram));
        o.put("c"); // b is LRU: down to NVMe (already there: write-through)
        assert_eq!(o.ram_keys(0), h(["c", "a"]));
        assert_eq!(o.get("b"), Some(Placement::Nvme)); // promoted, a moves down
        assert_eq!(o.ram_keys(0), h(["b", "c"]));
        assert_eq!(o.get("b"), Some(Placement::Ram));
        assert_eq!(o.get("zz"), None);
        assert_eq!(o.lookup(&["a".into(), "b".into(), "zz".into(), "c".into()]), 2);
    }

    #[test]
    fn write_back_reaches_nvme_only_when_demoted() {
        let mut o = PolicyOracle::new(1, 1, true, false);
        o.put("a");
        assert!(!o.nvme.contains(&BlockHash::of(b"a")));
        o.put("b");
        assert!(o.nvme.contains(&BlockHash::of(b"a")) && !o.nvme.contains(&BlockHash::of(b"b")));
        assert_eq!(o.get("a"), Some(Placement::Nvme));
        assert_eq!(o.get("a"), Some(Placement::Nvme), "no promotion");
        let mut none = PolicyOracle::new(1, 0, true, true);
        none.put("x");
        assert_eq!(none.get("x"), Some(Placement::Nvme), "no RAM tier: straight to NVMe");
    }

    #[test]
    fn a_tenant_hashes_scoped_keys_and_sees_its_limit() {
        let o = PolicyOracle::new(2, 4, false, true).for_tenant("acme", Some(3), None);
        assert_eq!(o.hash("k"), BlockHash::of(b"acme/k"));
        assert_eq!(o.ram_blocks, [2, 1], "3 blocks over 2 shards");
        let mut o = PolicyOracle::new(1, 4, false, true).for_tenant("acme", Some(2), None);
        for k in ["a", "b", "c"] {
            o.put(k);
        }
        assert_eq!(o.ram_keys(0), h(["acme/c", "acme/b"]), "its limit, not the tier's size");
        assert_eq!(o.get("a"), Some(Placement::Nvme));
    }

    /// The same sequence as server/tests/gpu.rs's three-tier test.
    #[test]
    fn three_tiers_demote_one_tier_down_and_promote_to_the_top() {
        let mut o = PolicyOracle::new(1, 4, false, true).with_gpu(4);
        for i in 0..10 {
            o.put(&format!("k{i}"));
        }
        assert_eq!(o.gpu_keys(0), h(["k9", "k8", "k7", "k6"]));
        assert_eq!(o.ram_keys(0), h(["k5", "k4", "k3", "k2"]));
        assert_eq!(o.get("k9"), Some(Placement::Gpu));
        assert_eq!(o.get("k0"), Some(Placement::Nvme));
        assert_eq!(o.gpu_keys(0), h(["k0", "k9", "k8", "k7"]));
        assert_eq!(o.ram_keys(0), h(["k6", "k5", "k4", "k3"]), "k6 came down; k2 left RAM");
        assert_eq!(o.get("k3"), Some(Placement::Ram));
        assert_eq!(o.gpu_keys(0), h(["k3", "k0", "k9", "k8"]));
        assert_eq!(o.ram_keys(0), h(["k7", "k6", "k5", "k4"]), "k3 left RAM, k7 took its place");
        assert_eq!(o.get("k3"), Some(Placement::Gpu));
        assert_eq!(o.lookup(&["k2".into(), "k7".into(), "k3".into(), "zz".into()]), 3);
    }

    #[test]
    fn three_tiers_write_back_reaches_nvme_from_ram_only() {
        let mut o = PolicyOracle::new(1, 1, true, false).with_gpu(1);
        o.put("a");
        o.put("b"); // a: GPU -> RAM
        assert!(o.nvme.is_empty());
        o.put("c"); // b: GPU -> RAM, a: RAM -> NVMe
        assert_eq!((o.gpu_keys(0), o.ram_keys(0)), (h(["c"]), h(["b"])));
        assert!(o.nvme.contains(&BlockHash::of(b"a")) && o.nvme.len() == 1);
        assert_eq!(o.get("b"), Some(Placement::Ram), "no promotion: stays in RAM");
        assert_eq!(o.ram_keys(0), h(["b"]));
        let mut no_ram = PolicyOracle::new(1, 0, true, true).with_gpu(1);
        no_ram.put("x");
        no_ram.put("y");
        assert!(no_ram.nvme.contains(&BlockHash::of(b"x")), "GPU -> NVMe when there is no RAM tier");
        assert_eq!(no_ram.get("x"), Some(Placement::Nvme));
        assert_eq!(no_ram.gpu_keys(0), h(["x"]));
    }
}
