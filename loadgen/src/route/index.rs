//! What a router knows of one node: engine block hash → the media the node
//! holds it in, learned from the node's KV events.
//!
//! A router fed every event (`follows_removals`) adds a medium at
//! `BlockStored`, drops it at `BlockRemoved` and forgets everything at
//! `AllBlocksCleared`. A router fed store events only (what LMCache's MP
//! mode and vLLM's FS and object tiers publish: stores, never removals)
//! applies `BlockStored` alone, so it still believes in blocks the node
//! evicted long ago: the index only grows.

use std::collections::HashMap;

use super::wire::{KvEvent, Medium};

/// Most blocks one node's index holds; a `BlockStored` for a new block
/// past it is counted in [`NodeIndex::overflow`] and not kept (a bound on
/// the router's memory: 16 bytes or so a block, about 320 MB at the limit).
pub const INDEX_BLOCKS_MAX: usize = 20_000_000;

/// The bits of the local media (GPU, RAM, NVMe).
const LOCAL_MEDIA: u8 = Medium::Gpu.bit() | Medium::Cpu.bit() | Medium::Storage.bit();

/// One node's blocks as its events told them.
#[derive(Debug, Default)]
pub struct NodeIndex {
    /// Engine hash → set of [`Medium::bit`]s (never empty: a block whose
    /// last medium is removed leaves the map).
    blocks: HashMap<u64, u8>,
    follows_removals: bool,
    /// `BlockStored` for a new block past [`INDEX_BLOCKS_MAX`].
    pub overflow: u64,
}

impl NodeIndex {
    /// An empty index; `follows_removals: false` applies `BlockStored` only.
    pub fn new(follows_removals: bool) -> NodeIndex {
        NodeIndex { blocks: HashMap::new(), follows_removals, overflow: 0 }
    }

    /// Applies one event of this node.
    pub fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::Stored { hashes, medium } => {
                for h in hashes {
                    if self.blocks.len() >= INDEX_BLOCKS_MAX && !self.blocks.contains_key(h) {
                        self.overflow += 1;
                        continue;
                    }
                    *self.blocks.entry(*h).or_default() |= medium.bit();
                }
            }
            KvEvent::Removed { hashes, medium } if self.follows_removals => {
                for h in hashes {
                    if let Some(media) = self.blocks.get_mut(h) {
                        *media &= !medium.bit();
                        if *media == 0 {
                            self.blocks.remove(h);
                        }
                    }
                }
            }
            KvEvent::Cleared if self.follows_removals => self.blocks.clear(),
            KvEvent::Removed { .. } | KvEvent::Cleared => {}
        }
        debug_assert!(self.blocks.values().all(|&m| m != 0), "a block in the index is in some medium");
    }

    /// How many leading hashes of `chain` this node holds in a local
    /// medium (GPU, RAM or NVMe; the shared bucket is every node's, so it
    /// tells the router nothing).
    pub fn local_prefix(&self, chain: &[u64]) -> usize {
        chain.iter().take_while(|&&h| self.is_local(h)).count()
    }

    /// Whether this node holds `hash` in a local medium.
    pub fn is_local(&self, hash: u64) -> bool {
        self.blocks.get(&hash).is_some_and(|&m| m & LOCAL_MEDIA != 0)
    }

    /// Whether this node holds `hash` in any medium, the shared bucket
    /// included.
    pub fn holds(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Blocks held in `medium`.
    pub fn blocks_in(&self, medium: Medium) -> usize {
        self.blocks.values().filter(|&&m| m & medium.bit() != 0).count()
    }

    /// Blocks held anywhere.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], medium: Medium) -> KvEvent {
        KvEvent::Stored { hashes: hashes.to_vec(), medium }
    }

    fn removed(hashes: &[u64], medium: Medium) -> KvEvent {
        KvEvent::Removed { hashes: hashes.to_vec(), medium }
    }

    /// A block's walk: RAM and log at PUT, out of RAM, out of the log (in
    /// S3 only), then a restart.
    fn walk(index: &mut NodeIndex) -> Vec<usize> {
        let chain = [1, 2, 3];
        let mut prefixes = Vec::new();
        index.apply(&stored(&[1, 2, 3], Medium::Cpu));
        index.apply(&stored(&[1, 2, 3], Medium::Storage));
        index.apply(&stored(&[1, 2, 3], Medium::External));
        prefixes.push(index.local_prefix(&chain));
        index.apply(&removed(&[1, 2], Medium::Cpu));
        prefixes.push(index.local_prefix(&chain));
        index.apply(&removed(&[2], Medium::Storage));
        prefixes.push(index.local_prefix(&chain));
        index.apply(&KvEvent::Cleared);
        prefixes.push(index.local_prefix(&chain));
        prefixes
    }

    #[test]
    fn every_event_follows_the_block_down_and_out() {
        let mut index = NodeIndex::new(true);
        assert_eq!(walk(&mut index), [3, 3, 1, 0], "in the log after RAM; the prefix stops at the block only S3 holds");
        assert!(index.is_empty());
        index.apply(&stored(&[9], Medium::External));
        assert_eq!((index.local_prefix(&[9]), index.blocks_in(Medium::External)), (0, 1), "the shared tier is not local");
        assert!(index.holds(9) && !index.is_local(9) && !index.holds(1));
    }

    #[test]
    fn store_only_believes_in_every_block_it_was_told_of() {
        let mut index = NodeIndex::new(false);
        assert_eq!(walk(&mut index), [3, 3, 3, 3]);
        assert_eq!((index.len(), index.blocks_in(Medium::Cpu)), (3, 3));
    }
}
