//! Crash harness: PUT load from several clients against a real `kvtier
//! serve`, `kill -9` at a random moment, restart, and check every key ever
//! written.
//!
//! Each round:
//! 1. clients (HTTP/2 and HTTP/1.1 alternately) PUT new keys, overwrite
//!    keys acknowledged earlier, and GET acknowledged keys, verifying bytes;
//! 2. after a random delay in `[kill_min_ms, kill_max_ms]` the server gets
//!    SIGKILL with requests in flight;
//! 3. the server restarts on the same data directory (the restart time is
//!    spawn → "listening" line);
//! 4. every key ever attempted is read back. A key whose last acknowledged
//!    version is `a` must return `a`, or a version whose PUT was still in
//!    flight at the kill; a key never acknowledged may be absent. Anything
//!    else is **lost** (acknowledged, now absent) or **wrong** (bytes that
//!    were never PUT for that key).
//!
//! Payloads: version `v` of key `k` is the [`Payloads`] block of seed
//! `v mod 4` stamped with `k`, so every check compares whole blocks.
//! Overwrites take a key exclusively, so each key has at most one PUT in
//! flight and the order of its versions is the order of the PUTs.
//!
//! The write budget keeps the run inside the log (`capacity_blocks` × 0.7
//! over all rounds): a reclaimed segment would evict blocks by design and
//! make a loss unprovable, so the harness also fails if the server reports
//! evictions. PUTs are paced so that a round's budget lasts until the
//! latest possible kill, so every kill lands with PUTs in flight.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

use crate::client::Client;
use crate::payload::Payloads;
use crate::server_process::{log_lines_with, Launcher};
use crate::stats::{FirstError, LatencySummary, OpLatency};

/// Distinct payload generators; version `v` uses `v % VERSIONS`.
const VERSIONS: u32 = 4;

/// Share of the log's capacity the whole run may write.
const BUDGET_SHARE: f64 = 0.7;

/// Problems quoted in the results (the counts cover all of them).
const PROBLEMS_MAX: usize = 20;

/// What [`run`] does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CrashConfig {
    /// The `kvtier` binary.
    pub server_bin: PathBuf,
    /// Data directory the server crashes on (created; should start empty).
    pub data_dir: PathBuf,
    /// Directory for `server.log` (and the caller's results.json).
    pub out_dir: PathBuf,
    /// Extra `kvtier serve` arguments (geometry, shards, tiers). The harness
    /// adds `--listen 127.0.0.1:0`, `--data-dir` and `--write-policy through`.
    pub serve_args: Vec<String>,
    /// Kill/restart rounds.
    pub rounds: usize,
    /// Concurrent clients, each with its own connection.
    pub clients: usize,
    /// Earliest kill, ms after the round's load starts.
    pub kill_min_ms: u64,
    /// Latest kill.
    pub kill_max_ms: u64,
    /// Share of operations that overwrite an acknowledged key.
    pub overwrite_share: f64,
    /// Share of operations that read an acknowledged key back.
    pub read_share: f64,
    /// Restart time each round must stay within (DESIGN: ≤ 1 s from a
    /// header scan).
    pub restart_target_ms: u64,
    /// Seed of kill times and operation choices.
    pub seed: u64,
}

/// One kill and restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoundResult {
    /// Round number from 0.
    pub round: usize,
    /// When SIGKILL was sent, ms after the load started.
    pub killed_after_ms: u64,
    /// PUTs acknowledged (201/200) this round.
    pub puts_acknowledged: u64,
    /// PUTs that got no acknowledgement (in flight at the kill, or refused).
    pub puts_unacknowledged: u64,
    /// GETs during the load, each verified.
    pub reads: u64,
    /// Spawn to "listening", ms.
    pub restart_ms: f64,
    /// Keys read back after the restart.
    pub keys_verified: u64,
    /// Unacknowledged PUTs found stored after the restart (allowed).
    pub unacknowledged_landed: u64,
    /// Acknowledged versions missing after the restart (must be 0).
    pub lost: u64,
    /// Reads that returned bytes never PUT for the key (must be 0).
    pub wrong: u64,
}

/// The harness's verdict and figures (`results.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CrashResults {
    /// Always "crash".
    pub mode: String,
    /// The settings.
    pub config: CrashConfig,
    /// Block size the server stores.
    pub block_bytes: u64,
    /// Rounds completed.
    pub rounds: usize,
    /// PUTs acknowledged over all rounds.
    pub blocks_acknowledged: u64,
    /// Keys stored at the end.
    pub keys_stored: u64,
    /// Unacknowledged PUTs that landed anyway.
    pub unacknowledged_landed: u64,
    /// Acknowledged blocks lost (must be 0).
    pub lost: u64,
    /// Wrong bytes served (must be 0).
    pub wrong: u64,
    /// Restart times (µs fields) over the rounds.
    pub restart: LatencySummary,
    /// The restart target in ms.
    pub restart_target_ms: u64,
    /// Blocks the server counted as corrupt at the end (torn writes of the
    /// kills; never served).
    pub corrupt_blocks_counted: u64,
    /// Lines of the server log naming corrupt or torn slots.
    pub damage_log_lines: usize,
    /// Per round.
    pub per_round: Vec<RoundResult>,
    /// The first problems found, in words.
    pub problems: Vec<String>,
    /// lost = 0, wrong = 0, every restart within target, no other problem.
    pub passed: bool,
}

#[derive(Default)]
struct KeyState {
    /// Last acknowledged version.
    acked: Option<u32>,
    /// Versions sent after `acked` without an acknowledgement.
    pending: Vec<u32>,
    /// Next version to write.
    next: u32,
    /// An overwrite of it is in flight.
    busy: bool,
}

impl KeyState {
    fn allowed(&self) -> impl Iterator<Item = u32> + '_ {
        self.acked.into_iter().chain(self.pending.iter().copied())
    }
}

struct Shared {
    keys: Mutex<HashMap<String, KeyState>>,
    /// Acknowledged keys, for overwrites and reads.
    acked_keys: Mutex<Vec<String>>,
    payloads: Vec<Payloads>,
    problems: Mutex<Vec<String>>,
    lost: AtomicU64,
    wrong: AtomicU64,
}

impl Shared {
    fn chunks(&self, key: &str, version: u32) -> Vec<bytes::Bytes> {
        self.payloads[(version % VERSIONS) as usize].chunks(key)
    }

    fn matches(&self, key: &str, version: u32, body: &[u8]) -> bool {
        self.payloads[(version % VERSIONS) as usize].verify(key, body, true)
    }

    fn problem(&self, what: String) {
        let mut p = self.problems.lock().unwrap();
        if p.len() < PROBLEMS_MAX {
            p.push(what);
        }
    }

    /// The oldest version a read of `key` sent now may return: the last
    /// acknowledged one, else the oldest in flight.
    fn oldest_allowed(&self, key: &str) -> Option<u32> {
        self.keys.lock().unwrap().get(key).and_then(|s| s.allowed().min())
    }

    /// Checks a read of `key` against what may be stored; counts lost and
    /// wrong. Returns the version found. `since`: for a read that ran
    /// concurrently with overwrites, the oldest version allowed when it was
    /// sent ([`Shared::oldest_allowed`]); any version from it to the newest
    /// allowed now was PUT during the read and may be returned (an older
    /// one is a stale read: wrong).
    fn check_read(&self, key: &str, body: Option<&[u8]>, since: Option<u32>, when: &str) -> Option<u32> {
        let keys = self.keys.lock().unwrap();
        let state = keys.get(key);
        match (body, state) {
            (Some(b), Some(s)) => {
                let newest = s.allowed().max();
                let found = match (since, newest) {
                    (Some(lo), Some(hi)) => (lo..=hi.max(lo)).find(|&v| self.matches(key, v, b)),
                    _ => s.allowed().find(|&v| self.matches(key, v, b)),
                };
                if found.is_none() {
                    self.wrong.fetch_add(1, Ordering::Relaxed);
                    self.problem(format!("{when}: {key} returned {} bytes that were never PUT for it", b.len()));
                }
                found
            }
            (Some(b), None) => {
                self.wrong.fetch_add(1, Ordering::Relaxed);
                self.problem(format!("{when}: {key} was never PUT but returned {} bytes", b.len()));
                None
            }
            (None, Some(s)) if s.acked.is_some() => {
                self.lost.fetch_add(1, Ordering::Relaxed);
                self.problem(format!("{when}: {key} version {} was acknowledged and is gone", s.acked.unwrap()));
                None
            }
            (None, _) => None,
        }
    }
}

struct RoundCounters {
    acked: AtomicU64,
    unacked: AtomicU64,
    reads: AtomicU64,
    attempts: AtomicU64,
}

/// Runs the harness: starts the server, `rounds` times loads, kills and
/// restarts it and verifies every key, then stops it cleanly.
///
/// # Errors
/// A message when the server cannot start or restart, or its geometry
/// cannot be read; the verdict itself is in [`CrashResults::passed`].
pub async fn run(cfg: CrashConfig, progress: bool) -> Result<CrashResults, String> {
    let extra: Vec<String> =
        ["--write-policy".to_string(), "through".to_string()].into_iter().chain(cfg.serve_args.iter().cloned()).collect();
    let launcher = Launcher::new(&cfg.server_bin, &cfg.data_dir, &cfg.out_dir, &extra)?;
    let log = launcher.log();
    let mut server = launcher.start().await?;
    let client = Client::new(server.url(), false, 1).map_err(|e| e.to_string())?;
    let stats = client.stats().await.map_err(|e| e.to_string())?;
    let block_bytes = stats["geometry"]["block_bytes"].as_u64().ok_or("no geometry in /v1/stats")?;
    let capacity_blocks = stats["totals"]["capacity_blocks"].as_u64().ok_or("no capacity_blocks in /v1/stats")?;
    let budget_per_round = ((capacity_blocks as f64 * BUDGET_SHARE) / cfg.rounds.max(1) as f64) as u64;
    if budget_per_round < cfg.clients as u64 {
        return Err(format!(
            "the log holds {capacity_blocks} blocks: too few for {} rounds of {} clients; raise --disk-gb in the serve arguments",
            cfg.rounds, cfg.clients
        ));
    }
    let shared = Arc::new(Shared {
        keys: Mutex::new(HashMap::new()),
        acked_keys: Mutex::new(Vec::new()),
        payloads: (0..VERSIONS).map(|v| Payloads::new(block_bytes as usize, 0xC4A5 + v as u64)).collect(),
        problems: Mutex::new(Vec::new()),
        lost: AtomicU64::new(0),
        wrong: AtomicU64::new(0),
    });
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
    let mut restart = OpLatency::default();
    let mut per_round = Vec::new();
    let mut restarts_over = 0;
    for round in 0..cfg.rounds {
        let counters = Arc::new(RoundCounters {
            acked: AtomicU64::new(0),
            unacked: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            attempts: AtomicU64::new(0),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let first_error = Arc::new(FirstError::default());
        let mut tasks = Vec::new();
        let round_start = Instant::now();
        let interval = Duration::from_millis(cfg.kill_max_ms) / budget_per_round as u32;
        for c in 0..cfg.clients.max(1) {
            let client = Client::new(server.url(), c % 2 == 1, 1).map_err(|e| e.to_string())?;
            let worker = Worker {
                client,
                shared: shared.clone(),
                counters: counters.clone(),
                stop: stop.clone(),
                first_error: first_error.clone(),
                prefix: format!("r{round:03}c{c:02}"),
                budget: budget_per_round,
                round_start,
                interval,
                overwrite_share: cfg.overwrite_share,
                read_share: cfg.read_share,
            };
            let seed = rng.gen::<u64>();
            tasks.push(tokio::spawn(worker.run(seed)));
        }
        let kill_ms = rng.gen_range(cfg.kill_min_ms..=cfg.kill_max_ms.max(cfg.kill_min_ms));
        tokio::time::sleep(Duration::from_millis(kill_ms)).await;
        server.kill9();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        server = launcher.start().await?;
        let restart_ms = server.start_time.as_secs_f64() * 1e3;
        restart.record(server.start_time.as_micros() as u64);
        if restart_ms > cfg.restart_target_ms as f64 {
            restarts_over += 1;
            shared.problem(format!("round {round}: restart took {restart_ms:.0} ms, over the {} ms target", cfg.restart_target_ms));
        }
        let (lost0, wrong0) = (shared.lost.load(Ordering::Relaxed), shared.wrong.load(Ordering::Relaxed));
        let (verified, landed) = verify_all(&shared, server.url(), cfg.clients.max(1), round).await?;
        let r = RoundResult {
            round,
            killed_after_ms: kill_ms,
            puts_acknowledged: counters.acked.load(Ordering::Relaxed),
            puts_unacknowledged: counters.unacked.load(Ordering::Relaxed),
            reads: counters.reads.load(Ordering::Relaxed),
            restart_ms,
            keys_verified: verified,
            unacknowledged_landed: landed,
            lost: shared.lost.load(Ordering::Relaxed) - lost0,
            wrong: shared.wrong.load(Ordering::Relaxed) - wrong0,
        };
        if progress {
            eprintln!(
                "round {:>3}: kill at {:>4} ms, {:>5} PUTs acknowledged, {:>3} not, {:>5} reads; restart {:>6.1} ms; {:>6} keys verified, lost {}, wrong {}",
                r.round,
                r.killed_after_ms,
                r.puts_acknowledged,
                r.puts_unacknowledged,
                r.reads,
                r.restart_ms,
                r.keys_verified,
                r.lost,
                r.wrong
            );
        }
        per_round.push(r);
    }
    let client = Client::new(server.url(), false, 1).map_err(|e| e.to_string())?;
    let stats = client.stats().await.map_err(|e| e.to_string())?;
    let evicted = stats["totals"]["evicted_blocks"].as_u64().unwrap_or(0);
    if evicted > 0 {
        shared.problem(format!("the log reclaimed segments ({evicted} blocks evicted): the run outgrew the budget"));
    }
    let corrupt_blocks_counted = stats["totals"]["corrupt_blocks"].as_u64().unwrap_or(0);
    server.stop().map_err(|e| format!("stopping the server: {e}"))?;
    let keys_stored = shared.keys.lock().unwrap().values().filter(|s| s.acked.is_some()).count() as u64;
    let problems = shared.problems.lock().unwrap().clone();
    let lost = shared.lost.load(Ordering::Relaxed);
    let wrong = shared.wrong.load(Ordering::Relaxed);
    Ok(CrashResults {
        mode: "crash".into(),
        block_bytes,
        rounds: per_round.len(),
        blocks_acknowledged: per_round.iter().map(|r| r.puts_acknowledged).sum(),
        keys_stored,
        unacknowledged_landed: per_round.iter().map(|r| r.unacknowledged_landed).sum(),
        lost,
        wrong,
        restart: restart.summary(),
        restart_target_ms: cfg.restart_target_ms,
        corrupt_blocks_counted,
        damage_log_lines: log_lines_with(log, "corrupt").len() + log_lines_with(log, "torn").len(),
        per_round,
        passed: lost == 0 && wrong == 0 && restarts_over == 0 && evicted == 0,
        problems,
        config: cfg,
    })
}

struct Worker {
    client: Client,
    shared: Arc<Shared>,
    counters: Arc<RoundCounters>,
    stop: Arc<AtomicBool>,
    first_error: Arc<FirstError>,
    prefix: String,
    budget: u64,
    /// The round's load began here; PUT `i` starts no earlier than
    /// `round_start + i × interval`.
    round_start: Instant,
    interval: Duration,
    overwrite_share: f64,
    read_share: f64,
}

impl Worker {
    async fn run(self, seed: u64) {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut n = 0u64;
        while !self.stop.load(Ordering::Relaxed) {
            let pick = {
                let acked = self.shared.acked_keys.lock().unwrap();
                (!acked.is_empty()).then(|| acked[rng.gen_range(0..acked.len())].clone())
            };
            let roll: f64 = rng.gen();
            if let (Some(key), true) = (&pick, roll < self.read_share) {
                self.read(key).await;
                continue;
            }
            let attempt = self.counters.attempts.fetch_add(1, Ordering::Relaxed);
            if attempt >= self.budget {
                // Budget spent: wait for the kill.
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            // Paced so that the budget lasts until the latest kill.
            tokio::time::sleep_until((self.round_start + self.interval * attempt as u32).into()).await;
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let key = match pick {
                Some(key) if roll < self.read_share + self.overwrite_share => key,
                _ => {
                    n += 1;
                    format!("{}n{n:06}", self.prefix)
                }
            };
            self.put(&key).await;
        }
    }

    async fn read(&self, key: &str) {
        let since = self.shared.oldest_allowed(key);
        match self.client.get(key).await {
            Ok(got) => {
                self.counters.reads.fetch_add(1, Ordering::Relaxed);
                let body = got.map(|(b, _)| b.to_bytes());
                self.shared.check_read(key, body.as_deref(), since, "read under load");
            }
            Err(e) => {
                self.first_error.note(e.to_string());
            }
        }
    }

    async fn put(&self, key: &str) {
        let version = {
            let mut keys = self.shared.keys.lock().unwrap();
            let s = keys.entry(key.to_string()).or_default();
            if s.busy {
                return;
            }
            s.busy = true;
            let v = s.next;
            s.next += 1;
            s.pending.push(v);
            v
        };
        let result = self.client.put(key, self.shared.chunks(key, version)).await;
        let mut keys = self.shared.keys.lock().unwrap();
        let s = keys.get_mut(key).expect("registered above");
        s.busy = false;
        match result {
            Ok(_) => {
                let first = s.acked.is_none();
                s.acked = Some(version);
                s.pending.clear();
                drop(keys);
                if first {
                    self.shared.acked_keys.lock().unwrap().push(key.to_string());
                }
                self.counters.acked.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                drop(keys);
                self.first_error.note(e.to_string());
                self.counters.unacked.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Reads every key back after a restart with `workers` clients; returns
/// (keys verified, unacknowledged versions that landed). What a read
/// shows becomes the key's acknowledged state (it is on disk now).
async fn verify_all(shared: &Arc<Shared>, url: &str, workers: usize, round: usize) -> Result<(u64, u64), String> {
    let keys: Vec<String> = shared.keys.lock().unwrap().keys().cloned().collect();
    let landed = Arc::new(AtomicU64::new(0));
    let keys = Arc::new(keys);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks: Vec<tokio::task::JoinHandle<Result<(), String>>> = Vec::new();
    for _ in 0..workers {
        let (shared, keys, next, landed) = (shared.clone(), keys.clone(), next.clone(), landed.clone());
        let client = Client::new(url, false, 1).map_err(|e| e.to_string())?;
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(key) = keys.get(i) else { return Ok(()) };
                let got = client.get(key).await.map_err(|e| format!("verifying {key} after restart {round}: {e}"))?;
                let when = format!("after restart {round}");
                let body = got.as_ref().map(|(b, _)| b.to_bytes());
                let found = shared.check_read(key, body.as_deref(), None, &when);
                let mut map = shared.keys.lock().unwrap();
                let s = map.get_mut(key).expect("key listed");
                match found {
                    Some(v) => {
                        if s.acked != Some(v) {
                            landed.fetch_add(1, Ordering::Relaxed);
                        }
                        let first = s.acked.is_none();
                        s.acked = Some(v);
                        s.pending.clear();
                        drop(map);
                        if first {
                            shared.acked_keys.lock().unwrap().push(key.clone());
                        }
                    }
                    // Not stored: forget the attempts (a loss is counted
                    // once, above).
                    None if got.is_none() => {
                        s.acked = None;
                        s.pending.clear();
                    }
                    // Wrong bytes, counted above.
                    None => {}
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok((keys.len() as u64, landed.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        Shared {
            keys: Mutex::new(HashMap::new()),
            acked_keys: Mutex::new(Vec::new()),
            payloads: (0..VERSIONS).map(|v| Payloads::new(4096, v as u64)).collect(),
            problems: Mutex::new(Vec::new()),
            lost: AtomicU64::new(0),
            wrong: AtomicU64::new(0),
        }
    }

    #[test]
    fn reads_are_judged_against_acknowledged_and_in_flight_versions() {
        let s = shared();
        let body = |key: &str, v: u32| s.chunks(key, v).concat();
        s.keys.lock().unwrap().insert("a".into(), KeyState { acked: Some(1), pending: vec![2], next: 3, busy: false });
        s.keys.lock().unwrap().insert("b".into(), KeyState { acked: None, pending: vec![0], next: 1, busy: false });
        // The acknowledged version and the one in flight are both fine.
        assert_eq!(s.check_read("a", Some(&body("a", 1)), None, "t"), Some(1));
        assert_eq!(s.check_read("a", Some(&body("a", 2)), None, "t"), Some(2));
        // An older version, another key's bytes, a torn block: wrong.
        assert_eq!(s.check_read("a", Some(&body("a", 0)), None, "t"), None);
        assert_eq!(s.check_read("a", Some(&body("b", 1)), None, "t"), None);
        let mut torn = body("a", 1);
        torn[3000] ^= 1;
        assert_eq!(s.check_read("a", Some(&torn), None, "t"), None);
        assert_eq!(s.wrong.load(Ordering::Relaxed), 3);
        // Gone after an acknowledgement: lost; never acknowledged: allowed.
        assert_eq!(s.check_read("a", None, None, "t"), None);
        assert_eq!(s.check_read("b", None, None, "t"), None);
        assert_eq!(s.lost.load(Ordering::Relaxed), 1);
        // Bytes for a key never written at all: wrong.
        assert_eq!(s.check_read("c", Some(&body("c", 0)), None, "t"), None);
        assert_eq!(s.wrong.load(Ordering::Relaxed), 4);
        assert_eq!(s.problems.lock().unwrap().len(), 5);
        // A read sent while version 1 was the newest acknowledged, answered
        // after versions 2 and 3 were acknowledged: 1, 2 or 3 are all
        // fine; 0 is a stale read.
        s.keys.lock().unwrap().insert("d".into(), KeyState { acked: Some(1), pending: vec![], next: 2, busy: false });
        let since = s.oldest_allowed("d");
        s.keys.lock().unwrap().insert("d".into(), KeyState { acked: Some(3), pending: vec![], next: 4, busy: false });
        for v in 1..=3 {
            assert_eq!(s.check_read("d", Some(&body("d", v)), since, "t"), Some(v));
        }
        assert_eq!(s.check_read("d", Some(&body("d", 0)), since, "t"), None);
        assert_eq!(s.wrong.load(Ordering::Relaxed), 5);
    }
}
