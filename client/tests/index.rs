//! The client's reader of the shared index against the engine's writer of
//! it: the same table, mapped read-only through the descriptor a client is
//! handed (`MAP_INDEX`), read while the shard writes.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvtier_client::{IndexError, SharedIndex, Table, BAD_KEY};
use kvtier_engine::key::BlockHash;
use kvtier_engine::shared_index::{IndexTable, IndexTier};

fn mapped(t: &IndexTable) -> Table {
    let fd = t.read_only_fd().unwrap();
    Table::map(fd.as_fd(), t.file_bytes()).unwrap()
}

#[test]
fn keys_are_found_on_their_shard_with_their_fastest_tier() {
    let dir = tempfile::tempdir().unwrap();
    let shards: Vec<_> = (0..3).map(|s| IndexTable::new(64, s, 3, dir.path()).unwrap()).collect();
    let keys: Vec<String> = (0..40).map(|i| format!("tenant.model.block-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        let h = BlockHash::of(k.as_bytes());
        let t = &shards[h.shard(3)];
        match i % 4 {
            0 => t.set(&h, IndexTier::Nvme, true),
            1 => {
                t.set(&h, IndexTier::Nvme, true);
                t.set(&h, IndexTier::Ram, true);
            }
            2 => t.set(&h, IndexTier::Gpu, true),
            _ => {}
        }
    }
    let index = SharedIndex::new(shards.iter().map(|t| mapped(t)).collect()).unwrap();
    let mut out = Vec::new();
    assert!(index.tiers(keys.iter().map(|k| k.as_bytes()), &mut out));
    let want: Vec<u8> = (0..40).map(|i| [3, 2, 1, 0][i % 4]).collect();
    assert_eq!(out, want);
    // A key the server would refuse is not probed: BAD_KEY in its place.
    out.clear();
    assert!(index.tiers([keys[1].as_bytes(), b"a/b", b"..", keys[2].as_bytes()], &mut out));
    assert_eq!(out, [2, BAD_KEY, BAD_KEY, 1]);
    // An overflowed table answers nothing: the caller asks the server.
    for i in 0..200u64 {
        shards[0].set(&BlockHash((i as u128) << 64 | 7), IndexTier::Ram, true);
    }
    assert!(index.overflowed());
    assert!(!index.tiers([b"k".as_slice()], &mut out));
    assert_eq!(out.len(), 4, "cut back to its length before");
}

#[test]
fn tables_out_of_place_or_short_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = IndexTable::new(8, 1, 2, dir.path()).unwrap();
    let err = SharedIndex::new(vec![mapped(&a)]).err().unwrap();
    assert!(matches!(err, IndexError::Shard { at: 0, shard: 1, shards: 2, tables: 1 }), "{err}");
    let fd = a.read_only_fd().unwrap();
    let err = Table::map(fd.as_fd(), a.file_bytes() + 4096).err().unwrap();
    assert!(matches!(err, IndexError::Short { .. }), "{err}");
    let file = tempfile::tempfile().unwrap();
    file.set_len(8192).unwrap();
    let err = Table::map(file.as_fd(), 8192).err().unwrap();
    assert!(err.to_string().contains("not a version-1 index table"), "{err}");
}

/// A reader probing while the shard inserts, deletes and shifts colliding
/// entries never believes a torn bucket: the watched key reads as absent
/// (a delete's shift raced it) or with its own tiers, never with another
/// key's.
#[test]
fn a_probe_racing_the_writer_never_sees_another_key_s_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let t = IndexTable::new(8, 0, 1, dir.path()).unwrap();
    // Every hash shares home bucket 5 of 16: long runs, shifts on delete.
    let h = |n: u64| BlockHash(((n as u128) << 64) | (16 * n + 5) as u128);
    let watched = h(0);
    t.set(&watched, IndexTier::Ram, true);
    t.set(&watched, IndexTier::Nvme, true);
    let index = SharedIndex::new(vec![mapped(&t)]).unwrap();
    let table = Arc::clone(&t);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Others come before and after the watched key in its run.
                for n in 1..6 {
                    table.set(&h(n), IndexTier::Gpu, true);
                }
                table.set(&watched, IndexTier::Nvme, round.is_multiple_of(2));
                for n in 1..6 {
                    table.set(&h(n), IndexTier::Gpu, false);
                }
                round += 1;
            }
        })
    };
    let (lo, hi) = (watched.0 as u64, (watched.0 >> 64) as u64);
    let reader = index_reader(&index);
    let mut seen = [0u64; 8];
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_millis(500) {
        match reader.probe(lo, hi) {
            kvtier_local_proto::shared_index::Probe::Tiers(bits) => {
                assert!(matches!(bits, 0 | 2 | 6), "the watched key read with tiers {bits:#b}");
                seen[bits as usize] += 1;
            }
            kvtier_local_proto::shared_index::Probe::Busy => {}
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(seen[2] + seen[6] > 0, "the watched key was never found: {seen:?}");
}

fn index_reader(index: &SharedIndex) -> kvtier_local_proto::shared_index::Reader {
    *index.table(0).reader()
}
