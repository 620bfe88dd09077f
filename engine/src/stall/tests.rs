//! The stall detector on real executors: a blocked thread, a long stall
//! sampled again, a busy one that yields, the causes told apart.

use super::*;

#[inline(never)]
fn block_thread_for(d: Duration) {
    std::thread::sleep(d);
}

#[test]
fn a_blocked_shard_is_counted_and_logged_with_the_frame_it_was_in() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stalls.jsonl");
    let stalls = Stalls::new(1, Duration::from_millis(40), Some(log.clone())).unwrap();
    let handler = stalls.handler(0);
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .preempt_timer(PREEMPT_BUDGET)
        .detect_stalls(Some(handler))
        .spawn(|| async move {
            // A quick task: no stall.
            glommio::timer::sleep(Duration::from_millis(5)).await;
            // A blocking call on the shard's thread: one stall.
            block_thread_for(Duration::from_millis(150));
            glommio::timer::sleep(Duration::from_millis(5)).await;
        })
        .unwrap()
        .join()
        .unwrap();
    stalls.stop();
    let s = &stalls.shard_stats()[0];
    assert_eq!(s.stalls, 1, "{s:?}");
    assert!(s.longest_ms >= 150.0 && s.longest_ms < 1000.0, "{s:?}");
    assert_eq!(s.durations.count(), 1);
    let last = s.last.as_ref().expect("logged");
    assert!(last.frames[0].contains("nanosleep"), "{:?}", last.frames);
    assert_eq!(last.cause, "blocked", "{last:?}");
    assert!(last.blocked >= 1 && last.cpu_ms < 100.0, "{last:?}");
    assert!(last.frames.iter().any(|f| f.contains("block_thread_for")), "{:?}", last.frames);
    let lines = std::fs::read_to_string(&log).unwrap();
    let record: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(record["shard"], 0);
    assert!(record["duration_ms"].as_f64().unwrap() >= 150.0, "{record}");
}

#[test]
fn a_long_stall_is_sampled_again_and_says_where_it_stayed() {
    let stalls = Stalls::new(1, Duration::from_millis(40), None).unwrap();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .preempt_timer(PREEMPT_BUDGET)
        .detect_stalls(Some(stalls.handler(0)))
        .spawn(|| async move {
            block_thread_for(Duration::from_millis(500));
            spin_for(Duration::from_millis(1800));
        })
        .unwrap()
        .join()
        .unwrap();
    stalls.stop();
    let last = stalls.shard_stats()[0].last.clone().expect("one stall");
    assert!(last.samples >= 2, "{last:?}");
    // Slept 500 ms, then computed 1.8 s: it blocked (and computed).
    assert_eq!(last.cause, "blocked", "{last:?}");
    assert!(last.cpu_ms >= 1000.0, "{last:?}");
    assert!(last.frames.iter().any(|f| f.contains("block_thread_for")), "{:?}", last.frames);
    // The last sample is in the computation, not the sleep it began with
    // (a sample inside a leaf function may lose its caller's frame, so
    // the test's own frame is what is asked for).
    assert!(!last.last_frames.is_empty() && !last.last_frames[0].contains("nanosleep"), "{:?}", last.last_frames);
    assert!(last.last_frames.iter().any(|f| f.contains("a_long_stall_is_sampled_again")), "{:?}", last.last_frames);
}

/// Computes for `d`, reading the clock rarely (a sample landing in the
/// vDSO's clock loses its caller's frame).
#[inline(never)]
fn spin_for(d: Duration) {
    let until = std::time::Instant::now() + d;
    let mut x = 1u64;
    while std::time::Instant::now() < until {
        for _ in 0..1_000_000 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

#[test]
fn a_busy_shard_that_yields_is_not_a_stall() {
    let stalls = Stalls::new(1, Duration::from_millis(40), None).unwrap();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .preempt_timer(PREEMPT_BUDGET)
        .detect_stalls(Some(stalls.handler(0)))
        .spawn(|| async move {
            // 300 ms of work in 2 ms steps, yielding between them.
            let until = std::time::Instant::now() + Duration::from_millis(300);
            while std::time::Instant::now() < until {
                let step = std::time::Instant::now() + Duration::from_millis(2);
                while std::time::Instant::now() < step {
                    std::hint::spin_loop();
                }
                glommio::yield_if_needed().await;
            }
        })
        .unwrap()
        .join()
        .unwrap();
    stalls.stop();
    assert_eq!(stalls.shard_stats()[0].stalls, 0);
}

#[test]
fn a_stall_is_told_computing_blocked_memory_or_waiting_for_a_cpu() {
    let usage = |cpu_ms: u64, voluntary: u64| Usage { cpu_us: cpu_ms * 1000, voluntary, involuntary: 3 };
    let frames = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let fsync = frames(&["__GI___fsync (./io/../sysdeps/unix/sysv/linux/fsync.c:27)", "kvtier_engine::segment::create_file"]);
    let futex = frames(&["syscall (./misc/../sysdeps/unix/sysv/linux/x86_64/syscall.S:37)"]);
    let send = frames(&["__libc_sendmsg (./socket/../sysdeps/unix/sysv/linux/sendmsg.c:28)", "glommio::task::task_impl::Task::run"]);
    let shutdown = frames(&["__GI_shutdown (./socket/../sysdeps/unix/syscall-template.S:120)", "glommio::sys::shutdown"]);
    assert_eq!(cause_of(1400.0, usage(0, 1), &shutdown), CAUSE_MEMORY, "a socket's shutdown waits for nothing");
    let fault = frames(&["__memset_avx512_unaligned_erms (./string/../sysdeps/x86_64/multiarch/memset-vec-unaligned-erms.S:235)"]);
    assert_eq!(cause_of(100.0, usage(90, 0), &fault), CAUSE_COMPUTING);
    assert_eq!(cause_of(1400.0, usage(1, 2), &fsync), CAUSE_BLOCKED);
    assert_eq!(cause_of(1400.0, usage(1, 2), &futex), CAUSE_BLOCKED);
    assert_eq!(cause_of(1400.0, usage(10, 19), &send), CAUSE_MEMORY, "a send that never waits slept allocating");
    assert_eq!(cause_of(1400.0, usage(0, 3), &fault), CAUSE_MEMORY, "a page fault");
    assert_eq!(cause_of(1200.0, usage(12, 0), &fault), CAUSE_WAITING_FOR_CPU);
    let record = |cause: &str| StallRecord {
        unix_s: 0.0,
        pid: 1,
        shard: 0,
        duration_ms: 1200.0,
        threshold_ms: 50.0,
        queue: "default".into(),
        frames: vec![],
        last_frames: vec![],
        samples: 1,
        cpu_ms: 12.0,
        blocked: 0,
        preempted: 3,
        cause: cause.into(),
    };
    assert_eq!(record(CAUSE_WAITING_FOR_CPU).own_ms(), 12.0, "the machine's part is not kvtier's");
    assert_eq!(record(CAUSE_MEMORY).own_ms(), 12.0);
    assert_eq!(record(CAUSE_BLOCKED).own_ms(), 1200.0);
    assert_eq!(record(CAUSE_COMPUTING).own_ms(), 1200.0);
}

#[test]
fn a_threshold_under_the_least_is_refused() {
    let e = Stalls::new(1, Duration::from_millis(5), None).unwrap_err();
    assert!(e.contains("--stall-threshold-ms must be at least 20"), "{e}");
}

#[test]
fn a_stalls_end_is_when_its_run_ended_not_when_the_reporter_got_to_it() {
    // The reporter resolves symbols (a second or more on a busy machine) and
    // reports stalls one at a time; `make test` places a stall against a
    // test's SIGSTOPs by its end, so the end must be the run's.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stalls.jsonl");
    let stalls = Stalls::new(1, Duration::from_millis(40), Some(log.clone())).unwrap();
    // Held, the shard's last-stall slot keeps the reporter on the first stall.
    let held = stalls.shards[0].last.lock().unwrap();
    let handler = stalls.handler(0);
    let ended = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .preempt_timer(PREEMPT_BUDGET)
        .detect_stalls(Some(handler))
        .spawn(|| async move {
            block_thread_for(Duration::from_millis(100));
            glommio::timer::sleep(Duration::from_millis(5)).await;
            block_thread_for(Duration::from_millis(100));
            let ended = std::time::SystemTime::now();
            glommio::timer::sleep(Duration::from_millis(5)).await;
            ended
        })
        .unwrap()
        .join()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    drop(held);
    stalls.stop();
    let lines = std::fs::read_to_string(&log).unwrap();
    let records: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 2, "{lines}");
    let ended = ended.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let late_s = records[1]["unix_s"].as_f64().unwrap() - ended;
    assert!((-0.001..0.5).contains(&late_s), "the second stall is placed {late_s:.3} s after its run ended");
}
