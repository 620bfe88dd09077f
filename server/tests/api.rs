//! The block API end to end: a real `kvtier serve` on a loopback port,
//! spoken to over HTTP/2 (prior knowledge) and HTTP/1.1.

mod common;

use std::io::Read;
use std::sync::Arc;

use bytes::Bytes;
use common::{client, payload, start, test_args, try_start, BLOCK_BYTES};
use http::{Method, StatusCode};
use kvtier_engine::key::BlockHash;
use kvtier_loadgen::client::ChunkedBody;
use serde_json::Value;

async fn send(c: &kvtier_loadgen::client::Client, m: Method, path: &str, body: Vec<Bytes>) -> (StatusCode, Option<String>, Bytes) {
    let a = c.send(m, path, ChunkedBody::new(body), None).await.unwrap();
    (a.status, a.tier, a.body.to_bytes())
}

fn error_code(body: &Bytes) -> String {
    let v: Value = serde_json::from_slice(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    v["error"]["code"].as_str().unwrap_or_else(|| panic!("no error code in {v}")).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_round_trip_over_h2_and_http1() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    for http1 in [false, true] {
        let c = client(&server, http1);
        let key = if http1 { "block-h1" } else { "block-h2" };
        let path = format!("/v1/blocks/{key}");
        let body = payload(key);
        assert_eq!(send(&c, Method::PUT, &path, vec![body.clone()]).await.0, StatusCode::CREATED);
        assert_eq!(send(&c, Method::PUT, &path, vec![body.clone()]).await.0, StatusCode::OK);
        let (status, tier, got) = send(&c, Method::GET, &path, vec![]).await;
        assert_eq!((status, tier.as_deref()), (StatusCode::OK, Some("nvme")));
        assert_eq!(got, body);
        assert_eq!(send(&c, Method::HEAD, &path, vec![]).await.0, StatusCode::OK);
        assert_eq!(send(&c, Method::DELETE, &path, vec![]).await.0, StatusCode::NO_CONTENT);
        let (status, _, body) = send(&c, Method::GET, &path, vec![]).await;
        assert_eq!((status, error_code(&body).as_str()), (StatusCode::NOT_FOUND, "not_found"));
        assert_eq!(send(&c, Method::HEAD, &path, vec![]).await.0, StatusCode::NOT_FOUND);
        assert_eq!(send(&c, Method::DELETE, &path, vec![]).await.0, StatusCode::NOT_FOUND);
    }
    assert!(server.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let c = client(&server, false);
    assert_eq!(send(&c, Method::PUT, "/v1/blocks/keep", vec![payload("keep")]).await.0, StatusCode::CREATED);

    // Too short: 422 naming the expected size.
    let (status, _, body) = send(&c, Method::PUT, "/v1/blocks/short", vec![Bytes::from(vec![1u8; 1000])]).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(String::from_utf8_lossy(&body).contains(&BLOCK_BYTES.to_string()), "{body:?}");
    // Too long: 413, refused from the declared length.
    let (status, _, body) = send(&c, Method::PUT, "/v1/blocks/long", vec![payload("long"), Bytes::from_static(b"x")]).await;
    assert_eq!((status, error_code(&body).as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"));
    // Invalid keys: 400.
    for bad in ["a%2Fb", "%00", "..", &"k".repeat(257)] {
        let (status, _, body) = send(&c, Method::GET, &format!("/v1/blocks/{bad}"), vec![]).await;
        assert_eq!((status, error_code(&body).as_str()), (StatusCode::BAD_REQUEST, "invalid_key"), "{bad}");
    }
    let (status, _, _) = send(&c, Method::PUT, "/v1/blocks/", vec![payload("x")]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // Unknown route, wrong method.
    assert_eq!(send(&c, Method::GET, "/v2/nothing", vec![]).await.0, StatusCode::NOT_FOUND);
    let (status, _, body) = send(&c, Method::POST, "/v1/blocks/keep", vec![]).await;
    assert_eq!((status, error_code(&body).as_str()), (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"));
    // Malformed and oversized lookups.
    let (status, _, body) = send(&c, Method::POST, "/v1/lookup", vec![Bytes::from_static(b"{\"keys\": 7}")]).await;
    assert_eq!((status, error_code(&body).as_str()), (StatusCode::BAD_REQUEST, "bad_json"));
    let (status, _, body) = send(&c, Method::POST, "/v1/lookup", vec![Bytes::from_static(b"{\"keys\": [\"ok\", \"a/b\"]}")]).await;
    assert_eq!((status, error_code(&body).as_str()), (StatusCode::BAD_REQUEST, "invalid_key"));
    let many = serde_json::to_vec(&serde_json::json!({ "keys": vec!["k"; 5000] })).unwrap();
    let (status, _, body) = send(&c, Method::POST, "/v1/lookup", vec![Bytes::from(many)]).await;
    assert_eq!((status, error_code(&body).as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "too_many_keys"));

    // No Content-Length (chunked HTTP/1.1): 411 naming the expected size.
    let addr = server.url.trim_start_matches("http://").to_string();
    let reply = tokio::task::spawn_blocking(move || {
        common::exchange(
            &addr,
            b"PUT /v1/blocks/chunked HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            std::time::Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 411"), "{reply}");
    assert!(reply.contains(&BLOCK_BYTES.to_string()), "{reply}");

    // Nothing was lost.
    let (status, _, got) = send(&c, Method::GET, "/v1/blocks/keep", vec![]).await;
    assert_eq!((status, got), (StatusCode::OK, payload("keep")));
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["totals"]["blocks"], 1);
    assert!(server.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_counts_leading_hits_across_shards() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let c = client(&server, false);
    let chain: Vec<String> = (0..8).map(|i| format!("chain-{i}")).collect();
    for k in &chain[..5] {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    c.put(&chain[6], vec![payload(&chain[6])]).await.unwrap();
    assert_eq!(c.lookup(&chain).await.unwrap(), 5);
    assert_eq!(c.lookup(&chain[5..]).await.unwrap(), 0);
    assert_eq!(c.lookup(&[]).await.unwrap(), 0);
    let shards: Vec<usize> = chain[..5].iter().map(|k| BlockHash::of(k.as_bytes()).shard(2)).collect();
    assert!(shards.contains(&0) && shards.contains(&1), "the chain spans both shards: {shards:?}");
    let stats = c.stats().await.unwrap();
    let per_shard: Vec<u64> = stats["per_shard"].as_array().unwrap().iter().map(|s| s["blocks"].as_u64().unwrap()).collect();
    assert_eq!(per_shard.iter().sum::<u64>(), 6);
    assert!(per_shard.iter().all(|b| *b > 0), "{per_shard:?}");
    let health = send(&c, Method::GET, "/healthz", vec![]).await;
    assert_eq!(health.0, StatusCode::OK);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_streams_on_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let c = Arc::new(client(&server, false));
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                let key = format!("stream-{i}");
                c.put(&key, vec![payload(&key)]).await.unwrap();
                let (body, _) = c.get(&key).await.unwrap().unwrap();
                assert_eq!(body.to_bytes(), payload(&key));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(c.stats().await.unwrap()["totals"]["blocks"], 100);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_data_after_sigterm_and_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let args = test_args(dir.path());
    let server = start(&args);
    let c = client(&server, false);
    let keys: Vec<String> = (0..20).map(|i| format!("durable-{i}")).collect();
    for k in &keys {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    c.delete(&keys[0]).await.unwrap();
    assert!(server.stop().success(), "SIGTERM exits 0");

    let server = start(&args);
    let c = client(&server, true);
    assert!(c.get(&keys[0]).await.unwrap().is_none(), "a delete survives restart");
    for k in &keys[1..] {
        assert_eq!(c.get(k).await.unwrap().expect(k).0.to_bytes(), payload(k));
    }
    // Acknowledged writes survive a crash: every PUT was on disk (O_DIRECT)
    // before its 201.
    let more: Vec<String> = (0..20).map(|i| format!("crash-{i}")).collect();
    for k in &more {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    server.crash();

    let server = start(&args);
    let c = client(&server, false);
    for k in keys[1..].iter().chain(&more) {
        assert_eq!(c.get(k).await.unwrap().expect(k).0.to_bytes(), payload(k));
    }
    assert_eq!(c.stats().await.unwrap()["totals"]["blocks"], 39);
    server.stop();
}

trait DeleteExt {
    async fn delete(&self, key: &str) -> Result<(), String>;
}

impl DeleteExt for kvtier_loadgen::client::Client {
    async fn delete(&self, key: &str) -> Result<(), String> {
        let a = self.send(Method::DELETE, &format!("/v1/blocks/{key}"), ChunkedBody::default(), None).await.map_err(|e| e.to_string())?;
        if a.status == StatusCode::NO_CONTENT {
            Ok(())
        } else {
            Err(format!("DELETE answered {}", a.status))
        }
    }
}

/// `curl` of `path` with an optional header: (status, body).
async fn curl(url: String, auth: Option<String>) -> (String, String) {
    tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new("curl");
        cmd.args(["-s", "-w", "\n%{http_code}", "--http2-prior-knowledge", &url]);
        if let Some(a) = auth {
            cmd.args(["-H", &a]);
        }
        let out = String::from_utf8(cmd.output().expect("curl is installed (make deps)").stdout).unwrap();
        let (body, status) = out.rsplit_once('\n').unwrap();
        (status.to_string(), body.trim_end().to_string())
    })
    .await
    .unwrap()
}

/// With a bearer token (and, the same code path, with tenants) every route
/// needs it, except the probes: `/healthz` answers as always and `/readyz`
/// its status with no details, so a kubelet or load balancer needs no
/// secret; the details and every other route stay behind the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_token_is_required_when_set_except_by_the_probes() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let tenants_file = dir.path().join("tenants.toml");
    std::fs::write(&tenants_file, "[[tenant]]\nname = \"a\"\ntoken = \"tenant-token\"\n").unwrap();
    for (flag, file, token) in [("--auth-token-file", &token_file, "s3cret-token"), ("--tenants", &tenants_file, "tenant-token")] {
        let mut args = test_args(&dir.path().join(format!("data{flag}")));
        args.extend([flag.to_string(), file.to_str().unwrap().to_string()]);
        let server = start(&args);
        let at = |path: &str| format!("{}{path}", server.url);
        let good = Some(format!("Authorization: Bearer {token}"));
        let wrong = Some("Authorization: Bearer wrong-token!".to_string());
        for auth in [None, wrong.clone()] {
            assert_eq!(curl(at("/v1/stats"), auth.clone()).await.0, "401", "{flag}");
            assert_eq!(curl(at("/metrics"), auth.clone()).await.0, "401", "{flag}");
            assert_eq!(curl(at("/v1/blocks/k"), auth.clone()).await.0, "401", "{flag}");
            let (status, body) = curl(at("/healthz"), auth.clone()).await;
            assert_eq!((status.as_str(), body.as_str()), ("200", r#"{"shards":2,"status":"ok"}"#), "{flag}");
            let (status, body) = curl(at("/readyz"), auth.clone()).await;
            assert_eq!((status.as_str(), body.as_str()), ("200", r#"{"status":"ready"}"#), "{flag}: no details without a token");
        }
        assert_eq!(curl(at("/v1/stats"), good.clone()).await.0, "200", "{flag}");
        let (status, body) = curl(at("/readyz"), good.clone()).await;
        let ready: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status, "200");
        assert!(ready["tiers"].as_array().is_some_and(|t| !t.is_empty()), "details with the token: {ready}");
        server.stop();
    }
}

#[test]
fn refuses_unsafe_or_mismatched_starts_with_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    // A non-loopback address without a token.
    let mut args = test_args(dir.path());
    args[1] = "0.0.0.0:0".into();
    let (status, stderr) = try_start(&args).err().expect("must refuse");
    assert!(!status.unwrap().success());
    assert!(stderr.contains("--auth-token-file"), "{stderr}");
    // A data directory created with another block size.
    let server = start(&test_args(dir.path()));
    server.stop();
    let mut args = test_args(dir.path());
    common::set_flag(&mut args, "--block-bytes", "131072");
    let (status, stderr) = try_start(&args).err().expect("must refuse");
    assert!(!status.unwrap().success());
    assert!(stderr.contains("65536") && stderr.contains("131072"), "{stderr}");
    // Two servers on one data directory.
    let first = start(&test_args(dir.path()));
    let (_, stderr) = try_start(&test_args(dir.path())).err().expect("must refuse");
    assert!(stderr.contains("in use"), "{stderr}");
    first.stop();
}

/// Two servers started at once on one port (two data directories): the
/// port is bound once, without `SO_REUSEPORT`, so exactly one serves and
/// the other is refused at once, naming the port; none listens beside the
/// other. A third on the same port and the winner's data directory is
/// refused too. Every connection then reaches the one server.
#[test]
fn two_servers_on_one_port_never_share_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let args_for = |name: &str| {
        let mut a = test_args(&dir.path().join(name));
        common::set_flag(&mut a, "--listen", &format!("127.0.0.1:{port}"));
        a
    };
    let (a, b) = (args_for("a"), args_for("b"));
    let started = std::time::Instant::now();
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| try_start(&a));
        let tb = s.spawn(|| try_start(&b));
        (ta.join().unwrap(), tb.join().unwrap())
    });
    let (winner, refused) = match (ra, rb) {
        (Ok(w), Err(r)) | (Err(r), Ok(w)) => (w, r),
        (Ok(_), Ok(_)) => panic!("two servers listen on port {port}"),
        (Err(a), Err(b)) => panic!("neither started: {a:?} {b:?}"),
    };
    assert!(started.elapsed() < std::time::Duration::from_secs(8), "the refusal took {:?}", started.elapsed());
    assert!(refused.1.contains(&format!("cannot listen on 127.0.0.1:{port}")), "{}", refused.1);
    let same_dir = {
        let mut a = test_args(&winner.data_dir);
        common::set_flag(&mut a, "--listen", &format!("127.0.0.1:{port}"));
        a
    };
    let (_, stderr) = try_start(&same_dir).err().expect("a third server must be refused");
    assert!(stderr.contains("in use"), "{stderr}");
    // Every connection lands on the one server: each is counted there.
    for _ in 0..8 {
        let answer = common::exchange(
            &format!("127.0.0.1:{port}"),
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            std::time::Duration::from_secs(5),
        );
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let stats = common::exchange(
        &format!("127.0.0.1:{port}"),
        b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        std::time::Duration::from_secs(5),
    );
    let stats: serde_json::Value = serde_json::from_str(stats.split_once("\r\n\r\n").unwrap().1).unwrap();
    let accepted: u64 = stats["http"]["per_shard"].as_array().unwrap().iter().map(|s| s["connections_total"].as_u64().unwrap()).sum();
    assert!(accepted >= 9, "the server accepted {accepted} of the 9 connections: {stats}");
    assert!(winner.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_block_is_a_miss_and_fsck_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let args = test_args(dir.path());
    let server = start(&args);
    let c = client(&server, false);
    // Keys on shard 0, so the first segment of shard 0 holds them in order.
    let keys: Vec<String> = (0..).map(|i| format!("fsck-{i}")).filter(|k| BlockHash::of(k.as_bytes()).shard(2) == 0).take(3).collect();
    for k in &keys {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    assert!(server.stop().success());
    let fsck = |dir: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvtier")).args(["fsck", "--data-dir", dir.to_str().unwrap()]).output().unwrap()
    };
    let clean = fsck(dir.path());
    assert!(clean.status.success(), "{}", String::from_utf8_lossy(&clean.stdout));
    // Flip one payload byte of the second block (slot 1 of segment 0).
    let seg = dir.path().join("shard-000/seg-000000.kvt");
    let slot_bytes = 4096 + BLOCK_BYTES;
    let offset = 4096 + slot_bytes + 4096 + 1234;
    common::flip_byte(&seg, offset);
    let damaged = fsck(dir.path());
    let out = String::from_utf8_lossy(&damaged.stdout);
    assert_eq!(damaged.status.code(), Some(1), "{out}");
    assert!(out.contains(&format!("key {} ", keys[1])) && out.contains("CRC-32"), "{out}");
    assert_eq!(out.matches("damaged:").count(), 1, "{out}");

    let server = start(&args);
    let c = client(&server, false);
    let (status, _, body) = send(&c, Method::GET, &format!("/v1/blocks/{}", keys[1]), vec![]).await;
    assert_eq!((status, error_code(&body).as_str()), (StatusCode::NOT_FOUND, "corrupt_block"));
    for k in [&keys[0], &keys[2]] {
        assert_eq!(c.get(k).await.unwrap().unwrap().0.to_bytes(), payload(k));
    }
    assert_eq!(c.stats().await.unwrap()["totals"]["corrupt_blocks"], 1);
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_per_route_and_shard() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let c = client(&server, false);
    for i in 0..6 {
        let k = format!("m{i}");
        c.put(&k, vec![payload(&k)]).await.unwrap();
        c.get(&k).await.unwrap().unwrap();
    }
    assert!(c.get("missing").await.unwrap().is_none());
    let a = c.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap();
    assert_eq!(a.status, StatusCode::OK);
    let text = String::from_utf8(a.body.to_bytes().to_vec()).unwrap();
    let value = |line_start: &str| -> f64 {
        text.lines().filter(|l| l.starts_with(line_start)).map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap()).sum()
    };
    assert_eq!(value("kvtier_http_requests_total{route=\"put_block\"}"), 6.0, "{text}");
    assert_eq!(value("kvtier_http_requests_total{route=\"get_block\"}"), 7.0);
    assert_eq!(value("kvtier_http_client_errors_total{route=\"get_block\"}"), 1.0);
    assert_eq!(value("kvtier_shard_blocks{"), 6.0);
    assert_eq!(value("kvtier_block_bytes"), BLOCK_BYTES as f64);
    assert!(value("kvtier_shard_bytes_written_total{") >= (6 * BLOCK_BYTES) as f64);
    // Prometheus text format 0.0.4 unless the scraper asks for OpenMetrics
    // (tests/metrics.rs).
    assert!(!text.contains("# EOF"), "{text}");
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["http"]["routes"]["put_block"]["requests"], 6);
    assert!(stats["http"]["routes"]["get_block"]["latency_us_p50"].as_u64().unwrap() > 0);
    let forwarded: u64 = stats["per_shard"].as_array().unwrap().iter().map(|s| s["forwarded_requests"].as_u64().unwrap()).sum();
    assert!(forwarded > 0, "with 2 shards and one connection some keys belong to the other shard");
    server.stop();
}

/// The README's curl walk-through, run as written against a test server
/// (only the address differs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_curl_examples_work_as_written() {
    let readme = std::fs::read_to_string(common::repo_root().join("README.md")).unwrap();
    let section = readme.split("## Try it with curl").nth(1).expect("README has the curl section");
    let script = section.split("```sh").nth(1).and_then(|s| s.split("```").next()).expect("a sh block");
    assert!(script.contains("http://127.0.0.1:8085"), "the README shows the default address");
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(&dir.path().join("data")));
    let script = script.replace("http://127.0.0.1:8085", &server.url);
    let work = dir.path().to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash").args(["-euo", "pipefail", "-c", &script]).current_dir(work).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "README commands failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for expected in
        ["\"status\":\"created\"", "identical", "HTTP/2 200", "\"prefix_hits\":1", "wrong_block_size", "kvtier_http_requests_total", "204"]
    {
        assert!(stdout.contains(expected), "missing {expected:?} in:\n{stdout}");
    }
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = test_args(dir.path());
    args.extend(["--idle-timeout-s".to_string(), "1".to_string()]);
    let server = start(&args);
    let addr = server.url.trim_start_matches("http://").to_string();
    let closed_after = tokio::task::spawn_blocking(move || {
        // A client that connects and says nothing.
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let t = std::time::Instant::now();
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(usize::MAX);
        (n, t.elapsed())
    })
    .await
    .unwrap();
    assert_eq!(closed_after.0, 0, "the server closes the idle connection");
    assert!(closed_after.1 >= std::time::Duration::from_millis(900), "{:?}", closed_after.1);
    // An HTTP/2 client that made a request and went quiet is dropped too;
    // a new connection works.
    let c = client(&server, false);
    c.put("idle", vec![payload("idle")]).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let stats = client(&server, false).stats().await.unwrap();
    let open: u64 = stats["http"]["per_shard"].as_array().unwrap().iter().map(|s| s["connections_open"].as_u64().unwrap()).sum();
    assert_eq!(open, 1, "only the stats request's own connection is open: {stats}");
    server.stop();
}

/// A restart right after a stop, on a fixed port whose server-closed
/// connections are still in TIME-WAIT, must not be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_restart_on_the_same_port() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut args = test_args(dir.path());
    args[1] = format!("127.0.0.1:{port}");
    let server = start(&args);
    let url = server.url.clone();
    tokio::task::spawn_blocking(move || {
        for _ in 0..3 {
            // Connection: close makes the server close first: TIME-WAIT on its port.
            let out =
                std::process::Command::new("curl").args(["-s", "-H", "Connection: close", &format!("{url}/healthz")]).output().unwrap();
            assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
        }
    })
    .await
    .unwrap();
    assert!(server.stop().success());
    let again = start(&args);
    assert_eq!(again.url, format!("http://127.0.0.1:{port}"));
    // A second server on the same port (another data directory) is refused,
    // not silently given half the connections by SO_REUSEPORT.
    let other = tempfile::tempdir().unwrap();
    let mut clash = test_args(other.path());
    clash[1] = format!("127.0.0.1:{port}");
    let (_, stderr) = try_start(&clash).err().expect("must refuse a taken port");
    assert!(stderr.contains("already accepts connections"), "{stderr}");
    again.stop();
}
