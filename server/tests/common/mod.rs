//! Starting and stopping a real `kvtier serve` for integration tests.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use kvtier_loadgen::server_process::ServerProcess;

/// Block size the tests use: 64 KiB keeps them fast.
pub const BLOCK_BYTES: u64 = 65_536;

/// A running server on an ephemeral loopback port; its stderr goes to a
/// temporary log file (never a pipe nobody drains, which would stall the
/// server once it fills).
pub struct Server {
    process: Option<ServerProcess>,
    log: tempfile::NamedTempFile,
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
    let log = tempfile::NamedTempFile::new().expect("temporary log file");
    match ServerProcess::start(Path::new(env!("CARGO_BIN_EXE_kvtier")), args, log.path()) {
        Ok(process) => Ok(Server { url: process.url().to_string(), process: Some(process), log, data_dir }),
        Err(e) => Err((e.status, std::fs::read_to_string(log.path()).unwrap_or(e.message))),
    }
}

impl Server {
    /// SIGTERM, then wait for the exit status.
    pub fn stop(mut self) -> ExitStatus {
        self.process.take().unwrap().stop().expect("wait for kvtier")
    }

    /// SIGKILL: a crash, as far as the store can tell.
    pub fn crash(mut self) {
        self.process.take().unwrap().kill9();
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.process.as_ref().unwrap().pid()
    }

    /// Resident set size in bytes.
    pub fn rss_bytes(&self) -> u64 {
        self.process.as_ref().unwrap().rss_bytes().expect("VmRSS in /proc")
    }

    /// Everything the server wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
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
