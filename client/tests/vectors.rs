//! The client against the server's frames: every reply vector of
//! `tests/data/local_frame_vectors.json` (written by
//! `local-proto/tests/frame_vectors.rs` from the encoders the server
//! answers with) is served to a real [`Connection`] over a Unix socket, with
//! the request id of the request it answers, and what the op returns must
//! be the vector's fields: the reader's framing, the ids, the status and
//! hint, and each decoder. The requests are `kvtier-local-proto`'s own
//! encoders, checked against the same file by that crate.
//!
//! `MAP_ARENA`/`MAP_INDEX` answers bring a descriptor; they are served with
//! one here too.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use kvtier_client::{BatchItem, Connection, Error, HelloRequest};
use kvtier_local_proto::Op;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(10);

fn vectors() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/local_frame_vectors.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("the vectors file")).expect("JSON")
}

/// Serves `frame` (a reply vector's bytes) to the first request of one
/// connection, with that request's id, then closes; a descriptor goes with
/// it when `with_fd`.
fn serve(frame: Vec<u8>, with_fd: bool) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<()>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kv.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut head = [0u8; 16];
        s.read_exact(&mut head).expect("a request header");
        let n = u32::from_le_bytes(head[4..8].try_into().expect("4")) as usize;
        let mut payload = vec![0u8; n];
        s.read_exact(&mut payload).expect("a request payload");
        let mut frame = frame;
        if frame[2] != 0xFF {
            frame[8..16].copy_from_slice(&head[8..16]);
        }
        if with_fd {
            let file = std::fs::File::open("/dev/null").expect("/dev/null");
            send_fd(&s, &frame, file.as_raw_fd());
        } else {
            s.write_all(&frame).expect("the reply");
        }
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    (dir, path, server)
}

fn send_fd(s: &UnixStream, bytes: &[u8], fd: i32) {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut control = kvtier_local_proto::fds::Control::default();
    let msg = kvtier_local_proto::fds::sending(&mut iov, &mut control, &[fd]);
    // SAFETY: `msg` points at the iovec and control buffer above.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, 0) };
    assert_eq!(n as usize, bytes.len(), "sendmsg");
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("k{i}")).collect()
}

/// What the client's op for `op` returns, as the vectors' fields.
fn ask(conn: &Connection, op: u8, fields: &Value) -> Result<Value, Error> {
    let count = |k: &str| fields[k].as_array().map_or(1, Vec::len);
    let items =
        |n: usize| -> Vec<BatchItem> { (0..n).map(|i| BatchItem { parts: vec![(1, 0, 64)], key: format!("k{i}"), tag: vec![] }).collect() };
    let answer = match Op::from_u8(op) {
        Some(Op::Hello) => json!({ "hello": conn.hello(&HelloRequest { client: "vectors", ..HelloRequest::default() }, T)? }),
        Some(Op::Register) => {
            let (handle, access) = conn.register(std::io::stdin().as_raw_fd(), 0, 4096, T)?;
            json!({ "handle": handle, "access": access })
        }
        Some(Op::Unregister) => {
            conn.unregister(1, T)?;
            json!({})
        }
        Some(o @ (Op::GetInto | Op::PutFrom | Op::GetIntoV | Op::PutFromV)) => {
            // A batch never fails as a whole: a request's failure is its items' code.
            let a = conn.batch(o, &items(count("results")), T, 0.0);
            json!({ "results": a.results, "retry_after_ms": a.retry_after_ms, "failures": a.failures })
        }
        Some(Op::Exists) => json!({ "tiers": conn.exists(&keys(count("tiers")), T)? }),
        Some(Op::Lookup) => {
            let (hits, tiers) = conn.lookup(&keys(3), T)?;
            json!({ "prefix_hits": hits, "tiers": tiers })
        }
        Some(Op::Delete) => json!({ "results": conn.delete(&keys(count("results")), T)? }),
        Some(Op::Prefetch) => {
            let (requested, found) = conn.prefetch(&keys(3), T)?;
            json!({ "requested": requested, "found": found })
        }
        Some(Op::MapArena) => {
            let (_fd, a) = conn.map_arena(1, T)?;
            json!({ "file_bytes": a.file_bytes, "slot_bytes": a.slot_bytes, "slots": a.slots, "generations_offset": a.generations_offset })
        }
        Some(Op::MapIndex) => {
            let (_fd, a) = conn.map_index(0, T)?;
            json!({ "file_bytes": a.file_bytes, "buckets": a.buckets, "shards": a.shards })
        }
        Some(Op::Lease) => {
            let items = conn.lease(&keys(count("items")), T)?;
            let items: Vec<Value> = items
                .iter()
                .map(|i| json!({ "result": i.result, "tier": i.tier, "arena": i.arena, "offset": i.offset, "generation": i.generation, "lease": i.lease }))
                .collect();
            json!({ "items": items })
        }
        Some(Op::Release) => json!({ "released": conn.release(&[5, 6], T)? }),
        None => {
            let r = conn.call(op, b"", None, T)?;
            r.body(op)?;
            json!({})
        }
    };
    Ok(answer)
}

#[test]
fn every_reply_vector_reaches_the_caller_as_its_fields() {
    let v = vectors();
    let replies = v["replies"].as_array().expect("replies");
    let mut checked = 0;
    for r in replies {
        let name = r["name"].as_str().expect("name");
        let frame = hex(r["frame_hex"].as_str().expect("hex"));
        let status = r["status"].as_i64().expect("status");
        let fields = &r["fields"];
        // A connection-error frame answers whatever was asked.
        let op = r["request_op"].as_u64().map_or(Op::Exists as u8, |o| o as u8);
        let with_fd = matches!(Op::from_u8(op), Some(Op::MapArena | Op::MapIndex)) && status == 0;
        let (_dir, path, server) = serve(frame, with_fd);
        let conn = Connection::connect(path.to_str().expect("utf-8")).expect("connect");
        let one_key = json!({ "tiers": [0] });
        let got = ask(&conn, op, if r["request_op"].is_null() { &one_key } else { fields });
        let hint = r["retry_after_ms"].as_u64().unwrap_or(0);
        let message = fields["message"].as_str().unwrap_or_default();
        match got {
            Ok(got) if got.get("failures").is_some() => {
                let results = got["results"].as_array().expect("results");
                if status == 0 {
                    assert_eq!(got["results"], fields["results"], "{name}");
                } else {
                    assert!(results.iter().all(|x| x[0] == status), "{name}: {got}");
                    if status != -9 {
                        assert!(got["failures"][0].as_str().is_some_and(|f| f.ends_with(message)), "{name}: {got}");
                    }
                }
                assert_eq!(got["retry_after_ms"], hint, "{name}");
            }
            Ok(got) => {
                assert_eq!(status, 0, "{name}: answered {got} for a failure");
                assert_eq!(&got, fields, "{name}");
            }
            Err(e) => {
                assert_eq!(e.code_number(), status, "{name}: {e:?}");
                assert!(e.to_string().ends_with(message), "{name}: {e}");
                assert_eq!(u64::from(e.retry_after_ms()), if r["request_op"].is_null() { 0 } else { hint }, "{name}");
            }
        }
        drop(conn);
        server.join().expect("the server thread");
        checked += 1;
    }
    assert!(checked >= 20, "{checked} reply vectors");
}

#[test]
fn an_answer_of_another_op_or_too_short_is_refused_and_a_bad_frame_ends_the_connection() {
    let v = vectors();
    let exists =
        v["replies"].as_array().expect("replies").iter().find(|r| r["request_op"] == 6 && r["status"] == 0).expect("an EXISTS answer");
    let frame = hex(exists["frame_hex"].as_str().expect("hex"));
    // Answered as if to EXISTS, asked DELETE.
    let (_dir, path, server) = serve(frame.clone(), false);
    let conn = Connection::connect(path.to_str().expect("utf-8")).expect("connect");
    let e = conn.delete(&keys(3), T).expect_err("another op");
    assert!(matches!(&e, Error::BadAnswer(m) if m.contains("answer to DELETE has op 0x86")), "{e:?}");
    drop(conn);
    server.join().expect("server");
    // EXISTS answered with 3 tiers for 2 keys.
    let (_dir, path, server) = serve(frame.clone(), false);
    let conn = Connection::connect(path.to_str().expect("utf-8")).expect("connect");
    let e = conn.exists(&keys(2), T).expect_err("another count");
    assert!(e.to_string().contains("3 items for a request of 2"), "{e}");
    drop(conn);
    server.join().expect("server");
    // A header with a bad magic: BAD_FRAME, the connection is gone.
    let mut bad = frame;
    bad[0..2].copy_from_slice(b"GE");
    let (_dir, path, server) = serve(bad, false);
    let conn = Connection::connect(path.to_str().expect("utf-8")).expect("connect");
    let e = conn.exists(&keys(3), T).expect_err("a bad frame");
    assert_eq!(e.code_number(), -19, "{e:?}");
    assert!(!conn.alive());
    drop(conn);
    server.join().expect("server");
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}
