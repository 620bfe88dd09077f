//! An executor never parks while a task it has woken is waiting to run.
//!
//! glommio 0.9.0 parked (slept in `io_uring_enter`) when its preemption
//! timer had already fired by the time it looked at its task queues: it ran
//! nothing, found the main future pending and slept, with woken tasks still
//! queued and nothing left to wake it (kvtier's glommio patch 6,
//! vendor/glommio/KVTIER-PATCH.md). In kvtier that was a start that never
//! listened: the shards' mesh join slept forever on a loaded machine (6
//! concurrent 4-shard starts on 2 cores: 5 to 11 of every 12–18 hung). The
//! test makes the window wide: a 20 µs preemption timer (kvtier's is 10 ms)
//! often fires between the executor's poll for I/O and its look at the task
//! queues, while two tasks hand a token back and forth with nothing else
//! (no timer, no I/O) that could wake a sleeping executor. Unpatched, it
//! hung 3 of 3 runs; patched, it ends in under 2 s. A timer of a
//! microsecond is too short: it fires again before every look, and the
//! patched executor then polls for I/O over and over without running a task.

use std::sync::mpsc;
use std::time::Duration;

use glommio::channels::local_channel;

/// The preemption timer, in microseconds: short enough to fire inside the
/// window often, long enough to let a task run once it has been re-armed.
const PREEMPT_US: u64 = 20;

/// Round trips of the token: enough that the window is hit many times over.
const ROUND_TRIPS: usize = 200_000;

#[test]
fn an_executor_whose_preemption_timer_fired_runs_its_woken_tasks_instead_of_parking() {
    let (done_tx, done_rx) = mpsc::channel();
    let executor = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .preempt_timer(Duration::from_micros(PREEMPT_US))
        .name("parking-test")
        .spawn(move || async move {
            let (ping_tx, ping_rx) = local_channel::new_bounded::<usize>(1);
            let (pong_tx, pong_rx) = local_channel::new_bounded::<usize>(1);
            let echo = glommio::spawn_local(async move {
                while let Some(n) = ping_rx.recv().await {
                    if pong_tx.send(n).await.is_err() {
                        break;
                    }
                }
            })
            .detach();
            for n in 0..ROUND_TRIPS {
                ping_tx.send(n).await.unwrap();
                assert_eq!(pong_rx.recv().await, Some(n));
            }
            drop(ping_tx);
            echo.await;
            done_tx.send(()).unwrap();
        })
        .unwrap();
    match done_rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => executor.join().unwrap(),
        // The executor thread sleeps for good: fail without joining it.
        Err(_) => panic!("the executor parked with a woken task queued: {ROUND_TRIPS} round trips did not end in 60 s"),
    }
}
