//! Cancel means cancel (docs/LOCAL.md, "When a client gives up"): requests
//! sent to a server held still with SIGSTOP by a client that then gives up
//! (shuts down its writing side) copy nothing into its memory and store
//! nothing out of it once the server runs again; they are answered
//! `CANCELLED`, counted, and the connection is closed. (The Python client's
//! side, timeouts included: clients/python/tests/test_local_cancel.py.)

mod common;

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use common::local::{items_payload, memfd, read_at, write_at, Raw, GET_INTO, PUT_FROM};
use common::{start, test_args, Server, BLOCK_BYTES};

const CANCELLED: i64 = -25;
const NOT_FOUND: i64 = -2;

fn socket_of(server: &Server) -> PathBuf {
    server.data_dir.join("kvtier.sock")
}

/// `/v1/stats` `local`, over a plain HTTP/1.1 exchange.
fn local_stats(server: &Server) -> serde_json::Value {
    let body = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    let json = &body[body.find("\r\n\r\n").expect("headers end") + 4..];
    serde_json::from_str::<serde_json::Value>(json).unwrap_or_else(|e| panic!("stats JSON: {e}: {json}"))["local"].clone()
}

/// The server stopped (SIGSTOP) while `f` runs, then let go (SIGCONT).
fn frozen<T>(server: &Server, f: impl FnOnce() -> T) -> T {
    let pid = server.pid() as libc::pid_t;
    // SAFETY: signals to the test's own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stat = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    while stat().rsplit(')').next().unwrap().split_whitespace().next() != Some("T") {
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = f();
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    out
}

/// A connection with `fd`'s first `blocks` blocks registered (handle 1).
fn registered(server: &Server, fd: &OwnedFd, blocks: u64) -> Raw {
    let mut r = Raw::ready(&socket_of(server));
    let a = r.register(&[std::os::fd::AsRawFd::as_raw_fd(fd)], 0, blocks * BLOCK_BYTES);
    assert_eq!(a.status, 0, "{}", a.message());
    r
}

fn block(seed: u8) -> Vec<u8> {
    (0..BLOCK_BYTES).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn a_get_into_from_a_client_that_gave_up_writes_nothing() {
    for sealed in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let server = start(&test_args(dir.path()));
        let fd = memfd(2 * BLOCK_BYTES, sealed);
        let mut r = registered(&server, &fd, 2);
        write_at(&fd, 0, &block(1));
        assert_eq!(r.call(PUT_FROM, &items_payload(&[(1, 0, BLOCK_BYTES, "k")])).items(), vec![(0, 1)]);
        let mine = vec![0xEE; 2 * BLOCK_BYTES as usize];
        frozen(&server, || {
            r.send(GET_INTO, &items_payload(&[(1, 0, BLOCK_BYTES, "k"), (1, BLOCK_BYTES, BLOCK_BYTES, "k")]));
            r.s.shutdown(std::net::Shutdown::Write).unwrap();
            write_at(&fd, 0, &mine); // the client's memory again
        });
        let answer = r.read().expect("answered after the half-close");
        assert_eq!(answer.items(), vec![(CANCELLED, 0); 2], "sealed {sealed}");
        assert!(r.closed(), "then closed: the client's confirmation");
        assert!(read_at(&fd, 0, 2 * BLOCK_BYTES) == mine, "sealed {sealed}: the server wrote into memory given up on");
        let stats = local_stats(&server);
        assert_eq!(stats["items_cancelled_total"], 2, "{stats}");
        // Healthy: a new connection reads the block.
        let mut again = registered(&server, &fd, 2);
        assert_eq!(again.call(GET_INTO, &items_payload(&[(1, 0, BLOCK_BYTES, "k")])).items()[0].0, BLOCK_BYTES as i64);
        assert!(read_at(&fd, 0, BLOCK_BYTES) == block(1));
    }
}

#[test]
fn a_put_from_a_client_that_gave_up_stores_nothing() {
    for sealed in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let server = start(&test_args(dir.path()));
        let fd = memfd(BLOCK_BYTES, sealed);
        let mut r = registered(&server, &fd, 1);
        write_at(&fd, 0, &block(2));
        frozen(&server, || {
            r.send(PUT_FROM, &items_payload(&[(1, 0, BLOCK_BYTES, "k")]));
            r.s.shutdown(std::net::Shutdown::Write).unwrap();
            write_at(&fd, 0, &block(3)); // written again after giving up
        });
        assert_eq!(r.read().expect("answered").items(), vec![(CANCELLED, 0)], "sealed {sealed}");
        assert!(r.closed());
        let mut again = registered(&server, &fd, 1);
        let got = again.call(GET_INTO, &items_payload(&[(1, 0, BLOCK_BYTES, "k")])).items()[0].0;
        assert_eq!(got, NOT_FOUND, "sealed {sealed}: nothing stored");
        assert_eq!(local_stats(&server)["items_cancelled_total"], 1);
    }
}
