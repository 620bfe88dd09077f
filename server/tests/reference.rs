//! `kvtier-http-reference`, the bare block server `make bench-http`
//! measures kvtier's HTTP path against, run as a real process: it answers
//! the block routes as kvtier does (so the same clients measure both),
//! refuses a PUT of the wrong size and keeps nothing of it, drops its
//! oldest blocks at capacity, and refuses bad flags with a clear error.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use bytes::Bytes;
use kvtier_loadgen::client::{ChunkedBody, Client};

const BLOCK_BYTES: u64 = 1 << 20;

/// A running reference server, killed on drop.
struct Reference {
    child: Child,
    url: String,
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Reference {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-http-reference"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.split_whitespace().find(|w| w.starts_with("http://")).unwrap_or_else(|| panic!("no address in {line:?}")).to_string();
    Reference { child, url }
}

fn block(fill: u8) -> Bytes {
    Bytes::from(vec![fill; BLOCK_BYTES as usize])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn it_answers_the_block_routes_as_kvtier_does_over_both_protocols() {
    let r = start(&["--block-bytes", &BLOCK_BYTES.to_string(), "--shards", "2", "--capacity-mib", "8"]);
    for http1 in [false, true] {
        let c = Client::new(&r.url, http1, 1).unwrap();
        // The loadgen learns the block size from /v1/stats, as from kvtier.
        assert_eq!(c.geometry().await.unwrap().0, BLOCK_BYTES);
        let key = format!("k-{http1}");
        assert_eq!(c.put(&key, vec![block(1)]).await.unwrap(), http::StatusCode::CREATED);
        assert_eq!(c.put(&key, vec![block(2)]).await.unwrap(), http::StatusCode::OK, "replaced");
        let (body, _) = c.get(&key).await.unwrap().expect("stored");
        assert!(body.to_bytes() == block(2));
        let head = c.send(http::Method::HEAD, &format!("/v1/blocks/{key}"), ChunkedBody::default(), None).await.unwrap();
        assert_eq!(head.status, http::StatusCode::OK);
        let del = c.send(http::Method::DELETE, &format!("/v1/blocks/{key}"), ChunkedBody::default(), None).await.unwrap();
        assert_eq!(del.status, http::StatusCode::NO_CONTENT);
        assert!(c.get(&key).await.unwrap().is_none(), "deleted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_of_the_wrong_size_is_refused_and_stores_nothing() {
    let r = start(&["--block-bytes", &BLOCK_BYTES.to_string(), "--capacity-mib", "8"]);
    let c = Client::new(&r.url, false, 1).unwrap();
    c.put("kept", vec![block(7)]).await.unwrap();
    for wrong in [Bytes::from_static(b"short"), Bytes::from(vec![0u8; BLOCK_BYTES as usize + 1])] {
        let a = c.send(http::Method::PUT, "/v1/blocks/kept", ChunkedBody::new(vec![wrong]), None).await.unwrap();
        assert_eq!(a.status, http::StatusCode::BAD_REQUEST);
    }
    let (body, _) = c.get("kept").await.unwrap().expect("still stored");
    assert!(body.to_bytes() == block(7), "the refused PUTs changed nothing");
    assert!(c.get("never").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_capacity_the_oldest_blocks_make_room() {
    // 4 MiB: four blocks of 1 MiB.
    let r = start(&["--block-bytes", &BLOCK_BYTES.to_string(), "--capacity-mib", "4"]);
    let c = Client::new(&r.url, false, 1).unwrap();
    for i in 0..6u8 {
        c.put(&format!("b{i}"), vec![block(i)]).await.unwrap();
    }
    for i in 0..6u8 {
        let got = c.get(&format!("b{i}")).await.unwrap();
        if i < 2 {
            assert!(got.is_none(), "b{i} is among the oldest, dropped");
        } else {
            assert!(got.expect("among the newest four").0.to_bytes() == block(i), "b{i}");
        }
    }
    assert_eq!(c.stats().await.unwrap()["totals"]["blocks"], 4);
}

#[test]
fn bad_flags_are_refused_with_a_clear_error() {
    for (args, says) in [
        (vec!["--shards", "0"], "--shards must be at least 1"),
        (vec!["--block-bytes", "4194304", "--capacity-mib", "1"], "--capacity-mib must hold at least one block"),
        (vec!["--block-bytes", "0"], "--capacity-mib must hold at least one block"),
        (vec!["--listen", "not-an-address"], "invalid value 'not-an-address'"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier-http-reference")).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
