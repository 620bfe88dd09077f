//! Miss-ratio curves: the hit ratio of an LRU cache at every size from one
//! pass over a reference stream.
//!
//! - **Exact** ([`LruStack`]): Mattson's stack distances (Mattson et al.,
//!   "Evaluation techniques for storage hierarchies", IBM Systems Journal
//!   1970): a reference hits an LRU cache of `c` blocks iff fewer than `c`
//!   other blocks were referenced since its previous reference. The
//!   distance is counted in O(log N) with a Fenwick tree over reference
//!   times holding a 1 at each block's latest reference (Bennett & Kruskal
//!   1975; Almási et al. 2002), so a trace of N references costs
//!   O(N log N) and one hash-map entry per distinct block.
//! - **SHARDS** ([`Shards`]): spatial sampling by block hash (Waldspurger
//!   et al., "Efficient MRC Construction with SHARDS", FAST 2015): only
//!   blocks whose hash falls under a threshold `T` of modulus `P = 2^24`
//!   are tracked, at rate `R = T / P`; their distances are scaled by `1/R`.
//!   The fixed-size variant lowers `T` whenever more than `s_max` blocks
//!   are tracked (evicting the block of largest hash value), bounding
//!   memory; SHARDS_adj's correction puts the difference between the
//!   expected and the sampled reference count in the first bucket.
//!
//! Distances here are 1-based: 1 is the most recently used block, a hit in
//! a cache of one block. `None` is a block never referenced (or deleted
//! since): a miss at every size.

use rustc_hash::FxHashMap;

/// A Fenwick (binary indexed) tree of counts over positions `0..len`,
/// grown on demand. Nodes are `i32`: a node sums at most `len` counts of 0
/// or 1 (4 bytes a reference; half the memory traffic of `i64`).
#[derive(Debug, Clone, Default)]
pub struct Fenwick {
    /// 1-based: `tree[i]` sums the counts of positions `(i - lowbit(i), i]`
    /// (1-based), a range that does not depend on the length.
    tree: Vec<i32>,
}

impl Fenwick {
    /// A tree of `len` zero counts.
    pub fn with_len(len: usize) -> Self {
        Fenwick { tree: vec![0; len + 1] }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.tree.len().saturating_sub(1)
    }

    /// Whether it holds no position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Doubles the length until `pos` fits: each new node sums the part
    /// of its range that lies in the old positions.
    fn grow_to(&mut self, pos: usize) {
        let old = self.len();
        if pos < old {
            return;
        }
        let mut new = old.max(1024);
        while pos >= new {
            new *= 2;
        }
        if self.tree.is_empty() {
            self.tree.push(0);
        }
        let total = self.prefix(old);
        let mut extra = Vec::with_capacity(new - old);
        for j in old + 1..=new {
            let lo = j - (j & j.wrapping_neg());
            extra.push(if lo < old { (total - self.prefix(lo)) as i32 } else { 0 });
        }
        self.tree.extend(extra);
    }

    /// Adds `delta` at `pos` (0-based), growing the tree if needed.
    pub fn add(&mut self, pos: usize, delta: i32) {
        self.grow_to(pos);
        let mut i = pos + 1;
        while i < self.tree.len() {
            self.tree[i] += delta;
            i += i & i.wrapping_neg();
        }
    }

    /// Sum of the counts at positions `0..pos`.
    pub fn prefix(&self, pos: usize) -> i64 {
        let mut i = pos.min(self.len());
        let mut sum = 0i64;
        while i > 0 {
            sum += i64::from(self.tree[i]);
            i &= i - 1;
        }
        sum
    }
}

/// One LRU stack: stack distances of references in O(log N) each.
#[derive(Debug, Clone, Default)]
pub struct LruStack {
    /// Block → the time of its latest reference.
    last: FxHashMap<u128, u32>,
    /// A 1 at the latest reference time of every block in the stack.
    marks: Fenwick,
    /// The next reference's time.
    now: u32,
}

impl LruStack {
    /// An empty stack with room for `references` references before its
    /// tree grows.
    pub fn with_capacity(references: usize) -> Self {
        LruStack { last: FxHashMap::default(), marks: Fenwick::with_len(references.max(1)), now: 0 }
    }

    /// Blocks in the stack.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// Whether the stack is empty.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }

    /// The stack distance of `block` now (1: most recently used), without
    /// moving it: a probe (a lookup, a HEAD). `None`: not in the stack.
    pub fn distance(&self, block: u128) -> Option<u64> {
        let at = *self.last.get(&block)? as usize;
        Some((self.last.len() as i64 - self.marks.prefix(at)) as u64)
    }

    /// A reference: returns the distance before it (as
    /// [`LruStack::distance`]) and moves `block` to the top.
    pub fn reference(&mut self, block: u128) -> Option<u64> {
        let live = self.last.len() as i64;
        let now = self.now;
        self.now = self.now.checked_add(1).expect("fewer than 2^32 references per stack");
        let distance = match self.last.insert(block, now) {
            Some(at) => {
                let d = (live - self.marks.prefix(at as usize)) as u64;
                self.marks.add(at as usize, -1);
                Some(d)
            }
            None => None,
        };
        self.marks.add(now as usize, 1);
        distance
    }

    /// Takes `block` out of the stack (a DELETE, or SHARDS dropping it);
    /// false when it was not in.
    pub fn remove(&mut self, block: u128) -> bool {
        match self.last.remove(&block) {
            Some(at) => {
                self.marks.add(at as usize, -1);
                true
            }
            None => false,
        }
    }
}

/// Counts of references by stack distance, weighted (SHARDS weighs each
/// sampled reference by `1/R`).
#[derive(Debug, Clone, Default)]
pub struct DistanceHistogram {
    /// `counts[d]`: weight of references at distance `d` (index 0 unused
    /// except for SHARDS_adj's correction, which counts as a hit at every
    /// size).
    counts: Vec<f64>,
    /// Weight of references that miss at every size.
    cold: f64,
}

impl DistanceHistogram {
    /// Adds a reference of weight `w` at `distance` (`None`: cold).
    pub fn add(&mut self, distance: Option<u64>, w: f64) {
        match distance {
            None => self.cold += w,
            Some(d) => {
                let d = d as usize;
                if self.counts.len() <= d {
                    self.counts.resize(d + 1, 0.0);
                }
                self.counts[d] += w;
            }
        }
    }

    /// Adds `w` at distance 0: a hit at every size (SHARDS_adj).
    pub fn adjust_first_bucket(&mut self, w: f64) {
        if self.counts.is_empty() {
            self.counts.push(0.0);
        }
        self.counts[0] += w;
    }

    /// Total weight.
    pub fn total(&self) -> f64 {
        self.cold + self.counts.iter().sum::<f64>()
    }

    /// The hit-ratio curve, `total` references in all (the histogram's
    /// own total when `None`).
    pub fn curve(&self, total: Option<f64>) -> Curve {
        let total = total.unwrap_or_else(|| self.total());
        let mut hits = Vec::with_capacity(self.counts.len());
        let mut sum = 0.0;
        for c in &self.counts {
            sum += c;
            hits.push(if total > 0.0 { (sum / total).clamp(0.0, 1.0) } else { 0.0 });
        }
        Curve { hits }
    }
}

/// A hit-ratio curve: the hit ratio of an LRU cache of `c` blocks (per
/// shard), for every `c`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Curve {
    /// `hits[c]`: hit ratio at `c` blocks; constant past the end.
    hits: Vec<f64>,
}

impl Curve {
    /// Hit ratio (0–1) of a cache of `blocks` blocks.
    pub fn at(&self, blocks: u64) -> f64 {
        match self.hits.len() {
            0 => 0.0,
            n => self.hits[(blocks as usize).min(n - 1)],
        }
    }

    /// Hit ratio of a cache that never evicts.
    pub fn unbounded(&self) -> f64 {
        self.hits.last().copied().unwrap_or(0.0)
    }

    /// The smallest size past which the curve no longer rises (the
    /// largest stack distance seen).
    pub fn saturation(&self) -> u64 {
        let top = self.unbounded();
        self.hits.iter().position(|h| *h >= top).unwrap_or(0) as u64
    }

    /// The smallest size whose hit ratio reaches `fraction` of the
    /// unbounded one (0 when the unbounded one is 0).
    pub fn reaching(&self, fraction: f64) -> u64 {
        let goal = fraction * self.unbounded();
        if goal <= 0.0 {
            return 0;
        }
        self.hits.iter().position(|h| *h >= goal - 1e-12).unwrap_or(self.hits.len()) as u64
    }

    /// The knee by Kneedle (Satopää et al., ICDCS-W 2011): on the curve
    /// scaled to [0, 1] in size (to [`Curve::saturation`]) and hit ratio,
    /// the size farthest above the diagonal: past it each block buys less
    /// than the average block did. `None` for a flat curve.
    pub fn knee(&self) -> Option<u64> {
        let (x_max, y_max) = (self.saturation() as f64, self.unbounded());
        if x_max < 2.0 || y_max <= 0.0 {
            return None;
        }
        (1..=self.saturation()).map(|c| (c, self.at(c) / y_max - c as f64 / x_max)).max_by(|a, b| a.1.total_cmp(&b.1)).map(|(c, _)| c)
    }

    /// Up to `n` sizes from 0 to `max_blocks`, evenly spaced, with every
    /// size given in `also`, in order.
    pub fn grid(max_blocks: u64, n: usize, also: &[u64]) -> Vec<u64> {
        let n = n.max(2) as u64;
        let mut sizes: Vec<u64> = (0..=n).map(|i| max_blocks * i / n).chain(also.iter().copied()).collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }
}

/// SHARDS sampling modulus `P`: 2^24, as in the paper.
pub const SHARDS_MODULUS: u64 = 1 << 24;

/// Per-shard LRU stacks over a spatially sampled reference stream.
#[derive(Debug, Clone)]
pub struct Shards {
    /// Sample a block when `value(hash) < threshold`.
    threshold: u64,
    /// Fixed-size SHARDS: at most this many blocks tracked.
    max_blocks: Option<usize>,
    stacks: Vec<LruStack>,
    /// (hash value, block) of tracked blocks, largest value on top
    /// (fixed-size only); entries of deleted blocks are skipped.
    heap: std::collections::BinaryHeap<(u64, u128)>,
}

/// A block's SHARDS hash value: its block hash's high 64 bits mod `P`
/// (the low bits choose its shard; the high bits are independent).
pub fn shards_value(block: u128) -> u64 {
    ((block >> 64) as u64) % SHARDS_MODULUS
}

impl Shards {
    /// Fixed-rate SHARDS at `rate` (0 < rate ≤ 1) over `shards` stacks.
    pub fn fixed_rate(rate: f64, shards: usize) -> Self {
        let threshold = ((rate.clamp(0.0, 1.0) * SHARDS_MODULUS as f64).round() as u64).max(1);
        Shards { threshold, max_blocks: None, stacks: vec![LruStack::default(); shards.max(1)], heap: Default::default() }
    }

    /// Fixed-size SHARDS: starts at rate 1 and lowers the rate to keep at
    /// most `max_blocks` blocks tracked.
    pub fn fixed_size(max_blocks: usize, shards: usize) -> Self {
        Shards { max_blocks: Some(max_blocks.max(1)), ..Shards::fixed_rate(1.0, shards) }
    }

    /// The sampling rate now.
    pub fn rate(&self) -> f64 {
        self.threshold as f64 / SHARDS_MODULUS as f64
    }

    /// Whether references to `block` are sampled now: the cheap test a
    /// pass makes before anything else.
    pub fn samples(&self, block: u128) -> bool {
        shards_value(block) < self.threshold
    }

    /// Blocks tracked now.
    pub fn tracked(&self) -> usize {
        self.stacks.iter().map(LruStack::len).sum()
    }

    /// A reference to `block` on `shard`: `None` when not sampled, else
    /// its distance scaled by `1/R` (`None` inside: cold) and its weight
    /// `1/R`.
    pub fn reference(&mut self, shard: usize, block: u128) -> Option<(Option<f64>, f64)> {
        let value = shards_value(block);
        if value >= self.threshold {
            return None;
        }
        let rate = self.rate();
        let d = self.stacks[shard].reference(block);
        if d.is_none() {
            if let Some(max) = self.max_blocks {
                self.heap.push((value, block));
                self.shrink(max);
            }
        }
        Some((d.map(|d| d as f64 / rate), 1.0 / rate))
    }

    /// A DELETE of `block` on `shard`.
    pub fn remove(&mut self, shard: usize, block: u128) {
        if shards_value(block) < self.threshold {
            self.stacks[shard].remove(block);
        }
    }

    /// Lowers the threshold to the largest tracked value until at most
    /// `max` blocks are tracked, dropping the blocks at or above it.
    fn shrink(&mut self, max: usize) {
        while self.tracked() > max {
            let Some((value, _)) = self.heap.peek().copied() else { return };
            while let Some(&(v, b)) = self.heap.peek() {
                if v < value {
                    break;
                }
                self.heap.pop();
                let shard_count = self.stacks.len();
                for s in 0..shard_count {
                    if self.stacks[s].remove(b) {
                        break;
                    }
                }
            }
            self.threshold = value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A direct LRU of `capacity` blocks: hits over a stream.
    fn direct_lru_hits(stream: &[u128], capacity: usize) -> usize {
        let mut order: Vec<u128> = Vec::new(); // most recent last
        let mut hits = 0;
        for &b in stream {
            if let Some(i) = order.iter().position(|x| *x == b) {
                hits += 1;
                order.remove(i);
            } else if order.len() == capacity {
                if capacity == 0 {
                    continue;
                }
                order.remove(0);
            }
            order.push(b);
        }
        hits
    }

    #[test]
    fn fenwick_grows_and_keeps_its_sums() {
        let mut f = Fenwick::with_len(3);
        let mut plain = vec![0i32; 5000];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..20_000 {
            let p = rng.gen_range(0..5000);
            let d = rng.gen_range(-3..4);
            f.add(p, d);
            plain[p] += d;
            let q = rng.gen_range(0..=5000);
            assert_eq!(f.prefix(q), plain[..q].iter().map(|v| i64::from(*v)).sum::<i64>());
        }
    }

    #[test]
    fn exact_curve_equals_a_direct_lru_at_every_size() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..40 {
            let blocks = rng.gen_range(1..60u128);
            // Zipf-ish skew: squares favour small ids.
            let stream: Vec<u128> = (0..rng.gen_range(1..400)).map(|_| (rng.gen_range(0..blocks * blocks) as f64).sqrt() as u128).collect();
            let mut stack = LruStack::with_capacity(4);
            let mut h = DistanceHistogram::default();
            for &b in &stream {
                h.add(stack.reference(b), 1.0);
            }
            let curve = h.curve(None);
            for c in 0..=blocks as usize + 1 {
                let want = direct_lru_hits(&stream, c) as f64 / stream.len() as f64;
                assert!((curve.at(c as u64) - want).abs() < 1e-12, "round {round}, size {c}: {} vs {want}", curve.at(c as u64));
            }
        }
    }

    #[test]
    fn probes_and_removals() {
        let mut s = LruStack::default();
        for b in [1, 2, 3] {
            s.reference(b);
        }
        assert_eq!((s.distance(3), s.distance(2), s.distance(1), s.distance(9)), (Some(1), Some(2), Some(3), None));
        assert_eq!(s.distance(1), Some(3), "a probe moves nothing");
        assert!(s.remove(2) && !s.remove(2));
        assert_eq!((s.distance(1), s.len()), (Some(2), 2));
        assert_eq!(s.reference(2), None, "a deleted block comes back cold");
    }

    #[test]
    fn knee_and_reach() {
        // 10 sizes: the hit ratio climbs fast to 0.8 at 2 blocks, then slowly.
        let c = Curve { hits: vec![0.0, 0.5, 0.8, 0.82, 0.84, 0.86, 0.88, 0.9, 0.92, 0.94, 0.96] };
        assert_eq!(c.knee(), Some(2));
        assert_eq!((c.reaching(0.5), c.reaching(0.9), c.reaching(1.0)), (1, 6, 10), "0.9 × 0.96 = 0.864: first reached at 0.88");
        assert_eq!(c.at(1000), 0.96);
        assert_eq!(Curve::grid(10, 5, &[3]), [0, 2, 3, 4, 6, 8, 10]);
    }

    #[test]
    fn fixed_size_shards_bounds_what_it_tracks() {
        let mut s = Shards::fixed_size(100, 2);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..50_000 {
            let b: u128 = rng.gen();
            s.reference((b % 2) as usize, b);
            assert!(s.tracked() <= 100);
        }
        assert!(s.rate() < 0.01, "rate {}", s.rate());
    }
}
