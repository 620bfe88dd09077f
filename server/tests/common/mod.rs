//! Starting and stopping a real `kvtier serve` for integration tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Block size the tests use: 64 KiB keeps them fast.
pub const BLOCK_BYTES: u64 = 65_536;

/// A running server on an ephemeral loopback port.
pub struct Server {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its data directory.
    pub data_dir: PathBuf,
}

/// The standard test arguments: 2 shards, 64 KiB blocks, small segments.
pub fn test_args(data_dir: &Path) -> Vec<String> {
    [
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--shards",
        "2",
        "--block-bytes",
        &BLOCK_BYTES.to_string(),
        "--disk-gb",
        "0.25",
        "--segment-mib",
        "8",
        "--pin-cpus",
        "false",
        "--log-level",
        "warn",
        "--ram-gb",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Runs `kvtier serve ARGS` and waits for its "listening" line.
pub fn start(args: &[String]) -> Server {
    try_start(args).unwrap_or_else(|(status, stderr)| panic!("server exited ({status:?}) before listening:\n{stderr}"))
}

/// Like [`start`], but returns the exit status and stderr when the server
/// stops before it listens.
pub fn try_start(args: &[String]) -> Result<Server, (Option<ExitStatus>, String)> {
    let data_dir = args.iter().position(|a| a == "--data-dir").map(|i| PathBuf::from(&args[i + 1])).unwrap_or_default();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("serve")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvtier");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kvtier listening on ") {
                let _ = tx.send(rest.split_whitespace().next().unwrap().to_string());
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(url) => Ok(Server { child: Some(child), url, data_dir }),
        Err(_) => {
            let _ = child.kill();
            let status = child.wait().ok();
            let mut stderr = String::new();
            use std::io::Read;
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut stderr);
            }
            Err((status, stderr))
        }
    }
}

impl Server {
    /// SIGTERM, then wait for the exit status.
    pub fn stop(mut self) -> ExitStatus {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().expect("wait for kvtier")
    }

    /// SIGKILL: a crash, as far as the store can tell.
    pub fn crash(mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A client for `server`, HTTP/2 unless `http1`.
pub fn client(server: &Server, http1: bool) -> kvtier_loadgen::client::Client {
    kvtier_loadgen::client::Client::new(&server.url, http1, 1).unwrap()
}

/// The test payload of `key`.
pub fn payload(key: &str) -> bytes::Bytes {
    kvtier_loadgen::payload::Payloads::new(BLOCK_BYTES as usize, 1).chunks(key).concat().into()
}

/// Repository root (for tests/data).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}
