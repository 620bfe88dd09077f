//! The interleavings docs/ARCHITECTURE.md ("A shard's concurrency, stated
//! once") names, each driven step by step on a real shard (a one-shard
//! store on files): the test holds the state a wait is about, checks that
//! the waiting task has not gone on after the executor ran every other
//! task, then makes the change and checks that the task goes on.

use std::cell::Cell;
use std::future::Future;
use std::path::Path;
use std::rc::Rc;

use bytes::Bytes;

use super::Shard;
use crate::geometry::Geometry;
use crate::key::testing::sk;
use crate::key::{BlockHash, StoredKey};
use crate::signal::InFlight;
use crate::store::{run, Store, StoreConfig};

const BLOCK_BYTES: u64 = 65_536;

/// One shard, 1 MiB segments (15 slots of 64 KiB blocks), room for 8;
/// `ram_blocks` blocks of RAM tier.
fn config(dir: &Path, ram_blocks: u64) -> StoreConfig {
    StoreConfig {
        data_dir: dir.to_path_buf(),
        layout: None,
        geometry: Geometry::from_block_bytes(BLOCK_BYTES, 128).unwrap(),
        shards: 1,
        disk_bytes: 8 << 20,
        segment_bytes: 1 << 20,
        sync: false,
        io_depth_max: 16,
        io_queue_max: crate::store::IO_QUEUE_MAX_DEFAULT,
        pin_cpus: false,
        snapshot_secs: 0,
        ram_bytes: ram_blocks * BLOCK_BYTES,
        ram_shared: Default::default(),
        shared_index: false,
        write_policy: crate::WritePolicy::Through,
        promote: false,
        gpu: Default::default(),
        io_memory_bytes: crate::store::IO_MEMORY_SHARD_BYTES_MIN,
        remote: None,
        health_window: crate::health::ERROR_WINDOW,
        trace: None,
        owners: Default::default(),
        events: None,
        stalls: None,
        device_faults: None,
    }
}

/// Runs `f` on the shard of a fresh one-shard store without a RAM tier.
fn on_shard<F, Fut>(f: F)
where
    F: Fn(Rc<Store>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + 'static,
{
    on_shard_with_ram(0, f)
}

/// Runs `f` on the shard of a fresh one-shard store with `ram_blocks`
/// blocks of RAM tier.
fn on_shard_with_ram<F, Fut>(ram_blocks: u64, f: F)
where
    F: Fn(Rc<Store>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let dir = tempfile::tempdir().unwrap();
    let f = std::sync::Arc::new(f);
    run(config(dir.path(), ram_blocks), move |store| {
        let f = f.clone();
        async move { f(store).await }
    })
    .unwrap();
}

fn block(key: &StoredKey) -> Bytes {
    Bytes::from(key.as_str().as_bytes().iter().cycle().take(BLOCK_BYTES as usize).copied().collect::<Vec<u8>>())
}

async fn put(shard: &Shard, key: &StoredKey) {
    shard.put(key, key.hash(), &[block(key)]).await.unwrap();
}

/// Lets every other task of the executor run until none can go on: their
/// I/O too (50 ms covers a slot write here many times over, so a task that
/// was not waiting would have finished).
async fn settle() {
    for _ in 0..20 {
        glommio::executor().yield_task_queue_now().await;
    }
    glommio::timer::sleep(std::time::Duration::from_millis(50)).await;
    for _ in 0..20 {
        glommio::executor().yield_task_queue_now().await;
    }
}

/// A task whose end the test can see.
fn watched<F: Future + 'static>(f: F) -> (Rc<Cell<bool>>, glommio::task::JoinHandle<F::Output>) {
    let done = Rc::new(Cell::new(false));
    let flag = done.clone();
    let task = glommio::spawn_local(async move {
        let out = f.await;
        flag.set(true);
        out
    })
    .detach();
    (done, task)
}

#[test]
fn a_reclaim_waits_for_the_segments_writers_then_for_its_readers() {
    on_shard(|store| async move {
        let shard = store.shard_for_tests().clone();
        // 20 blocks: segment 0 is full and sealed, segment 1 the head.
        for i in 0..20 {
            put(&shard, &sk(&format!("k{i}"))).await;
        }
        let segment = shard.segment(0);
        let writer = InFlight::enter(&segment.writers);
        let reader = InFlight::enter(&segment.readers);
        let (done, task) = {
            let shard = shard.clone();
            watched(async move { shard.reclaim(0).await.map(|c| c.is_none()) })
        };
        settle().await;
        assert!(!done.get() && !segment.compacting.get(), "the reclaim went on with a write in flight");
        drop(writer);
        settle().await;
        assert!(segment.compacting.get(), "the last writer out did not wake the reclaim");
        assert!(!done.get(), "the reclaim began the new life with a read of the old one in flight");
        drop(reader);
        assert!(matches!(task.await, Some(Ok(true))), "the reclaim failed, or kept a survivor without reads or reservations");
        assert!(!segment.compacting.get());
    });
}

#[test]
fn a_read_of_a_survivor_not_yet_moved_waits_for_the_copy_and_reads_the_right_bytes() {
    on_shard(|store| async move {
        let shard = store.shard_for_tests().clone();
        put(&shard, &sk("survivor")).await;
        let hash = BlockHash::of(b"survivor");
        let entry = shard.index.borrow().get(&hash).unwrap();
        let segment = shard.segment(entry.segment);
        // As a reclaim leaves it: the block's life is below the new one's.
        segment.compact_below_seq.set(entry.seq + 1);
        segment.compacting.set(true);
        let (done, task) = {
            let shard = shard.clone();
            watched(async move { shard.get(&sk("survivor"), hash, false).await.map(|(body, _)| body) })
        };
        settle().await;
        assert!(!done.get(), "a survivor not yet moved was read");
        // The copy ends (here without moving it): the read looks again.
        segment.compacting.set(false);
        segment.survivors_moved.notify();
        let body = task.await.unwrap().unwrap();
        assert!(body.collect().await.unwrap() == block(&sk("survivor")));
    });
}

#[test]
fn a_write_into_a_slot_a_survivor_holds_waits_until_the_copy_has_read_it() {
    on_shard(|store| async move {
        let shard = store.shard_for_tests().clone();
        put(&shard, &sk("first")).await;
        let head = shard.segment(shard.head.get().unwrap());
        // The copy has yet to read the old slot of a survivor at slot 0:
        // every later slot of this segment waits for it.
        head.copy_next_old_slot.set(0);
        let (done, task) = {
            let shard = shard.clone();
            watched(async move { put(&shard, &sk("second")).await })
        };
        settle().await;
        assert!(!done.get(), "a write went into a slot the copy had not read yet");
        head.copy_next_old_slot.set(u32::MAX);
        head.survivors_moved.notify();
        task.await.unwrap();
        let (body, _) = shard.get(&sk("second"), BlockHash::of(b"second"), false).await.unwrap();
        assert!(body.collect().await.unwrap() == block(&sk("second")));
    });
}

#[test]
fn a_delete_waits_for_the_transit_it_saw_then_deletes() {
    on_shard(|store| async move {
        let shard = store.shard_for_tests().clone();
        put(&shard, &sk("moving")).await;
        let hash = BlockHash::of(b"moving");
        let ticket = shard.transits.begin(&sk("moving"), hash, vec![block(&sk("moving"))]);
        let (done, task) = {
            let shard = shard.clone();
            watched(async move { shard.delete(&sk("moving"), hash).await })
        };
        settle().await;
        assert!(!done.get(), "the DELETE went on while the block was in transit");
        drop(ticket);
        task.await.unwrap().unwrap();
        assert!(shard.get(&sk("moving"), hash, false).await.is_err(), "deleted");
    });
}

#[test]
fn a_delete_waits_for_a_demotion_of_the_block_from_ram_then_deletes() {
    on_shard_with_ram(4, |store| async move {
        let shard = store.shard_for_tests().clone();
        put(&shard, &sk("demoting")).await;
        let hash = BlockHash::of(b"demoting");
        let ram = shard.ram.as_ref().expect("a RAM tier");
        let victim = ram.borrow().victim_for(crate::tenant::DEFAULT_OWNER).expect("the block is in RAM");
        let pinned = ram.borrow_mut().begin_demotion(victim.slot);
        let (done, task) = {
            let shard = shard.clone();
            watched(async move { shard.delete(&sk("demoting"), hash).await })
        };
        settle().await;
        assert!(!done.get(), "the DELETE went on while a demotion of the block could still land after its tombstone");
        drop(pinned);
        ram.borrow_mut().end_demotion(victim.slot, false);
        task.await.unwrap().unwrap();
        assert!(shard.get(&sk("demoting"), hash, false).await.is_err(), "deleted");
    });
}

#[test]
fn a_close_waits_for_a_task_still_holding_the_shard_then_keeps_its_write() {
    let dir = tempfile::tempdir().unwrap();
    // The front door returns at once; a task it started still holds the
    // shard, waits on a signal, then writes. The shard must not close its
    // files before that task has ended (its hold is the wait's condition).
    let released = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = released.clone();
    run(config(dir.path(), 0), move |store| {
        let r = r.clone();
        async move {
            let shard = store.shard_for_tests().clone();
            let gate = Rc::new(crate::signal::Signal::new("the test let the late write go"));
            let go = Rc::new(Cell::new(false));
            let (g, flag) = (gate.clone(), go.clone());
            // The store holds the shard (alive until the serve future
            // returns), and so may the task making its spare segment.
            let before = shard.tasks.get();
            shard.spawn_holding(|shard| async move {
                g.until(|| flag.get()).await;
                put(&shard, &sk("late")).await;
            });
            assert_eq!(shard.tasks.get(), before + 1, "the task's hold is counted");
            drop(shard);
            // Let the close begin waiting, then release the task from a
            // task of the executor (the serve future has returned by then).
            glommio::spawn_local(async move {
                settle().await;
                go.set(true);
                gate.notify();
                r.store(true, std::sync::atomic::Ordering::SeqCst);
            })
            .detach();
        }
    })
    .unwrap();
    assert!(released.load(std::sync::atomic::Ordering::SeqCst), "the store closed before the holding task was released");
    run(config(dir.path(), 0), |store| async move {
        let shard = store.shard_for_tests().clone();
        assert!(shard.contains(&BlockHash::of(b"late")).is_some(), "the late write was lost: the files closed under it");
    })
    .unwrap();
}
