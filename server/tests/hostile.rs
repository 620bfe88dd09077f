//! Hostile HTTP against the live server: malformed and oversized headers,
//! bad Content-Length, bodies longer or shorter than declared, bad keys,
//! slow clients, thousands of streams on one connection, many idle
//! connections, raw malformed HTTP/2 frames, missing and wrong bearer
//! tokens. Each answers with the right status or a closed connection, the
//! server keeps serving everyone else, nothing half-sent is stored, and the
//! server's memory stays bounded.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{client, exchange, payload, read_until_quiet, set_flag, start, status_of, test_args, Server, BLOCK_BYTES};
use http::{Method, StatusCode};
use kvtier_loadgen::client::ChunkedBody;

/// Timeouts short enough to test: headers 1 s, bodies 1 s, idle 2 s.
fn hostile_args(dir: &std::path::Path) -> Vec<String> {
    let mut a = test_args(dir);
    a.extend(["--header-timeout-s", "1", "--body-timeout-s", "1", "--idle-timeout-s", "2"].map(String::from));
    a
}

fn addr(server: &Server) -> String {
    server.url.trim_start_matches("http://").to_string()
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// The server still answers a normal PUT and GET.
async fn still_serves(server: &Server, key: &str) {
    let c = client(server, false);
    c.put(key, vec![payload(key)]).await.unwrap();
    assert_eq!(c.get(key).await.unwrap().unwrap().0.to_bytes(), payload(key));
}

fn put_head(key: &str, content_length: &str) -> String {
    format!("PUT /v1/blocks/{key} HTTP/1.1\r\nHost: t\r\nContent-Length: {content_length}\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_http1_headers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&hostile_args(dir.path()));
    let a = addr(&server);
    let big = "a".repeat(64 << 10);
    let many: String = (0..200).map(|i| format!("X-H{i}: v\r\n")).collect();
    let cases: Vec<(&str, String, &[u16])> = vec![
        ("garbage request line", "GARBAGE\r\n\r\n".into(), &[400]),
        ("invalid method", "G@T /healthz HTTP/1.1\r\nHost: t\r\n\r\n".into(), &[400]),
        ("header without a colon", "GET /healthz HTTP/1.1\r\nHost: t\r\nNoColonHere\r\n\r\n".into(), &[400]),
        ("header name with a space", "GET /healthz HTTP/1.1\r\nHost: t\r\nBad Name: v\r\n\r\n".into(), &[400]),
        ("64 KiB header value", format!("GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: {big}\r\n\r\n"), &[431]),
        ("200 headers", format!("GET /healthz HTTP/1.1\r\nHost: t\r\n{many}\r\n"), &[431]),
        ("unsupported HTTP version", "GET /healthz HTTP/9.9\r\nHost: t\r\n\r\n".into(), &[400, 505]),
        ("raw non-ASCII in the path", "GET /v1/blocks/caf\u{e9} HTTP/1.1\r\nHost: t\r\n\r\n".into(), &[400]),
        ("Content-Length not a number", put_head("cl", "abc"), &[400]),
        ("negative Content-Length", put_head("cl", "-1"), &[400]),
        (
            "two different Content-Lengths",
            "PUT /v1/blocks/cl HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\nContent-Length: 20\r\n\r\n".into(),
            &[400],
        ),
    ];
    for (name, request, expected) in cases {
        let a = a.clone();
        let reply = blocking(move || exchange(&a, request.as_bytes(), Duration::from_secs(5))).await;
        let status = status_of(&reply);
        assert!(expected.contains(&status), "{name}: expected {expected:?}, got {status}: {:.300}", reply);
    }
    // Nothing from any of them was stored; the server serves on.
    let stats = client(&server, false).stats().await.unwrap();
    assert_eq!(stats["totals"]["blocks"], 0);
    still_serves(&server, "after-headers").await;
    assert!(server.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_longer_or_shorter_than_declared_store_nothing_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&hostile_args(dir.path()));
    let a = addr(&server);
    let block = payload("over");

    // Longer than declared on a kept-alive connection: the block is the
    // declared bytes; the surplus is parsed as the next request and refused.
    let mut request = put_head("over", &BLOCK_BYTES.to_string()).into_bytes();
    request.extend_from_slice(&block);
    request.extend_from_slice(b"SURPLUS BYTES NOT HTTP\r\n\r\n");
    let reply = blocking({
        let a = a.clone();
        move || exchange(&a, &request, Duration::from_secs(5))
    })
    .await;
    assert_eq!(status_of(&reply), 201, "{reply:.300}");
    assert!(reply.matches("HTTP/1.1 ").count() == 2 && reply.contains("HTTP/1.1 400"), "surplus refused: {reply:.500}");
    let c = client(&server, false);
    assert_eq!(c.get("over").await.unwrap().unwrap().0.to_bytes(), block);

    // Declared size other than the block size: 422 before the body.
    let reply = blocking({
        let a = a.clone();
        move || exchange(&a, put_head("small", "10").as_bytes(), Duration::from_secs(5))
    })
    .await;
    assert_eq!(status_of(&reply), 422, "{reply:.300}");
    assert!(reply.contains("wrong_block_size"), "{reply:.300}");

    // Shorter than declared, then the client hangs up: nothing stored.
    let half = block.slice(..block.len() / 2);
    let reply = blocking({
        let a = a.clone();
        move || {
            let mut s = TcpStream::connect(&a).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(put_head("short", &BLOCK_BYTES.to_string()).as_bytes()).unwrap();
            s.write_all(&half).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            read_until_quiet(&mut s)
        }
    })
    .await;
    assert!(matches!(status_of(&reply), 0 | 400), "{reply:.300}");
    // Shorter than declared and the client goes quiet: 408 after the body
    // timeout, nothing stored.
    let half = block.slice(..block.len() / 2);
    let (reply, waited) = blocking({
        let a = a.clone();
        move || {
            let mut s = TcpStream::connect(&a).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(put_head("stalled", &BLOCK_BYTES.to_string()).as_bytes()).unwrap();
            s.write_all(&half).unwrap();
            let t = Instant::now();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).unwrap_or(0);
            (String::from_utf8_lossy(&buf[..n]).into_owned(), t.elapsed())
        }
    })
    .await;
    assert_eq!(status_of(&reply), 408, "{reply:.300}");
    assert!(reply.contains("body_timeout") && waited >= Duration::from_millis(900), "{waited:?} {reply:.300}");
    for key in ["short", "stalled", "small"] {
        assert!(c.get(key).await.unwrap().is_none(), "{key} must not be stored");
    }
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["totals"]["blocks"], 1);
    still_serves(&server, "after-bodies").await;
    assert!(server.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_are_400_on_every_route() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&hostile_args(dir.path()));
    let c = client(&server, false);
    let long = "k".repeat(257);
    let bad = ["", "..", ".", "a%2Fb", "%2e%2e", "%00", "a%00b", "caf%C3%A9", "%E2%9C%93", "sp%20ace", "tab%09", long.as_str()];
    for key in bad {
        for method in [Method::GET, Method::PUT, Method::DELETE, Method::HEAD] {
            let body = if method == Method::PUT { vec![payload("x")] } else { vec![] };
            let a = c.send(method.clone(), &format!("/v1/blocks/{key}"), ChunkedBody::new(body), None).await.unwrap();
            assert_eq!(a.status, StatusCode::BAD_REQUEST, "{method} {key:?}: {:?}", a.body);
        }
        let lookup = serde_json::to_vec(&serde_json::json!({ "keys": ["fine", urlish(key)] })).unwrap();
        let a = c.send(Method::POST, "/v1/lookup", ChunkedBody::new(vec![Bytes::from(lookup)]), None).await.unwrap();
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "lookup of {key:?}");
    }
    // A literal slash makes a path no route matches: 404 or 400, never a
    // stored block.
    for path in ["/v1/blocks/a/b", "/v1/blocks/../../etc/passwd", "/v1/blocks//x"] {
        let a = c.send(Method::PUT, path, ChunkedBody::new(vec![payload("x")]), None).await.unwrap();
        assert!(matches!(a.status, StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND), "{path}: {}", a.status);
    }
    // The longest valid key (256 bytes) works.
    let longest = "k".repeat(256);
    c.put(&longest, vec![payload(&longest)]).await.unwrap();
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["totals"]["blocks"], 1);
    assert!(server.stop().success());
}

/// The key as a lookup would carry it (JSON strings are not URL-encoded).
fn urlish(key: &str) -> String {
    let mut out = Vec::new();
    let b = key.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 3 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&key[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_while_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&hostile_args(dir.path()));
    let a = addr(&server);
    // Headers trickled a byte every 200 ms (slowloris): cut off after the
    // 1 s header timeout, long before the request is complete.
    let trickle = blocking({
        let a = a.clone();
        move || {
            let mut s = TcpStream::connect(&a).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
            let request = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
            let t = Instant::now();
            let mut buf = [0u8; 1024];
            for byte in request.iter() {
                if s.write_all(&[*byte]).is_err() {
                    return (t.elapsed(), String::new(), true);
                }
                match s.read(&mut buf) {
                    Ok(0) => return (t.elapsed(), String::new(), true),
                    Ok(n) => return (t.elapsed(), String::from_utf8_lossy(&buf[..n]).into_owned(), true),
                    Err(_) => {}
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            (t.elapsed(), String::new(), false)
        }
    });
    // Meanwhile other clients are served at full speed.
    let c = client(&server, false);
    let t = Instant::now();
    for i in 0..20 {
        let key = format!("busy-{i}");
        c.put(&key, vec![payload(&key)]).await.unwrap();
    }
    let busy = t.elapsed();
    let (elapsed, reply, cut) = trickle.await;
    assert!(cut, "the slow client sent its whole request ({elapsed:?})");
    assert!(matches!(status_of(&reply), 0 | 408), "{reply:.300}");
    assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(8), "cut off after {elapsed:?}");
    assert!(busy < elapsed, "other clients waited on the slow one ({busy:?})");
    // A body trickled a byte every 50 ms: 408 after the 1 s body timeout.
    let reply = blocking({
        let a = a.clone();
        move || {
            let mut s = TcpStream::connect(&a).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
            s.write_all(put_head("trickled", &BLOCK_BYTES.to_string()).as_bytes()).unwrap();
            let mut buf = [0u8; 4096];
            for _ in 0..200 {
                if s.write_all(b"x").is_err() {
                    break;
                }
                if let Ok(n) = s.read(&mut buf) {
                    return String::from_utf8_lossy(&buf[..n]).into_owned();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            String::new()
        }
    })
    .await;
    assert_eq!(status_of(&reply), 408, "{reply:.300}");
    assert!(c.get("trickled").await.unwrap().is_none());
    still_serves(&server, "after-slow").await;
    assert!(server.stop().success());
}

/// An HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const GOAWAY: u8 = 7;

/// Frame types the server sent, in order, until it closed.
fn frames_received(bytes: &[u8]) -> Vec<u8> {
    let mut kinds = Vec::new();
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let len = ((bytes[at] as usize) << 16) | ((bytes[at + 1] as usize) << 8) | bytes[at + 2] as usize;
        kinds.push(bytes[at + 3]);
        at += 9 + len;
    }
    kinds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_http2_frames_end_the_connection_with_goaway() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&hostile_args(dir.path()));
    let a = addr(&server);
    let settings = frame(4, 0, 0, &[]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("DATA on stream 0", frame(0, 0, 0, b"hello")),
        ("frame over the 1 MiB max frame size", {
            let mut f = frame(0, 0, 1, &[]);
            f[..3].copy_from_slice(&[0x20, 0, 0]); // declares 2 MiB
            f.extend(std::iter::repeat_n(0u8, 4096));
            f
        }),
        ("HEADERS with a garbage HPACK block", frame(1, 0x4 | 0x1, 1, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])),
        ("HEADERS on an even (server) stream id", frame(1, 0x4 | 0x1, 2, &[0x82, 0x86, 0x84])),
        ("WINDOW_UPDATE of 0 on the connection", frame(8, 0, 0, &0u32.to_be_bytes())),
        ("SETTINGS of 5 bytes", frame(4, 0, 0, &[0, 3, 0, 0, 0])),
        ("PING of 3 bytes", frame(6, 0, 0, &[1, 2, 3])),
        ("CONTINUATION without HEADERS", frame(9, 0x4, 1, &[0x82])),
    ];
    for (name, bad) in cases {
        let mut bytes = PREFACE.to_vec();
        bytes.extend_from_slice(&settings);
        bytes.extend_from_slice(&bad);
        let a = a.clone();
        let (reply, closed) = blocking(move || {
            let mut s = TcpStream::connect(&a).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = s.write_all(&bytes);
            let mut out = Vec::new();
            let mut buf = [0u8; 65536];
            let closed = loop {
                match s.read(&mut buf) {
                    Ok(0) => break true,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                    Err(e) => break e.kind() == std::io::ErrorKind::ConnectionReset,
                }
            };
            (out, closed)
        })
        .await;
        let kinds = frames_received(&reply);
        assert!(kinds.contains(&GOAWAY), "{name}: no GOAWAY, frames {kinds:?}");
        assert!(closed, "{name}: the connection stayed open");
    }
    still_serves(&server, "after-frames").await;
    assert!(server.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_streams_and_many_idle_connections_keep_memory_bounded() {
    let dir = tempfile::tempdir().unwrap();
    // No stall detector: a stall's report maps the binary's debug
    // information to name its frames, memory this test does not measure.
    let mut args = hostile_args(dir.path());
    set_flag(&mut args, "--stall-threshold-ms", "0");
    let server = start(&args);
    // The I/O memory is faulted in just after start: not inside the window.
    common::wait_for_io_memory_registration(&server).await;
    let c = Arc::new(client(&server, false));
    c.put("shared", vec![payload("shared")]).await.unwrap();
    // Warm up allocator arenas and buffers before the baseline.
    for _ in 0..50 {
        c.get("shared").await.unwrap().unwrap();
    }
    let rss_before = server.rss_bytes();

    // 3,000 requests at once on one HTTP/2 connection (the server allows
    // 256 concurrent streams; the rest wait their turn).
    let tasks: Vec<_> = (0..3000)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                if i % 3 == 0 {
                    c.lookup(&["shared".to_string(), format!("missing-{i}")]).await.map(|n| n == 1)
                } else {
                    c.get("shared").await.map(|b| b.is_some_and(|(b, _)| b.to_bytes() == payload("shared")))
                }
            })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap().unwrap(), "a stream got a wrong answer");
    }

    // 400 connections that never send a byte, and 100 that stop after
    // half a request line.
    let a = addr(&server);
    let idle: Vec<TcpStream> = blocking(move || {
        (0..500)
            .map(|i| {
                let mut s = TcpStream::connect(&a).unwrap();
                if i % 5 == 0 {
                    s.write_all(b"GET /heal").unwrap();
                }
                s
            })
            .collect()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let open = |stats: &serde_json::Value| -> u64 {
        stats["http"]["per_shard"].as_array().unwrap().iter().map(|s| s["connections_open"].as_u64().unwrap()).sum()
    };
    let stats = client(&server, false).stats().await.unwrap();
    assert!(open(&stats) >= 500, "idle connections are open: {}", open(&stats));
    // The server still serves while they sit there.
    still_serves(&server, "among-idle").await;
    // The idle timeout (2 s) and header timeout (1 s) close them all.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let stats = client(&server, false).stats().await.unwrap();
    assert!(open(&stats) <= 2, "idle connections closed: {} open", open(&stats));
    let closed = blocking(move || {
        idle.into_iter()
            .filter(|s| {
                let mut s = s.try_clone().unwrap();
                s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
                let mut buf = [0u8; 1024];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) => return true,
                        Ok(_) => continue,
                        Err(_) => return false,
                    }
                }
            })
            .count()
    })
    .await;
    assert_eq!(closed, 500, "the server closed every idle connection");
    let rss_after = server.rss_bytes();
    let grown = rss_after.saturating_sub(rss_before);
    assert!(grown < 64 << 20, "RSS grew {} MiB ({} → {} MiB)", grown >> 20, rss_before >> 20, rss_after >> 20);
    assert!(server.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_wrong_bearer_tokens_get_401_over_both_protocols() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let mut args = hostile_args(&dir.path().join("data"));
    args.extend(["--auth-token-file".to_string(), token_file.display().to_string()]);
    let server = start(&args);
    let a = addr(&server);
    let tries = [
        None,
        Some("Authorization: Bearer wrong"),
        Some("Authorization: Bearer s3cret-tokenX"),
        Some("Authorization: Bearer s3cret-toke"),
        Some("Authorization: Basic czNjcmV0LXRva2Vu"),
        Some("Authorization: s3cret-token"),
        Some("Authorization: Bearer"),
    ];
    for auth in tries {
        let mut request = put_head("secret", &BLOCK_BYTES.to_string());
        if let Some(h) = auth {
            request = request.replace("Host: t\r\n", &format!("Host: t\r\n{h}\r\n"));
        }
        let mut bytes = request.into_bytes();
        bytes.extend_from_slice(&payload("secret"));
        let a = a.clone();
        let reply = blocking(move || exchange(&a, &bytes, Duration::from_secs(3))).await;
        assert_eq!(status_of(&reply), 401, "{auth:?}: {reply:.300}");
        assert!(reply.to_ascii_lowercase().contains("www-authenticate: bearer"), "{reply:.300}");
    }
    // HTTP/2 without a token: 401 too, for every route.
    let c = client(&server, false);
    for (method, path) in [(Method::GET, "/v1/blocks/secret"), (Method::GET, "/v1/stats"), (Method::POST, "/v1/lookup")] {
        let a = c.send(method.clone(), path, ChunkedBody::default(), None).await.unwrap();
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{method} {path}");
    }
    // With the token: stored nothing from the refused PUTs.
    let reply = blocking(move || {
        exchange(
            &a,
            b"GET /v1/blocks/secret HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer s3cret-token\r\nConnection: close\r\n\r\n",
            Duration::from_secs(3),
        )
    })
    .await;
    assert_eq!(status_of(&reply), 404, "{reply:.300}");
    assert!(server.stop().success());
}
