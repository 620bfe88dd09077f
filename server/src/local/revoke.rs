//! Cancel means cancel (docs/LOCAL.md, "When a client gives up"): once a
//! client has given up on a connection, or unregistered a buffer, the server
//! touches none of that memory for it again.
//!
//! A client that times out reuses its memory (a staging slot, the engine's
//! own KV pages), so a copy into it that lands after the client gave up
//! corrupts the client, and a copy out of it stores whatever the client put
//! there since. Every copy into or out of a registered region therefore
//! asks first, at copy time, whether it is still wanted, for items already
//! running as tasks too:
//! - [`Peer`]: the connection's client. Gone once the connection's reader
//!   saw the end of the client's stream (EOF, a reset, a framing error),
//!   once the server closes it, or as soon as the socket itself says the
//!   peer hung up (`POLLRDHUP`: a shutdown of its writing side, a close), so
//!   a copy on a busy shard learns of it before that shard's reader runs.
//! - [`Claim`]: one region's permission to copy: its [`Peer`], its own
//!   revocation (`UNREGISTER`), and a count of the copies running now, so a
//!   revocation returns only once no copy runs and none can start.
//!
//! A copy is entered piece by piece ([`COPY_PIECE_BYTES`]), so a revocation
//! stops a block's copy between pieces.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes of client memory one [`Claim::enter`] covers at most: a copy into
/// or out of a region asks again before each piece.
pub const COPY_PIECE_BYTES: usize = 256 << 10;

/// A connection's client, as copies into and out of its memory see it.
pub struct Peer {
    /// Set once the client gave up or the server closed the connection.
    gone: AtomicBool,
    /// A duplicate of the connection's socket, polled for the peer's
    /// hang-up; `None` when it could not be duplicated (then the reader's
    /// [`Peer::give_up`] alone ends the copies).
    socket: Option<OwnedFd>,
}

impl Peer {
    /// The client at the other end of `stream`.
    pub fn new(stream: &UnixStream) -> Peer {
        let socket = match stream.try_clone() {
            Ok(s) => Some(OwnedFd::from(s)),
            Err(e) => {
                tracing::debug!(
                    "local connection: cannot duplicate the socket to watch it ({e}); copies stop when its reader sees the end"
                );
                None
            }
        };
        Peer { gone: AtomicBool::new(false), socket }
    }

    /// A client no connection watches (a region made outside one: tests,
    /// fuzzing): only [`Peer::give_up`] and revocations end its copies.
    pub fn detached() -> Peer {
        Peer { gone: AtomicBool::new(false), socket: None }
    }

    /// The client gave up (or the server is closing): no copy into or out
    /// of its memory starts from now on.
    pub fn give_up(&self) {
        self.gone.store(true, Ordering::SeqCst);
    }

    /// Whether the client has given up, as far as known without a syscall.
    fn is_gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Whether the client still wants its memory touched: `false` once it
    /// gave up, or once its socket says it hung up (one `poll`, no wait).
    pub fn wants(&self) -> bool {
        if self.is_gone() {
            return false;
        }
        if let Some(fd) = &self.socket {
            let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
            // SAFETY: poll of one descriptor we own, with no wait.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            if n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                self.give_up();
                return false;
            }
        }
        true
    }
}

/// One registered region's permission to copy.
pub struct Claim {
    peer: Arc<Peer>,
    revoked: AtomicBool,
    copying: AtomicUsize,
}

/// A copy under way ([`Claim::enter`]); ends when dropped.
pub struct Copying<'a>(&'a Claim);

impl Drop for Copying<'_> {
    fn drop(&mut self) {
        self.0.copying.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Claim {
    /// A claim of a region registered on `peer`'s connection.
    pub fn new(peer: Arc<Peer>) -> Claim {
        Claim { peer, revoked: AtomicBool::new(false), copying: AtomicUsize::new(0) }
    }

    /// The connection's client.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Starts one copy of at most [`COPY_PIECE_BYTES`]: `None` when the
    /// region was revoked or its client gave up, the socket asked too
    /// ([`Peer::wants`]: one `poll`, no wait, until the hang-up is seen).
    /// Each piece asks the socket because the connection's reader may not
    /// run before a copy ends: a shard copying a 16 MiB block runs no
    /// other task meanwhile, and a server held still mid-copy (SIGSTOP)
    /// and run again went on copying whole blocks into memory its client
    /// had taken back (up to 28 MB a batch); asked per piece, only the
    /// piece it was in lands.
    pub fn enter(&self) -> Option<Copying<'_>> {
        self.copying.fetch_add(1, Ordering::SeqCst);
        let copying = Copying(self);
        // Both sides are SeqCst: either this sees the revocation, or
        // `revoke` sees this copy and waits for it.
        (!self.revoked.load(Ordering::SeqCst) && self.peer.wants()).then_some(copying)
    }

    /// Whether copies may still start, without asking the socket (a caller
    /// asks [`Peer::wants`] once for all the regions of an item): not
    /// revoked, and the client not known to be gone.
    pub fn wanted_here(&self) -> bool {
        !self.revoked.load(Ordering::SeqCst) && !self.peer.is_gone()
    }

    /// Revokes the region: once this returns, no copy into or out of it runs
    /// and none starts. Waits for the copies running now (a piece each, on
    /// other shards' threads; this thread runs none while it waits).
    pub fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
        while self.copying.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }
}

/// The error a copy met that was no longer wanted (kind `ConnectionAborted`,
/// which [`is_cancelled`] tells).
pub fn cancelled() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the client gave up on this memory (docs/LOCAL.md, CANCELLED)")
}

/// Whether `e` is [`cancelled`]'s.
pub fn is_cancelled(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::ConnectionAborted
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    impl Claim {
        fn wanted(&self) -> bool {
            self.wanted_here() && self.peer.wants()
        }
    }

    fn pair() -> (Arc<Peer>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        (Arc::new(Peer::new(&ours)), theirs)
    }

    #[test]
    fn a_copy_starts_only_while_wanted() {
        let (peer, _client) = pair();
        let claim = Claim::new(peer.clone());
        assert!(claim.wanted() && claim.enter().is_some());
        claim.revoke();
        assert!(!claim.wanted() && claim.enter().is_none(), "revoked (UNREGISTER)");
        let other = Claim::new(peer.clone());
        assert!(other.enter().is_some(), "another region of the connection is not revoked");
        peer.give_up();
        assert!(other.enter().is_none() && !other.wanted(), "the client gave up");
    }

    #[test]
    fn a_client_that_shuts_down_its_writing_side_is_seen_at_copy_time() {
        let (peer, client) = pair();
        let claim = Claim::new(peer);
        assert!(claim.wanted());
        client.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(!claim.wanted(), "POLLRDHUP");
        assert!(claim.enter().is_none(), "and remembered: no poll needed");
        // A copy already past its item's check asks again at each piece:
        // the hang-up is seen there, with no reader and no give_up.
        let (peer, client) = pair();
        let claim = Claim::new(peer.clone());
        assert!(claim.enter().is_some());
        client.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(claim.enter().is_none(), "a copy's next piece started after the client hung up");
        assert!(peer.is_gone(), "the hang-up is remembered for the other copies");
        let (peer, client) = pair();
        drop(client);
        assert!(!Claim::new(peer).wanted(), "closed");
    }

    #[test]
    fn a_revocation_waits_for_the_copy_running() {
        let (peer, _client) = pair();
        let claim = Arc::new(Claim::new(peer));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let copier = {
            let claim = claim.clone();
            std::thread::spawn(move || {
                let copying = claim.enter().expect("wanted");
                started_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(200));
                // The copy's end is taken before the guard goes: once it
                // goes, `revoke` may return and be timed before this thread
                // runs again (it failed that way in a cold CI run).
                let ended = Instant::now();
                drop(copying);
                ended
            })
        };
        started_rx.recv().unwrap();
        claim.revoke();
        let revoked = Instant::now();
        assert!(copier.join().unwrap() <= revoked, "revoke returned before the copy ended");
        assert!(claim.enter().is_none());
    }
}
