//! A request that times out says where its bytes are, which tells the
//! causes of a silent server apart (client/src/conn.rs, `queued_bytes`):
//! a server that stopped reading leaves the request in the socket, one that
//! read it and never answered leaves nothing.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::time::Duration;

use kvtier_client::{Connection, Error};
use kvtier_local_proto::{frame, Op};

/// A server on a fresh socket that accepts one connection and, when
/// `reads`, reads every byte sent, answering nothing; else reads nothing.
fn silent_server(reads: bool) -> (tempfile::TempDir, String, std::thread::JoinHandle<()>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kv.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut sink = Vec::new();
        if reads {
            let _ = s.read_to_end(&mut sink);
        } else {
            // Held open, unread, until the client has given up.
            std::thread::sleep(Duration::from_millis(1500));
            drop(s);
        }
    });
    (dir, path.to_str().unwrap().to_string(), server)
}

fn timed_out_message(reads: bool) -> String {
    let (_dir, path, server) = silent_server(reads);
    let conn = Connection::connect(&path).expect("connect");
    let payload = kvtier_local_proto::encode_keys(&["a-key"]);
    let err = conn.call(Op::Exists as u8, &payload, None, Duration::from_millis(300)).expect_err("no answer");
    drop(conn);
    server.join().unwrap();
    match err {
        Error::Code { message, .. } => message,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_request_the_server_never_read_is_named_so() {
    let sent = frame(Op::Exists as u8, 1, &kvtier_local_proto::encode_keys(&["a-key"])).len();
    let message = timed_out_message(false);
    assert!(message.contains("no answer to EXISTS"), "{message}");
    let queued: usize =
        message.split("the socket holds ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok()).expect(&message);
    assert!(queued >= sent && message.contains("sent and not yet read by the server"), "{message}");
}

#[test]
fn a_request_the_server_read_and_never_answered_leaves_nothing_queued() {
    let message = timed_out_message(true);
    assert!(
        message.contains("holds 0 bytes (with the kernel's overhead) sent and not yet read by the server, 0 bytes received"),
        "{message}"
    );
}
