//! What the shared-tier tests share: a real S3-compatible server (moto) on
//! loopback, a slow proxy in front of it, and requests to kvtier nodes.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use kvtier_engine::key::BlockHash;
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::{json, Value};

use crate::common::{self, payload, test_args, BLOCK_BYTES};

pub const BUCKET: &str = "kvtier-shared";
pub const PREFIX: &str = "fleet";

/// Credentials moto accepts (it checks none), so the client never asks
/// the instance metadata service.
pub fn aws_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::env::set_var("AWS_ACCESS_KEY_ID", "kvtier-test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "kvtier-test");
        std::env::set_var("AWS_REGION", "us-east-1");
    });
}

pub fn moto_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVTIER_MOTO_SERVER") {
        return PathBuf::from(p);
    }
    let p = common::repo_root().join("target/py-s3/bin/moto_server");
    assert!(
        p.exists(),
        "{} is missing: these tests need a real S3 server; run `make python-env` (or `make target/py-s3/.installed`) first",
        p.display()
    );
    p
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One HTTP/1.1 request to `addr` with a made-up SigV4 `Authorization`
/// (moto checks no signature, but answers requests without one as an
/// anonymous user, who may not read private objects); returns the status
/// and body.
pub fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = "AWS4-HMAC-SHA256 Credential=kvtier-test/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00";
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {auth}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n").ok_or(std::io::ErrorKind::InvalidData)?;
    let head = String::from_utf8_lossy(&out[..split]).to_string();
    let status = head.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, out[split + 4..].to_vec()))
}

/// A moto_server on a loopback port, with the test bucket.
pub struct Moto {
    child: Option<Child>,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Moto {
    pub fn start() -> Moto {
        aws_env();
        let dir = tempfile::tempdir().unwrap();
        let mut m = Moto { child: None, addr: SocketAddr::from(([127, 0, 0, 1], free_port())), dir };
        m.restart();
        m
    }

    /// Starts moto on the same port (an empty store: moto keeps objects in
    /// memory) and creates the bucket.
    pub fn restart(&mut self) {
        assert!(self.child.is_none());
        let log = std::fs::File::create(self.dir.path().join("moto.log")).unwrap();
        let child = Command::new(moto_bin())
            .args(["-H", "127.0.0.1", "-p", &self.addr.port().to_string()])
            .current_dir(self.dir.path())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run moto_server ({e}); run `make python-env`"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match http(self.addr, "PUT", &format!("/{BUCKET}"), b"") {
                Ok((200, _)) => return,
                _ if Instant::now() > deadline => panic!("moto_server did not answer within 30 s: {}", self.log()),
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// SIGKILL: the S3 server is gone, mid-request or not.
    pub fn kill(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("moto.log")).unwrap_or_default()
    }

    /// Object names under the test prefix.
    pub fn list(&self) -> Vec<String> {
        let (status, body) = http(self.addr, "GET", &format!("/{BUCKET}?list-type=2&prefix={PREFIX}/"), b"").unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let text = String::from_utf8_lossy(&body);
        text.split("<Key>").skip(1).map(|s| s.split("</Key>").next().unwrap().to_string()).collect()
    }

    pub fn get_object(&self, name: &str) -> Option<Vec<u8>> {
        match http(self.addr, "GET", &format!("/{BUCKET}/{name}"), b"").unwrap() {
            (200, body) => Some(body),
            (404, _) => None,
            (s, body) => panic!("GET {name}: {s} {}", String::from_utf8_lossy(&body)),
        }
    }

    pub fn put_object(&self, name: &str, body: &[u8]) {
        let (s, b) = http(self.addr, "PUT", &format!("/{BUCKET}/{name}"), body).unwrap();
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The object name docs/FORMAT.md gives `key` (64 KiB blocks).
pub fn object_name(key: &str) -> String {
    format!("{PREFIX}/kvtier/v2/{BLOCK_BYTES}/{:02x}/{key}", BlockHash::of(key.as_bytes()).0 as u8)
}

/// Node arguments: the test defaults, a small RAM tier, the shared tier at
/// `endpoint`, and `extra` flags.
pub fn node_args(dir: &Path, endpoint: &str, extra: &[&str]) -> Vec<String> {
    let mut args = test_args(dir);
    common::set_flag(&mut args, "--ram-gb", "0.01");
    args.extend(["--s3-url".into(), format!("s3://{BUCKET}/{PREFIX}"), "--s3-endpoint".into(), endpoint.into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

pub async fn put_answer(c: &Client, key: &str) -> Value {
    let a = c.send(Method::PUT, &format!("/v1/blocks/{key}"), ChunkedBody::new(vec![payload(key)]), None).await.unwrap();
    assert!(a.status.is_success(), "PUT {key}: {} {:?}", a.status, a.body.to_bytes());
    serde_json::from_slice(&a.body.to_bytes()).unwrap()
}

/// GETs `key`: `Some(tier)` with the bytes checked, `None` on 404; any
/// other answer fails the test.
pub async fn get_tier(c: &Client, key: &str) -> Option<String> {
    let (body, tier) = c.get(key).await.unwrap_or_else(|e| panic!("GET {key}: {e}"))?;
    assert_eq!(body.to_bytes(), payload(key), "{key} came back with other bytes");
    Some(tier.expect("x-kvtier-tier"))
}

pub async fn lookup(c: &Client, keys: &[String]) -> Vec<String> {
    let body = serde_json::to_vec(&json!({ "keys": keys })).unwrap();
    let a = c.send(Method::POST, "/v1/lookup", ChunkedBody::new(vec![Bytes::from(body)]), Some("application/json")).await.unwrap();
    assert_eq!(a.status, StatusCode::OK);
    let v: Value = serde_json::from_slice(&a.body.to_bytes()).unwrap();
    assert_eq!(v["prefix_hits"].as_u64().unwrap() as usize, v["tiers"].as_array().unwrap().len());
    v["tiers"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

pub async fn s3_totals(c: &Client) -> Value {
    c.stats().await.unwrap()["s3"]["totals"].clone()
}

/// Waits until the node's write-behind queue is empty and nothing is in
/// flight.
pub async fn uploads_settle(c: &Client) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let t = s3_totals(c).await;
        if t["uploads_unfinished"] == 0 {
            return t;
        }
        assert!(Instant::now() < deadline, "uploads did not settle: {t}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// A TCP proxy that holds each client→server chunk for `delay_ms` first:
/// a slow S3.
pub struct SlowProxy {
    pub addr: SocketAddr,
    pub delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl SlowProxy {
    pub fn start(upstream: SocketAddr) -> SlowProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (delay_ms.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                let Ok(server) = TcpStream::connect(upstream) else { continue };
                let d = d.clone();
                let (mut c_read, mut s_write) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let mut buf = [0u8; 65536];
                    while let Ok(n) = c_read.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(d.load(Ordering::SeqCst)));
                        if s_write.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s_write.shutdown(std::net::Shutdown::Write);
                });
                let (mut s_read, mut c_write) = (server, client);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s_read, &mut c_write);
                    let _ = c_write.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        SlowProxy { addr, delay_ms, stop }
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}
