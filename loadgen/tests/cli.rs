//! The `kvtier-loadgen` binary on bad input and against Redis: a clear
//! message, a non-zero exit, and results.json written all the same.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn loadgen(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier-loadgen")).args(args).output().expect("run kvtier-loadgen")
}

fn results(out: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(out.join("results.json")).expect("results.json written");
    serde_json::from_str(&text).expect("results.json is JSON")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn unreachable_target_fails_clearly_and_writes_results() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("http://127.0.0.1:{}", closed_port());
    let out = dir.path().join("sweep");
    let o = loadgen(&["sweep", "--target", &url, "--concurrency", "1", "--duration-s", "1", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("cannot reach") && err.contains(&url), "{err}");
    let r = results(&out);
    assert_eq!(r["mode"], "sweep");
    assert!(r["error"].as_str().unwrap().contains("cannot reach"), "{r}");

    let o = loadgen(&["sweep", "--target", "ftp://127.0.0.1:1", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("expected http://HOST:PORT"), "{}", stderr(&o));

    let o = loadgen(&["sweep", "--mix", "7:6", "--out", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "clap refuses a bad --mix");
    assert!(stderr(&o).contains("LOOKUPS:READS:WRITES"), "{}", stderr(&o));
}

#[test]
fn missing_dataset_fails_clearly_and_writes_results() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("replay");
    let missing = dir.path().join("no-such-sharegpt.json");
    let o = loadgen(&["replay", "--dataset-path", missing.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no-such-sharegpt.json"), "{}", stderr(&o));
    let r = results(&out);
    assert_eq!(r["mode"], "replay");
    assert!(r["error"].as_str().unwrap().contains("no-such-sharegpt.json"), "{r}");
}

/// An HTTP/1.1 server that knows its geometry but answers 500 to every
/// block request, as a kvtier with a failing disk would.
fn failing_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || answer(stream));
        }
    });
    url
}

fn answer(stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let (mut request_line, mut length) = (String::new(), 0usize);
    if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
        return;
    }
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    let _ = reader.read_exact(&mut body);
    let (status, text) = if request_line.contains("/v1/stats") {
        ("200 OK", r#"{"geometry":{"block_bytes":65536,"block_tokens":128,"model":"custom"},"http":{"per_shard":[]}}"#)
    } else {
        ("500 Internal Server Error", r#"{"error":"io","message":"injected failure"}"#)
    };
    let mut stream = stream;
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
}

#[test]
fn server_errors_fail_the_run_and_keep_the_results() {
    let dir = tempfile::tempdir().unwrap();
    let url = failing_server();
    let out = dir.path().join("sweep");
    let o = loadgen(&[
        "sweep",
        "--target",
        &url,
        "--http1",
        "--concurrency",
        "1",
        "--warmup-s",
        "0",
        "--duration-s",
        "1",
        "--working-set-mib",
        "1",
        "--link-gbps",
        "10",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("500") && err.contains("injected failure"), "{err}");
    let r = results(&out);
    let t = &r["targets"][0];
    assert!(t["error"].as_str().unwrap().contains("storing the working set failed"), "{r}");
    assert!(out.join("report.html").exists(), "the report is written for a failed run too");
}

struct Redis(std::process::Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A redis-server on a free port; fails naming the package when it is not
/// installed (`make test` installs it: `make deps`).
fn start_redis() -> (Redis, String) {
    let port = closed_port();
    let child = match Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => panic!("cannot run redis-server ({e}): `make deps` installs it (apt-get install redis-server)"),
    };
    let redis = Redis(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    (redis, format!("redis://127.0.0.1:{port}"))
}

#[test]
fn sweep_against_a_real_redis() {
    let (_redis, url) = start_redis();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sweep");
    let o = loadgen(&[
        "sweep",
        "--target",
        &url,
        "--concurrency",
        "1,2",
        "--warmup-s",
        "0.3",
        "--duration-s",
        "1",
        "--working-set-mib",
        "4",
        "--block-bytes",
        "65536",
        "--link-gbps",
        "10",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r = results(&out);
    let t = &r["targets"][0];
    assert_eq!((t["kind"].as_str(), t["protocol"].as_str()), (Some("redis"), Some("resp")));
    assert_eq!(r["config"]["block_bytes"], 65536);
    let levels = t["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for l in levels {
        assert!(l["tokens_per_s"].as_f64().unwrap() > 0.0, "{l}");
        assert_eq!(l["errors"], 0);
        assert_eq!(l["wrong_bytes"], 0);
        assert!((l["prefix_hit_rate"].as_f64().unwrap() - 0.8).abs() < 1e-9, "EXISTS along the chain: {l}");
        assert!(l["read_latency_by_tier"]["redis"]["count"].as_u64().unwrap() > 0, "{l}");
        assert!(l["server"]["out_bytes_per_s"].as_f64().unwrap() > 0.0, "INFO stats counters: {l}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<svg") && html.contains(&url));
}
