//! Engine tests on real files in temp dirs, through real io_uring.

use std::future::Future;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use kvtier_engine::key::{BlockHash, StoredKey};
use kvtier_engine::slot::PAGE_BYTES;
use kvtier_engine::{Error, Geometry, PutOutcome, Store, StoreConfig};

/// The default owner's stored key of `key`.
fn sk(key: &str) -> StoredKey {
    StoredKey::unscoped(key).expect("a valid test key")
}

/// [`sk`] of each key.
fn sks<K: AsRef<str>>(keys: &[K]) -> Vec<StoredKey> {
    keys.iter().map(|k| sk(k.as_ref())).collect()
}

fn config(dir: &Path, block_bytes: u64, shards: usize, segment_bytes: u64, disk_bytes: u64) -> StoreConfig {
    StoreConfig {
        data_dir: dir.to_path_buf(),
        layout: None,
        geometry: Geometry::from_block_bytes(block_bytes, 128).unwrap(),
        shards,
        disk_bytes,
        segment_bytes,
        sync: false,
        io_depth_max: 16,
        io_queue_max: kvtier_engine::store::IO_QUEUE_MAX_DEFAULT,
        pin_cpus: false,
        snapshot_secs: 0,
        ram_bytes: 0,
        ram_shared: Default::default(),
        shared_index: false,
        write_policy: kvtier_engine::WritePolicy::Through,
        promote: false,
        gpu: Default::default(),
        io_memory_bytes: kvtier_engine::store::IO_MEMORY_SHARD_BYTES_MIN,
        remote: None,
        health_window: kvtier_engine::health::ERROR_WINDOW,
        trace: None,
        owners: Default::default(),
        events: None,
        stalls: None,
        device_faults: None,
    }
}

/// Runs `f` on shard 0 while the other shards only answer forwarded requests.
fn on_shard0<F, Fut, T>(cfg: StoreConfig, f: F) -> Result<T, Error>
where
    F: Fn(Rc<Store>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = T> + 'static,
    T: Send + 'static,
{
    let f = Arc::new(f);
    let out = kvtier_engine::run(cfg, move |store| {
        let f = f.clone();
        async move {
            if store.shard_id() == 0 {
                Some(f(store).await)
            } else {
                None
            }
        }
    })?;
    Ok(out.into_iter().flatten().next().expect("shard 0 ran"))
}

/// Deterministic payload for a key: the key's hash repeated.
fn payload(key: &str, len: u64) -> Bytes {
    let seed = BlockHash::of(key.as_bytes()).0.to_le_bytes();
    Bytes::from(seed.iter().cycle().take(len as usize).copied().collect::<Vec<u8>>())
}

fn key_on_shard(shard: usize, shards: usize, n: usize) -> Vec<String> {
    (0..).map(|i| format!("k{i}")).filter(|k| BlockHash::of(k.as_bytes()).shard(shards) == shard).take(n).collect()
}

#[test]
fn round_trip_for_several_geometries() {
    // 4 KiB, 64 KiB, 1.2 MB (the KVStore benchmark's block) and 16 MiB
    // (llama3.1-8b at 128 tokens).
    for block_bytes in [4096u64, 65_536, 1_228_800, 16 << 20] {
        let dir = tempfile::tempdir().unwrap();
        let segment = 4 * (block_bytes + PAGE_BYTES) + PAGE_BYTES;
        let cfg = config(dir.path(), block_bytes, 1, segment, 4 * segment);
        let ok = on_shard0(cfg, move |store| async move {
            for i in 0..3 {
                let key = format!("block-{i}");
                let body = payload(&key, block_bytes);
                // Split the body in uneven chunks, as HTTP frames arrive.
                let cut = (block_bytes / 3) as usize;
                let chunks = vec![body.slice(..cut), body.slice(cut..)];
                assert_eq!(store.put(&sk(&key), chunks).await.unwrap(), PutOutcome::Created);
                let got = store.get(&sk(&key)).await.unwrap();
                assert_eq!(got.bytes, body, "block {i} of {block_bytes} bytes");
            }
            true
        })
        .unwrap();
        assert!(ok);
    }
}

#[test]
fn overwrite_delete_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8192, 2, 1 << 20, 8 << 20);
    on_shard0(cfg.clone(), |store| async move {
        let (a1, a2) = (payload("a1", 8192), payload("a2", 8192));
        assert_eq!(store.put(&sk("a"), vec![a1]).await.unwrap(), PutOutcome::Created);
        assert_eq!(store.put(&sk("a"), vec![a2.clone()]).await.unwrap(), PutOutcome::Replaced);
        assert_eq!(store.get(&sk("a")).await.unwrap().bytes, a2);
        store.put(&sk("gone"), vec![payload("gone", 8192)]).await.unwrap();
        store.delete(&sk("gone")).await.unwrap();
        assert!(matches!(store.delete(&sk("gone")).await, Err(Error::NotFound)));
        assert!(matches!(store.get(&sk("gone")).await, Err(Error::NotFound)));
        assert!(matches!(store.get(&sk("never")).await, Err(Error::NotFound)));
    })
    .unwrap();
    // Reopen from the snapshot the clean close wrote, then from a header
    // scan alone: either way the newest record of "a" wins and the
    // tombstone holds.
    for from_snapshot in [true, false] {
        if !from_snapshot {
            remove_snapshots(dir.path());
        }
        on_shard0(cfg.clone(), move |store| async move {
            assert_eq!(store.get(&sk("a")).await.unwrap().bytes, payload("a2", 8192));
            assert!(matches!(store.get(&sk("gone")).await, Err(Error::NotFound)));
            let stats = store.stats().await.unwrap();
            assert_eq!(stats.iter().map(|s| s.blocks).sum::<u64>(), 1);
            assert!(stats.iter().all(|s| s.recovery.snapshot_loaded == from_snapshot));
            if !from_snapshot {
                assert_eq!(stats.iter().map(|s| s.recovery.tombstones_found).sum::<u64>(), 1);
            }
        })
        .unwrap();
    }
}

/// Deletes every shard's index snapshot: what a crash before the first
/// snapshot leaves.
fn remove_snapshots(dir: &Path) {
    for shard in std::fs::read_dir(dir).unwrap().flatten() {
        let _ = std::fs::remove_file(shard.path().join("index.snapshot"));
    }
}

#[test]
fn restart_from_an_old_snapshot_sees_every_later_write_delete_and_reclaim() {
    let dir = tempfile::tempdir().unwrap();
    // 3 slots per segment, 4 segments: 12 slots, so the later writes reclaim.
    let segment = PAGE_BYTES + 3 * 8192;
    let cfg = config(dir.path(), 4096, 1, segment, 4 * segment);
    on_shard0(cfg.clone(), |store| async move {
        for k in ["a", "b", "c", "d"] {
            store.put(&sk(k), vec![payload(k, 4096)]).await.unwrap();
        }
    })
    .unwrap();
    let snap = dir.path().join("shard-000/index.snapshot");
    let old = std::fs::read(&snap).unwrap();
    on_shard0(cfg.clone(), |store| async move {
        assert!(store.stats().await.unwrap()[0].recovery.snapshot_loaded);
        store.delete(&sk("b")).await.unwrap();
        store.put(&sk("c"), vec![payload("c2", 4096)]).await.unwrap();
        for i in 0..6 {
            let k = format!("n{i}");
            store.put(&sk(&k), vec![payload(&k, 4096)]).await.unwrap();
        }
    })
    .unwrap();
    // As if the process had crashed after the old snapshot was written.
    std::fs::write(&snap, &old).unwrap();
    let expect = |store: Rc<Store>| async move {
        assert!(matches!(store.get(&sk("b")).await, Err(Error::NotFound)), "a delete after the snapshot holds");
        assert_eq!(store.get(&sk("c")).await.unwrap().bytes, payload("c2", 4096));
        for i in 0..6 {
            let k = format!("n{i}");
            assert_eq!(store.get(&sk(&k)).await.unwrap().bytes, payload(&k, 4096));
        }
        store.stats().await.unwrap()[0].clone()
    };
    let from_old = on_shard0(cfg.clone(), expect).unwrap();
    assert!(from_old.recovery.snapshot_loaded);
    assert!(from_old.recovery.segments_scanned < from_old.recovery.segments, "{:?}", from_old.recovery);
    // A damaged snapshot is ignored, counted, and the scan finds the same.
    let mut bad = std::fs::read(&snap).unwrap();
    bad[40] ^= 1;
    std::fs::write(&snap, &bad).unwrap();
    let from_scan = on_shard0(cfg, expect).unwrap();
    assert!(!from_scan.recovery.snapshot_loaded && from_scan.recovery.snapshot_invalid);
    assert_eq!(from_scan.blocks, from_old.blocks);
}

/// Found by the fuzz target `store_ops` (fuzz/artifacts/store_ops/crash-e230…):
/// a segment whose only record never landed (a kill -9 mid-write) is free
/// after restart, with no sequence number taken since its life began. A
/// write that lands in it after the next snapshot must still be found by a
/// restart from that snapshot (a kill -9 before the one after).
#[test]
fn a_write_into_a_free_segment_survives_a_restart_from_the_snapshot_that_saw_it_free() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 4096, 1, PAGE_BYTES + 3 * 8192, 4 * (PAGE_BYTES + 3 * 8192));
    on_shard0(cfg.clone(), |store| async move {
        store.put(&sk("lost"), vec![payload("lost", 4096)]).await.unwrap();
    })
    .unwrap();
    // As if the process had died before that write reached the disk.
    remove_snapshots(dir.path());
    {
        use std::os::unix::fs::FileExt;
        let seg = std::fs::OpenOptions::new().write(true).open(dir.path().join("shard-000/seg-000000.kvt")).unwrap();
        seg.write_all_at(&[0u8; 4096], slot_offset(4096, 0)).unwrap();
    }
    on_shard0(cfg.clone(), |store| async move {
        assert_eq!(store.stats().await.unwrap()[0].blocks, 0);
    })
    .unwrap();
    let snap = dir.path().join("shard-000/index.snapshot");
    let saw_it_free = std::fs::read(&snap).unwrap();
    on_shard0(cfg.clone(), |store| async move {
        assert!(store.stats().await.unwrap()[0].recovery.snapshot_loaded);
        store.put(&sk("kept"), vec![payload("kept", 4096)]).await.unwrap();
    })
    .unwrap();
    std::fs::write(&snap, &saw_it_free).unwrap();
    on_shard0(cfg, |store| async move {
        assert!(store.stats().await.unwrap()[0].recovery.snapshot_loaded);
        assert_eq!(store.get(&sk("kept")).await.unwrap().bytes, payload("kept", 4096), "an acknowledged write was lost");
    })
    .unwrap();
}

#[test]
fn wrong_size_and_invalid_keys_are_refused_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    on_shard0(config(dir.path(), 8192, 1, 1 << 20, 4 << 20), |store| async move {
        store.put(&sk("keep"), vec![payload("keep", 8192)]).await.unwrap();
        match store.put(&sk("short"), vec![Bytes::from(vec![0u8; 100])]).await {
            Err(Error::WrongSize { expected: 8192, got: 100 }) => {}
            other => panic!("{other:?}"),
        }
        // A store call takes only a typed key: a bad key or scope is refused
        // where the key is made, before any call can see it.
        for (scope, bad) in [("", ""), ("A", "b"), ("a", "b/c"), ("", "a/b"), ("", ".."), ("a", &"x".repeat(257))] {
            assert!(matches!(StoredKey::new(scope, bad), Err(Error::InvalidKey { .. })), "{scope:?} {bad:?} accepted");
        }
        assert_eq!(store.get(&sk("keep")).await.unwrap().bytes, payload("keep", 8192));
        assert!(matches!(store.get(&sk("short")).await, Err(Error::NotFound)));
    })
    .unwrap();
}

#[test]
fn geometry_mismatch_names_both_values() {
    let dir = tempfile::tempdir().unwrap();
    on_shard0(config(dir.path(), 8192, 1, 1 << 20, 4 << 20), |_| async {}).unwrap();
    let err = on_shard0(config(dir.path(), 16384, 1, 1 << 20, 4 << 20), |_| async {}).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::GeometryMismatch { .. }), "{msg}");
    assert!(msg.contains("8192") && msg.contains("16384"), "{msg}");
    let err = on_shard0(config(dir.path(), 8192, 2, 1 << 20, 4 << 20), |_| async {}).unwrap_err();
    assert!(err.to_string().contains("shards"), "{err}");
}

#[test]
fn two_shards_route_keys_to_their_owner() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 4096, 2, 1 << 20, 8 << 20);
    on_shard0(cfg.clone(), |store| async move {
        let keys: Vec<String> = key_on_shard(0, 2, 5).into_iter().chain(key_on_shard(1, 2, 5)).collect();
        for k in &keys {
            store.put(&sk(k), vec![payload(k, 4096)]).await.unwrap();
        }
        for k in &keys {
            assert_eq!(store.get(&sk(k)).await.unwrap().bytes, payload(k, 4096));
        }
        let stats = store.stats().await.unwrap();
        assert_eq!(stats.iter().map(|s| s.blocks).collect::<Vec<_>>(), vec![5, 5]);
        // A chain whose 4th key is missing has 3 prefix hits.
        let mut chain: Vec<&str> = keys.iter().map(|s| s.as_str()).take(3).collect();
        chain.push("missing");
        chain.push(&keys[4]);
        assert_eq!(store.lookup_prefix(&sks(&chain)).await.unwrap().len(), 3);
    })
    .unwrap();
    // Files exist per shard, each owning its keys after restart.
    assert!(dir.path().join("shard-000/seg-000000.kvt").exists());
    assert!(dir.path().join("shard-001/seg-000000.kvt").exists());
    on_shard0(cfg, |store| async move {
        for k in key_on_shard(1, 2, 5) {
            assert_eq!(store.get(&sk(&k)).await.unwrap().bytes, payload(&k, 4096));
        }
    })
    .unwrap();
}

#[test]
fn io_memory_is_registered_after_start_and_blocks_read_back_either_side() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 65_536, 2, 1 << 20, 8 << 20);
    cfg.ram_bytes = 4 << 20;
    let registered = kvtier_engine::run(cfg.clone(), |store| async move {
        // Written and read with buffers from before the registration (on
        // Linux 6.0+ the shard serves first), then after it.
        let keys = key_on_shard(store.shard_id(), 2, 6);
        for k in &keys[..3] {
            store.put(&sk(k), vec![payload(k, 65_536)]).await.unwrap();
            assert_eq!(store.get(&sk(k)).await.unwrap().bytes, payload(k, 65_536));
        }
        let waited = std::time::Instant::now();
        while !glommio::executor().io_memory_registered() && waited.elapsed() < std::time::Duration::from_secs(20) {
            glommio::timer::sleep(std::time::Duration::from_millis(5)).await;
        }
        for k in &keys[3..] {
            store.put(&sk(k), vec![payload(k, 65_536)]).await.unwrap();
        }
        for k in &keys {
            assert_eq!(store.get(&sk(k)).await.unwrap().bytes, payload(k, 65_536));
        }
        glommio::executor().io_memory_registered()
    })
    .unwrap();
    assert_eq!(registered, vec![true, true], "each shard registers its I/O memory once it serves");
    // A store that stops at once stops its warm-up too, within a chunk.
    let started = std::time::Instant::now();
    kvtier_engine::run(cfg, |_store| async {}).unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "stopped after {:?}", started.elapsed());
}

#[test]
fn log_full_reclaims_oldest_segment_and_stays_consistent() {
    let dir = tempfile::tempdir().unwrap();
    // 3 slots per segment (4 KiB superblock + 3 × 8 KiB), 3 segments: 9 slots.
    let segment = PAGE_BYTES + 3 * 8192;
    let cfg = config(dir.path(), 4096, 1, segment, 3 * segment);
    let written = 20;
    on_shard0(cfg.clone(), move |store| async move {
        for i in 0..written {
            let k = format!("b{i}");
            store.put(&sk(&k), vec![payload(&k, 4096)]).await.unwrap();
        }
        let s = &store.stats().await.unwrap()[0];
        assert!(s.reclaimed_segments >= 3, "{s:?}");
        assert!(s.blocks <= 9 && s.blocks >= 6, "{s:?}");
        // The newest block is always there; the oldest is gone.
        let last = format!("b{}", written - 1);
        assert_eq!(store.get(&sk(&last)).await.unwrap().bytes, payload(&last, 4096));
        assert!(matches!(store.get(&sk("b0")).await, Err(Error::NotFound)));
    })
    .unwrap();
    // After a restart the same blocks are found, and no reclaimed one returns.
    on_shard0(cfg, move |store| async move {
        let mut present = 0;
        for i in 0..written {
            let k = format!("b{i}");
            match store.get(&sk(&k)).await {
                Ok(b) => {
                    assert_eq!(b.bytes, payload(&k, 4096));
                    present += 1;
                }
                Err(Error::NotFound) => {
                    assert!(present == 0, "hole after b{i}: blocks return out of order")
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(present as u64, store.stats().await.unwrap()[0].blocks);
        // Writes go on after the restart, reclaiming again.
        for i in 0..10 {
            let k = format!("c{i}");
            store.put(&sk(&k), vec![payload(&k, 4096)]).await.unwrap();
        }
        assert_eq!(store.get(&sk("c9")).await.unwrap().bytes, payload("c9", 4096));
    })
    .unwrap();
}

/// Offset of slot `slot` in a segment of `block_bytes` blocks.
fn slot_offset(block_bytes: u64, slot: u64) -> u64 {
    PAGE_BYTES + slot * (PAGE_BYTES + block_bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES)
}

fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0xFF;
    f.write_all_at(&b, offset).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn flipped_payload_byte_is_corrupt_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8192, 1, 1 << 20, 4 << 20);
    on_shard0(cfg.clone(), |store| async move {
        for k in ["s0", "s1", "s2"] {
            store.put(&sk(k), vec![payload(k, 8192)]).await.unwrap();
        }
    })
    .unwrap();
    // Slot 1 holds "s1": flip a byte in the middle of its payload.
    remove_snapshots(dir.path());
    flip_byte(&dir.path().join("shard-000/seg-000000.kvt"), slot_offset(8192, 1) + PAGE_BYTES + 5000);
    on_shard0(cfg, |store| async move {
        assert!(matches!(store.get(&sk("s1")).await, Err(Error::Corrupt { segment: 0, slot: 1 })));
        // Dropped from the index: a miss from now on, and counted.
        assert!(matches!(store.get(&sk("s1")).await, Err(Error::NotFound)));
        assert_eq!(store.stats().await.unwrap()[0].corrupt_blocks, 1);
        for k in ["s0", "s2"] {
            assert_eq!(store.get(&sk(k)).await.unwrap().bytes, payload(k, 8192));
        }
    })
    .unwrap();
}

#[test]
fn torn_header_and_torn_payload_after_crash() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8192, 1, 1 << 20, 4 << 20);
    on_shard0(cfg.clone(), |store| async move {
        for k in ["t0", "t1", "t2", "t3"] {
            store.put(&sk(k), vec![payload(k, 8192)]).await.unwrap();
        }
    })
    .unwrap();
    let seg = dir.path().join("shard-000/seg-000000.kvt");
    remove_snapshots(dir.path());
    // As if the process died mid-write: slot 3's header is torn, and slot 2's
    // payload only half written.
    flip_byte(&seg, slot_offset(8192, 3) + 100);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&seg).unwrap();
        f.write_all_at(&[0u8; 4096], slot_offset(8192, 2) + PAGE_BYTES + 4096).unwrap();
    }
    on_shard0(cfg, |store| async move {
        let s = &store.stats().await.unwrap()[0];
        assert_eq!(s.recovery.headers_invalid, 1, "{s:?}");
        assert!(matches!(store.get(&sk("t3")).await, Err(Error::NotFound)));
        assert!(matches!(store.get(&sk("t2")).await, Err(Error::Corrupt { .. })));
        for k in ["t0", "t1"] {
            assert_eq!(store.get(&sk(k)).await.unwrap().bytes, payload(k, 8192));
        }
        // The log keeps taking writes after the damaged slots.
        store.put(&sk("t4"), vec![payload("t4", 8192)]).await.unwrap();
        assert_eq!(store.get(&sk("t4")).await.unwrap().bytes, payload("t4", 8192));
    })
    .unwrap();
}

#[test]
fn concurrent_puts_of_one_key_never_tear() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 65_536, 1, 4 << 20, 16 << 20);
    on_shard0(cfg, |store| async move {
        let versions: Vec<Bytes> = (0..8).map(|v| payload(&format!("v{v}"), 65_536)).collect();
        let writers = versions.iter().map(|body| {
            let store = store.clone();
            let body = body.clone();
            async move { store.put(&sk("hot"), vec![body]).await.unwrap() }
        });
        let readers = (0..8).map(|_| {
            let store = store.clone();
            async move { store.get(&sk("hot")).await.ok().map(|b| b.bytes) }
        });
        let (_, reads) = futures::future::join(futures::future::join_all(writers), futures::future::join_all(readers)).await;
        for r in reads.into_iter().flatten() {
            assert!(versions.contains(&r), "a read returned bytes no writer wrote");
        }
        let last = store.get(&sk("hot")).await.unwrap().bytes;
        assert!(versions.contains(&last));
    })
    .unwrap();
}

#[test]
fn second_chance_keeps_a_block_read_since_written_once() {
    let dir = tempfile::tempdir().unwrap();
    // 4 slots per segment (4 KiB blocks in 8 KiB slots), 3 segments.
    let segment = PAGE_BYTES + 4 * 8192;
    let cfg = config(dir.path(), 4096, 1, segment, 3 * segment);
    on_shard0(cfg.clone(), |store| async move {
        let put = |k: String| {
            let store = store.clone();
            async move { store.put(&sk(&k), vec![payload(&k, 4096)]).await.unwrap() }
        };
        for i in 0..4 {
            put(format!("h{i}")).await;
        }
        store.get(&sk("h1")).await.unwrap(); // h1 is hot
        for i in 0..8 {
            put(format!("x{i}")).await; // fills segments 1 and 2
        }
        put("y0".into()).await; // reclaims segment 0
                                // h1 moves in the background; a read of it waits for the move.
        assert_eq!(store.get(&sk("h1")).await.unwrap().bytes, payload("h1", 4096));
        let s = &store.stats().await.unwrap()[0];
        assert_eq!((s.reclaimed_segments, s.second_chance_blocks), (1, 1), "{s:?}");
        for k in ["h0", "h2", "h3"] {
            assert!(matches!(store.get(&sk(k)).await, Err(Error::NotFound)), "{k} should be evicted");
        }
    })
    .unwrap();
    // The moved block survives a restart from the snapshot and from a scan.
    for from_snapshot in [true, false] {
        if !from_snapshot {
            remove_snapshots(dir.path());
        }
        on_shard0(cfg.clone(), |store| async move {
            assert_eq!(store.get(&sk("h1")).await.unwrap().bytes, payload("h1", 4096));
        })
        .unwrap();
    }
    // Read again after its move, it gets another chance; unread, it goes when
    // its segment comes round again.
    on_shard0(cfg, |store| async move {
        for i in 0..12 {
            let k = format!("z{i}");
            store.put(&sk(&k), vec![payload(&k, 4096)]).await.unwrap();
        }
        assert!(matches!(store.get(&sk("h1")).await, Err(Error::NotFound)));
    })
    .unwrap();
}

#[test]
fn reads_during_reclaim_and_compaction_never_see_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let segment = PAGE_BYTES + 4 * 8192;
    let cfg = config(dir.path(), 4096, 1, segment, 3 * segment);
    on_shard0(cfg, |store| async move {
        let hot: Vec<String> = (0..3).map(|i| format!("hot{i}")).collect();
        for k in &hot {
            store.put(&sk(k), vec![payload(k, 4096)]).await.unwrap();
        }
        let writer = {
            let store = store.clone();
            async move {
                for i in 0..60 {
                    let k = format!("w{i}");
                    store.put(&sk(&k), vec![payload(&k, 4096)]).await.unwrap();
                }
            }
        };
        let reader = {
            let store = store.clone();
            let hot = hot.clone();
            async move {
                let (mut served, mut missed) = (0, 0);
                for round in 0..200 {
                    let k = &hot[round % hot.len()];
                    match store.get(&sk(k)).await {
                        Ok(b) => {
                            assert_eq!(b.bytes, payload(k, 4096), "wrong bytes for {k}");
                            served += 1;
                        }
                        Err(Error::NotFound) => missed += 1,
                        Err(e) => panic!("{e}"),
                    }
                    glommio::yield_if_needed().await;
                }
                (served, missed)
            }
        };
        let (_, (served, _)) = futures::future::join(writer, reader).await;
        let s = &store.stats().await.unwrap()[0];
        assert!(s.reclaimed_segments >= 5 && served > 0, "{s:?}");
        assert_eq!(s.corrupt_blocks, 0, "{s:?}");
    })
    .unwrap();
}

#[test]
fn fsck_lists_exactly_the_damaged_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), 8192, 1, 1 << 20, 4 << 20);
    on_shard0(cfg, |store| async move {
        for k in ["f0", "f1", "f2", "f3", "old"] {
            store.put(&sk(k), vec![payload(k, 8192)]).await.unwrap();
        }
        store.put(&sk("old"), vec![payload("new", 8192)]).await.unwrap(); // slot 5 supersedes slot 4
        store.delete(&sk("f3")).await.unwrap();
    })
    .unwrap();
    let clean = kvtier_engine::fsck::fsck(dir.path()).unwrap();
    assert!(clean.damaged.is_empty(), "{:?}", clean.damaged);
    assert_eq!((clean.blocks_checked, clean.live_blocks, clean.tombstones), (6, 4, 1));
    let seg = dir.path().join("shard-000/seg-000000.kvt");
    flip_byte(&seg, slot_offset(8192, 1) + PAGE_BYTES + 77); // f1's payload
    flip_byte(&seg, slot_offset(8192, 2) + 20); // f2's header
    flip_byte(&seg, slot_offset(8192, 4) + PAGE_BYTES); // the superseded "old"
    std::fs::write(dir.path().join("shard-000/notes.txt"), "not a segment").unwrap();
    let report = kvtier_engine::fsck::fsck(dir.path()).unwrap();
    let found: Vec<(u32, Option<&str>, bool)> = report.damaged.iter().map(|d| (d.slot, d.key.as_deref(), d.live)).collect();
    assert_eq!(found, vec![(1, Some("f1"), true), (2, None, false), (4, Some("old"), false)], "{:?}", report.damaged);
    assert_eq!(report.live_blocks, 2, "f0 and the new 'old'");
    assert_eq!(report.foreign_files.len(), 1);
}

/// A GET served from RAM is a view of the slot itself; while a response
/// still holds it, eviction takes the block out of RAM but never writes the
/// slot, so the response sends the bytes it was given. Forwarded reads (from
/// shard 1's keys) end on another thread and release their slot there.
#[test]
fn a_response_holding_a_ram_slot_keeps_its_bytes_while_eviction_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8192, 2, 1 << 20, 16 << 20);
    cfg.ram_bytes = 2 * 4 * 8192; // 4 slots per shard
    cfg.promote = true;
    on_shard0(cfg, |store| async move {
        let held_keys: Vec<String> = key_on_shard(0, 2, 1).into_iter().chain(key_on_shard(1, 2, 1)).collect();
        let mut held = Vec::new();
        for k in &held_keys {
            store.put(&sk(k), vec![payload(k, 8192)]).await.unwrap();
            let block = store.get(&sk(k)).await.unwrap();
            assert_eq!(block.tier, kvtier_engine::Tier::Ram);
            held.push(block.bytes);
        }
        // 40 more blocks per shard push the held ones out of RAM, ten times over.
        for k in key_on_shard(0, 2, 41).into_iter().skip(1).chain(key_on_shard(1, 2, 41).into_iter().skip(1)) {
            store.put(&sk(&k), vec![payload(&k, 8192)]).await.unwrap();
        }
        for (k, bytes) in held_keys.iter().zip(&held) {
            assert_eq!(bytes, &payload(k, 8192), "a held response changed under eviction");
            let again = store.get(&sk(k)).await.unwrap();
            assert_eq!((again.tier, &again.bytes), (kvtier_engine::Tier::Nvme, &payload(k, 8192)));
        }
        // While held, each shard's pinned slot stayed out of use.
        for s in store.stats().await.unwrap() {
            assert_eq!((s.tiers[0].capacity_blocks, s.tiers[0].used_blocks), (4, 3), "{:?}", s.tiers[0]);
        }
        // Released (shard 1's on this thread), the slots serve again.
        drop(held);
        for k in [&key_on_shard(0, 2, 42)[41], &key_on_shard(1, 2, 42)[41]] {
            store.put(&sk(k), vec![payload(k, 8192)]).await.unwrap();
        }
        for s in store.stats().await.unwrap() {
            let ram = &s.tiers[0];
            assert_eq!((ram.capacity_blocks, ram.used_blocks), (4, 4), "{ram:?}");
            assert!(ram.demotions >= 38, "{ram:?}");
        }
    })
    .unwrap();
}

#[test]
fn client_io_past_the_queue_limit_is_refused_not_queued() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8192, 1, 1 << 20, 8 << 20);
    // One I/O at a time, two waiting: of 8 PUTs issued together, the first
    // runs, the next two wait, the other five are refused at once.
    cfg.io_depth_max = 1;
    cfg.io_queue_max = 2;
    on_shard0(cfg, |store| async move {
        let puts = (0..8).map(|i| {
            let store = store.clone();
            async move { store.put(&sk(&format!("q{i}")), vec![payload("q", 8192)]).await }
        });
        let results = futures::future::join_all(puts).await;
        let stored = results.iter().filter(|r| r.is_ok()).count();
        let refused = results.iter().filter(|r| matches!(r, Err(Error::Overloaded(m)) if m.contains("--io-queue-max 2"))).count();
        assert_eq!((stored, refused), (3, 5), "{results:?}");
        let stats = &store.stats().await.unwrap()[0];
        assert_eq!((stats.io_queue_refusals, stats.io_queued, stats.puts), (5, 0, 3));
        // Refused means nothing was stored, and the queue is free again.
        assert!(matches!(store.get(&sk("q7")).await, Err(Error::NotFound)));
        assert_eq!(store.put(&sk("q7"), vec![payload("q", 8192)]).await.unwrap(), PutOutcome::Created);
    })
    .unwrap();
}

/// What `writes_go_ahead_while_reclaim_moves_survivors...` leaves: k12
/// rewritten and k13 deleted while they were being moved, the other
/// survivors (k8..k15) kept, k0..k7 evicted.
async fn check_after_concurrent_reclaim(store: Rc<Store>) {
    let old = |k: &str| payload(k, 65_536);
    assert_eq!(store.get(&sk("k12")).await.unwrap().bytes, payload("k12-new", 65_536));
    assert!(matches!(store.get(&sk("k13")).await, Err(Error::NotFound)));
    for i in (8..12).chain(14..16) {
        let k = format!("k{i}");
        assert_eq!(store.get(&sk(&k)).await.unwrap().bytes, old(&k), "{k}");
    }
    for i in 0..8 {
        assert!(matches!(store.get(&sk(&format!("k{i}"))).await, Err(Error::NotFound)), "k{i} was evicted");
    }
    for k in ["t", "u", "f0", "f15"] {
        assert_eq!(store.get(&sk(k)).await.unwrap().bytes, old(k), "{k}");
    }
}

#[test]
fn writes_go_ahead_while_reclaim_moves_survivors_and_newer_writes_win_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    // 16 slots of 64 KiB per segment, 2 segments: the 33rd PUT reclaims
    // segment 0.
    let segment = PAGE_BYTES + 16 * (65_536 + PAGE_BYTES);
    let cfg = config(dir.path(), 65_536, 1, segment, 2 * segment);
    on_shard0(cfg.clone(), |store| async move {
        let old = |k: &str| payload(k, 65_536);
        for i in 0..16 {
            let k = format!("k{i}");
            store.put(&sk(&k), vec![old(&k)]).await.unwrap();
        }
        for i in 8..16 {
            store.get(&sk(&format!("k{i}"))).await.unwrap(); // slots 8..15 survive
        }
        for i in 0..16 {
            let k = format!("f{i}");
            store.put(&sk(&k), vec![old(&k)]).await.unwrap();
        }
        // "t" reclaims segment 0, whose 8 survivors then move in the
        // background; the writes take slots 8 to 11 meanwhile, each waiting
        // only for the survivor in its slot to be read.
        let (t_key, k12_key, k13_key) = (sk("t"), sk("k12"), sk("k13"));
        let t = store.put(&t_key, vec![old("t")]);
        let u = async {
            store.put(&sk("u"), vec![old("u")]).await.unwrap();
            store.stats().await.unwrap()[0].second_chance_blocks
        };
        let k12 = store.put(&k12_key, vec![payload("k12-new", 65_536)]);
        let k13 = store.delete(&k13_key);
        let (t, moved_when_u_landed, k12, k13) = futures::join!(t, u, k12, k13);
        assert_eq!((t.unwrap(), k12.unwrap()), (PutOutcome::Created, PutOutcome::Replaced));
        k13.unwrap();
        assert!(moved_when_u_landed < 8, "a PUT waited for the whole survivor copy ({moved_when_u_landed} of 8 moved)");
        // Reads of the last survivor wait for its move.
        assert_eq!(store.get(&sk("k15")).await.unwrap().bytes, old("k15"));
        let s = &store.stats().await.unwrap()[0];
        assert_eq!((s.reclaimed_segments, s.evicted_blocks, s.corrupt_blocks), (1, 8, 0), "{s:?}");
        check_after_concurrent_reclaim(store).await;
    })
    .unwrap();
    // Whether each survivor moved before or after the newer PUT or DELETE
    // of its key, the newer one wins after a restart too, from the snapshot
    // or from a header scan alone.
    on_shard0(cfg.clone(), check_after_concurrent_reclaim).unwrap();
    remove_snapshots(dir.path());
    on_shard0(cfg, check_after_concurrent_reclaim).unwrap();
}

/// A KV event sink that keeps what it is given.
#[derive(Debug, Default)]
struct Collect(std::sync::Mutex<Vec<kvtier_engine::events::TierEvent>>);

impl kvtier_engine::events::EventSink for Collect {
    fn submit(&self, _shard: usize, events: Vec<kvtier_engine::events::TierEvent>) {
        self.0.lock().unwrap().extend(events);
    }
}

fn tag(i: u8) -> Bytes {
    kvtier_engine::events::BlockTag { block_hashes: vec![vec![i; 32]], parent_hash: None, block_size: 4, token_ids: vec![i as u32; 4] }
        .encode()
}

#[test]
fn block_tags_survive_a_restart_by_snapshot_and_by_header_scan_and_are_published_for_the_blocks_found() {
    use kvtier_engine::events::{Medium, TierEvent};
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8192, 2, 1 << 20, 8 << 20);
    cfg.ram_bytes = 4 * 8192 * 2;
    let sink = Arc::new(Collect::default());
    cfg.events = Some(sink.clone());
    on_shard0(cfg.clone(), |store| async move {
        for i in 0..4u8 {
            store.put_reporting(&sk(&format!("t{i}")), vec![payload(&format!("t{i}"), 8192)], Some(tag(i))).await.unwrap();
        }
        store.put(&sk("untagged"), vec![payload("untagged", 8192)]).await.unwrap();
        // Published (a block's moves within one interval publish only their
        // net effect).
        glommio::timer::sleep(kvtier_engine::events::FLUSH_EVERY * 10).await;
        // The four tagged blocks keep their tags in memory; the untagged
        // one keeps none.
        let tagged: u64 = store.stats().await.unwrap().iter().map(|s| s.tagged_blocks).sum();
        assert_eq!(tagged, 4);
        // Retagged to nothing, then deleted: neither is found again.
        store.put_reporting(&sk("t2"), vec![payload("t2", 8192)], None).await.unwrap();
        store.delete(&sk("t3")).await.unwrap();
        // A tag the store refuses: garbage, or one too long for no reason.
        let bad = store.put_reporting(&sk("bad"), vec![payload("bad", 8192)], Some(Bytes::from_static(b"\x01\x20"))).await;
        assert!(matches!(&bad, Err(Error::InvalidTag(m)) if m.contains("ends after")), "{bad:?}");
        assert!(matches!(store.get(&sk("bad")).await, Err(Error::NotFound)), "a refused tag stores nothing");
    })
    .unwrap();
    let stored = |events: &[TierEvent], medium: Medium| -> Vec<u8> {
        let mut got: Vec<u8> = events
            .iter()
            .filter_map(|e| match e {
                TierEvent::Stored { medium: m, tag } if *m == medium => Some(tag[3]),
                _ => None,
            })
            .collect();
        got.sort();
        got
    };
    {
        let events = sink.0.lock().unwrap();
        // Each tagged block arrived in RAM and the log (write-through); t2
        // and t3 left both again.
        assert_eq!(stored(&events, Medium::Ram), [0, 1, 2, 3]);
        assert_eq!(stored(&events, Medium::Nvme), [0, 1, 2, 3]);
        let removed = events.iter().filter(|e| matches!(e, TierEvent::Removed { .. })).count();
        assert_eq!(removed, 4, "t2 and t3 out of RAM and the log: {events:?}");
    }
    for from_snapshot in [true, false] {
        if !from_snapshot {
            remove_snapshots(dir.path());
        }
        sink.0.lock().unwrap().clear();
        on_shard0(cfg.clone(), |_store| async move {}).unwrap();
        let events = sink.0.lock().unwrap();
        // Recovery finds t0 and t1 in the log with their tags (the RAM tier
        // starts empty), nothing else.
        assert_eq!(stored(&events, Medium::Nvme), [0, 1], "from snapshot: {from_snapshot}: {events:?}");
        assert_eq!(events.len(), 2, "from snapshot: {from_snapshot}: {events:?}");
    }
}
