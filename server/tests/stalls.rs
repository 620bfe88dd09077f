//! No shard blocks on the disk: with every fsync of the server delayed
//! (strace's fault injection, the real system call held in the kernel's
//! entry), a writer rolls one shard's log over new segments, whose files
//! are made with two fsyncs each, while a reader GETs blocks held in RAM
//! from both shards. The reader's requests are answered at RAM speed, the
//! writer's wait for the disk, and the stall detector reports nothing. On a
//! build that creates segments on the shard's own thread the reader waits
//! out the fsyncs and the detector names `segment::create_file`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{client, payload, set_flag, start, test_args, Strace};

/// How long each fsync is held.
const FSYNC_DELAY: Duration = Duration::from_millis(1500);

/// Keys owned by `shard` of 2 (the owner is xxh3-128 of the key mod shards).
fn keys_of(shard: usize, prefix: &str, n: usize) -> Vec<String> {
    (0..).map(|i| format!("{prefix}-{i}")).filter(|k| kvtier_engine::key::BlockHash::of(k.as_bytes()).shard(2) == shard).take(n).collect()
}

#[test]
fn segment_rollovers_under_slow_fsyncs_leave_ram_hits_and_the_other_shard_at_ram_speed() {
    let dir = tempfile::tempdir().unwrap();
    let stall_log = dir.path().join("stalls.jsonl");
    let mut args = test_args(&dir.path().join("data"));
    // 64 KiB blocks, 8 MiB segments: a rollover every 126 blocks. A RAM tier
    // that keeps the read blocks, write-through (each PUT waits for the log).
    set_flag(&mut args, "--ram-gb", "0.0625");
    set_flag(&mut args, "--stall-log", stall_log.to_str().unwrap());
    let server = start(&args);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let reader = client(&server, true);
    let hot: Vec<String> = [keys_of(0, "hot", 4), keys_of(1, "hot", 4)].concat();
    rt.block_on(async {
        for k in &hot {
            assert_eq!(reader.put(k, vec![payload(k)]).await.unwrap(), http::StatusCode::CREATED);
        }
    });

    let delay = format!("delay_enter={}", FSYNC_DELAY.as_micros());
    let filters = ["trace=fsync,fdatasync".to_string(), format!("inject=fsync:{delay}"), format!("inject=fdatasync:{delay}")];
    let _slow = Strace::attach(server.pid(), &filters, &dir.path().join("strace.log"));
    let writing = Arc::new(AtomicBool::new(true));
    let url = server.url.clone();
    let writer = {
        let writing = writing.clone();
        std::thread::spawn(move || {
            // Three segments' worth on shard 0: two rollovers or more,
            // each a new segment file (two fsyncs) unless the spare is ready.
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let c = kvtier_loadgen::client::Client::new(&url, true, 1).unwrap();
            let mut slowest = Duration::ZERO;
            rt.block_on(async {
                for k in keys_of(0, "cold", 3 * 126) {
                    let started = Instant::now();
                    assert!(c.put(&k, vec![payload(&k)]).await.unwrap().is_success());
                    slowest = slowest.max(started.elapsed());
                }
            });
            writing.store(false, Ordering::SeqCst);
            slowest
        })
    };
    let mut slowest_read = Duration::ZERO;
    let mut reads = 0u64;
    rt.block_on(async {
        while writing.load(Ordering::SeqCst) {
            for k in &hot {
                let started = Instant::now();
                let (body, tier) = reader.get(k).await.unwrap().expect("a hot block is there");
                assert_eq!(body.to_bytes(), payload(k));
                assert_eq!(tier.as_deref(), Some("ram"), "{k}");
                slowest_read = slowest_read.max(started.elapsed());
                reads += 1;
            }
        }
    });
    let slowest_write = writer.join().unwrap();
    drop(_slow);
    let stats = rt.block_on(common::json_call(&reader, http::Method::GET, "/v1/stats", None)).1;
    server.stop();
    eprintln!("reads {reads}: slowest {slowest_read:?}; slowest write {slowest_write:?}; fsync delay {FSYNC_DELAY:?}");
    // The fault was there: some write waited for a delayed fsync (its own
    // segment's, or the spare's it needed).
    assert!(slowest_write >= FSYNC_DELAY, "no write waited on the disk: the test did not exercise a rollover");
    assert!(reads >= hot.len() as u64 * 4, "too few reads ({reads}) to judge");
    // RAM hits of both shards never waited for one: a tenth of one delay is
    // far above a RAM hit (milliseconds) and far below a blocked shard
    // (two delays per segment).
    assert!(slowest_read < FSYNC_DELAY / 10, "a RAM hit waited {slowest_read:?} while a segment was created");
    let stalls = std::fs::read_to_string(&stall_log).unwrap_or_default();
    assert!(stalls.is_empty(), "the stall detector reported:\n{stalls}");
    assert_eq!(stats["stalls"]["stalls"], 0, "{}", stats["stalls"]);
    assert!(stats["per_shard"][0]["segments"].as_u64().unwrap() >= 3, "{}", stats["per_shard"][0]);
}
