//! Which tiers of one shard hold each tagged block, and the events that
//! tell a router so.
//!
//! A block is tracked here from the PUT (or recovery, or shared-tier
//! install) that brings its tag until it is in no tier of this node: the
//! tag is what the log writes into the block's slot header and the shared
//! tier into its object, whatever moves the block later. Blocks stored
//! without a tag are not tracked and publish nothing.
//!
//! The tiers report through a [`Journal`] of their medium where their own
//! maps change — the memory tiers' slot maps (`lru.rs`), the log's index
//! (`index.rs`), the shared tier's uploads and deletes — so no move between
//! tiers can happen without its event. [`Residency::flush`], once per
//! interval, compares what each touched block's tiers are now with what was
//! last published and hands the difference to the [`EventSink`]: per block
//! its arrivals (fastest tier first), then its departures, blocks in the
//! order they were first touched. A block that arrives and leaves within
//! one interval publishes nothing; a reclaim moving a block inside the log
//! publishes nothing. A PUT that replaces a tagged block with another tag
//! first removes the old tag from every tier it was published in.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;

use super::{EventSink, Medium, TierEvent};
use crate::key::{BlockHash, BlockHashHasher};

struct Tracked {
    tag: Bytes,
    /// Tiers holding the block now (`Medium::bit`).
    held: u8,
    /// Tiers the last flush published it in.
    published: u8,
    /// PUTs of the block in progress: it stays tracked until they end even
    /// while no tier holds it yet.
    putting: u32,
    /// In `Inner::touched`.
    touched: bool,
}

#[derive(Default)]
struct Inner {
    blocks: HashMap<BlockHash, Tracked, BuildHasherDefault<BlockHashHasher>>,
    touched: Vec<BlockHash>,
    /// Events decided before the next flush (a replaced tag's removals),
    /// published first.
    early: Vec<TierEvent>,
}

/// One shard's tagged blocks and where they are. Lives on the shard's
/// executor.
pub struct Residency {
    shard: usize,
    sink: Option<Arc<dyn EventSink>>,
    inner: RefCell<Inner>,
    /// Fired when the first block of an interval is touched (the flush
    /// loop's wake-up).
    pending: crate::signal::Signal,
    has_pending: Cell<bool>,
    /// The shard's index table, when clients read it
    /// ([`crate::shared_index`]): every arrival and departure in the GPU, RAM
    /// and NVMe tiers is written there too, tagged block or not.
    shared_index: RefCell<Option<Arc<crate::shared_index::IndexTable>>>,
}

impl std::fmt::Debug for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residency").field("shard", &self.shard).field("tracked", &self.inner.borrow().blocks.len()).finish()
    }
}

impl Residency {
    /// Shard `shard`'s tracker; events go to `sink` (`None`: tags are kept
    /// for the tiers to write, nothing is published).
    pub fn new(shard: usize, sink: Option<Arc<dyn EventSink>>) -> Rc<Residency> {
        Rc::new(Residency {
            shard,
            sink,
            inner: RefCell::default(),
            pending: crate::signal::Signal::new("a tagged block changed tiers"),
            has_pending: Cell::new(false),
            shared_index: RefCell::new(None),
        })
    }

    /// Writes every later arrival and departure of the local tiers into
    /// `table` as well.
    pub fn set_shared_index(&self, table: Arc<crate::shared_index::IndexTable>) {
        *self.shared_index.borrow_mut() = Some(table);
    }

    /// A journal for the tier `medium` to report its arrivals and
    /// departures through.
    pub fn journal(self: &Rc<Self>, medium: Medium) -> Journal {
        Journal { residency: self.clone(), medium }
    }

    /// The tag a block carries now, if it is tracked.
    pub fn tag_of(&self, hash: &BlockHash) -> Option<Bytes> {
        self.inner.borrow().blocks.get(hash).map(|t| t.tag.clone())
    }

    /// Tagged blocks tracked now (each keeps its tag in memory; `/v1/stats`
    /// `tagged_blocks` per shard).
    pub fn tracked(&self) -> usize {
        self.inner.borrow().blocks.len()
    }

    /// A PUT of `hash` with `tag` (`None`: untagged) begins; the returned
    /// guard ends it. A different tag than the block had is published as the
    /// old tag's removal from every tier it was published in, then the new
    /// tag's arrival in the tiers holding the block.
    pub fn begin_put(self: &Rc<Self>, hash: BlockHash, tag: Option<Bytes>) -> PutGuard {
        self.retag(hash, tag);
        if let Some(t) = self.inner.borrow_mut().blocks.get_mut(&hash) {
            t.putting += 1;
        }
        PutGuard { residency: self.clone(), hash }
    }

    /// Gives `hash` the tag `tag` (recovery, a shared-tier install) as
    /// [`Residency::begin_put`] does, without a PUT in progress: the block
    /// stays tracked only once a tier holds it, from the next flush.
    pub fn set_tag(&self, hash: BlockHash, tag: Option<Bytes>) {
        self.retag(hash, tag);
        self.touch(&mut self.inner.borrow_mut(), hash);
    }

    fn retag(&self, hash: BlockHash, tag: Option<Bytes>) {
        let mut inner = self.inner.borrow_mut();
        let inner = &mut *inner;
        let old = inner.blocks.get(&hash).map(|t| (t.tag.clone(), t.published));
        match (old, tag) {
            (Some((old_tag, _)), Some(new)) if old_tag == new => {}
            (old, new) => {
                if let Some((old_tag, published)) = old {
                    for m in Medium::ALL.into_iter().filter(|m| published & m.bit() != 0) {
                        inner.early.push(TierEvent::Removed { medium: m, tag: old_tag.clone() });
                    }
                }
                match new {
                    Some(tag) => {
                        let t = inner.blocks.entry(hash).or_insert(Tracked {
                            tag: tag.clone(),
                            held: 0,
                            published: 0,
                            putting: 0,
                            touched: false,
                        });
                        t.tag = tag;
                        t.published = 0;
                    }
                    None => {
                        inner.blocks.remove(&hash);
                    }
                }
                self.note_pending(inner.early.len());
            }
        }
    }

    fn changed(&self, hash: BlockHash, medium: Medium, held: bool) {
        if let Some(table) = &*self.shared_index.borrow() {
            use crate::shared_index::IndexTier;
            let tier = match medium {
                Medium::Gpu => Some(IndexTier::Gpu),
                Medium::Ram => Some(IndexTier::Ram),
                Medium::Nvme => Some(IndexTier::Nvme),
                Medium::S3 => None,
            };
            if let Some(tier) = tier {
                table.set(&hash, tier, held);
            }
        }
        let mut inner = self.inner.borrow_mut();
        let Some(t) = inner.blocks.get_mut(&hash) else { return };
        if held {
            t.held |= medium.bit();
        } else {
            t.held &= !medium.bit();
        }
        self.touch(&mut inner, hash);
    }

    fn touch(&self, inner: &mut Inner, hash: BlockHash) {
        if let Some(t) = inner.blocks.get_mut(&hash) {
            if !t.touched {
                t.touched = true;
                inner.touched.push(hash);
                self.note_pending(1);
            }
        }
    }

    fn note_pending(&self, n: usize) {
        if n > 0 && !self.has_pending.replace(true) {
            self.pending.notify();
        }
    }

    /// Resolves once something is waiting to be flushed.
    pub async fn until_pending(&self) {
        self.pending.until(|| self.has_pending.get()).await;
    }

    /// Publishes the net change of every block touched since the last
    /// flush (see the module docs) and stops tracking blocks no tier holds
    /// and no PUT is bringing. Returns the events handed to the sink.
    pub fn flush(&self) -> usize {
        self.has_pending.set(false);
        let mut inner = self.inner.borrow_mut();
        let inner = &mut *inner;
        let mut events = std::mem::take(&mut inner.early);
        for hash in std::mem::take(&mut inner.touched) {
            let Some(t) = inner.blocks.get_mut(&hash) else { continue };
            t.touched = false;
            let (held, published) = (t.held, t.published);
            for m in Medium::ALL.into_iter().filter(|m| held & !published & m.bit() != 0) {
                events.push(TierEvent::Stored { medium: m, tag: t.tag.clone() });
            }
            for m in Medium::ALL.into_iter().filter(|m| published & !held & m.bit() != 0) {
                events.push(TierEvent::Removed { medium: m, tag: t.tag.clone() });
            }
            t.published = held;
            if held == 0 && t.putting == 0 {
                inner.blocks.remove(&hash);
            }
        }
        let n = events.len();
        if let (Some(sink), false) = (&self.sink, events.is_empty()) {
            sink.submit(self.shard, events);
        }
        n
    }
}

/// A PUT in progress on a tracked block ([`Residency::begin_put`]); its
/// drop ends it, whatever the PUT's outcome.
pub struct PutGuard {
    residency: Rc<Residency>,
    hash: BlockHash,
}

impl Drop for PutGuard {
    fn drop(&mut self) {
        let r = &self.residency;
        let mut inner = r.inner.borrow_mut();
        if let Some(t) = inner.blocks.get_mut(&self.hash) {
            t.putting = t.putting.saturating_sub(1);
            r.touch(&mut inner, self.hash);
        }
    }
}

/// A tier's handle on its shard's [`Residency`]: the tier's map calls
/// [`Journal::arrived`] when it starts holding a block and
/// [`Journal::left`] when it stops.
#[derive(Clone)]
pub struct Journal {
    residency: Rc<Residency>,
    medium: Medium,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Journal({:?})", self.medium)
    }
}

impl Journal {
    /// The tier now holds `hash`'s block.
    pub fn arrived(&self, hash: BlockHash) {
        self.residency.changed(hash, self.medium, true);
    }

    /// The tier no longer holds `hash`'s block.
    pub fn left(&self, hash: BlockHash) {
        self.residency.changed(hash, self.medium, false);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default, Debug)]
    struct Collect(Mutex<Vec<(usize, TierEvent)>>);

    impl EventSink for Collect {
        fn submit(&self, shard: usize, events: Vec<TierEvent>) {
            self.0.lock().unwrap().extend(events.into_iter().map(|e| (shard, e)));
        }
    }

    fn names(c: &Collect) -> Vec<String> {
        c.0.lock()
            .unwrap()
            .drain(..)
            .map(|(_, e)| match e {
                TierEvent::Stored { medium, tag } => format!("+{}:{}", medium.as_str(), tag[0]),
                TierEvent::Removed { medium, tag } => format!("-{}:{}", medium.as_str(), tag[0]),
            })
            .collect()
    }

    #[test]
    fn a_block_walking_the_tiers_publishes_each_net_change_in_order() {
        let sink = Arc::new(Collect::default());
        let r = Residency::new(3, Some(sink.clone()));
        let (ram, nvme, s3) = (r.journal(Medium::Ram), r.journal(Medium::Nvme), r.journal(Medium::S3));
        let h = BlockHash(7);
        let guard = r.begin_put(h, Some(Bytes::from_static(&[1])));
        r.flush();
        assert_eq!(names(&sink), Vec::<String>::new(), "nothing holds it yet; tracked while the PUT runs");
        assert_eq!(r.tracked(), 1);
        ram.arrived(h);
        nvme.arrived(h);
        drop(guard);
        r.flush();
        assert_eq!(names(&sink), ["+ram:1", "+nvme:1"]);
        // Demotion: out of RAM; upload: into S3.
        ram.left(h);
        s3.arrived(h);
        r.flush();
        assert_eq!(names(&sink), ["+s3:1", "-ram:1"]);
        // A reclaim moving it inside the log: out and back in one interval.
        nvme.left(h);
        nvme.arrived(h);
        r.flush();
        assert_eq!(names(&sink), Vec::<String>::new());
        // Replaced under another tag: the old tag leaves every tier first.
        let guard = r.begin_put(h, Some(Bytes::from_static(&[2])));
        ram.arrived(h);
        drop(guard);
        r.flush();
        assert_eq!(names(&sink), ["-nvme:1", "-s3:1", "+ram:2", "+nvme:2", "+s3:2"]);
        // DELETE: gone everywhere, and untracked.
        ram.left(h);
        nvme.left(h);
        s3.left(h);
        r.flush();
        assert_eq!(names(&sink), ["-ram:2", "-nvme:2", "-s3:2"]);
        assert_eq!(r.tracked(), 0);
        assert_eq!(sink.0.lock().unwrap().len(), 0);
    }

    #[test]
    fn untagged_blocks_publish_nothing_and_a_failed_put_is_forgotten() {
        let sink = Arc::new(Collect::default());
        let r = Residency::new(0, Some(sink.clone()));
        let ram = r.journal(Medium::Ram);
        ram.arrived(BlockHash(1));
        drop(r.begin_put(BlockHash(2), Some(Bytes::from_static(&[5]))));
        r.flush();
        assert_eq!(names(&sink), Vec::<String>::new());
        assert_eq!(r.tracked(), 0);
        // Retagging to nothing removes what was published.
        let g = r.begin_put(BlockHash(3), Some(Bytes::from_static(&[6])));
        ram.arrived(BlockHash(3));
        drop(g);
        r.flush();
        drop(r.begin_put(BlockHash(3), None));
        r.flush();
        assert_eq!(names(&sink), ["+ram:6", "-ram:6"]);
        assert_eq!(r.tracked(), 0);
    }
}
