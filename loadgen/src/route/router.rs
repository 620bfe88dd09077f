//! Which node a turn goes to.
//!
//! A KV-aware router weighs, for each node, the prefill a turn would need
//! there against the load already on it, as NVIDIA Dynamo's KV router does
//! (its cost: `overlap_score_weight × prefill blocks + active blocks`):
//!
//! `cost(node) = overlap_weight × (prompt blocks − local prefix) + active blocks`
//!
//! where the local prefix is the longest prefix of the turn's engine block
//! hashes the node holds in a local tier (GPU, RAM or NVMe; its index,
//! [`NodeIndex::local_prefix`]) and the active blocks are the prompt
//! blocks of the turns the node is serving now (prefill and decode). The
//! turn goes to the cheapest node; among equals, the next in round-robin
//! order. A large weight makes it "longest prefix, then the less loaded".
//! Round robin ignores the indexes and the load.

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

/// One routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// The node.
    pub node: usize,
    /// The local prefix, in blocks, the router believed that node holds
    /// (0 in round robin).
    pub predicted_blocks: usize,
}

/// The router: a mode, the weight of a block of prefill against a block
/// of load, and the round-robin position it shares across users.
pub struct Router {
    mode: RouteMode,
    overlap_weight: f64,
    next: AtomicUsize,
}

impl Router {
    /// A router in `mode` weighing a prefill block `overlap_weight` times
    /// an active block (Dynamo's default: 1).
    pub fn new(mode: RouteMode, overlap_weight: f64) -> Router {
        assert!(overlap_weight.is_finite() && overlap_weight >= 0.0, "a weight of 0 or more");
        Router { mode, overlap_weight, next: AtomicUsize::new(0) }
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
        let scores: Vec<usize> = indexes.iter().map(|i| i.lock().expect("index lock").local_prefix(chain)).collect();
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
        let r = Router::new(RouteMode::Events, 1.0);
        assert_eq!(r.choose(&[1, 2, 3], &[&a, &b], &[1, 0]), Choice { node: 0, predicted_blocks: 2 }, "S3 counts for neither");
        assert_eq!(r.choose(&[1, 2, 3], &[&a, &b], &[3, 0]).node, 1, "2 blocks of prefill saved, 3 of load more: the other");
        let longest_first = Router::new(RouteMode::Events, 1e6);
        assert_eq!(longest_first.choose(&[1, 2, 3], &[&a, &b], &[30, 0]).node, 0, "a large weight: the prefix first");
        assert_eq!(r.choose(&[7], &[&a, &b], &[1, 0]).node, 1, "nothing cached: the less loaded");
        let picks: Vec<usize> = (0..4).map(|_| r.choose(&[7], &[&a, &b], &[0, 0]).node).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "equal cost: round robin, {picks:?}");
        let rr = Router::new(RouteMode::RoundRobin, 1.0);
        let picks: Vec<usize> = (0..4).map(|_| rr.choose(&[1, 2], &[&a, &b], &[0, 9]).node).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
    }

    #[test]
    fn modes_name_themselves_and_only_events_follow_removals() {
        let names: Vec<&str> = RouteMode::ALL.iter().map(|m| m.name()).collect();
        assert_eq!(names, ["events", "store-only", "round-robin"]);
        assert_eq!(RouteMode::ALL.map(RouteMode::follows_removals), [true, false, false]);
    }
}
