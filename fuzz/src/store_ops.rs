//! `store_ops`: a structure-aware target for the store itself.
//!
//! The fuzzer's bytes choose a small store (one or two shards, 4 KiB or
//! 1 MiB + 4 KiB blocks so reads span two verified chunks, 2–4 slots per
//! segment and 2–4 segments per shard so reclaim comes quickly, an optional
//! RAM tier) and a sequence of operations: put, two concurrent puts of one
//! key, get, contains, delete, a forced reclaim, a clean restart, `kill -9`
//! at a chosen point with puts in flight, and one byte flipped in a chosen
//! file of the stopped store. Each runs against a real store on real files
//! through io_uring (the store opened anew for every life), and an
//! in-memory model says what each read may return. The store may span two
//! devices (a data directory each: with two shards shard s on device s, with
//! one its segments rotating over both), and a `Corrupt` of no byte loses
//! one between lives: its
//! directory is emptied, as a failed drive replaced by an empty one, and
//! the store opens with the empty directory in its place; or the device is
//! absent for the next life, its directory moved away as an unmounted
//! drive's, and back after it; or it fails in the middle of the next life,
//! every segment I/O on it answering `EIO` from a chosen operation on
//! (`kvtier_engine::faults`), and works again after it.
//!
//! The model:
//!
//! - a block acknowledged and not overwritten or deleted since is served
//!   with exactly its bytes, unless an eviction (reclaim of the oldest
//!   segment, `evicted_blocks`) or a flipped byte could have taken it; then
//!   it may be missing, never different;
//! - a put in flight at `kill -9` may or may not have landed, and may hide
//!   the key's older value (a torn newer record);
//! - after a flipped byte, a key may read as missing or as any value it
//!   ever held (an older record behind a damaged newer one), byte for
//!   byte, never as bytes it never held;
//! - while a device is absent, its shards' keys read as missing and their
//!   PUTs and DELETEs are refused ([`Error::DeviceDown`], a miss), and
//!   once it is back they read as before it went;
//! - while a device fails, its shards' PUTs and DELETEs are refused
//!   ([`Error::DeviceDown`]), a read may miss and is never wrong, and once
//!   it works again its keys read as before it failed;
//! - recovery always completes: every restart opens the store.
//!
//! `kill -9` is real: that life runs in a forked child that reports each
//! acknowledgement to the parent over a pipe, fires its puts, yields a
//! chosen number of times and sends itself `SIGKILL`; the parent then
//! reopens the store the child left. libFuzzer does not see the child's
//! coverage, only the parent's (the recovery after it included).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use kvtier_engine::devices::{devices_of_shard, DeviceSpec, Layout};
use kvtier_engine::faults::DeviceFaults;
use kvtier_engine::key::StoredKey;
use kvtier_engine::slot::{slot_bytes, PAGE_BYTES};
use kvtier_engine::{Error, Geometry, Store, StoreConfig};
use serde::{Deserialize, Serialize};

/// Keys the operations choose from (few, so operations meet).
const KEYS: [&str; 6] = ["k0", "k1", "k2", "k3", "k4", "k5"];

/// The default owner's stored key of `KEYS[k]`.
fn stored(k: usize) -> StoredKey {
    StoredKey::unscoped(KEYS[k]).expect("a valid key")
}
/// Most operations one input runs.
const OPS_MAX: usize = 48;

/// The store an input runs against.
#[derive(Debug, Arbitrary)]
struct Setup {
    two_shards: bool,
    big_blocks: bool,
    slots_per_segment: u8,
    segments_per_shard: u8,
    ram_blocks: u8,
    /// Bit 0: reads from the log promote into RAM; bit 1: two devices, one
    /// per shard with two shards, both under the one shard's rotating
    /// segments with one. (Bit 0 alone was a `bool` before there were
    /// devices: the committed inputs decode as they did.)
    flags: u8,
}

impl Setup {
    fn promote(&self) -> bool {
        self.flags & 1 != 0
    }

    fn two_devices(&self) -> bool {
        self.flags & 2 != 0
    }
}

/// One operation.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Op {
    Put {
        key: u8,
        seed: u8,
    },
    PutPair {
        key: u8,
        a: u8,
        b: u8,
    },
    Get {
        key: u8,
    },
    Contains {
        key: u8,
    },
    Delete {
        key: u8,
    },
    /// Writes filler blocks until the oldest segment is reclaimed.
    Reclaim,
    /// Ends the life cleanly (snapshot written); the next opens the store.
    Restart,
    /// Ends the life with `kill -9` after `inflight % 3 + 1` puts are
    /// started and the shard has yielded `yields % 8` times.
    Kill {
        inflight: u8,
        yields: u8,
    },
    /// Ends the life cleanly, then xors the byte at `offset` (modulo the
    /// file's length) of the `file`-th file of the store with `xor`. With
    /// `xor` 0, which changes no byte, a two-device store loses device
    /// `file % 2` instead, by `offset % 4`: 0 and 2, its directory is
    /// emptied (a failed drive replaced by an empty one), and its shards'
    /// keys read as missing from then on; 1, the device is absent for the
    /// next life (its directory moved away, as a drive not mounted) and
    /// back after it; 3, the device fails in the next life from its
    /// operation `offset / 4 % 8` on (every segment I/O answers `EIO`) and
    /// works again after it. (A new variant would renumber every committed
    /// input's operations.)
    Corrupt {
        file: u8,
        offset: u32,
        xor: u8,
    },
}

/// What one key may read as.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct KeyState {
    /// Acceptable answers (`None`: missing); the last acknowledged write,
    /// and those that may or may not have landed.
    allowed: Vec<Option<u8>>,
    /// Every seed ever written to the key.
    history: Vec<u8>,
    /// [`Model::epoch`] when it was last written (0: never).
    written_epoch: u64,
}

/// What the store must hold.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Model {
    keys: Vec<KeyState>,
    /// Counts acknowledged writes.
    epoch: u64,
    /// Keys written at or before this epoch may have been evicted.
    loss_epoch: u64,
    /// Keys written at or before this epoch may have been damaged.
    damage_epoch: u64,
    /// Filler blocks written so far (their keys are unique).
    fillers: u64,
    /// The keys whose device is absent in this life: they read as missing,
    /// and their writes are refused, leaving their state as it was.
    #[serde(default)]
    absent_keys: Vec<usize>,
    /// A device to fail in this life: from which operation, and its keys.
    #[serde(default)]
    fail: Option<FailPlan>,
    /// The keys whose device fails now: their writes are refused, their
    /// reads may miss, and neither changes their state.
    #[serde(default)]
    failing_keys: Vec<usize>,
}

/// A device failing from one operation of a life on ([`Model::fail`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct FailPlan {
    device: usize,
    from_op: usize,
    keys: Vec<usize>,
}

impl Model {
    fn new() -> Self {
        let empty = KeyState { allowed: vec![None], history: Vec::new(), written_epoch: 0 };
        Model {
            keys: vec![empty; KEYS.len()],
            epoch: 0,
            loss_epoch: 0,
            damage_epoch: 0,
            fillers: 0,
            absent_keys: Vec::new(),
            fail: None,
            failing_keys: Vec::new(),
        }
    }

    /// The keys of the shards on device `device` ([`devices_of_shard`]: a
    /// shard spanning it and another loses its whole log with it).
    fn keys_on(device: usize, devices: usize, shards: usize) -> Vec<usize> {
        (0..KEYS.len()).filter(|k| devices_of_shard(stored(*k).hash().shard(shards), shards, devices).contains(&device)).collect()
    }

    fn acked(&mut self, k: usize, values: &[Option<u8>]) {
        self.epoch += 1;
        let s = &mut self.keys[k];
        s.allowed = values.to_vec();
        s.history.extend(values.iter().flatten());
        s.written_epoch = self.epoch;
    }

    /// A write that may or may not have landed; `hides` when it may also
    /// have hidden the value before it (a torn newer record).
    fn maybe(&mut self, k: usize, value: Option<u8>, hides: bool) {
        let s = &mut self.keys[k];
        s.allowed.push(value);
        if hides {
            s.allowed.push(None);
        }
        s.history.extend(value);
    }

    /// Device `device`'s log is gone: the keys of its shards
    /// ([`Model::keys_on`]) are missing from now on.
    fn lost(&mut self, device: usize, devices: usize, shards: usize) {
        for k in Self::keys_on(device, devices, shards) {
            self.keys[k].allowed = vec![None];
        }
    }

    /// Checks an answer for key `k` of an absent device: a miss (`got`
    /// `None`, or a refusal), which says nothing of what it holds once back.
    fn read_absent(&self, k: usize, got: Option<u8>, what: &str) {
        assert_eq!(got, None, "{what} {}: its device is absent, yet it was served", KEYS[k]);
    }

    /// Checks one answer for key `k`; `got` is the seed served or `None`.
    fn read(&mut self, k: usize, got: Option<u8>, what: &str) {
        let s = &mut self.keys[k];
        if s.allowed.contains(&got) {
            s.allowed = vec![got];
            return;
        }
        let written = s.written_epoch > 0 || !s.history.is_empty();
        let lossy = written && self.loss_epoch >= s.written_epoch;
        let damaged = written && self.damage_epoch >= s.written_epoch;
        if got.is_none() && (lossy || damaged) {
            return;
        }
        if damaged && got.is_some_and(|v| s.history.contains(&v)) {
            return;
        }
        panic!(
            "{what} {}: got {got:?}, the model allows {:?} (history {:?}, written at epoch {}, evictions up to {}, damage up to {})",
            KEYS[k], s.allowed, s.history, s.written_epoch, self.loss_epoch, self.damage_epoch
        );
    }

    /// The seed whose block `bytes` are, among those key `k` ever held.
    fn identify(&self, k: usize, bytes: &[u8]) -> u8 {
        let s = &self.keys[k];
        let candidates = s.allowed.iter().flatten().chain(&s.history);
        for seed in candidates {
            if payload(k, *seed, bytes.len() as u64) == bytes {
                return *seed;
            }
        }
        panic!("GET {} served {} bytes that are no block ever written to it (history {:?})", KEYS[k], bytes.len(), s.history);
    }
}

/// The block of key `k` with seed `seed`: distinct for every (key, seed),
/// so a block served for the wrong key or version is caught.
fn payload(k: usize, seed: u8, len: u64) -> Bytes {
    let word = xxhash_rust::xxh3::xxh3_64(&[k as u8, seed]).to_le_bytes();
    let mut v: Vec<u8> = word.iter().cycle().take(len as usize).copied().collect();
    // A per-page counter too, so pages cannot be swapped unseen.
    for (i, page) in v.chunks_mut(PAGE_BYTES as usize).enumerate() {
        page[0] = i as u8;
    }
    Bytes::from(v)
}

/// The devices of a store of `setup` in `dir`: `dir/d0` and `dir/d1` with
/// two devices, else none (the store is `dir` itself, one directory).
fn device_dirs(setup: &Setup, dir: &Path) -> Vec<PathBuf> {
    if setup.two_devices() {
        vec![dir.join("d0"), dir.join("d1")]
    } else {
        Vec::new()
    }
}

/// The store's configuration for its next life: over its devices as
/// `kvtier serve` resolves them (an emptied one stands in for the lost
/// device), else over `dir`.
fn config(setup: &Setup, dir: &Path) -> StoreConfig {
    let mut cfg = config_in(setup, dir);
    let devices = device_dirs(setup, dir);
    if !devices.is_empty() {
        let specs: Vec<DeviceSpec> = devices.into_iter().map(|dir| DeviceSpec { dir, capacity_bytes: None }).collect();
        let layout = Layout::resolve(&specs, cfg.disk_bytes, cfg.shards).unwrap_or_else(|e| panic!("the devices did not resolve: {e}"));
        cfg.layout = Some(layout);
    }
    cfg
}

fn config_in(setup: &Setup, dir: &Path) -> StoreConfig {
    let shards = if setup.two_shards { 2 } else { 1 };
    let block_bytes: u64 = if setup.big_blocks { (1 << 20) + 4096 } else { 4096 };
    let slots = 2 + setup.slots_per_segment as u64 % 3;
    let segments = 2 + setup.segments_per_shard as u64 % 3;
    let segment_bytes = PAGE_BYTES + slots * slot_bytes(block_bytes);
    StoreConfig {
        data_dir: dir.to_path_buf(),
        layout: None,
        geometry: Geometry::from_block_bytes(block_bytes, 16).expect("a valid block size"),
        shards,
        disk_bytes: shards as u64 * segments * segment_bytes,
        segment_bytes,
        sync: false,
        io_depth_max: 8,
        io_queue_max: kvtier_engine::store::IO_QUEUE_MAX_DEFAULT,
        pin_cpus: false,
        snapshot_secs: 0,
        ram_bytes: shards as u64 * (setup.ram_blocks % 4) as u64 * block_bytes,
        ram_shared: Default::default(),
        shared_index: false,
        write_policy: kvtier_engine::WritePolicy::Through,
        promote: setup.promote(),
        gpu: Default::default(),
        io_memory_bytes: kvtier_engine::store::IO_MEMORY_SHARD_BYTES_MIN,
        remote: None,
        health_window: kvtier_engine::health::ERROR_WINDOW,
        trace: None,
        owners: Default::default(),
        events: None,
        stalls: None,
        device_faults: None,
    }
}

/// Where the stores live: `$KVTIER_FUZZ_TMP`, else the system temp dir
/// (it must take `O_DIRECT`: not tmpfs).
fn tmp_root() -> PathBuf {
    std::env::var_os("KVTIER_FUZZ_TMP").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

/// The target.
pub fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(setup) = Setup::arbitrary(&mut u) else { return };
    let mut ops = Vec::new();
    while ops.len() < OPS_MAX && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    if ops.is_empty() {
        return;
    }
    if tracing() {
        eprintln!("store_ops: {setup:?}\nstore_ops: {ops:?}");
    }
    let dir = tempfile::Builder::new().prefix("kvtier-fuzz-store-").tempdir_in(tmp_root()).expect("a temp dir");
    let devices = device_dirs(&setup, dir.path());
    // Each device's injected failure (kvtier_engine::faults), off but in a life planned to fail.
    let faults = (!devices.is_empty()).then(|| DeviceFaults::new(devices.len()));
    let mut model = Model::new();
    let ends_life = |op: &Op| matches!(op, Op::Restart | Op::Kill { .. } | Op::Corrupt { .. });
    // The directory of a device absent for this life, moved away, and where.
    let mut away: Option<(PathBuf, PathBuf)> = None;
    for life in ops.split_inclusive(ends_life) {
        let mut cfg = config(&setup, dir.path());
        cfg.device_faults = faults.clone();
        model = match life.last() {
            Some(Op::Kill { .. }) => killed_life(&cfg, life, model),
            _ => life_in_process(&cfg, life, model),
        };
        if let (Some(plan), Some(faults)) = (model.fail.take(), &faults) {
            faults.set_failing(plan.device, false);
            model.failing_keys.clear();
        }
        if let Some((at, moved)) = away.take() {
            assert!(!at.exists(), "the store made {} while its device was absent", at.display());
            std::fs::rename(&moved, &at).expect("putting an absent device back");
            model.absent_keys.clear();
        }
        if let Some(Op::Corrupt { file, offset, xor }) = life.last() {
            if flip_byte(dir.path(), *file, *offset, *xor) {
                model.damage_epoch = model.epoch;
            }
        }
        if let (Some(Op::Corrupt { file, offset, xor: 0 }), false) = (life.last(), devices.is_empty()) {
            let lost = *file as usize % devices.len();
            if offset % 4 == 3 {
                let from_op = (*offset / 4 % 8) as usize;
                if tracing() {
                    eprintln!("store_ops: device {lost} fails in the next life from its operation {from_op}");
                }
                model.fail = Some(FailPlan { device: lost, from_op, keys: Model::keys_on(lost, devices.len(), cfg.shards) });
                continue;
            }
            if offset % 4 == 1 {
                let moved = devices[lost].with_extension("away");
                std::fs::rename(&devices[lost], &moved).expect("moving a device away");
                if tracing() {
                    eprintln!("store_ops: device {lost} absent for a life ({})", devices[lost].display());
                }
                model.absent_keys = Model::keys_on(lost, devices.len(), cfg.shards);
                away = Some((devices[lost].clone(), moved));
                continue;
            }
            std::fs::remove_dir_all(&devices[lost]).expect("emptying a device");
            std::fs::create_dir(&devices[lost]).expect("its replacement");
            if tracing() {
                eprintln!("store_ops: device {lost} lost ({})", devices[lost].display());
            }
            model.lost(lost, devices.len(), cfg.shards);
        }
    }
    // The last life reads every key back (a failure planned for it comes
    // at its chosen operation, as in any life).
    let check: Vec<Op> = (0..KEYS.len() as u8).map(|key| Op::Get { key }).collect();
    let mut cfg = config(&setup, dir.path());
    cfg.device_faults = faults.clone();
    life_in_process(&cfg, &check, model);
}

/// Whether `KVTIER_FUZZ_TRACE` asks for the input, each operation, each
/// recovery and each flipped byte on stderr.
fn tracing() -> bool {
    std::env::var_os("KVTIER_FUZZ_TRACE").is_some()
}

/// Opens the store, runs `ops` on shard 0, and closes it cleanly.
fn life_in_process(cfg: &StoreConfig, ops: &[Op], model: Model) -> Model {
    let job = Arc::new(Mutex::new(Some((ops.to_vec(), model))));
    let faults = cfg.device_faults.clone();
    let out = kvtier_engine::run(cfg.clone(), move |store| {
        let (job, faults) = (job.clone(), faults.clone());
        async move {
            let taken = if store.shard_id() == 0 { job.lock().expect("job").take() } else { None };
            match taken {
                Some((ops, model)) => Some(apply(&store, &ops, model, None, faults.as_ref()).await),
                None => None,
            }
        }
    });
    let out = out.unwrap_or_else(|e| panic!("the store did not open (recovery must always complete): {e}"));
    out.into_iter().flatten().next().expect("shard 0 ran the operations")
}

/// Where a child life reports to its parent.
struct Reporter(i32);

impl Reporter {
    fn send(&self, msg: &Report) {
        let mut line = serde_json::to_vec(msg).expect("a report serializes");
        line.push(b'\n');
        let mut at = 0;
        while at < line.len() {
            // SAFETY: writes from a buffer we own to the pipe's write end.
            let n = unsafe { libc::write(self.0, line[at..].as_ptr().cast(), line.len() - at) };
            assert!(n > 0, "writing to the parent failed");
            at += n as usize;
        }
    }
}

/// A child life's messages, one JSON line each.
#[derive(Serialize, Deserialize)]
enum Report {
    /// The model after an operation completed.
    Model(Model),
    /// Just before the kill: puts about to be in flight, and whether the
    /// log was full (a put may then reclaim the oldest segment).
    Killing { inflight: Vec<(usize, u8)>, may_evict: bool },
}

/// Runs `ops` in a forked child that ends with `kill -9`; the model is
/// what the child had acknowledged, plus the puts in flight as maybes.
fn killed_life(cfg: &StoreConfig, ops: &[Op], model: Model) -> Model {
    let mut fds = [0i32; 2];
    // SAFETY: pipe into a two-element array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe");
    // SAFETY: fork; the child only runs the store and exits with _exit, it
    // never returns into the fuzzer. No executor threads run in the parent
    // here (every earlier life has joined them).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: the child's copy of the read end.
        unsafe { libc::close(fds[0]) };
        std::panic::set_hook(Box::new(|info| {
            eprintln!("store_ops child life: {info}");
            // SAFETY: ends the child at once, without running the parent's atexit handlers.
            unsafe { libc::_exit(101) };
        }));
        let reporter = Arc::new(Reporter(fds[1]));
        let job = Arc::new(Mutex::new(Some((ops.to_vec(), model))));
        let faults = cfg.device_faults.clone();
        let opened = kvtier_engine::run(cfg.clone(), move |store| {
            let (job, reporter, faults) = (job.clone(), reporter.clone(), faults.clone());
            async move {
                if let Some((ops, model)) = if store.shard_id() == 0 { job.lock().expect("job").take() } else { None } {
                    apply(&store, &ops, model, Some(&reporter), faults.as_ref()).await;
                }
            }
        });
        if let Err(e) = opened {
            eprintln!("store_ops child life: the store did not open: {e}");
        }
        // SAFETY: as above. Reaching here means no kill happened.
        unsafe { libc::_exit(102) };
    }
    // SAFETY: the parent's copy of the write end; the read end is ours.
    unsafe { libc::close(fds[1]) };
    // SAFETY: fds[0] is the pipe's read end, owned here from now on.
    let pipe = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    let reports = read_until_closed(&pipe, pid);
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let killed = libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL;
    assert!(killed, "the killed life ended otherwise (status {status:#x}): see its message above");
    let mut model = model;
    for line in reports.lines() {
        match serde_json::from_str::<Report>(line).expect("a report parses") {
            Report::Model(m) => model = m,
            Report::Killing { inflight, may_evict } => {
                for (k, seed) in inflight {
                    model.maybe(k, Some(seed), true);
                }
                if may_evict {
                    model.loss_epoch = model.epoch;
                }
            }
        }
    }
    model
}

/// Longest a child life may take: its few operations take well under a
/// second, so this is a hang (the child is killed and the input fails).
const CHILD_LIFE_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// Reads the child's reports until it closes the pipe (it died), killing
/// it and failing after [`CHILD_LIFE_MAX`].
fn read_until_closed(pipe: &OwnedFd, pid: libc::pid_t) -> String {
    let deadline = std::time::Instant::now() + CHILD_LIFE_MAX;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut pfd = libc::pollfd { fd: pipe.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: polls one descriptor we own.
        let ready = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
        if ready == 0 {
            // SAFETY: kills and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            panic!(
                "a kill -9 life did not end within {CHILD_LIFE_MAX:?}: the store hung (reports so far: {})",
                String::from_utf8_lossy(&out)
            );
        }
        // SAFETY: reads into a buffer we own.
        let n = unsafe { libc::read(pipe.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        match n {
            0 => return String::from_utf8(out).expect("reports are UTF-8"),
            n if n > 0 => out.extend_from_slice(&buf[..n as usize]),
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => panic!("reading the child's reports: {}", std::io::Error::last_os_error()),
        }
    }
}

/// Blocks evicted so far in this life, all shards together.
async fn evicted(store: &Store) -> u64 {
    store.stats().await.expect("stats").iter().map(|s| s.evicted_blocks).sum()
}

fn miss(e: &Error) -> bool {
    matches!(e, Error::NotFound | Error::Corrupt { .. })
}

/// Runs the operations of one life, checking every answer against the
/// model; with a reporter (a child life), reports the model after each.
async fn apply(store: &Rc<Store>, ops: &[Op], mut model: Model, reporter: Option<&Reporter>, faults: Option<&Arc<DeviceFaults>>) -> Model {
    let block_bytes = store.geometry().block_bytes;
    let mut evicted_seen = 0;
    if tracing() {
        for s in store.stats().await.expect("stats") {
            eprintln!("store_ops: shard {} opened: {:?}", s.shard, s.recovery);
        }
    }
    for (i, op) in ops.iter().enumerate() {
        if let (Some(plan), Some(faults)) = (model.fail.clone(), faults) {
            if plan.from_op == i {
                faults.set_failing(plan.device, true);
                model.failing_keys = plan.keys;
                if tracing() {
                    eprintln!("store_ops: device {} fails from here on", plan.device);
                }
            }
        }
        if tracing() {
            eprintln!("store_ops: {op:?}");
        }
        match *op {
            Op::Put { key, seed } => {
                let k = key as usize % KEYS.len();
                match store.put(&stored(k), vec![payload(k, seed, block_bytes)]).await {
                    Ok(_) if model.absent_keys.contains(&k) => panic!("PUT {} stored with its device absent", KEYS[k]),
                    Err(Error::DeviceDown(_)) if model.absent_keys.contains(&k) || model.failing_keys.contains(&k) => {}
                    Ok(_) => model.acked(k, &[Some(seed)]),
                    Err(e @ (Error::DiskFull(_) | Error::Overloaded(_))) => panic!("PUT {} refused on an idle store: {e}", KEYS[k]),
                    Err(e) => panic!("PUT {} failed: {e}", KEYS[k]),
                }
            }
            Op::PutPair { key, a, b } => {
                let k = key as usize % KEYS.len();
                let (ra, rb) = futures_lite::future::zip(
                    store.put(&stored(k), vec![payload(k, a, block_bytes)]),
                    store.put(&stored(k), vec![payload(k, b, block_bytes)]),
                )
                .await;
                if model.absent_keys.contains(&k) {
                    assert!(
                        matches!((&ra, &rb), (Err(Error::DeviceDown(_)), Err(Error::DeviceDown(_)))),
                        "concurrent PUTs of {} with its device absent: {ra:?} {rb:?}",
                        KEYS[k]
                    );
                    continue;
                }
                if model.failing_keys.contains(&k) {
                    // Each stored (on a device the shard spans that works) or refused.
                    let stored: Vec<Option<u8>> = [(a, &ra), (b, &rb)]
                        .into_iter()
                        .filter_map(|(seed, r)| match r {
                            Ok(_) => Some(Some(seed)),
                            Err(Error::DeviceDown(_)) => None,
                            Err(e) => panic!("concurrent PUT of {} while its device fails: {e}", KEYS[k]),
                        })
                        .collect();
                    if !stored.is_empty() {
                        model.acked(k, &stored);
                    }
                    continue;
                }
                if let Err(e) = ra.and(rb) {
                    panic!("concurrent PUTs of {} failed: {e}", KEYS[k]);
                }
                model.acked(k, &[Some(a), Some(b)]);
            }
            Op::Get { key } => {
                let k = key as usize % KEYS.len();
                match store.get(&stored(k)).await {
                    Ok(block) => {
                        assert_eq!(block.bytes.len() as u64, block_bytes, "GET {} served a short block", KEYS[k]);
                        let seed = model.identify(k, &block.bytes);
                        if model.absent_keys.contains(&k) {
                            model.read_absent(k, Some(seed), "GET");
                        }
                        model.read(k, Some(seed), "GET");
                    }
                    Err(e) if miss(&e) && (model.absent_keys.contains(&k) || model.failing_keys.contains(&k)) => {}
                    Err(e) if miss(&e) => model.read(k, None, "GET"),
                    Err(e) => panic!("GET {} failed: {e}", KEYS[k]),
                }
            }
            Op::Contains { key } => {
                let k = key as usize % KEYS.len();
                let found = store.contains(&stored(k)).await.unwrap_or_else(|e| panic!("HEAD {} failed: {e}", KEYS[k]));
                if model.absent_keys.contains(&k) {
                    model.read_absent(k, found.map(|_| 0), "HEAD");
                } else if found.is_none() {
                    // A failing device's key may read as missing (its copy
                    // in memory gone with a refused DELETE).
                    if !model.failing_keys.contains(&k) {
                        model.read(k, None, "HEAD");
                    }
                } else {
                    let s = &model.keys[k];
                    let damaged = model.damage_epoch >= s.written_epoch && !s.history.is_empty();
                    assert!(
                        s.allowed.iter().any(Option::is_some) || damaged,
                        "HEAD {} found a block the model says is absent ({:?})",
                        KEYS[k],
                        s.allowed
                    );
                }
            }
            Op::Delete { key } => {
                let k = key as usize % KEYS.len();
                match store.delete(&stored(k)).await {
                    Ok(()) if model.absent_keys.contains(&k) => panic!("DELETE {} done with its device absent", KEYS[k]),
                    Err(e) if miss(&e) && model.absent_keys.contains(&k) => {}
                    // The tombstone is not written; a copy in memory may be gone.
                    Err(Error::DeviceDown(_) | Error::NotFound) if model.failing_keys.contains(&k) => {}
                    Ok(()) => model.acked(k, &[None]),
                    Err(e) if miss(&e) => model.read(k, None, "DELETE"),
                    Err(e) => panic!("DELETE {} failed: {e}", KEYS[k]),
                }
            }
            Op::Reclaim => {
                let stats = store.stats().await.expect("stats");
                let before: u64 = stats.iter().map(|s| s.reclaimed_segments).sum();
                let capacity: u64 = stats.iter().map(|s| s.capacity_blocks).sum();
                for _ in 0..capacity + 4 {
                    model.fillers += 1;
                    let key = format!("fill-{}", model.fillers);
                    match store
                        .put(&StoredKey::unscoped(&key).expect("a valid key"), vec![payload(0xff, model.fillers as u8, block_bytes)])
                        .await
                    {
                        Ok(_) => {}
                        // A filler of an absent or failing device's shard.
                        Err(Error::DeviceDown(_)) if !model.absent_keys.is_empty() || model.fail.is_some() => continue,
                        Err(e) => panic!("a filler PUT failed: {e}"),
                    }
                    let now: u64 = store.stats().await.expect("stats").iter().map(|s| s.reclaimed_segments).sum();
                    if now > before {
                        break;
                    }
                }
            }
            Op::Restart | Op::Corrupt { .. } => {}
            Op::Kill { inflight, yields } => {
                let reporter = reporter.expect("a kill runs in a child life");
                let may_evict = store.stats().await.expect("stats").iter().any(|s| s.segments >= s.segments_max);
                let puts: Vec<(usize, u8)> =
                    (0..inflight % 3 + 1).map(|i| ((inflight as usize + i as usize) % KEYS.len(), yields.wrapping_add(i))).collect();
                reporter.send(&Report::Killing { inflight: puts.clone(), may_evict });
                for (k, seed) in puts {
                    let store = store.clone();
                    glommio::spawn_local(async move {
                        let _ = store.put(&stored(k), vec![payload(k, seed, block_bytes)]).await;
                    })
                    .detach();
                }
                // Lets the shard's other tasks (the puts, their I/O) run.
                for _ in 0..yields % 8 {
                    futures_lite::future::yield_now().await;
                }
                // SAFETY: kill -9 of this (child) process.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
        }
        let now = evicted(store).await;
        if now > evicted_seen {
            evicted_seen = now;
            model.loss_epoch = model.epoch;
        }
        if let Some(r) = reporter {
            r.send(&Report::Model(model.clone()));
        }
    }
    model
}

/// Xors one byte of the `file`-th file (sorted by path; `store.json` and
/// the lock file left out: a damaged manifest is refused by design) of the
/// stopped store in `dir`. Returns whether a byte changed.
fn flip_byte(dir: &Path, file: u8, offset: u32, xor: u8) -> bool {
    if xor == 0 {
        return false;
    }
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n != "store.json" && !n.to_string_lossy().contains("lock")) {
                files.push(path);
            }
        }
    }
    files.sort();
    if files.is_empty() {
        return false;
    }
    let path = &files[file as usize % files.len()];
    let mut bytes = std::fs::read(path).expect("reading a store file");
    if bytes.is_empty() {
        return false;
    }
    let at = offset as usize % bytes.len();
    bytes[at] ^= xor;
    if tracing() {
        eprintln!("store_ops: flipped byte {at} of {} with {xor:#04x}", path.display());
    }
    std::fs::write(path, &bytes).expect("writing a store file");
    true
}
