//! Which node a turn goes to.
//!
//! A KV-aware router weighs, for each node, the prefill a turn would need
//! there against the load already on it, as NVIDIA Dynamo's KV router does
//! (its cost: `overlap_score_weight × prefill blocks + active blocks`):
//!
//! `cost(node) = overlap_weight × (prompt blocks − local prefix) + active blocks`
//!
//! where the active blocks are the prompt blocks of the turns the node is
//! serving now (prefill and decode), and the local prefix is one of
//! ([`RouteScore`]):
//!
//! - `prefix`: the longest prefix of the turn's engine block hashes the
//!   node holds in a local tier (GPU, RAM or NVMe; its index,
//!   [`NodeIndex::local_prefix`]), as a router over engines that share
//!   nothing scores;
//! - `fleet`: of the longest prefix the fleet holds anywhere (some node's
//!   local tier, or the bucket they share, `EXTERNAL`), the blocks this
//!   node holds locally. With a shared tier a node lacking a prefix's first
//!   blocks still serves the rest from its own tiers (kvtier's lookup
//!   counts through blocks in S3, and the GET of each reads it there), so
//!   a node that lost a conversation's oldest blocks is still the place
//!   for it; `prefix` would score it 0 and send the turn where every block
//!   comes from S3. A block only the bucket holds counts for no node.
//!
//! The turn goes to the cheapest node; among equals, the next in
//! round-robin order. A large weight makes it "most local blocks, then the
//! less loaded". Round robin ignores the indexes and the load.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::index::NodeIndex;

/// How the router picks a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RouteMode {
    /// Longest local prefix from every event: stores, removals, clears.
    Events,
    /// Longest local prefix from `BlockStored` events only, as a router fed
    /// by a tier that publishes stores and never removals.
    StoreOnly,
    /// Turn after turn to the next node, whatever it holds.
    RoundRobin,
}

impl RouteMode {
    /// Every mode, in the order the benchmark runs them.
    pub const ALL: [RouteMode; 3] = [RouteMode::Events, RouteMode::StoreOnly, RouteMode::RoundRobin];

    /// `events`, `store-only` or `round-robin`.
    pub fn name(self) -> &'static str {
        match self {
            RouteMode::Events => "events",
            RouteMode::StoreOnly => "store-only",
            RouteMode::RoundRobin => "round-robin",
        }
    }

    /// Whether the mode's indexes apply `BlockRemoved` and
    /// `AllBlocksCleared`.
    pub fn follows_removals(self) -> bool {
        matches!(self, RouteMode::Events)
    }
}

/// What a router counts as a node's local prefix (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RouteScore {
    /// The node's blocks within the prefix the fleet holds anywhere.
    Fleet,
    /// The longest prefix the node holds locally.
    Prefix,
}

/// One routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The node.
    pub node: usize,
    /// The local blocks the router believed that node holds, as its score
    /// counts them (0 in round robin).
    pub predicted_blocks: usize,
}

/// The router: a mode, the weight of a block of prefill against a block
/// of load, and the round-robin position it shares across users.
pub struct Router {
    mode: RouteMode,
    score: RouteScore,
    overlap_weight: f64,
    next: AtomicUsize,
}

impl Router {
    /// A router in `mode` scoring nodes by `score`, weighing a prefill
    /// block `overlap_weight` times an active block (Dynamo's default: 1).
    pub fn new(mode: RouteMode, score: RouteScore, overlap_weight: f64) -> Router {
        assert!(overlap_weight.is_finite() && overlap_weight >= 0.0, "a weight of 0 or more");
        Router { mode, score, overlap_weight, next: AtomicUsize::new(0) }
    }

    /// Each node's local blocks for `chain`, as [`RouteScore`] counts them.
    fn scores(&self, chain: &[u64], indexes: &[&Mutex<NodeIndex>]) -> Vec<usize> {
        // Locked in node order, one at a time by the subscribers: no cycle.
        let held: Vec<_> = indexes.iter().map(|i| i.lock().expect("index lock")).collect();
        match self.score {
            RouteScore::Prefix => held.iter().map(|i| i.local_prefix(chain)).collect(),
            RouteScore::Fleet => {
                let fleet = chain.iter().take_while(|&&h| held.iter().any(|i| i.holds(h))).count();
                held.iter().map(|i| chain[..fleet].iter().filter(|&&h| i.is_local(h)).count()).collect()
            }
        }
    }

    /// Its mode.
    pub fn mode(&self) -> RouteMode {
        self.mode
    }

    /// The node for a turn whose prompt's engine block hashes are `chain`,
    /// given each node's index and active blocks (one entry per node).
    pub fn choose(&self, chain: &[u64], indexes: &[&Mutex<NodeIndex>], active_blocks: &[usize]) -> Choice {
        let nodes = indexes.len();
        assert!(nodes > 0 && nodes == active_blocks.len(), "one index and one load per node");
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        if self.mode == RouteMode::RoundRobin {
            return Choice { node: turn % nodes, predicted_blocks: 0 };
        }
        let scores = self.scores(chain, indexes);
        let cost = |n: usize| self.overlap_weight * (chain.len() - scores[n]) as f64 + active_blocks[n] as f64;
        // The cheapest, the first found from the round-robin position.
        let node = (0..nodes)
            .map(|k| (turn + k) % nodes)
            .fold(None, |best: Option<usize>, n| match best {
                Some(b) if cost(b) <= cost(n) => Some(b),
                _ => Some(n),
            })
            .expect("at least one node");
        debug_assert!(scores[node] <= chain.len());
        Choice { node, predicted_blocks: scores[node] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::wire::{KvEvent, Medium};

    fn index(follows_removals: bool, events: &[KvEvent]) -> Mutex<NodeIndex> {
        let mut i = NodeIndex::new(follows_removals);
        for e in events {
            i.apply(e);
        }
        Mutex::new(i)
    }

    #[test]
    fn prefill_saved_against_load_then_round_robin() {
        let a = index(true, &[KvEvent::Stored { hashes: vec![1, 2], medium: Medium::Cpu }]);
        let b = index(true, &[KvEvent::Stored { hashes: vec![1, 2, 3], medium: Medium::External }]);
        let r = Router::new(RouteMode::Events, RouteScore::Prefix, 1.0);
        assert_eq!(r.choose(&[1, 2, 3], &[&a, &b], &[1, 0]), Choice { node: 0, predicted_blocks: 2 }, "S3 counts for neither");
        assert_eq!(r.choose(&[1, 2, 3], &[&a, &b], &[3, 0]).node, 1, "2 blocks of prefill saved, 3 of load more: the other");
        let longest_first = Router::new(RouteMode::Events, RouteScore::Prefix, 1e6);
        assert_eq!(longest_first.choose(&[1, 2, 3], &[&a, &b], &[30, 0]).node, 0, "a large weight: the prefix first");
        assert_eq!(r.choose(&[7], &[&a, &b], &[1, 0]).node, 1, "nothing cached: the less loaded");
        let picks: Vec<usize> = (0..4).map(|_| r.choose(&[7], &[&a, &b], &[0, 0]).node).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "equal cost: round robin, {picks:?}");
        let rr = Router::new(RouteMode::RoundRobin, RouteScore::Fleet, 1.0);
        let picks: Vec<usize> = (0..4).map(|_| rr.choose(&[1, 2], &[&a, &b], &[0, 9]).node).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
    }

    #[test]
    fn the_fleet_score_counts_a_nodes_blocks_past_one_it_lost() {
        // Node a lost block 1 of the chain but holds 2 and 3; b holds 1
        // only; the bucket holds every block, 4 included.
        let a = index(true, &[KvEvent::Stored { hashes: vec![2, 3], medium: Medium::Storage }]);
        let b = index(
            true,
            &[
                KvEvent::Stored { hashes: vec![1], medium: Medium::Cpu },
                KvEvent::Stored { hashes: vec![1, 2, 3, 4], medium: Medium::External },
            ],
        );
        let chain = [1, 2, 3, 4, 5];
        let prefix = Router::new(RouteMode::Events, RouteScore::Prefix, 1.0);
        assert_eq!(prefix.choose(&chain, &[&a, &b], &[0, 0]), Choice { node: 1, predicted_blocks: 1 });
        let fleet = Router::new(RouteMode::Events, RouteScore::Fleet, 1.0);
        assert_eq!(fleet.choose(&chain, &[&a, &b], &[0, 0]), Choice { node: 0, predicted_blocks: 2 });
        // Nobody holds block 1: the prefix ends before a's blocks.
        let c = index(true, &[]);
        assert_eq!(fleet.choose(&chain, &[&a, &c], &[1, 0]), Choice { node: 1, predicted_blocks: 0 });
    }

    #[test]
    fn modes_name_themselves_and_only_events_follow_removals() {
        let names: Vec<&str> = RouteMode::ALL.iter().map(|m| m.name()).collect();
        assert_eq!(names, ["events", "store-only", "round-robin"]);
        assert_eq!(RouteMode::ALL.map(RouteMode::follows_removals), [true, false, false]);
    }
}
