//! On-disk damage of a stopped store: a flipped payload byte, a flipped
//! header byte, a segment truncated mid-slot, one index snapshot deleted
//! and another corrupted, foreign files in the data directory. `kvtier
//! fsck` lists exactly the damaged blocks; the server starts, serves every
//! intact block byte for byte, answers 404 for the damaged ones (never
//! wrong bytes), counts and logs them, and a new PUT heals a key.

mod common;

use std::collections::BTreeSet;
use std::fs::OpenOptions;

use common::{client, flip_byte, fsck_json, locate, payload, start, test_args, Location, BLOCK_BYTES};
use kvtier_engine::slot::PAGE_BYTES;
use serde_json::Value;

/// (shard, slot) of every damaged record fsck lists, with its key if named.
fn damaged(report: &Value) -> BTreeSet<(u64, u64, Option<String>)> {
    report["damaged"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["shard"].as_u64().unwrap(), d["slot"].as_u64().unwrap(), d["key"].as_str().map(String::from)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_files_are_found_by_fsck_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = test_args(&data);
    let keys: Vec<String> = (0..40).map(|i| format!("blk-{i:02}")).collect();
    let server = start(&args);
    let c = client(&server, false);
    for k in &keys {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    assert!(server.stop().success());
    let (clean, report) = fsck_json(&data);
    assert!(clean && damaged(&report).is_empty(), "{report}");

    // Pick victims: A (payload) and B (header) on shard 0, C (truncated,
    // the last slot written) on shard 1.
    let at = locate(&data, BLOCK_BYTES);
    assert_eq!(at.len(), keys.len());
    let on = |shard: u32| {
        let mut v: Vec<(&String, &Location)> = at.iter().filter(|(_, l)| l.1 == shard).collect();
        v.sort_by_key(|(_, l)| (l.0.clone(), l.2));
        v
    };
    let (shard0, shard1) = (on(0), on(1));
    assert!(shard0.len() >= 3 && shard1.len() >= 3);
    let (a, la) = shard0[0];
    let (b, lb) = shard0[1];
    let (c_key, lc) = *shard1.last().unwrap();
    flip_byte(&la.0, la.3 + PAGE_BYTES + 1000);
    flip_byte(&lb.0, lb.3 + 20);
    let truncated_to = lc.3 + PAGE_BYTES + BLOCK_BYTES / 2;
    OpenOptions::new().write(true).open(&lc.0).unwrap().set_len(truncated_to).unwrap();
    // Snapshots: shard 0's deleted, shard 1's corrupted.
    std::fs::remove_file(data.join("shard-000/index.snapshot")).unwrap();
    let snap1 = data.join("shard-001/index.snapshot");
    let len = std::fs::metadata(&snap1).unwrap().len();
    for off in [len / 3, len / 2, len - 5] {
        flip_byte(&snap1, off);
    }
    // Foreign files.
    std::fs::write(data.join("shard-000/notes.txt"), "not a segment").unwrap();
    std::fs::write(data.join("shard-001/seg-000077.kvt"), vec![0xAB; 10_000]).unwrap();
    std::fs::write(data.join("stray.bin"), b"stray").unwrap();

    // fsck names exactly the three damaged records (B's key is unreadable).
    let (clean, report) = fsck_json(&data);
    assert!(!clean, "fsck exits 1 on damage");
    let expected: BTreeSet<(u64, u64, Option<String>)> =
        [(0, la.2 as u64, Some(a.clone())), (0, lb.2 as u64, None), (1, lc.2 as u64, Some(c_key.clone()))].into_iter().collect();
    assert_eq!(damaged(&report), expected, "{report}");
    assert!(report["foreign_files"].as_array().unwrap().len() >= 2, "{report}");

    // The server starts, serves every intact block, never a damaged one.
    let server = start(&args);
    let c = client(&server, false);
    let victims = [a.as_str(), b.as_str(), c_key.as_str()];
    for k in &keys {
        let got = c.get(k).await.unwrap();
        if victims.contains(&k.as_str()) {
            assert!(got.is_none(), "damaged {k} was served");
        } else {
            let (body, _) = got.unwrap_or_else(|| panic!("intact {k} missing"));
            assert!(body.to_bytes() == payload(k), "{k} served wrong bytes");
        }
    }
    let stats = c.stats().await.unwrap();
    let t = &stats["totals"];
    assert_eq!(t["blocks"].as_u64().unwrap() + t["corrupt_blocks"].as_u64().unwrap(), keys.len() as u64 - 1, "{t}");
    assert!(t["corrupt_blocks"].as_u64().unwrap() >= 1, "{t}");
    assert!(t["invalid_headers_at_start"].as_u64().unwrap() >= 1, "{t}");
    assert!(t["foreign_files_at_start"].as_u64().unwrap() >= 2, "{t}");
    assert_eq!(t["invalid_snapshots_at_start"], 1, "{t}");
    assert_eq!(t["truncated_segments_at_start"], 1, "{t}");
    assert!(std::fs::metadata(&lc.0).unwrap().len() > truncated_to, "the truncated segment's length is restored");
    let log = server.log();
    for needle in ["corrupt", "skipping invalid slot header", "ignoring", "is truncated"] {
        assert!(log.contains(needle), "the log names the damage ({needle}):\n{log}");
    }
    // A new PUT heals a damaged key; the others keep working.
    c.put(a, vec![payload(a)]).await.unwrap();
    assert!(c.get(a).await.unwrap().unwrap().0.to_bytes() == payload(a));
    assert!(server.stop().success());

    // After a clean restart, still consistent: the healed key reads, the
    // other damaged ones stay missing.
    let server = start(&args);
    let c = client(&server, false);
    assert!(c.get(a).await.unwrap().unwrap().0.to_bytes() == payload(a));
    assert!(c.get(b).await.unwrap().is_none() && c.get(c_key).await.unwrap().is_none());
    assert!(server.stop().success());
}
