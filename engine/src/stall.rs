//! Reactor stalls: a shard's executor that ran one task queue for longer
//! than a threshold without getting back to its I/O, as Seastar's
//! `--blocked-reactor-notify-ms` reports them.
//!
//! A shard is one thread serving every connection, forwarded item and
//! background loop it owns; while one task holds it (a blocking syscall, a
//! long computation) all of them wait. Each shard's executor runs with a
//! preemption budget of [`PREEMPT_BUDGET`] (a task queue yields to I/O once
//! it has run that long, between tasks) and glommio's stall detector: when
//! a task queue's run passes the threshold ([`STALL_THRESHOLD_DEFAULT`],
//! `--stall-threshold-ms`), a per-executor watchdog thread signals the
//! shard's thread, which records its own stack; when the run ends, the
//! shard counts the stall ([`ShardStalls`]: count, longest, a histogram)
//! and hands the stack to the `kvtier-stalls` thread, which resolves its
//! symbols (reading debug info: never on a shard) and logs one warning
//! naming the shard, the duration and the frames of kvtier's code it was
//! in. With `--stall-log FILE` each stall is also appended to FILE as one
//! JSON line ([`StallRecord`]); `make test` points every server it starts
//! at one directory and fails on any stall over a second.
//!
//! What a stall costs the shard's clients: every request it owns waits
//! for the stall's length. docs/OPERATIONS.md ("Shard stalls") says what a
//! report means and what to do about one.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::latency::{AtomicLatencyBuckets, LatencyBuckets};

/// How long a shard's task queue may run before it yields to I/O (between
/// tasks; glommio's default is 100 ms). Short, so that a shard with work
/// queued still polls its sockets and devices every few milliseconds, and
/// so that a run past the stall threshold means one task held the thread.
pub const PREEMPT_BUDGET: Duration = Duration::from_millis(10);

/// Default stall threshold: a task queue run this long is reported.
pub const STALL_THRESHOLD_DEFAULT: Duration = Duration::from_millis(50);

/// The least threshold accepted: below it the preemption budget itself
/// would be reported.
pub const STALL_THRESHOLD_MIN: Duration = Duration::from_millis(20);

/// Stalls waiting for the reporter thread; past it a stall is counted but
/// not logged ([`Stalls::reports_dropped`]).
const REPORT_QUEUE: usize = 64;

/// Frames of kvtier's own code a report names, innermost first.
const FRAMES_NAMED: usize = 8;

/// The signal the watchdog sends a stalled shard's thread to take its
/// stack. SIGURG's default action is to ignore it, so one arriving after
/// the handler is gone (a shard stopping) harms nothing. Its handler
/// unwinds the stack where the signal lands, which takes kilobytes: a
/// handler that runs on the small alternate signal stack must keep it
/// blocked (`server/src/local/guard.rs`).
pub const STALL_SIGNAL: i32 = libc::SIGURG;

/// One stall, as logged and written to `--stall-log`.
#[derive(Debug, Clone, Serialize)]
pub struct StallRecord {
    /// When the stall ended (the task queue run), in seconds since the Unix
    /// epoch, read on the shard's thread as the run ended: not when the
    /// reporter logged it, which can be seconds later.
    pub unix_s: f64,
    /// The server's process id.
    pub pid: u32,
    /// The shard whose thread stalled.
    pub shard: u32,
    /// How long the task queue ran without yielding, in milliseconds.
    pub duration_ms: f64,
    /// The threshold it passed, in milliseconds.
    pub threshold_ms: f64,
    /// The glommio task queue that ran.
    pub queue: String,
    /// The stack when the threshold passed: the innermost frame (often the
    /// system call), then up to eight frames of kvtier's code, innermost
    /// first, each `function (file:line)`.
    pub frames: Vec<String>,
    /// The stack sampled last, as `frames`, for a stall that went on past a
    /// second (sampled again each second, `glommio::RESAMPLE_EVERY`): where
    /// it stayed. Empty when sampled once.
    pub last_frames: Vec<String>,
    /// Samples taken of the stack: one at the threshold, one per second after.
    pub samples: usize,
    /// CPU time the thread used in the run, in milliseconds.
    pub cpu_ms: f64,
    /// Times the thread went to sleep in the run (a blocking system call, a
    /// page fault waiting on I/O or a lock).
    pub blocked: u64,
    /// Times it was taken off its CPU for another thread.
    pub preempted: u64,
    /// Why the run was long, from the three above and the innermost
    /// frame: `"computing"` (mostly on the CPU: kvtier's code ran long),
    /// `"blocked"` (it slept in a system call that can block: a file's
    /// fsync or read, a lock, a sleep, the memory map; a blocking call on
    /// the shard's thread, kvtier's to fix), `"memory"` (it slept in the
    /// kernel with no such call: in a page fault, or allocating inside a
    /// call that never waits by design, such as a send with
    /// `MSG_DONTWAIT`: the machine's memory was short, reclaimed or
    /// compacted), or `"waiting for a CPU"` (runnable and neither: other
    /// threads had the machine's CPUs).
    pub cause: String,
}

impl StallRecord {
    /// How much of the stall kvtier's own thread accounts for, in ms: all of
    /// it when it computed or blocked in a call that can block; its CPU time
    /// when it waited for the machine (memory, a CPU). `make test` fails on
    /// a stall whose own part is a second or more.
    pub fn own_ms(&self) -> f64 {
        match self.cause.as_str() {
            CAUSE_COMPUTING | CAUSE_BLOCKED => self.duration_ms,
            _ => self.cpu_ms,
        }
    }
}

/// [`StallRecord::cause`]: mostly on the CPU.
pub const CAUSE_COMPUTING: &str = "computing";
/// [`StallRecord::cause`]: asleep in a system call that can block.
pub const CAUSE_BLOCKED: &str = "blocked";
/// [`StallRecord::cause`]: asleep in the kernel in a page fault or in a call
/// that never waits by design.
pub const CAUSE_MEMORY: &str = "memory";
/// [`StallRecord::cause`] of a thread that was runnable and not run.
pub const CAUSE_WAITING_FOR_CPU: &str = "waiting for a CPU";

/// The calls a shard makes that never wait by design (non-blocking sockets,
/// a socket's shutdown, eventfds, timers, its own accounting): asleep in
/// one of them, the thread was allocating or faulting memory in the kernel
/// (a shutdown that slept 1.4 s with no CPU, under memory pressure).
const NEVER_WAIT: [&str; 11] = [
    "sendmsg",
    "__libc_send ",
    "sendto",
    "recvmsg",
    "__libc_recv",
    "io_uring_enter",
    "timerfd_settime",
    "write_eventfd",
    "getrusage",
    // A socket's shutdown (no linger): a FIN queued, nothing waited for.
    "_shutdown",
    // fcntl on a shard is F_GETFL, F_SETFL or F_GET_SEALS, never a lock.
    "fcntl",
];

/// The cause of a stall of `duration_ms` with `usage`, the thread's stack
/// innermost first as `frames` names it (see [`StallRecord::cause`]).
fn cause_of(duration_ms: f64, usage: Usage, frames: &[String]) -> &'static str {
    if usage.voluntary > 0 {
        // A libc system call wrapper lives under sysdeps/unix; anything else
        // innermost (a memset, kvtier's code) slept in a page fault.
        let in_syscall = frames.first().is_some_and(|f| f.contains("sysdeps/unix") || f.starts_with("syscall "));
        let never_waits = frames.iter().take(2).any(|f| NEVER_WAIT.iter().any(|c| f.contains(c)));
        if in_syscall && !never_waits {
            CAUSE_BLOCKED
        } else {
            CAUSE_MEMORY
        }
    } else if (usage.cpu_us as f64 / 1e3) * 2.0 >= duration_ms {
        CAUSE_COMPUTING
    } else {
        CAUSE_WAITING_FOR_CPU
    }
}

/// One shard's stall counters, written by the shard's thread and read by
/// any (metrics, `/v1/stats`) without a lock on the shard's side.
#[derive(Debug, Default)]
pub struct ShardStalls {
    count: AtomicU64,
    /// Stalls whose cause was the machine's: memory or a CPU
    /// ([`StallRecord::own_ms`] less than the stall; counted once reported).
    machine: AtomicU64,
    longest_us: AtomicU64,
    durations: AtomicLatencyBuckets,
    /// The last stall reported, once its frames are resolved.
    last: Mutex<Option<StallRecord>>,
}

/// A point-in-time view of one shard's stalls, for `/v1/stats`.
#[derive(Debug, Clone, Serialize)]
pub struct ShardStallStats {
    /// The shard.
    pub shard: u32,
    /// Stalls since start.
    pub stalls: u64,
    /// Of those, the ones the machine caused (memory, a CPU: their cause
    /// is `memory` or `waiting for a CPU`), once reported.
    pub machine: u64,
    /// The longest, in milliseconds (0 with none).
    pub longest_ms: f64,
    /// The last one logged (null with none).
    pub last: Option<StallRecord>,
    /// Their durations, for `/metrics` (not in the JSON).
    #[serde(skip)]
    pub durations: LatencyBuckets,
}

/// Every shard's stall counters and the reporter thread: one per process,
/// shared by the shards' handlers and the metrics.
#[derive(Debug)]
pub struct Stalls {
    threshold: Duration,
    shards: Vec<ShardStalls>,
    reports: Mutex<Option<SyncSender<Report>>>,
    reports_dropped: AtomicU64,
    reporter: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Report {
    shard: u32,
    queue: String,
    /// When the run ended ([`StallRecord::unix_s`]), read on the shard's
    /// thread: the reporter may take a second or more to resolve symbols.
    ended_unix_s: f64,
    duration: Duration,
    usage: Usage,
    trace: backtrace::Backtrace,
}

impl Stalls {
    /// Stall counters for `shards` shards, a stall being a task queue run
    /// of more than `threshold`, and the `kvtier-stalls` reporter thread,
    /// which logs each and appends it to `log` when given.
    ///
    /// # Errors
    /// A threshold under [`STALL_THRESHOLD_MIN`]; a `log` file that cannot
    /// be opened for appending; the thread cannot be started.
    pub fn new(shards: usize, threshold: Duration, log: Option<PathBuf>) -> Result<Arc<Stalls>, String> {
        if threshold < STALL_THRESHOLD_MIN {
            return Err(format!(
                "--stall-threshold-ms must be at least {} (a shard's preemption budget is {} ms), got {}",
                STALL_THRESHOLD_MIN.as_millis(),
                PREEMPT_BUDGET.as_millis(),
                threshold.as_millis()
            ));
        }
        let file = match &log {
            None => None,
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("cannot open --stall-log {}: {e}", path.display()))?,
            ),
        };
        let (tx, rx) = sync_channel(REPORT_QUEUE);
        let stalls = Arc::new(Stalls {
            threshold,
            shards: (0..shards).map(|_| ShardStalls::default()).collect(),
            reports: Mutex::new(Some(tx)),
            reports_dropped: AtomicU64::new(0),
            reporter: Mutex::new(None),
        });
        let reporter = stalls.clone();
        let handle = std::thread::Builder::new()
            .name("kvtier-stalls".into())
            .spawn(move || reporter.report_all(rx, file))
            .map_err(|e| format!("cannot start the stall reporter thread: {e}"))?;
        *stalls.reporter.lock().expect("stall reporter") = Some(handle);
        Ok(stalls)
    }

    /// The threshold a task queue run must pass to count.
    pub fn threshold(&self) -> Duration {
        self.threshold
    }

    /// Stalls counted but not logged: the reporter was this far behind.
    pub fn reports_dropped(&self) -> u64 {
        self.reports_dropped.load(Ordering::Relaxed)
    }

    /// Every shard's stalls now.
    pub fn shard_stats(&self) -> Vec<ShardStallStats> {
        self.shards
            .iter()
            .enumerate()
            .map(|(i, s)| ShardStallStats {
                shard: i as u32,
                stalls: s.count.load(Ordering::Relaxed),
                machine: s.machine.load(Ordering::Relaxed),
                longest_ms: s.longest_us.load(Ordering::Relaxed) as f64 / 1e3,
                last: s.last.lock().expect("stall record").clone(),
                durations: s.durations.load(),
            })
            .collect()
    }

    /// The handler shard `shard`'s executor is built with
    /// (`LocalExecutorBuilder::detect_stalls`).
    ///
    /// # Panics
    /// `shard` is not below the shard count given to [`Stalls::new`].
    pub fn handler(self: &Arc<Self>, shard: usize) -> Box<dyn glommio::StallDetectionHandler> {
        assert!(shard < self.shards.len(), "shard {shard} of {}", self.shards.len());
        Box::new(Handler { stalls: self.clone(), shard: shard as u32, run_start: RunStart::default() })
    }

    /// Logs what is queued and stops the reporter thread (the shards have
    /// stopped: nothing more comes).
    pub fn stop(&self) {
        drop(self.reports.lock().expect("stall reports").take());
        if let Some(handle) = self.reporter.lock().expect("stall reporter").take() {
            let _ = handle.join();
        }
    }

    /// On the shard's thread, as its task queue run ends: counts the stall
    /// and queues its report (never blocks: a full queue drops it).
    fn record(&self, shard: u32, queue: &str, duration: Duration, usage: Usage, trace: backtrace::Backtrace) {
        let counters = &self.shards[shard as usize];
        let us = duration.as_micros() as u64;
        counters.count.fetch_add(1, Ordering::Relaxed);
        counters.longest_us.fetch_max(us, Ordering::Relaxed);
        counters.durations.record(us);
        // clock_gettime through the vDSO: no syscall, nothing that waits.
        let ended_unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        let report = Report { shard, queue: queue.to_string(), ended_unix_s, duration, usage, trace };
        // try_lock: the lock is only ever contended by `stop`.
        let sent = self.reports.try_lock().ok().and_then(|tx| tx.as_ref().map(|tx| tx.try_send(report)));
        if !matches!(sent, Some(Ok(()))) {
            self.reports_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The reporter thread: resolves each stall's frames, logs it, keeps it
    /// as its shard's last and appends it to the stall log.
    fn report_all(&self, rx: Receiver<Report>, mut file: Option<std::fs::File>) {
        let pid = std::process::id();
        for mut report in rx {
            report.trace.resolve();
            let samples = samples_of(&report.trace);
            let frames = samples.first().map(|f| named_frames(f)).unwrap_or_default();
            let frames_for_cause = frames.clone();
            let last_frames = if samples.len() > 1 { samples.last().map(|f| named_frames(f)).unwrap_or_default() } else { Vec::new() };
            let record = StallRecord {
                unix_s: report.ended_unix_s,
                pid,
                shard: report.shard,
                duration_ms: report.duration.as_secs_f64() * 1e3,
                threshold_ms: self.threshold.as_secs_f64() * 1e3,
                queue: report.queue,
                frames,
                last_frames,
                samples: samples.len(),
                cpu_ms: report.usage.cpu_us as f64 / 1e3,
                blocked: report.usage.voluntary,
                preempted: report.usage.involuntary,
                cause: cause_of(report.duration.as_secs_f64() * 1e3, report.usage, &frames_for_cause).to_string(),
            };
            if record.own_ms() < record.duration_ms {
                self.shards[record.shard as usize].machine.fetch_add(1, Ordering::Relaxed);
            }
            let stayed = match record.last_frames.is_empty() {
                true => String::new(),
                false => format!("; sampled {} times, last in {}", record.samples, record.last_frames.join(" <- ")),
            };
            tracing::warn!(
                shard = record.shard,
                ms = format!("{:.1}", record.duration_ms),
                "shard {} stalled: its thread ran {:.1} ms without serving (threshold {:.0} ms; every request it owns waited): {} \
                 ({:.1} ms on a CPU, slept {} times, preempted {} times), in {}{stayed}",
                record.shard,
                record.duration_ms,
                record.threshold_ms,
                record.cause,
                record.cpu_ms,
                record.blocked,
                record.preempted,
                record.frames.join(" <- ")
            );
            if let Some(f) = &mut file {
                let line = serde_json::to_string(&record).expect("a stall record serializes");
                if let Err(e) = writeln!(f, "{line}") {
                    tracing::warn!("cannot append to --stall-log: {e}; stalls are only logged from now on");
                    file = None;
                }
            }
            let shard = record.shard as usize;
            *self.shards[shard].last.lock().expect("stall record") = Some(record);
            // Naming the frames mapped and parsed the binary's debug
            // information (tens of MiB of a debug build); let it go until
            // the next stall.
            backtrace::clear_symbol_cache();
        }
    }
}

/// The samples of a stall's stack: the trace holds each capture in turn,
/// each starting at the unwinder's own frame.
fn samples_of(trace: &backtrace::Backtrace) -> Vec<&[backtrace::BacktraceFrame]> {
    let frames = trace.frames();
    let starts: Vec<usize> = (0..frames.len())
        .filter(|&i| {
            frames[i]
                .symbols()
                .iter()
                .any(|s| s.name().is_some_and(|n| format!("{n:#}").starts_with("backtrace::backtrace::trace_unsynchronized")))
        })
        .collect();
    if starts.is_empty() {
        return vec![frames];
    }
    starts.iter().enumerate().map(|(k, &a)| &frames[a..starts.get(k + 1).copied().unwrap_or(frames.len())]).collect()
}

/// The frames a report names of one sample: the innermost one with a
/// symbol (what the thread was in: often a system call's wrapper), then up
/// to [`FRAMES_NAMED`] of kvtier's own crates, innermost first.
fn named_frames(frames: &[backtrace::BacktraceFrame]) -> Vec<String> {
    // The signal handler's frames come first (the unwinder, glommio's
    // closure, signal-hook's handler), then the kernel's signal trampoline
    // (no symbol), then the interrupted code.
    let start = frames
        .iter()
        .rposition(|f| f.symbols().iter().any(|s| s.name().is_some_and(|n| format!("{n:#}").starts_with("signal_hook_registry::handler"))))
        .map_or(0, |i| i + 1);
    let start = start + frames[start.min(frames.len())..].iter().take_while(|f| f.symbols().iter().all(|s| s.name().is_none())).count();
    let describe = |s: &backtrace::BacktraceSymbol| {
        let name = s.name().map_or_else(|| "?".to_string(), |n| format!("{n:#}"));
        match (s.filename(), s.lineno()) {
            (Some(file), Some(line)) => {
                let file = file.to_string_lossy();
                let short = file.rsplit_once("/src/").map_or(file.as_ref(), |(_, rest)| rest);
                format!("{name} ({short}:{line})")
            }
            _ => name,
        }
    };
    let symbols: Vec<&backtrace::BacktraceSymbol> = frames[start.min(frames.len())..].iter().flat_map(|f| f.symbols()).collect();
    let mut named: Vec<String> = symbols.first().map(|s| describe(s)).into_iter().collect();
    let ours = |s: &&&backtrace::BacktraceSymbol, prefixes: &[&str]| {
        s.name().is_some_and(|n| {
            let n = format!("{n:#}");
            prefixes.iter().any(|p| n.starts_with(p))
        })
    };
    // kvtier's own frames; glommio's too when kvtier's are few (a stall in
    // the executor's own work: registering memory, waking waiters).
    let kvtier: Vec<&&backtrace::BacktraceSymbol> = symbols.iter().skip(1).filter(|s| ours(s, &["kvtier"])).collect();
    let chosen: Vec<&&backtrace::BacktraceSymbol> =
        if kvtier.len() >= 2 { kvtier } else { symbols.iter().skip(1).filter(|s| ours(s, &["kvtier", "glommio"])).collect() };
    named.extend(chosen.into_iter().take(FRAMES_NAMED).map(|s| describe(s)));
    named
}

/// The stall detection handler of one shard's executor.
#[derive(Debug)]
struct Handler {
    stalls: Arc<Stalls>,
    shard: u32,
    /// The shard thread's usage when the current task queue run started.
    run_start: RunStart,
}

/// A thread's CPU time and context switches (`getrusage(RUSAGE_THREAD)`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    cpu_us: u64,
    voluntary: u64,
    involuntary: u64,
}

impl Usage {
    /// The calling thread's usage now (one system call).
    fn now() -> Usage {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
            return Usage::default();
        }
        let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
        Usage { cpu_us: us(ru.ru_utime) + us(ru.ru_stime), voluntary: ru.ru_nvcsw as u64, involuntary: ru.ru_nivcsw as u64 }
    }
}

/// [`Usage`] at a run's start, written and read on the shard's thread only
/// (atomics because a handler must be `Sync`).
#[derive(Debug, Default)]
struct RunStart {
    cpu_us: AtomicU64,
    voluntary: AtomicU64,
    involuntary: AtomicU64,
}

impl RunStart {
    fn set(&self, u: Usage) {
        self.cpu_us.store(u.cpu_us, Ordering::Relaxed);
        self.voluntary.store(u.voluntary, Ordering::Relaxed);
        self.involuntary.store(u.involuntary, Ordering::Relaxed);
    }

    fn since(&self, now: Usage) -> Usage {
        Usage {
            cpu_us: now.cpu_us.saturating_sub(self.cpu_us.load(Ordering::Relaxed)),
            voluntary: now.voluntary.saturating_sub(self.voluntary.load(Ordering::Relaxed)),
            involuntary: now.involuntary.saturating_sub(self.involuntary.load(Ordering::Relaxed)),
        }
    }
}

impl glommio::StallDetectionHandler for Handler {
    /// Called by the executor as each task queue run starts, with the run's
    /// budget (the preemption budget): the watchdog fires at the stall
    /// threshold measured from the run's start.
    fn threshold(&self, _queue: glommio::TaskQueueHandle, budget: Duration) -> Option<Duration> {
        // The thread's usage at the run's start: a stall's CPU time and
        // whether it blocked come from the difference (one getrusage per run).
        self.run_start.set(Usage::now());
        // At least 1 ms: a zero timer is a disarmed one.
        Some(self.stalls.threshold.saturating_sub(budget).max(Duration::from_millis(1)))
    }

    fn signal(&self) -> u8 {
        STALL_SIGNAL as u8
    }

    /// On the shard's thread, once the run that passed the threshold ends.
    fn stall(&self, detection: glommio::StallDetection<'_>) {
        // A signal that landed after its run ended (the run finished as the
        // timer fired) is another run's stack, not a stall.
        if detection.overage().is_zero() {
            return;
        }
        let duration = detection.budget() + detection.overage();
        let queue = detection.queue_name().to_string();
        let usage = self.run_start.since(Usage::now());
        self.stalls.record(self.shard, &queue, duration, usage, detection.into_trace());
    }
}

#[cfg(test)]
mod tests;
