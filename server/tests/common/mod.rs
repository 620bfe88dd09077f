//! Starting and stopping a real `kvtier serve` for integration tests.

#![allow(dead_code)]

pub mod browser;
pub mod local;
pub mod loopfs;

use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use kvtier_loadgen::server_process::ServerProcess;

// The test server's command line (the standard flags, 64 KiB blocks,
// `set_flag`), written once for the server's and the loadgen's tests; not
// every test binary uses every one.
#[allow(unused_imports)]
pub use kvtier_test_support::server_args::{launch_args, serve_flags, set_flag, test_args, BLOCK_BYTES};

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

/// Runs `kvtier serve ARGS` and waits for its "listening" line.
pub fn start(args: &[String]) -> Server {
    try_start(args).unwrap_or_else(|(status, stderr)| panic!("server exited ({status:?}) before listening:\n{stderr}"))
}

/// Like [`start`], but returns the exit status and stderr when the server
/// stops before it listens.
pub fn try_start(args: &[String]) -> Result<Server, (Option<ExitStatus>, String)> {
    try_start_env(args, &[])
}

/// Like [`try_start`], with `env` added to the server's environment.
pub fn try_start_env(args: &[String], env: &[(String, String)]) -> Result<Server, (Option<ExitStatus>, String)> {
    let data_dir = args.iter().position(|a| a == "--data-dir").map(|i| PathBuf::from(&args[i + 1])).unwrap_or_default();
    let log = tempfile::NamedTempFile::new().expect("temporary log file");
    match ServerProcess::start_with_env(Path::new(env!("CARGO_BIN_EXE_kvtier")), args, env, log.path()) {
        Ok(process) => Ok(Server { url: process.url().to_string(), process: Some(process), log, data_dir }),
        // The server's log, then what the start saw (a timeout names where
        // each of the server's threads was).
        Err(e) => Err((e.status, format!("{}\n{}", std::fs::read_to_string(log.path()).unwrap_or_default(), e.message))),
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

    /// The server's "kvtier listening on ..." start-up line.
    pub fn listening_line(&self) -> String {
        self.process.as_ref().unwrap().listening_line().to_string()
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

/// Sends `method path` with `body` as JSON (none: empty), and returns the
/// status and the answer's JSON (`null` for a body that is not JSON).
pub async fn json_call(
    c: &kvtier_loadgen::client::Client,
    method: http::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (http::StatusCode, serde_json::Value) {
    let chunks = body.map(|b| vec![bytes::Bytes::from(serde_json::to_vec(&b).unwrap())]).unwrap_or_default();
    let a = c.send(method, path, kvtier_loadgen::client::ChunkedBody::new(chunks), Some("application/json")).await.unwrap();
    (a.status, serde_json::from_slice(&a.body.to_bytes()).unwrap_or(serde_json::Value::Null))
}

/// The test payload of `key`.
pub fn payload(key: &str) -> bytes::Bytes {
    kvtier_loadgen::payload::Payloads::new(BLOCK_BYTES as usize, 1).chunks(key).concat().into()
}

/// Repository root (for tests/data).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Flips the bits of one byte of `path` at `offset` (0x5a), as a bad sector
/// or a stray write would.
pub fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], offset).unwrap();
}

/// Where a key's slot is: (segment file, shard, slot index, byte offset).
pub type Location = (PathBuf, u32, u32, u64);

/// Reads every slot header of every segment of a stopped store of
/// `block_bytes` blocks (every `shard-NNN` directory): key → its newest
/// location.
pub fn locate(data: &Path, block_bytes: u64) -> std::collections::HashMap<String, Location> {
    use kvtier_engine::slot::{slot_bytes, SlotHeader, PAGE_BYTES};
    use std::io::{Read, Seek, SeekFrom};
    let mut found: std::collections::HashMap<String, (u64, Location)> = Default::default();
    for shard in 0u32.. {
        let dir = data.join(format!("shard-{shard:03}"));
        if !dir.is_dir() {
            break;
        }
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("kvt") {
                continue;
            }
            let mut f = std::fs::File::open(&path).unwrap();
            let len = f.metadata().unwrap().len();
            let mut page = vec![0u8; PAGE_BYTES as usize];
            for slot in 0.. {
                let at = PAGE_BYTES + slot as u64 * slot_bytes(block_bytes);
                if at + PAGE_BYTES > len {
                    break;
                }
                f.seek(SeekFrom::Start(at)).unwrap();
                f.read_exact(&mut page).unwrap();
                let Ok(h) = SlotHeader::decode(&page) else { break };
                let key = String::from_utf8(h.key.clone()).unwrap();
                if found.get(&key).is_none_or(|(seq, _)| h.seq > *seq) {
                    found.insert(key, (h.seq, (path.clone(), shard, slot, at)));
                }
            }
        }
    }
    found.into_iter().map(|(k, (_, l))| (k, l)).collect()
}

/// `kvtier fsck --json` of a stopped store: (exit status 0, the report).
pub fn fsck_json(data_dir: &Path) -> (bool, serde_json::Value) {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_kvtier")).args(["fsck", "--json", "--data-dir"]).arg(data_dir).output().unwrap();
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("fsck --json ({e}): {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), report)
}

/// Sends raw `request` bytes on a fresh connection to `addr` (HOST:PORT) and
/// returns everything read until the server closes or `wait` passes
/// without a byte.
pub fn exchange(addr: &str, request: &[u8], wait: std::time::Duration) -> String {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    // The server may answer and close before taking all of a huge request.
    let _ = s.write_all(request);
    read_until_quiet(&mut s)
}

/// Reads `s` until the peer closes or its read timeout passes.
pub fn read_until_quiet(s: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Status code of the first HTTP/1 response in `reply`, or 0 when the
/// server closed without answering.
pub fn status_of(reply: &str) -> u16 {
    reply.strip_prefix("HTTP/1.1 ").and_then(|r| r.get(..3)).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// Replays the ShareGPT sample (`tests/data/sharegpt_sample.json`) as one
/// user, two passes, against the server at `url`, with the policy oracle
/// built from the server's own tier capacities, and checks what every
/// oracle replay must hold: no errors, no wrong bytes, every lookup and the
/// tier of every GET as the oracle predicted, nothing stored missed. Returns
/// the oracle's settings and the results for the caller's own checks.
pub async fn replay_matching_the_oracle(
    url: &str,
    policy: &str,
) -> (kvtier_loadgen::replay::OracleConfig, kvtier_loadgen::replay::ReplayResults) {
    replay_matching_the_oracle_as(url, policy, None).await
}

/// [`replay_matching_the_oracle`] as the tenant whose token is `token`.
pub async fn replay_matching_the_oracle_as(
    url: &str,
    policy: &str,
    token: Option<&str>,
) -> (kvtier_loadgen::replay::OracleConfig, kvtier_loadgen::replay::ReplayResults) {
    use kvtier_loadgen::target::Target;
    use kvtier_loadgen::{replay, sharegpt};
    use std::sync::Arc;
    let path = repo_root().join("tests/data/sharegpt_sample.json");
    let dataset = Arc::new(sharegpt::load(&path).unwrap().conversations);
    let target = Arc::new(Target::open_as(url, false, 1, 1, token).await.unwrap());
    let oracle = replay::OracleConfig::from_server(&target).await.unwrap();
    let cfg = replay::ReplayConfig {
        users: 1,
        duration: std::time::Duration::from_secs(300),
        seed: 11,
        passes: Some(2),
        max_context_tokens: 8192,
        verify_full: true,
        generation: replay::GenerationMode::None,
        progress: false,
        oracle: Some(oracle.clone()),
        trace_out: None,
    };
    let geometry = target.geometry().await.unwrap().unwrap();
    let r = replay::run(target, dataset, path, geometry, cfg).await;
    assert_eq!((r.errors, r.wrong_bytes), (0, 0), "{policy}: {:?}", r.first_error);
    let o = r.oracle.as_ref().unwrap();
    assert!(o.gets_checked > 0 && o.lookups_checked > 0, "{o:?}");
    assert_eq!((o.lookup_mismatches, o.get_mismatches), (0, 0), "{policy}: {:?}", o.first_mismatch);
    assert_eq!(o.predicted_hit_rate, o.measured_hit_rate);
    assert_eq!(o.measured_gets_by_tier.get("miss"), None, "{policy}: nothing stored and not evicted is missed");
    (oracle, r)
}

/// The tier `POST /v1/lookup` names for each key of a stored prefix.
pub async fn tiers_of(c: &kvtier_loadgen::client::Client, keys: &[&str]) -> Vec<String> {
    let body = serde_json::to_vec(&serde_json::json!({ "keys": keys })).unwrap();
    let a = c
        .send(
            http::Method::POST,
            "/v1/lookup",
            kvtier_loadgen::client::ChunkedBody::new(vec![bytes::Bytes::from(body)]),
            Some("application/json"),
        )
        .await
        .unwrap();
    assert_eq!(a.status, http::StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&a.body.to_bytes()).unwrap();
    v["tiers"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

/// GETs `key`, checks its bytes, returns the serving tier.
pub async fn read_tier(c: &kvtier_loadgen::client::Client, key: &str) -> String {
    let (body, tier) = c.get(key).await.unwrap().unwrap_or_else(|| panic!("{key} not found"));
    assert_eq!(body.to_bytes(), payload(key), "{key} read back with other bytes");
    tier.expect("x-kvtier-tier")
}

/// Waits until every shard reports in `/v1/stats` that its I/O memory is
/// registered (it is faulted in and registered just after the shards start
/// serving): before a test takes a memory baseline.
pub async fn wait_for_io_memory_registration(server: &Server) {
    let c = client(server, true);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let stats = c.stats().await.unwrap();
        let shards = stats["per_shard"].as_array().unwrap();
        if shards.iter().all(|s| s["io_memory_registered"] == true) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "I/O memory not registered within 20 s: {shards:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `tier`'s entry (`{tier, state, reason, since_unix_ms}`) in `GET /readyz`,
/// which must answer 200: a degraded tier costs misses or refusals, not
/// readiness.
pub async fn ready_tier(c: &kvtier_loadgen::client::Client, tier: &str) -> serde_json::Value {
    let a = c.send(http::Method::GET, "/readyz", kvtier_loadgen::client::ChunkedBody::default(), None).await.unwrap();
    let ready: serde_json::Value = serde_json::from_slice(&a.body.to_bytes()).unwrap();
    assert_eq!(a.status, http::StatusCode::OK, "{ready}");
    ready["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == tier).unwrap_or_else(|| panic!("no {tier} in {ready}")).clone()
}

/// Runs `promtool check metrics` on `text`: (success, what it printed).
pub fn promtool_check(text: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run promtool ({e}): `make deps` installs it (apt-get install prometheus)"));
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// strace attached to every thread of a running server, injecting faults
/// into its real system calls (`-e inject=...`: a delay, an error), for
/// the tests of what a slow or failing call costs; detached when dropped.
pub struct Strace(std::process::Child);

impl Strace {
    /// `strace -f -p PID` with `filters` (`-e` expressions, e.g.
    /// `inject=fsync:delay_enter=1500000`), its output to `log`.
    ///
    /// # Panics
    /// strace is not installed (`make deps` installs it), or cannot start.
    pub fn attach(pid: u32, filters: &[String], log: &Path) -> Strace {
        let strace = ["/usr/bin/strace", "/bin/strace"].into_iter().find(|p| Path::new(p).exists()).unwrap_or_else(|| {
            panic!(
                "this test needs strace (Debian's strace package; `make deps` installs it) to inject faults into the server's system calls"
            )
        });
        let mut cmd = std::process::Command::new(strace);
        cmd.args(["-f", "-qq", "-p", &pid.to_string()]);
        for f in filters {
            cmd.args(["-e", f]);
        }
        let child =
            cmd.arg("-o").arg(log).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("start strace");
        // Attaching to a server's dozen threads takes tens of milliseconds.
        std::thread::sleep(std::time::Duration::from_millis(500));
        Strace(child)
    }
}

impl Drop for Strace {
    fn drop(&mut self) {
        // SAFETY: SIGINT to our own child: strace detaches and exits.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let _ = self.0.wait();
    }
}
