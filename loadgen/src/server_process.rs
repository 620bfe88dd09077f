//! A `kvtier serve` child process that the crash and soak harnesses start,
//! kill and restart, with the figures they sample from `/proc`.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long [`ServerProcess::start`] waits for the "listening" line.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Bytes of the server log quoted when it fails to start.
const LOG_TAIL_BYTES: u64 = 4096;

/// Why [`ServerProcess::start`] failed.
#[derive(Debug)]
pub struct StartError {
    /// The exit status, when the process ran and exited (or was killed
    /// after the timeout).
    pub status: Option<ExitStatus>,
    /// What went wrong, with the log's tail.
    pub message: String,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<StartError> for String {
    fn from(e: StartError) -> String {
        e.message
    }
}

/// A running `kvtier serve`.
pub struct ServerProcess {
    child: Option<Child>,
    url: String,
    /// The whole "kvtier listening on ..." line.
    listening_line: String,
    /// From spawn to the "kvtier listening on" line: the restart time.
    pub start_time: Duration,
}

/// The default server binary: `kvtier` beside the running executable
/// (`target/release/kvtier` for `target/release/kvtier-loadgen`).
pub fn default_server_bin() -> PathBuf {
    std::env::current_exe().ok().and_then(|p| p.parent().map(|d| d.join("kvtier"))).unwrap_or_else(|| PathBuf::from("kvtier"))
}

impl ServerProcess {
    /// Runs `BIN serve ARGS` with stderr appended to `log` and waits for its
    /// "kvtier listening on URL" line.
    ///
    /// # Errors
    /// [`StartError`] with the exit status and the log's tail when the
    /// process cannot be spawned, exits, or does not listen within
    /// [`START_TIMEOUT`].
    pub fn start(bin: &Path, args: &[String], log: &Path) -> Result<ServerProcess, StartError> {
        Self::start_with_env(bin, args, &[], log)
    }

    /// [`ServerProcess::start`] with `env` added to the child's environment
    /// (e.g. `LD_LIBRARY_PATH`, which must be set before the process starts
    /// to steer where it loads a library from).
    ///
    /// # Errors
    /// As [`ServerProcess::start`].
    pub fn start_with_env(bin: &Path, args: &[String], env: &[(String, String)], log: &Path) -> Result<ServerProcess, StartError> {
        let failed = |status, message| StartError { status, message };
        let log_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| failed(None, format!("cannot open {}: {e}", log.display())))?;
        let started = Instant::now();
        let mut child = Command::new(bin)
            .arg("serve")
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .map_err(|e| failed(None, format!("cannot run {}: {e}", bin.display())))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("kvtier listening on ") {
                    let _ = tx.send((rest.split_whitespace().next().unwrap_or_default().to_string(), line.clone()));
                }
            }
        });
        match rx.recv_timeout(START_TIMEOUT) {
            Ok((url, listening_line)) => Ok(ServerProcess { child: Some(child), url, listening_line, start_time: started.elapsed() }),
            Err(_) => {
                // Where it waited, taken before the kill: a start that hangs
                // says so (an empty log alone cannot).
                let threads = match child.try_wait() {
                    Ok(None) => format!("\nnot listening after {START_TIMEOUT:?}; its threads then:\n{}", thread_states(child.id())),
                    _ => String::new(),
                };
                let _ = child.kill();
                let status = child.wait().ok();
                Err(failed(
                    status,
                    format!("{} serve exited ({status:?}) before listening; its log ends:\n{}{threads}", bin.display(), log_tail(log)),
                ))
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's whole "kvtier listening on ..." start-up line.
    pub fn listening_line(&self) -> &str {
        &self.listening_line
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGKILL and reap: a crash, as far as the store can tell.
    pub fn kill9(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM (a clean stop: snapshots written, RAM flushed), then wait.
    ///
    /// # Errors
    /// When waiting for the child fails.
    pub fn stop(mut self) -> std::io::Result<ExitStatus> {
        let mut child = self.child.take().expect("a running child");
        // SAFETY: kill(2) on the pid of our own unreaped child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait()
    }

    /// Resident set size in bytes (`VmRSS` of `/proc/PID/status`).
    pub fn rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?;
        Some(kib * 1024)
    }

    /// Open file descriptors (entries of `/proc/PID/fd`).
    pub fn open_fds(&self) -> Option<u64> {
        Some(std::fs::read_dir(format!("/proc/{}/fd", self.pid())).ok()?.count() as u64)
    }
}

/// One `kvtier serve` configuration that a harness starts again and again:
/// its arguments, its log file (`OUT/server.log`), and the blocking wait for
/// the "listening" line kept off the async runtime's threads.
pub struct Launcher {
    bin: PathBuf,
    args: Vec<String>,
    log: PathBuf,
}

impl Launcher {
    /// Creates `out_dir`, empties `server.log` there, and prepares `BIN serve
    /// --listen 127.0.0.1:0 --data-dir DATA EXTRA...` (a later flag in
    /// `extra` overrides an earlier one).
    ///
    /// # Errors
    /// When `out_dir` cannot be created.
    pub fn new(bin: &Path, data_dir: &Path, out_dir: &Path, extra: &[String]) -> Result<Launcher, String> {
        std::fs::create_dir_all(out_dir).map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
        let log = out_dir.join("server.log");
        let _ = std::fs::remove_file(&log);
        let mut args: Vec<String> = vec!["--listen".into(), "127.0.0.1:0".into(), "--data-dir".into(), data_dir.display().to_string()];
        args.extend(extra.iter().cloned());
        Ok(Launcher { bin: bin.to_path_buf(), args, log })
    }

    /// The server's log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Starts the server (see [`ServerProcess::start`]).
    ///
    /// # Errors
    /// The [`StartError`]'s message.
    pub async fn start(&self) -> Result<ServerProcess, String> {
        let (bin, args, log) = (self.bin.clone(), self.args.clone(), self.log.clone());
        tokio::task::spawn_blocking(move || ServerProcess::start(&bin, &args, &log)).await.expect("start task").map_err(String::from)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The last few KiB of `log`, for error messages.
pub fn log_tail(log: &Path) -> String {
    let Ok(mut f) = File::open(log) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    s
}

/// One line per thread of process `pid`: its name, state, the kernel
/// function it sleeps in (`wchan`) and its kernel stack where readable
/// (root), from `/proc`.
pub fn thread_states(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return format!("(no /proc/{pid}/task)") };
    let mut lines = Vec::new();
    for task in tasks.flatten() {
        let dir = task.path();
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
        let stat = read("stat");
        let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next().unwrap_or('?')).unwrap_or('?');
        let stack: Vec<String> = read("stack").lines().filter_map(|l| l.split_whitespace().nth(1).map(str::to_string)).collect();
        lines.push(format!(
            "  {} {} state {state} wchan {} stack {}",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim(),
            stack.join(" <- ")
        ));
    }
    lines.sort();
    lines.join("\n")
}

/// Lines of `log` that contain `needle` (e.g. "corrupt").
pub fn log_lines_with(log: &Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(log).map(|s| s.lines().filter(|l| l.contains(needle)).map(str::to_string).collect()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hung_process_is_described_by_its_threads_states() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let states = thread_states(child.id());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(states.contains("sleep state S wchan "), "{states}");
        assert!(thread_states(child.id()).starts_with("(no /proc/"), "a reaped process has no threads to describe");
    }
}
