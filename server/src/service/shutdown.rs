//! Shutdown as a broadcast: requested once (SIGTERM, SIGINT, a failed
//! start), seen by every task on every shard that waits for it, each woken
//! by the request itself rather than polling a flag.

use std::sync::atomic::{AtomicBool, Ordering};

use event_listener::Event;

/// The process's shutdown request.
#[derive(Default)]
pub struct Shutdown {
    requested: AtomicBool,
    event: Event,
}

impl Shutdown {
    /// Requests shutdown and wakes every task waiting in
    /// [`Shutdown::requested`] (on any thread). Idempotent.
    pub fn request(&self) {
        self.requested.store(true, Ordering::SeqCst);
        self.event.notify(usize::MAX);
    }

    /// Whether shutdown was requested.
    pub fn is_requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// Resolves once shutdown is requested (at once if it was).
    pub async fn requested(&self) {
        loop {
            if self.is_requested() {
                return;
            }
            // Listen, then look again: a request between the two is seen.
            let listener = self.event.listen();
            if self.is_requested() {
                return;
            }
            listener.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_waiter_on_every_thread_wakes_at_the_request() {
        let shutdown = Arc::new(Shutdown::default());
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let s = shutdown.clone();
                std::thread::spawn(move || futures_lite::future::block_on(s.requested()))
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!shutdown.is_requested());
        shutdown.request();
        for w in waiters {
            w.join().unwrap();
        }
        // After the request, a new waiter returns at once.
        futures_lite::future::block_on(shutdown.requested());
    }
}
