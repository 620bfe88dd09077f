//! The same-host data plane's front door (docs/LOCAL.md) against a live
//! server, frame by frame: bad input gets its code and stores nothing,
//! framing errors close only their own connection, descriptors return to
//! their baseline, and the socket's start-up checks say what is wrong.
//! (Round trips through every op and tier, client crashes, shrinking
//! files, other uids and restarts are tested from the Python client,
//! clients/python/tests/test_local.rs, and the loadgen.)

mod common;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use std::os::fd::OwnedFd;

use common::local::{
    frame, items_payload, items_v_payload, keys_payload, memfd, read_at, write_at, Raw, EXISTS, GET_INTO, GET_INTO_V, HELLO, PUT_FROM,
    PUT_FROM_V, UNREGISTER,
};
use common::{set_flag, start, test_args, try_start, Server, BLOCK_BYTES};

fn socket_of(server: &Server) -> PathBuf {
    server.data_dir.join("kvtier.sock")
}

/// The server's open descriptors once start-up's background work (I/O
/// memory registration) is done, so later counts compare with a settled
/// baseline.
fn settled_fds(server: &Server) -> usize {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(common::wait_for_io_memory_registration(server));
    open_fds(server.pid())
}

/// The server's open descriptors, segment files left out (a shard opens
/// its first segment at its first write).
fn open_fds(pid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    dir.flatten().filter(|e| std::fs::read_link(e.path()).map_or(true, |l| l.extension().is_none_or(|x| x != "kvt"))).count()
}

/// Waits up to 5 s for the server's open descriptors to come back to `baseline`.
fn fds_back_to(pid: u32, baseline: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = open_fds(pid);
        if now <= baseline || Instant::now() > deadline {
            if now > baseline {
                let links: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
                    .map(|d| d.flatten().map(|e| format!("{:?}", std::fs::read_link(e.path()))).collect())
                    .unwrap_or_default();
                eprintln!("server descriptors: {links:?}");
            }
            return now;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn bad_requests_get_their_codes_store_nothing_and_leave_the_connection_open() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let path = socket_of(&server);
    let baseline = settled_fds(&server);

    let mut r = Raw::connect(&path);
    // Nothing but HELLO before HELLO.
    assert_eq!(r.call(EXISTS, &keys_payload(&["a"])).status, -12);
    let a = r.call(HELLO, br#"{"versions":[7,9]}"#);
    assert_eq!(a.status, -14);
    assert!(a.message().contains("[7, 9]") && a.message().contains("[1, 2, 3]"), "{}", a.message());
    let a = r.call(HELLO, br#"{"versions":[1],"block_bytes":1234}"#);
    assert_eq!(a.status, -15);
    assert!(a.message().contains("1234") && a.message().contains(&BLOCK_BYTES.to_string()), "{}", a.message());
    assert_eq!(r.call(HELLO, b"not json").status, -13);
    let a = r.call(HELLO, br#"{"versions":[1],"block_bytes":65536}"#);
    assert_eq!(a.status, 0, "{}", a.message());
    let hello: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(hello["block_bytes"], BLOCK_BYTES);
    assert!(hello["epoch"].as_u64().unwrap() > 0);
    assert_eq!(a.op, HELLO | 0x80);

    // REGISTER: no descriptor, two, read-only, past the end of the file.
    assert_eq!(r.register(&[], 0, 4096).status, -18);
    let (f1, f2) = (memfd(1 << 20, true), memfd(1 << 20, true));
    let a = r.register(&[f1.as_raw_fd(), f2.as_raw_fd()], 0, 4096);
    assert_eq!(a.status, -18);
    assert!(a.message().contains("2 descriptors"), "{}", a.message());
    let ro = std::fs::File::open(format!("/proc/self/fd/{}", f1.as_raw_fd())).unwrap();
    let a = r.register(&[ro.as_raw_fd()], 0, 4096);
    assert!(a.status == -18 && a.message().contains("read-write"), "{a:?}");
    let a = r.register(&[f1.as_raw_fd()], 4096, 1 << 20);
    assert!(a.status == -18 && a.message().contains("past the end"), "{a:?}");
    // A file on a disk: a copy could block the shard on the device.
    let on_disk = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.path().join("buffer")).unwrap();
    on_disk.set_len(1 << 20).unwrap();
    let a = r.register(&[on_disk.as_raw_fd()], 0, 1 << 20);
    assert!(a.status == -18 && a.message().contains("not shared memory"), "{a:?}");

    // A good registration, mapped (sealed) and mapped under the SIGBUS guard
    // (unsealed).
    let a = r.register(&[f1.as_raw_fd()], 0, 4 * BLOCK_BYTES);
    assert_eq!((a.status, a.body[8]), (0, 1), "{}", a.message());
    let sealed = u64::from_le_bytes(a.body[..8].try_into().unwrap());
    let plain_fd = memfd(4 * BLOCK_BYTES, false);
    let a = r.register(&[plain_fd.as_raw_fd()], 0, 4 * BLOCK_BYTES);
    assert_eq!((a.status, a.body[8]), (0, 3), "{}", a.message());

    // Per item: unknown handle, out of bounds, short buffer, bad keys.
    let long_key = "k".repeat(300);
    let bad = [
        (999, 0, BLOCK_BYTES, "unknown-handle"),
        (sealed, 3 * BLOCK_BYTES + 1, BLOCK_BYTES, "out-of-bounds"),
        (sealed, 0, BLOCK_BYTES - 1, "short-buffer"),
        (sealed, 0, BLOCK_BYTES, ""),
        (sealed, 0, BLOCK_BYTES, long_key.as_str()),
    ];
    let codes: Vec<i64> = r.call(PUT_FROM, &items_payload(&bad)).items().iter().map(|i| i.0).collect();
    assert_eq!(codes, vec![-5, -6, -4, -3, -3]);
    let codes: Vec<i64> = r.call(GET_INTO, &items_payload(&bad)).items().iter().map(|i| i.0).collect();
    assert_eq!(codes, vec![-5, -6, -4, -3, -3]);
    let a = r.call(EXISTS, &keys_payload(&["unknown-handle", "out-of-bounds", "short-buffer"]));
    assert_eq!(&a.body[4..], &[0, 0, 0], "nothing was stored");

    // Malformed payloads and unknown ops: a code, and the connection stays.
    assert_eq!(r.call(PUT_FROM, &[1, 0, 0, 0, 1]).status, -13);
    let mut too_many = 5000u32.to_le_bytes().to_vec();
    too_many.resize(200_000, 0);
    assert_eq!(r.call(GET_INTO, &too_many).status, -16);
    let a = r.call(42, b"");
    assert_eq!((a.status, a.op), (-17, 42 | 0x80));
    // ... and a good round trip on the same connection, both buffer kinds.
    let block: Vec<u8> = (0..BLOCK_BYTES).map(|i| (i * 7 % 251) as u8).collect();
    for (handle, fd) in [(sealed, &f1), (sealed + 1, &plain_fd)] {
        // SAFETY: pwrite/pread on our own memfds.
        unsafe { libc::pwrite(fd.as_raw_fd(), block.as_ptr().cast(), block.len(), 0) };
        let key = format!("good-{handle}");
        assert_eq!(r.call(PUT_FROM, &items_payload(&[(handle, 0, BLOCK_BYTES, &key)])).items(), vec![(0, 1)]);
        let got = r.call(GET_INTO, &items_payload(&[(handle, BLOCK_BYTES, 2 * BLOCK_BYTES, &key)])).items();
        assert_eq!(got, vec![(BLOCK_BYTES as i64, 3)], "read from the log (no RAM tier here)");
        let mut back = vec![0u8; BLOCK_BYTES as usize];
        unsafe { libc::pread(fd.as_raw_fd(), back.as_mut_ptr().cast(), back.len(), BLOCK_BYTES as i64) };
        assert!(back == block, "byte-exact through handle {handle}");
    }
    drop(r);
    let now = fds_back_to(server.pid(), baseline);
    assert!(now <= baseline, "server descriptors {now} after close, {baseline} before");
}

#[test]
fn framing_errors_close_only_their_own_connection() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let path = socket_of(&server);
    let baseline = settled_fds(&server);
    let mut bystander = Raw::ready(&path);
    let fd = memfd(BLOCK_BYTES, true);
    assert_eq!(bystander.register(&[fd.as_raw_fd()], 0, BLOCK_BYTES).status, 0);

    // Garbage: one 0xFF frame saying why, then EOF.
    let mut g = Raw::connect(&path);
    g.s.write_all(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let a = g.read().expect("a connection-error frame");
    assert_eq!((a.op, a.status), (0xFF, -19));
    assert!(a.message().contains("magic"), "{}", a.message());
    assert!(g.closed());

    // Oversized: a header declaring 2 MiB.
    let mut o = Raw::ready(&path);
    let mut h = frame(EXISTS, 9, b"");
    h[4..8].copy_from_slice(&(2u32 << 20).to_le_bytes());
    o.s.write_all(&h).unwrap();
    let a = o.read().expect("a connection-error frame");
    assert!(a.status == -19 && a.message().contains("over the limit"), "{a:?}");
    assert!(o.closed());

    // Truncated: half a frame, then the client stops writing.
    let mut t = Raw::ready(&path);
    let f = frame(EXISTS, 3, &keys_payload(&["truncated"]));
    t.s.write_all(&f[..f.len() / 2]).unwrap();
    t.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(t.closed());

    // Nonzero flags.
    let mut n = Raw::ready(&path);
    let mut f = frame(EXISTS, 4, &keys_payload(&["x"]));
    f[3] = 1;
    n.s.write_all(&f).unwrap();
    assert_eq!(n.read().map(|a| a.status), Some(-19));
    drop((g, o, t, n));

    // The bystander's registration and connection are untouched.
    let block = vec![0xA5u8; BLOCK_BYTES as usize];
    // SAFETY: pwrite on our own memfd.
    unsafe { libc::pwrite(fd.as_raw_fd(), block.as_ptr().cast(), block.len(), 0) };
    assert_eq!(bystander.call(PUT_FROM, &items_payload(&[(1, 0, BLOCK_BYTES, "bystander")])).items(), vec![(0, 1)]);
    let stats: serde_json::Value = stats_of(&server);
    assert_eq!(stats["local"]["frame_errors"], 3, "{}", stats["local"]);
    assert_eq!(stats["local"]["registrations_open"], 1);
    drop(bystander);
    let now = fds_back_to(server.pid(), baseline);
    assert!(now <= baseline, "server descriptors {now} after close, {baseline} before");
    let stats = stats_of(&server);
    assert_eq!(stats["local"]["registrations_open"], 0);
    assert!(stats["local"]["routes"]["put_from"]["requests"].as_u64().unwrap() >= 1);
}

/// `/v1/stats` over a plain HTTP/1.1 exchange.
fn stats_of(server: &Server) -> serde_json::Value {
    let body = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    let json = &body[body.find("\r\n\r\n").expect("headers end") + 4..];
    serde_json::from_str(json).unwrap_or_else(|e| panic!("stats JSON: {e}: {json}"))
}

#[test]
fn the_socket_is_checked_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a");
    let server = start(&test_args(&data));
    let path = socket_of(&server);
    let mode = std::fs::metadata(&path).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777).unwrap();
    assert_eq!(mode, 0o660);
    assert_eq!(stats_of(&server)["local"]["socket"], path.display().to_string());
    assert!(server.listening_line().contains("listening"));

    // Another server on the same socket path: a clear error.
    let mut other = test_args(&dir.path().join("b"));
    set_flag(&mut other, "--local-socket", path.to_str().unwrap());
    let (_, stderr) = try_start(&other).err().expect("refused");
    assert!(stderr.contains("another kvtier server is serving"), "{stderr}");
    // A path too long for sun_path, and one that is not a socket.
    let long = dir.path().join("x".repeat(120));
    set_flag(&mut other, "--local-socket", long.to_str().unwrap());
    let (_, stderr) = try_start(&other).err().expect("refused");
    assert!(stderr.contains("a Unix socket path holds at most 107"), "{stderr}");
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    set_flag(&mut other, "--local-socket", file.to_str().unwrap());
    let (_, stderr) = try_start(&other).err().expect("refused");
    assert!(stderr.contains("is not a socket"), "{stderr}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");

    // Killed: the socket file stays; a restart replaces it and serves.
    let epoch = stats_of(&server)["local"]["epoch"].as_u64().unwrap();
    server.crash();
    assert!(path.exists());
    let mut args = test_args(&data);
    set_flag(&mut args, "--log-level", "info");
    let server = start(&args);
    assert!(server.log().contains("replacing the stale socket"), "{}", server.log());
    let again = stats_of(&server)["local"]["epoch"].as_u64().unwrap();
    assert_ne!(epoch, again, "a restarted server has a new epoch");
    let mut r = Raw::ready(&path);
    assert_eq!(r.call(EXISTS, &keys_payload(&["x"])).status, 0);
    drop(r);
    // Stopped cleanly: the socket file goes with it.
    server.stop();
    assert!(!path.exists());

    // Off: no socket, and /v1/stats says so.
    let mut args = test_args(&data);
    set_flag(&mut args, "--local-socket", "none");
    let server = start(&args);
    assert!(!path.exists());
    assert!(stats_of(&server)["local"]["socket"].is_null());
}

#[test]
fn puts_over_the_shards_put_budget_are_refused_with_a_retry_hint_and_the_rest_stored() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = test_args(dir.path());
    set_flag(&mut args, "--put-inflight-mib", "1");
    set_flag(&mut args, "--block-bytes", &(256u64 << 10).to_string());
    let server = start(&args);
    let block_bytes = 256u64 << 10;
    let mut r = Raw::ready(&socket_of(&server));
    let fd = memfd(64 * block_bytes, true);
    let a = r.register(&[fd.as_raw_fd()], 0, 64 * block_bytes);
    assert_eq!(a.status, 0, "{}", a.message());
    let keys: Vec<String> = (0..64).map(|i| format!("budget-{i}")).collect();
    let items: Vec<(u64, u64, u64, &str)> =
        keys.iter().enumerate().map(|(i, k)| (1, i as u64 * block_bytes, block_bytes, k.as_str())).collect();
    let id = r.send(PUT_FROM, &items_payload(&items));
    let a = r.read().unwrap();
    assert_eq!(a.id, id);
    let results = a.items();
    let refused: Vec<&str> = keys.iter().zip(&results).filter(|(_, r)| r.0 == -9).map(|(k, _)| k.as_str()).collect();
    assert!(!refused.is_empty(), "64 blocks of 256 KiB at once exceed a 1 MiB budget: {results:?}");
    assert!(results.iter().all(|r| r.0 == 0 || r.0 == -9), "{results:?}");
    assert_eq!(a.retry_after_ms, 1000, "the refusal says when to retry");
    let key_list: Vec<&str> = keys.iter().map(String::as_str).collect();
    let stored = r.call(EXISTS, &keys_payload(&key_list));
    for (k, t) in key_list.iter().zip(&stored.body[4..]) {
        assert_eq!(*t != 0, !refused.contains(k), "{k}: stored exactly when not refused");
    }
    // Counted in the socket's own series, not HTTP's (one budget per
    // shard, two counters), and in the totals.
    let stats = stats_of(&server);
    let sum = |door: &str| -> u64 {
        stats[door]["per_shard"].as_array().unwrap().iter().map(|s| s["put_bytes_refusals"].as_u64().unwrap()).sum()
    };
    assert_eq!((sum("local"), sum("http")), (refused.len() as u64, 0), "{stats}");
    assert_eq!(stats["totals"]["put_bytes_refusals"], refused.len() as u64);
    let metrics = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    let series = |name: &str| -> u64 {
        metrics.lines().filter(|l| l.starts_with(name)).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum()
    };
    assert_eq!(series("kvtier_local_put_bytes_refusals_total{"), refused.len() as u64, "{metrics}");
    assert_eq!(series("kvtier_http_put_bytes_refusals_total{"), 0, "{metrics}");
}

/// `CANCELLED` (docs/LOCAL.md, "Codes").
const CANCELLED: i64 = -25;

/// A client that stops sending has given up (docs/LOCAL.md, "When a client
/// gives up"): it still gets its answers, but a copy out of its memory not
/// made before the server saw the end of its stream is not made
/// (`CANCELLED`, nothing stored); the close that follows confirms it.
#[test]
fn a_client_that_stops_sending_still_gets_its_answers() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let mut r = Raw::ready(&socket_of(&server));
    let fd = memfd(BLOCK_BYTES, true);
    assert_eq!(r.register(&[fd.as_raw_fd()], 0, BLOCK_BYTES).status, 0);
    let put = r.send(PUT_FROM, &items_payload(&[(1, 0, BLOCK_BYTES, "half-closed")]));
    let exists = r.send(EXISTS, &keys_payload(&["half-closed", "never"]));
    r.s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answers: Vec<_> = (0..2).map(|_| r.read().expect("an answer after the half-close")).collect();
    answers.sort_by_key(|a| a.id);
    assert_eq!(answers[0].id, put);
    let stored = answers[0].items()[0];
    assert!(stored == (0, 1) || stored == (CANCELLED, 0), "stored before the half-close was seen, or cancelled: {stored:?}");
    assert_eq!(answers[1].id, exists);
    let tiers = &answers[1].body[4..];
    assert_eq!((tiers[0] != 0, tiers[1]), (stored.0 == 0, 0), "stored exactly when answered so");
    assert!(r.closed(), "then the server closes");
    let cancelled = stats_of(&server)["local"]["items_cancelled_total"].as_u64().unwrap();
    assert_eq!(cancelled, u64::from(stored.0 == CANCELLED), "counted");
}

#[test]
fn a_connection_whose_responses_cannot_be_sent_ends_at_once_never_in_silence() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let mut before = Raw::ready(&socket_of(&server));
    // Every response the server sends with send(2) fails, as on a socket
    // that broke under it (the HTTP door writes with sendmsg, so /v1/stats
    // still answers).
    let filters = ["trace=sendto".to_string(), "inject=sendto:error=EIO".to_string()];
    let failing = common::Strace::attach(server.pid(), &filters, &dir.path().join("strace.log"));
    let mut r = Raw::connect(&socket_of(&server));
    let started = Instant::now();
    r.send(HELLO, br#"{"versions":[1]}"#);
    let mut b = [0u8; 1];
    let first = r.s.read(&mut b);
    let waited = started.elapsed();
    // The connection's end, not the 10 s read timeout.
    assert!(matches!(first, Ok(0)), "the client saw {first:?} after {waited:?}, not the end of the connection");
    // A later request on it: refused at once (the server shut it both ways).
    let later = r.s.write_all(&frame(EXISTS, 9, &keys_payload(&["k"])));
    assert!(later.is_err() || matches!(r.s.read(&mut b), Ok(0)), "a later request was taken in silence");
    drop(failing);
    // Only that connection: another, opened before, is served as before.
    let a = before.call(EXISTS, &keys_payload(&["k"]));
    assert_eq!(a.status, 0, "{}", a.message());
    assert!(server.log().contains("sending its responses failed"), "the reason is logged:\n{}", server.log());
    assert_eq!(server.log().matches("sending its responses failed").count(), 1, "once");
}

#[test]
fn a_request_unanswered_for_a_second_is_logged_with_its_stage_and_again_when_answered() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let (mut r, fd, handle) = common::local::ready_with_buffer(&socket_of(&server), BLOCK_BYTES);
    write_at(&fd, 0, &pattern(3));
    // Every fsync held 1.5 s: the spare segment the first rollover needs
    // (made as the first write takes the one made at start) takes 3 s.
    let filters = ["trace=fsync".to_string(), "inject=fsync:delay_enter=1500000".to_string()];
    let slow = common::Strace::attach(server.pid(), &filters, &dir.path().join("strace.log"));
    // More blocks on shard 0 than an 8 MiB segment holds (126).
    let keys: Vec<String> =
        (0..).map(|i| format!("slow-{i}")).filter(|k| kvtier_engine::key::BlockHash::of(k.as_bytes()).shard(2) == 0).take(140).collect();
    let items: Vec<(u64, u64, u64, &str)> = keys.iter().map(|k| (handle, 0, BLOCK_BYTES, k.as_str())).collect();
    let a = r.call(PUT_FROM, &items_payload(&items));
    assert!(a.items().iter().all(|&(result, _)| result == 0), "{:?}", a.items());
    drop(slow);
    let log = server.log();
    let unanswered = log.lines().find(|l| l.contains("local PUT_FROM request") && l.contains("unanswered after"));
    let unanswered = unanswered.unwrap_or_else(|| panic!("no report of the slow request:\n{log}"));
    assert!(unanswered.contains("read, in the store"), "{unanswered}");
    assert!(log.lines().any(|l| l.contains("local PUT_FROM request") && l.contains("answered after")), "{log}");
}

#[test]
fn a_clean_stop_is_not_held_up_by_idle_local_connections() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let path = socket_of(&server);
    let mut idle = Raw::ready(&path);
    let fd = memfd(BLOCK_BYTES, true);
    assert_eq!(idle.register(&[fd.as_raw_fd()], 0, BLOCK_BYTES).status, 0);
    let started = Instant::now();
    let status = server.stop();
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "SIGTERM took {:?} with an idle local connection open", started.elapsed());
    assert!(idle.closed(), "the server closed the connection");
    assert!(!path.exists());
}

/// Registers `fd`'s first `len` bytes: the handle.
fn register(r: &mut Raw, fd: &OwnedFd, len: u64) -> u64 {
    let a = r.register(&[fd.as_raw_fd()], 0, len);
    assert_eq!(a.status, 0, "{}", a.message());
    u64::from_le_bytes(a.body[..8].try_into().unwrap())
}

/// A block of pattern bytes, distinct per `seed`, never the sentinel 0xEE
/// everywhere.
fn pattern(seed: u64) -> Vec<u8> {
    (0..BLOCK_BYTES).map(|i| ((i * 31 + seed * 7 + i / 251) % 253) as u8).collect()
}

const SENTINEL: u8 = 0xEE;

#[test]
fn a_block_is_gathered_from_spans_and_scattered_into_others() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let mut r = Raw::connect(&socket_of(&server));
    // HELLO names every op the server serves, the vectored ones too.
    let a = r.call(HELLO, br#"{"versions":[1]}"#);
    assert_eq!(a.status, 0, "{}", a.message());
    let hello: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    let ops: Vec<&str> = hello["ops"].as_array().expect("ops").iter().map(|o| o.as_str().unwrap()).collect();
    assert!(ops.contains(&"GET_INTO_V") && ops.contains(&"PUT_FROM_V"), "{ops:?}");
    assert_eq!(ops[..5], ["HELLO", "REGISTER", "UNREGISTER", "GET_INTO", "PUT_FROM"], "{ops:?}");

    // Two buffers, one mapped (sealed) and one reached with file I/O.
    let len = 4 * BLOCK_BYTES;
    let (fa, fb) = (memfd(len, true), memfd(len, false));
    let (a_h, b_h) = (register(&mut r, &fa, len), register(&mut r, &fb, len));

    // PUT_FROM_V: 40 % of the block at 1000 in A, 60 % at 5000 in B.
    let block = pattern(1);
    let first = BLOCK_BYTES * 2 / 5;
    write_at(&fa, 1000, &block[..first as usize]);
    write_at(&fb, 5000, &block[first as usize..]);
    let parts = [(a_h, 1000, first), (b_h, 5000, BLOCK_BYTES - first)];
    assert_eq!(r.call_v(PUT_FROM_V, &[(&parts, "v-block")]), vec![(0, 1)]);

    // Plain GET_INTO: the concatenation, byte-exact.
    write_at(&fa, 0, &vec![SENTINEL; len as usize]);
    write_at(&fb, 0, &vec![SENTINEL; len as usize]);
    let got = r.call(GET_INTO, &items_payload(&[(a_h, 2 * BLOCK_BYTES, BLOCK_BYTES, "v-block")])).items();
    assert_eq!(got, vec![(BLOCK_BYTES as i64, 3)]);
    assert!(read_at(&fa, 2 * BLOCK_BYTES, BLOCK_BYTES) == block, "plain GET_INTO of a gathered block");

    // GET_INTO_V into 3 parts laid out otherwise, 80,000 bytes of room for
    // 65,536: part 0 in B, part 1 in A, part 2 in B, which takes only the
    // rest of the block; the bytes past it stay as they were.
    write_at(&fa, 0, &vec![SENTINEL; len as usize]);
    let parts = [(b_h, 2 * BLOCK_BYTES + 7, 10_000), (a_h, 3 * BLOCK_BYTES + 100, 30_000), (b_h, 100, 40_000)];
    assert_eq!(r.call_v(GET_INTO_V, &[(&parts, "v-block")]), vec![(BLOCK_BYTES as i64, 3)]);
    let (b_all, a_all) = (read_at(&fb, 0, len), read_at(&fa, 0, len));
    let b0 = (2 * BLOCK_BYTES + 7) as usize;
    let a1 = (3 * BLOCK_BYTES + 100) as usize;
    assert!(b_all[b0..b0 + 10_000] == block[..10_000], "part 0");
    assert!(a_all[a1..a1 + 30_000] == block[10_000..40_000], "part 1");
    let tail = BLOCK_BYTES as usize - 40_000;
    assert!(b_all[100..100 + tail] == block[40_000..], "part 2 takes the rest of the block");
    // Everything else in both buffers, part 2's unused room included, is
    // untouched.
    let touched_b = |i: usize| (b0..b0 + 10_000).contains(&i) || (100..100 + tail).contains(&i);
    assert!(b_all.iter().enumerate().all(|(i, b)| touched_b(i) || *b == SENTINEL), "B outside the parts");
    assert!(a_all.iter().enumerate().all(|(i, b)| (a1..a1 + 30_000).contains(&i) || *b == SENTINEL), "A outside the part");

    // 16 parts of 4 KiB, in reverse order over one buffer, both ways.
    let block = pattern(2);
    let parts: Vec<(u64, u64, u64)> = (0..16u64).map(|i| (a_h, (15 - i) * 4096 * 2 + 1, 4096)).collect();
    for (i, p) in parts.iter().enumerate() {
        write_at(&fa, p.1, &block[i * 4096..(i + 1) * 4096]);
    }
    assert_eq!(r.call_v(PUT_FROM_V, &[(&parts, "v-sixteen")]), vec![(0, 1)]);
    let got = r.call(GET_INTO, &items_payload(&[(b_h, 0, BLOCK_BYTES, "v-sixteen")])).items();
    assert_eq!(got, vec![(BLOCK_BYTES as i64, 3)]);
    assert!(read_at(&fb, 0, BLOCK_BYTES) == block, "16 parts gathered in order");
    write_at(&fa, 0, &vec![SENTINEL; len as usize]);
    assert_eq!(r.call_v(GET_INTO_V, &[(&parts, "v-sixteen")]), vec![(BLOCK_BYTES as i64, 3)]);
    for (i, p) in parts.iter().enumerate() {
        assert!(read_at(&fa, p.1, 4096) == block[i * 4096..(i + 1) * 4096], "part {i} scattered");
    }

    // Counted under their own routes, with the block bytes moved.
    let stats = stats_of(&server);
    let routes = &stats["local"]["routes"];
    assert_eq!((routes["put_from_v"]["requests"].as_u64(), routes["get_into_v"]["requests"].as_u64()), (Some(2), Some(2)), "{routes}");
    assert_eq!(routes["get_into"]["requests"], 2);
    let sum = |field: &str| stats["local"]["per_shard"].as_array().unwrap().iter().map(|s| s[field].as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("bytes_in"), sum("bytes_out")), (2 * BLOCK_BYTES, 4 * BLOCK_BYTES));
    let metrics = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(metrics.contains("route=\"get_into_v\"") && metrics.contains("route=\"put_from_v\""), "{metrics}");
}

#[test]
fn a_vectored_item_is_checked_whole_before_anything_is_copied() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let mut r = Raw::ready(&socket_of(&server));
    let len = 4 * BLOCK_BYTES;
    let (fa, fb) = (memfd(len, true), memfd(len, false));
    let (a_h, b_h) = (register(&mut r, &fa, len), register(&mut r, &fb, len));
    let block = pattern(3);
    write_at(&fa, 0, &block);
    assert_eq!(r.call(PUT_FROM, &items_payload(&[(a_h, 0, BLOCK_BYTES, "stored")])).items(), vec![(0, 1)]);
    write_at(&fa, 0, &vec![SENTINEL; len as usize]);
    let untouched = |fd: &OwnedFd, what: &str| assert!(read_at(fd, 0, len).iter().all(|b| *b == SENTINEL), "{what}: nothing copied");
    let half = BLOCK_BYTES / 2;

    // WRONG_SIZE: room one byte short (get), one byte short or over (put).
    let short = [(a_h, 0, half), (a_h, 2 * BLOCK_BYTES, half - 1)];
    assert_eq!(r.call_v(GET_INTO_V, &[(&short, "stored")]), vec![(-4, 0)]);
    untouched(&fa, "a get with too little room");
    let over = [(a_h, 0, half), (a_h, 2 * BLOCK_BYTES, half + 1)];
    let codes = r.call_v(PUT_FROM_V, &[(&short, "put-short"), (&over, "put-over")]);
    assert_eq!(codes, vec![(-4, 0), (-4, 0)]);

    // OUT_OF_BOUNDS or UNKNOWN_HANDLE in the second part only: the first
    // part gets nothing. BUFFER_SHRUNK likewise, for a file I/O buffer
    // shrunk under its registration.
    let oob = [(a_h, 0, half), (a_h, len - 10, half)];
    let unknown = [(a_h, 0, half), (999, 0, half)];
    let shrunk = [(a_h, 0, half), (b_h, 3 * BLOCK_BYTES, half)];
    // SAFETY: ftruncate on the test's own (unsealed) memfd.
    assert_eq!(unsafe { libc::ftruncate(fb.as_raw_fd(), (2 * BLOCK_BYTES) as i64) }, 0);
    let codes = r.call_v(GET_INTO_V, &[(&oob, "stored"), (&unknown, "stored"), (&shrunk, "stored")]);
    assert_eq!(codes, vec![(-6, 0), (-5, 0), (-7, 0)]);
    untouched(&fa, "a get with a bad second part");
    let codes = r.call_v(PUT_FROM_V, &[(&oob, "put-oob"), (&unknown, "put-unknown"), (&shrunk, "put-shrunk")]);
    assert_eq!(codes, vec![(-6, 0), (-5, 0), (-7, 0)]);
    let keys = ["put-short", "put-over", "put-oob", "put-unknown", "put-shrunk"];
    let a = r.call(EXISTS, &keys_payload(&keys));
    assert_eq!(&a.body[4..], &[0; 5], "nothing was stored");

    // Malformed payloads: parts 0 and PARTS_MAX + 1 are bad requests, too
    // many items a limit, and the connection stays usable.
    let none: &[(u64, u64, u64)] = &[];
    let too_many_parts = vec![(a_h, 0, 64); kvtier_local_proto::PARTS_MAX + 1];
    for (op, payload) in [
        (GET_INTO_V, items_v_payload(&[(none, "stored")])),
        (PUT_FROM_V, items_v_payload(&[(none, "put-none")])),
        (GET_INTO_V, items_v_payload(&[(&too_many_parts, "stored")])),
        (PUT_FROM_V, items_v_payload(&[(&too_many_parts, "put-257")])),
    ] {
        let a = r.call(op, &payload);
        assert_eq!((a.op, a.status), (op | 0x80, -13), "{}", a.message());
        assert!(a.message().contains("parts"), "{}", a.message());
    }
    // A plain GET_INTO payload sent as GET_INTO_V: its handle's low bytes
    // read as a parts count of 1, the rest does not parse.
    assert_eq!(r.call(GET_INTO_V, &items_payload(&[(a_h, 0, BLOCK_BYTES, "stored")])).status, -13);
    let mut too_many = 5000u32.to_le_bytes().to_vec();
    too_many.resize(200_000, 0);
    assert_eq!(r.call(PUT_FROM_V, &too_many).status, -16);
    untouched(&fa, "malformed requests");
    let whole = [(a_h, 8, BLOCK_BYTES)];
    assert_eq!(r.call_v(GET_INTO_V, &[(&whole, "stored")]), vec![(BLOCK_BYTES as i64, 3)]);
    assert!(read_at(&fa, 8, BLOCK_BYTES) == block, "one part is a plain GET_INTO");
    let routes = &stats_of(&server)["local"]["routes"];
    assert_eq!(routes["get_into_v"]["client_errors"], 3, "{routes}");
    assert_eq!(routes["put_from_v"]["client_errors"], 3, "{routes}");
}

/// An engine's unsealed buffer is mapped under the server's SIGBUS guard
/// (access 3). A client that truncates it while the server copies into it
/// costs that registration (`BUFFER_SHRUNK` for its items, then for every
/// item on it), never the server: `sigbus_caught` counts the faults caught,
/// and the server serves on, a new registration included.
#[test]
fn a_buffer_truncated_under_the_servers_copies_costs_the_registration_not_the_server() {
    const BB: u64 = 16 << 20;
    const N: u64 = 16;
    let dir = tempfile::tempdir().unwrap();
    let mut args = test_args(dir.path());
    for (flag, value) in [("--block-bytes", "16777216"), ("--segment-mib", "64"), ("--disk-gb", "1.5"), ("--ram-gb", "1")] {
        set_flag(&mut args, flag, value);
    }
    let server = start(&args);
    let mut r = Raw::ready(&socket_of(&server));
    let source = memfd(N * BB, true);
    let sealed = register(&mut r, &source, N * BB);
    let keys: Vec<String> = (0..N).map(|i| format!("sigbus-{i}")).collect();
    for (i, key) in keys.iter().enumerate() {
        write_at(&source, i as u64 * BB, &pattern(i as u64)[..1].repeat(BB as usize));
        let stored = r.call(PUT_FROM, &items_payload(&[(sealed, i as u64 * BB, BB, key)])).items();
        assert_eq!(stored, vec![(0, 1)]);
    }
    let caught = || stats_of(&server)["local"]["sigbus_caught"].as_u64().unwrap();
    let mut attempts = 0;
    while caught() == 0 {
        attempts += 1;
        assert!(attempts <= 40, "no truncation landed inside a copy in 40 tries");
        let target = memfd(N * BB, false);
        let a = r.register(&[target.as_raw_fd()], 0, N * BB);
        assert_eq!((a.status, a.body[8]), (0, 3), "{}", a.message());
        let handle = u64::from_le_bytes(a.body[..8].try_into().unwrap());
        let items: Vec<(u64, u64, u64, &str)> = keys.iter().enumerate().map(|(i, k)| (handle, i as u64 * BB, BB, k.as_str())).collect();
        r.send(GET_INTO, &items_payload(&items));
        std::thread::sleep(Duration::from_micros(500 * (attempts % 8)));
        // SAFETY: ftruncate on the test's own memfd, under the server's copies.
        assert_eq!(unsafe { libc::ftruncate(target.as_raw_fd(), 0) }, 0);
        let answer = r.read().unwrap_or_else(|| panic!("the server closed the connection (dead? its log:)\n{}", server.log()));
        assert!(answer.items().iter().all(|(res, _)| *res == BB as i64 || *res == -7), "{:?}", answer.items());
        // Lost whole, faulted or not: the next item on it fails too.
        // SAFETY: as above, the file grown back to its size.
        assert_eq!(unsafe { libc::ftruncate(target.as_raw_fd(), (N * BB) as i64) }, 0);
        let again = r.call(GET_INTO, &items_payload(&[(handle, 0, BB, &keys[0])])).items();
        assert_eq!(again, vec![(-7, 0)], "a registration whose file shrank stays lost");
        r.call(UNREGISTER, &handle.to_le_bytes());
    }
    // The server serves on: a new unsealed registration, byte-exact.
    let fresh = memfd(BB, false);
    let handle = register(&mut r, &fresh, BB);
    assert_eq!(r.call(GET_INTO, &items_payload(&[(handle, 0, BB, &keys[3])])).items(), vec![(BB as i64, 2)]);
    let byte = pattern(3)[0];
    assert!(read_at(&fresh, 0, BB).iter().all(|b| *b == byte));
    let metrics = common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(metrics.contains("kvtier_local_sigbus_caught"), "{metrics}");
    assert!(server.log().is_empty() || !server.log().contains("panicked"), "{}", server.log());
}

/// The minor page faults so far of the server's shard threads, those that
/// copy (`/proc/PID/task/TID/stat`, field 10). Other threads are left out:
/// the stall reporter resolving a stack's symbols on a busy machine faults
/// in the binary's debug info (1,436 faults in one `make test-all`).
fn minor_faults(pid: u32) -> u64 {
    let (mut total, mut shards) = (0, 0);
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else { continue };
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else { continue };
        if comm.starts_with("kvtier-shard") {
            shards += 1;
            total += stat.rsplit_once(')').unwrap().1.split_whitespace().nth(7).unwrap().parse::<u64>().unwrap();
        }
    }
    assert!(shards > 0, "no kvtier-shard thread in /proc/{pid}/task");
    total
}

#[test]
fn a_registered_buffers_pages_are_mapped_ahead_so_a_load_into_them_takes_no_page_faults() {
    // A load into pages the server's mapping never touched faulted once a
    // page on the shard's thread: 300,000 faults and 2.7 CPU-s for an
    // 8K-token load into vLLM's cache (docs/BENCHMARKS.md).
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let mut r = Raw::connect(&socket_of(&server));
    assert_eq!(r.call(HELLO, br#"{"versions":[1]}"#).status, 0);
    let blocks = (16 << 20) / BLOCK_BYTES;
    let len = blocks * BLOCK_BYTES;
    let (source, dest) = (memfd(len, true), memfd(len, true));
    let block = pattern(3);
    for i in 0..blocks {
        write_at(&source, i * BLOCK_BYTES, &block);
    }
    write_at(&dest, 0, &vec![SENTINEL; len as usize]); // the client's pages, held, as vLLM's cache is
    let (s_h, d_h) = (register(&mut r, &source, len), register(&mut r, &dest, len));
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats_of(&server)["local"]["registered_bytes_mapped_ahead_total"].as_u64().unwrap() < 2 * len {
        assert!(Instant::now() < deadline, "not mapped ahead in 30 s: {}", stats_of(&server)["local"]);
        std::thread::sleep(Duration::from_millis(20));
    }
    let keys: Vec<String> = (0..blocks).map(|i| format!("ahead-{i}")).collect();
    let items = |h: u64| keys.iter().enumerate().map(|(i, k)| (h, i as u64 * BLOCK_BYTES, BLOCK_BYTES, k.as_str())).collect::<Vec<_>>();
    let put = r.call(PUT_FROM, &items_payload(&items(s_h))).items();
    assert!(put.iter().all(|(code, _)| *code == 0), "{put:?}");
    let before = minor_faults(server.pid());
    let got = r.call(GET_INTO, &items_payload(&items(d_h))).items();
    let faults = minor_faults(server.pid()) - before;
    assert!(got.iter().all(|(n, _)| *n == BLOCK_BYTES as i64), "{got:?}");
    assert!(read_at(&dest, 0, len).chunks(BLOCK_BYTES as usize).all(|b| b == block), "the blocks loaded");
    // One fault a page without the mapping ahead (4,441 for 4,096 pages,
    // the server's own allocations included); 526 with it, all the
    // server's own (its chunk buffers, the RAM tier's slots).
    let pages = len / 4096;
    assert!(faults < pages / 4, "a load into {pages} pages mapped ahead took {faults} page faults in the server");
    assert!(metrics_of(&server).contains("kvtier_local_registered_bytes_mapped_ahead_total"));
}

fn metrics_of(server: &Server) -> String {
    common::exchange(
        server.url.trim_start_matches("http://"),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
}
