//! The block API's listening sockets: one per shard with `SO_REUSEPORT`,
//! under a per-port lock that keeps a second kvtier off the port.

use std::net::SocketAddr;

/// How long a live server has to answer the start-up probe's
/// `GET /healthz` before the listener is taken for an orphan.
const PROBE_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// How long start-up waits for an orphaned listening socket (a killed
/// process's, which io_uring tears down asynchronously) to go away.
const ORPHAN_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(10);

/// What answers on a port.
#[derive(Debug, PartialEq, Eq)]
enum PortState {
    /// Nothing accepts connections there.
    Free,
    /// A connection is accepted but nobody answers a request on it: the
    /// listening socket of a process that is gone (after `kill -9`,
    /// io_uring keeps it accepting for about a second).
    Orphaned,
    /// A live server answered.
    Live,
}

/// Connects to `probe` and, if that works, sends `GET /healthz` and waits up
/// to [`PROBE_ANSWER_TIMEOUT`] for any HTTP answer.
fn probe_port(probe: SocketAddr) -> PortState {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&probe, PROBE_ANSWER_TIMEOUT) else {
        return PortState::Free;
    };
    let _ = stream.set_read_timeout(Some(PROBE_ANSWER_TIMEOUT));
    let _ = stream.set_write_timeout(Some(PROBE_ANSWER_TIMEOUT));
    if stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: kvtier-start-probe\r\nConnection: close\r\n\r\n").is_err() {
        return PortState::Orphaned;
    }
    let mut answer = [0u8; 5];
    let mut got = 0;
    let deadline = std::time::Instant::now() + PROBE_ANSWER_TIMEOUT;
    while got < answer.len() && std::time::Instant::now() < deadline {
        match stream.read(&mut answer[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    // Any HTTP answer (even 401 from a server with a token) is a live server;
    // so is any other byte: some other program owns the port.
    if got > 0 {
        PortState::Live
    } else {
        PortState::Orphaned
    }
}

/// The block API's listening sockets, one per shard, and the lock that
/// keeps the port this process's while they live.
pub(crate) struct Listeners {
    /// One per shard, each bound with `SO_REUSEPORT` to the same address,
    /// so the kernel spreads connections across the shards.
    pub(crate) sockets: Vec<std::net::TcpListener>,
    /// The port's lock, held while this value lives.
    _lock: PortLock,
}

impl Listeners {
    /// Hands the sockets over (to the shards); the lock stays with `self`,
    /// which the caller keeps for as long as it serves.
    /// The address the sockets listen on (with the port the kernel chose
    /// for port 0); `None` once they were taken.
    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        self.sockets.first()?.local_addr().ok()
    }

    pub(crate) fn take_sockets(&mut self) -> Vec<std::net::TcpListener> {
        std::mem::take(&mut self.sockets)
    }
}

/// Where the lock file of `port` lives: `$XDG_RUNTIME_DIR` when set, else
/// the temporary directory (shared by every process of this host that
/// could bind the port).
fn port_lock_path(port: u16) -> std::path::PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    dir.join(format!("kvtier-port-{port}.lock"))
}

/// The port's lock: an exclusive `flock` on its lock file, held while
/// this value lives. Dropped at a clean stop, it removes the file first
/// (still locked, so a kvtier starting meanwhile either fails to lock it
/// or finds it gone from the path and locks a fresh one); after `kill -9`
/// the kernel releases the lock and the next start reuses the file.
pub(crate) struct PortLock {
    /// The locked file; the lock goes when it closes.
    _file: std::fs::File,
    path: std::path::PathBuf,
}

impl Drop for PortLock {
    fn drop(&mut self) {
        // `_file` (and with it the lock) closes after this, once the path
        // no longer names it.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Takes the port's lock: an exclusive, non-blocking `flock` on the file
/// at [`port_lock_path`], kept only if that path still names the file
/// locked (another kvtier's clean stop may have removed it in between:
/// then try again with a fresh one).
fn lock_port(port: u16) -> Result<PortLock, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    use std::os::unix::io::AsRawFd;
    let path = port_lock_path(port);
    for _ in 0..100 {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .open(&path)
            .or_else(|_| std::fs::File::open(&path))
            .map_err(|e| format!("cannot open the port's lock file {}: {e}", path.display()))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(format!("a server already accepts connections there: another kvtier holds port {port} ({})", path.display()));
        }
        let locked = file.metadata().map_err(|e| format!("{}: {e}", path.display()))?;
        if std::fs::metadata(&path).is_ok_and(|now| now.ino() == locked.ino() && now.dev() == locked.dev()) {
            return Ok(PortLock { _file: file, path });
        }
    }
    Err(format!("the port's lock file {} kept changing under us", path.display()))
}

/// Binds the block API's sockets, one per shard. Each has `SO_REUSEPORT`
/// (the kernel spreads connections over the shards; one socket shared by
/// every shard's ring would hand nearly all of them to one shard), which
/// would also let a second kvtier join the port unnoticed: so the port is
/// first locked for the life of the process (`flock` on a lock file named
/// by the port, [`port_lock_path`]), which no two kvtier processes can
/// hold at once however their starts interleave.
///
/// With the lock held, whatever still listens on the port is not a
/// kvtier that lives: a listener that answers `GET /healthz` (anything,
/// even 401) is another server, refused at once; one that accepts but
/// does not answer is the orphaned socket of a killed process (io_uring
/// closes it within about a second): wait up to [`ORPHAN_WAIT_MAX`] for it
/// to go, then refuse, rather than listen beside it.
pub(crate) fn bind_listeners(addr: SocketAddr, shards: usize) -> Result<Listeners, String> {
    // Port 0: the kernel picks the port with the first bind; lock that one.
    let (first, port) = if addr.port() == 0 {
        let first = try_bind(addr).map_err(|e| e.to_string())?;
        let port = first.local_addr().map_err(|e| e.to_string())?.port();
        (Some(first), port)
    } else {
        (None, addr.port())
    };
    let lock = lock_port(port)?;
    if first.is_none() {
        wait_for_orphans(addr)?;
    }
    let bound = SocketAddr::new(addr.ip(), port);
    let mut sockets: Vec<std::net::TcpListener> = first.into_iter().collect();
    while sockets.len() < shards.max(1) {
        sockets.push(try_bind(bound).map_err(|e| e.to_string())?);
    }
    Ok(Listeners { sockets, _lock: lock })
}

/// With the port locked: returns once nothing listens on `addr`, or fails
/// for a live listener, or one still there after [`ORPHAN_WAIT_MAX`].
fn wait_for_orphans(addr: SocketAddr) -> Result<(), String> {
    let probe = match addr.ip() {
        ip if ip.is_unspecified() && addr.is_ipv4() => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        ip if ip.is_unspecified() => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port())),
        _ => addr,
    };
    let started = std::time::Instant::now();
    let mut warned = false;
    loop {
        match probe_port(probe) {
            PortState::Free => {
                if warned {
                    tracing::info!("the orphaned listener on {addr} closed after {} ms", started.elapsed().as_millis());
                }
                return Ok(());
            }
            PortState::Live => return Err("a server already accepts connections there and answers requests".into()),
            PortState::Orphaned if started.elapsed() >= ORPHAN_WAIT_MAX => {
                return Err(format!("a listener there still accepts without answering after {ORPHAN_WAIT_MAX:?}; not listening beside it"))
            }
            PortState::Orphaned => {
                if !warned {
                    tracing::warn!(
                        "a listener on {addr} accepts connections but does not answer (a killed process's socket, closing); waiting for it"
                    );
                    warned = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
}

/// One socket on `addr` with `SO_REUSEADDR` (a restart binds past the old
/// connections in TIME-WAIT) and `SO_REUSEPORT` (one per shard), listening
/// with a backlog of 1024 (glommio's own).
fn try_bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}
