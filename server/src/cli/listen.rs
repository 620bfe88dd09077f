//! The block API's listening socket, bound once for every shard.

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

/// Binds the block API's listening socket, once for every shard, with
/// `SO_REUSEADDR` and without `SO_REUSEPORT`: the kernel then refuses the
/// address to any other process while this one listens (a check before
/// a shared bind could race with another start), and a restart right
/// after a stop still binds past the old connections in TIME-WAIT.
///
/// While the address is in use: a listener that answers `GET /healthz`
/// (anything, even 401) is a live server, refused at once; one that
/// accepts but does not answer is the orphaned socket of a killed
/// process (io_uring closes it within about a second): wait up to
/// [`ORPHAN_WAIT_MAX`] for it to go, then refuse.
pub(crate) fn bind_listener(addr: SocketAddr) -> Result<std::net::TcpListener, String> {
    let probe = match addr.ip() {
        ip if ip.is_unspecified() && addr.is_ipv4() => SocketAddr::from(([127, 0, 0, 1], addr.port())),
        ip if ip.is_unspecified() => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port())),
        _ => addr,
    };
    let started = std::time::Instant::now();
    let mut warned = false;
    loop {
        let in_use = match try_bind(addr) {
            Ok(listener) => {
                if warned {
                    tracing::info!("the orphaned listener on {addr} closed after {} ms", started.elapsed().as_millis());
                }
                return Ok(listener);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => e,
            Err(e) => return Err(e.to_string()),
        };
        match probe_port(probe) {
            PortState::Live => return Err("a server already accepts connections there and answers requests".into()),
            _ if started.elapsed() >= ORPHAN_WAIT_MAX => {
                return Err(format!(
                    "the address is still in use after {ORPHAN_WAIT_MAX:?} ({in_use}) by a socket that does not answer requests; \
                     not listening beside it"
                ))
            }
            state => {
                if !warned {
                    let what = match state {
                        PortState::Orphaned => "accepts connections but does not answer (a killed process's socket, closing)",
                        _ => "is bound by a socket that does not accept connections",
                    };
                    tracing::warn!("a listener on {addr} {what}; waiting for it");
                    warned = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
}

/// One bind attempt: a TCP socket on `addr` with `SO_REUSEADDR`, listening
/// with a backlog of 1024 (glommio's own).
fn try_bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}
