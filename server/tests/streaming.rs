//! Streamed GETs from the log: a block of several chunks is sent chunk by
//! chunk, each checked against its own CRC-32 first. A damaged chunk at
//! any position (first, middle, last) never reaches a client as a
//! complete response: the first chunk's damage is a clean 404, a later
//! one resets the response after the chunks before it (all of them
//! right), over HTTP/2 and HTTP/1.1, and the same whether the connection
//! is on the shard that owns the block or on another. And a store written in format 1
//! (whole-block CRC only) still opens and serves.

mod common;

use std::io::{Read, Write};
use std::path::Path;

use common::{client, flip_byte, fsck_json, locate, set_flag, start};
use kvtier_engine::geometry::FORMAT_VERSION;
use kvtier_engine::slot::{SlotHeader, PAGE_BYTES};

/// 3.5 MiB: chunks 0, 1 and 2 of 1 MiB and a short last chunk 3.
const BLOCK_BYTES: u64 = 7 << 19;
const CHUNK_BYTES: u64 = 1 << 20;

fn args(data: &Path) -> Vec<String> {
    let mut a = common::test_args(data);
    set_flag(&mut a, "--block-bytes", &BLOCK_BYTES.to_string());
    set_flag(&mut a, "--segment-mib", "16");
    a
}

/// One shard: every GET is served by the shard that accepted it, so it is
/// streamed chunk by chunk (a GET forwarded from another shard gets its
/// chunks in one message once all have passed, and ends alike on damage:
/// `a_damaged_block_ends_alike_through_a_connection_on_either_shard`).
fn one_shard(data: &Path) -> Vec<String> {
    let mut a = args(data);
    set_flag(&mut a, "--shards", "1");
    a
}

fn payload(key: &str) -> bytes::Bytes {
    kvtier_loadgen::payload::Payloads::new(BLOCK_BYTES as usize, 1).chunks(key).concat().into()
}

/// A raw HTTP/1.1 GET: (status, declared Content-Length, body bytes
/// received before the server closed).
fn raw_http1_get(url: &str, key: &str) -> (u16, u64, Vec<u8>) {
    let addr = url.trim_start_matches("http://");
    http1_get_on(std::net::TcpStream::connect(addr).unwrap(), addr, key)
}

/// [`raw_http1_get`] on a connection already open.
fn http1_get_on(mut s: std::net::TcpStream, addr: &str, key: &str) -> (u16, u64, Vec<u8>) {
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    write!(s, "GET /v1/blocks/{key} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let end = all.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head") + 4;
    let head = String::from_utf8_lossy(&all[..end]).to_lowercase();
    let status = head[9..12].parse().unwrap();
    let length = head.lines().find_map(|l| l.strip_prefix("content-length: ")).map(|v| v.trim().parse().unwrap()).unwrap_or(0);
    (status, length, all[end..].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_chunk_anywhere_never_completes_a_response_and_earlier_chunks_are_right() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = one_shard(&data);
    // Per position, one victim read over HTTP/2 and one over HTTP/1.1 (a
    // damaged block is dropped at its first read), and intact blocks.
    let positions = [("first", 100), ("middle", 2 * CHUNK_BYTES + 5_000), ("last", BLOCK_BYTES - 10)];
    let victims: Vec<(String, u64, bool)> =
        positions.iter().flat_map(|(name, at)| [(format!("{name}-h2"), *at, false), (format!("{name}-h1"), *at, true)]).collect();
    let intact: Vec<String> = (0..4).map(|i| format!("intact-{i}")).collect();
    let server = start(&args);
    let c = client(&server, false);
    for k in victims.iter().map(|v| &v.0).chain(&intact) {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    // Streamed from the log, in chunks, byte-exact, over both protocols.
    for http1 in [false, true] {
        let (body, tier) = client(&server, http1).get(&intact[0]).await.unwrap().unwrap();
        assert_eq!(tier.as_deref(), Some("nvme"));
        assert!(body.to_bytes() == payload(&intact[0]));
    }
    assert!(server.stop().success());
    let (clean, report) = fsck_json(&data);
    assert!(clean, "{report}");

    let at = locate(&data, BLOCK_BYTES);
    for (key, offset, _) in &victims {
        let l = &at[key];
        flip_byte(&l.0, l.3 + PAGE_BYTES + offset);
    }
    // fsck names each damaged chunk.
    let (clean, report) = fsck_json(&data);
    assert!(!clean);
    let whys: Vec<String> = report["damaged"].as_array().unwrap().iter().map(|d| d["problem"].as_str().unwrap().to_string()).collect();
    assert_eq!(whys.len(), victims.len(), "{report}");
    for chunk in [0, 2, 3] {
        let named = format!("chunk {chunk} of 4");
        assert_eq!(whys.iter().filter(|w| w.contains(&named)).count(), 2, "{named}: {whys:?}");
    }

    let server = start(&args);
    for (key, offset, http1) in &victims {
        let expected = payload(key);
        let first_chunk = *offset < CHUNK_BYTES;
        if *http1 {
            let (status, length, got) = raw_http1_get(&server.url, key);
            if first_chunk {
                assert_eq!(status, 404, "{key}");
            } else {
                assert_eq!((status, length), (200, BLOCK_BYTES), "{key}");
                assert!((got.len() as u64) < BLOCK_BYTES, "{key}: a complete response with a damaged chunk");
                assert!(got[..] == expected[..got.len()], "{key}: a wrong byte was sent");
                let damaged_chunk = offset / CHUNK_BYTES;
                assert!(got.len() as u64 <= damaged_chunk * CHUNK_BYTES, "{key}: bytes of the damaged chunk were sent");
            }
        } else {
            // The loadgen's GET: a cut-off or reset response is a miss,
            // counted in body_cuts; the first chunk's damage a plain 404.
            let h2 = client(&server, false);
            assert!(h2.get(key).await.unwrap().is_none(), "{key}: served");
            assert_eq!(h2.body_cuts(), if first_chunk { 0 } else { 1 }, "{key}");
        }
        // Dropped: a miss from now on, for either client.
        assert!(client(&server, false).get(key).await.unwrap().is_none(), "{key}");
    }
    let c = client(&server, false);
    for k in &intact {
        let (body, _) = c.get(k).await.unwrap().unwrap();
        assert!(body.to_bytes() == payload(k), "{k}");
    }
    let stats = c.stats().await.unwrap();
    assert_eq!(stats["totals"]["corrupt_blocks"], victims.len() as u64, "{}", stats["totals"]);
    assert!(server.log().contains("CRC-32 mismatch in chunk 2 of 4"), "{}", server.log());
    assert!(server.stop().success());
}

/// Per shard, connections accepted since start (`/v1/stats`).
async fn connections_per_shard(observer: &kvtier_loadgen::client::Client) -> Vec<u64> {
    let stats = observer.stats().await.unwrap();
    stats["http"]["per_shard"].as_array().unwrap().iter().map(|s| s["connections_total"].as_u64().unwrap()).collect()
}

/// A damaged block read through a connection on the shard that owns it
/// (streamed there) and through a connection on the other shard (the GET
/// forwarded to the owner, its chunks sent back together) ends the same
/// way: damage in the first chunk is a 404, damage later a 200 whose body
/// stops before the damaged chunk, every byte sent right. Two shards;
/// the shard that accepted each raw connection is told by which shard's
/// accepted-connections counter moved, and the victim read on it is one
/// its shard owns or one it does not, as the case needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_block_ends_alike_through_a_connection_on_either_shard() {
    use kvtier_engine::key::BlockHash;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut a = args(&data);
    set_flag(&mut a, "--shards", "2");
    set_flag(&mut a, "--ram-gb", "0");
    let owner = |k: &str| BlockHash::of(k.as_bytes()).shard(2);
    let positions = [("first", 100), ("middle", 2 * CHUNK_BYTES + 5_000), ("last", BLOCK_BYTES - 10)];
    // Per position and owning shard, one victim to read on its owner and
    // one to read on the other shard.
    let mut victims = Vec::new(); // (key, offset, owner, forwarded)
    for (name, at) in positions {
        for shard in 0..2 {
            let keys: Vec<String> = (0..).map(|i| format!("dmg-{name}-{i}")).filter(|k| owner(k) == shard).take(2).collect();
            victims.push((keys[0].clone(), at, shard, false));
            victims.push((keys[1].clone(), at, shard, true));
        }
    }
    let server = start(&a);
    let c = client(&server, false);
    for (k, ..) in &victims {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    assert!(server.stop().success());
    let at = locate(&data, BLOCK_BYTES);
    for (key, offset, ..) in &victims {
        let l = &at[key];
        flip_byte(&l.0, l.3 + PAGE_BYTES + offset);
    }
    let server = start(&a);
    let addr = server.url.trim_start_matches("http://").to_string();
    let observer = client(&server, false);
    let mut outcomes = std::collections::BTreeMap::new();
    for (key, offset, owning, forwarded) in &victims {
        let want_shard = if *forwarded { 1 - owning } else { *owning };
        let mut stream = None;
        for _ in 0..64 {
            let before = connections_per_shard(&observer).await;
            let s = std::net::TcpStream::connect(&addr).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let on = loop {
                let now = connections_per_shard(&observer).await;
                if let Some(i) = (0..2).find(|&i| now[i] > before[i]) {
                    break i;
                }
                assert!(std::time::Instant::now() < deadline, "no shard counted the connection");
            };
            if on == want_shard {
                stream = Some(s);
                break;
            }
        }
        let stream = stream.unwrap_or_else(|| panic!("64 connections never landed on shard {want_shard}"));
        let (status, length, got) = http1_get_on(stream, &addr, key);
        let damaged_chunk = offset / CHUNK_BYTES;
        let outcome = if status == 404 {
            "404".to_string()
        } else {
            assert_eq!((status, length), (200, BLOCK_BYTES), "{key}");
            assert!(got[..] == payload(key)[..got.len()], "{key}: a wrong byte was sent");
            assert!((got.len() as u64) < BLOCK_BYTES, "{key}: a complete response with a damaged chunk");
            assert!(got.len() as u64 <= damaged_chunk * CHUNK_BYTES, "{key}: bytes of the damaged chunk were sent");
            "200, cut short".to_string()
        };
        outcomes.insert((*offset, *owning, *forwarded), outcome);
    }
    for (name, offset) in positions {
        let want = if offset < CHUNK_BYTES { "404" } else { "200, cut short" };
        for shard in 0..2 {
            for forwarded in [false, true] {
                assert_eq!(outcomes[&(offset, shard, forwarded)], want, "{name} chunk damaged, owner {shard}, forwarded {forwarded}");
            }
        }
    }
    let stats = observer.stats().await.unwrap();
    assert_eq!(stats["totals"]["corrupt_blocks"], victims.len() as u64, "{}", stats["totals"]);
    assert!(server.stop().success());
}

/// Rewrites every slot header of a stopped store as format 1 wrote it
/// (version 1, no chunk size or chunk CRCs) and marks `store.json` format 1.
fn downgrade_to_format_1(data: &Path, block_bytes: u64) {
    use std::os::unix::fs::FileExt;
    for (_, (path, _, _, at)) in locate(data, block_bytes) {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let mut page = vec![0u8; PAGE_BYTES as usize];
        f.read_exact_at(&mut page, at).unwrap();
        let mut h = SlotHeader::decode(&page).unwrap();
        assert_eq!(h.chunk_crcs.len(), 4, "written as format 2");
        h.chunk_bytes = 0;
        h.chunk_crcs.clear();
        h.encode(&mut page);
        page[4..6].copy_from_slice(&1u16.to_le_bytes());
        let crc = crc32fast::hash(&page[..4092]);
        page[4092..].copy_from_slice(&crc.to_le_bytes());
        f.write_all_at(&page, at).unwrap();
    }
    let manifest = data.join("store.json");
    let text =
        std::fs::read_to_string(&manifest).unwrap().replace(&format!("\"format_version\": {FORMAT_VERSION}"), "\"format_version\": 1");
    std::fs::write(&manifest, text).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_1_store_opens_serves_every_block_and_takes_format_2_writes() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = args(&data);
    let keys: Vec<String> = (0..6).map(|i| format!("old-{i}")).collect();
    let server = start(&args);
    let c = client(&server, true);
    for k in &keys {
        c.put(k, vec![payload(k)]).await.unwrap();
    }
    assert!(server.stop().success());
    downgrade_to_format_1(&data, BLOCK_BYTES);
    let (clean, report) = fsck_json(&data);
    assert!(clean, "fsck reads format 1: {report}");

    let server = start(&args);
    for http1 in [false, true] {
        let c = client(&server, http1);
        for k in &keys {
            let (body, _) = c.get(k).await.unwrap().unwrap_or_else(|| panic!("{k} missing"));
            assert!(body.to_bytes() == payload(k), "{k}");
        }
    }
    let manifest = std::fs::read_to_string(data.join("store.json")).unwrap();
    assert!(manifest.contains(&format!("\"format_version\": {FORMAT_VERSION}")), "{manifest}");
    client(&server, false).put("new-0", vec![payload("new-0")]).await.unwrap();
    assert!(server.stop().success());
    let (clean, report) = fsck_json(&data);
    assert!(clean, "{report}");
    // Old slots stay format 1 (read whole), the new one is format 2.
    let at = locate(&data, BLOCK_BYTES);
    let chunks_of = |k: &str| {
        use std::os::unix::fs::FileExt;
        let (path, _, _, offset) = &at[k];
        let mut page = vec![0u8; PAGE_BYTES as usize];
        std::fs::File::open(path).unwrap().read_exact_at(&mut page, *offset).unwrap();
        SlotHeader::decode(&page).unwrap().chunk_crcs.len()
    };
    assert_eq!((chunks_of("old-0"), chunks_of("new-0")), (0, 4));
}

/// A block promoted on read is copied chunk by chunk into its RAM slot and
/// sent from there; the next GET is a RAM hit with the same bytes, under
/// both write policies (write-back: RAM's victims must reach the log first,
/// so the chunks are copied into RAM after the read instead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_block_streams_from_its_ram_slot_and_is_then_a_ram_hit() {
    for policy in ["through", "back"] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args(&dir.path().join("data"));
        // Two blocks of RAM per shard.
        set_flag(&mut args, "--ram-gb", &((4 * BLOCK_BYTES) as f64 / (1u64 << 30) as f64).to_string());
        set_flag(&mut args, "--write-policy", policy);
        let server = start(&args);
        let c = client(&server, false);
        let keys: Vec<String> = (0..10).map(|i| format!("promo-{i}")).collect();
        for k in &keys {
            c.put(k, vec![payload(k)]).await.unwrap();
        }
        let mut from_nvme = 0;
        for k in &keys {
            let (body, tier) = c.get(k).await.unwrap().unwrap();
            assert!(body.to_bytes() == payload(k), "{policy}: {k}");
            if tier.as_deref() == Some("nvme") {
                from_nvme += 1;
                let (again, tier) = c.get(k).await.unwrap().unwrap();
                assert_eq!(tier.as_deref(), Some("ram"), "{policy}: {k} was not promoted");
                assert!(again.to_bytes() == payload(k), "{policy}: {k} wrong from RAM");
            }
        }
        assert!(from_nvme >= 4, "{policy}: only {from_nvme} GETs reached the log");
        let stats = c.stats().await.unwrap();
        let ram = stats["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == "ram").unwrap().clone();
        assert!(ram["promotions"].as_u64().unwrap() >= from_nvme, "{policy}: {ram}");
        assert!(server.stop().success());
    }
}

/// The kernel's transparent huge page mode: the bracketed word of
/// `/sys/kernel/mm/transparent_hugepage/enabled` (`always`, `madvise` or
/// `never`); `None` where the kernel has no THP.
fn thp_mode() -> Option<String> {
    let line = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    Some(line.split('[').nth(1)?.split(']').next()?.to_string())
}

/// `AnonHugePages` of a process, in bytes (`/proc/PID/smaps_rollup`).
fn anon_huge_page_bytes(pid: u32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let kib = rollup.lines().find_map(|l| l.strip_prefix("AnonHugePages:")).expect("AnonHugePages in smaps_rollup");
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() << 10
}

/// The DMA buffers block reads land in come from jemalloc, which the server
/// configures with `thp:always`: with no RAM tier (the only other user of
/// huge pages) a serving process still holds anonymous huge pages. Without
/// the setting (or with it under a wrong symbol name, which jemalloc would
/// silently ignore) a kernel in `madvise` mode gives it none, and chunk reads
/// go to the disk split at 254 scattered 4 KiB pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dma_buffers_sit_in_transparent_huge_pages() {
    match thp_mode().as_deref() {
        Some("always") | Some("madvise") => {}
        other => panic!(
            "transparent huge pages are {other:?} on this kernel; this test needs `always` or `madvise` \
             (echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)"
        ),
    }
    let dir = tempfile::tempdir().unwrap();
    let server = start(&one_shard(&dir.path().join("data")));
    let c = client(&server, true);
    for k in ["huge-0", "huge-1", "huge-2"] {
        c.put(k, vec![payload(k)]).await.unwrap();
        let (body, tier) = c.get(k).await.unwrap().unwrap();
        assert_eq!(tier.as_deref(), Some("nvme"));
        assert!(body.to_bytes() == payload(k), "{k}");
    }
    let huge = anon_huge_page_bytes(server.pid());
    assert!(huge >= 2 << 20, "the server holds {huge} bytes of anonymous huge pages; its DMA buffers are in 4 KiB pages");
    // The streamed chunks were DMA buffers, each dropped on its shard.
    let m = c.send(http::Method::GET, "/metrics", kvtier_loadgen::client::ChunkedBody::default(), None).await.unwrap();
    let text = String::from_utf8(m.body.to_bytes().to_vec()).unwrap();
    assert!(text.lines().any(|l| l == "kvtier_dma_chunks_leaked_total 0"), "{text}");
    assert!(server.stop().success());
}

/// A GET that lands on a shard other than its key's owner is sent from
/// the owner's DMA buffers (no copy on the way), every byte right, and
/// each buffer goes back to the owner to be freed: counted as sent home,
/// none leaked. HTTP/2 and HTTP/1.1, two shards, no RAM tier (so every GET
/// reads the log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_get_sends_the_owners_chunks_and_returns_them_home() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = args(&dir.path().join("data"));
    set_flag(&mut a, "--shards", "2");
    set_flag(&mut a, "--ram-gb", "0");
    let server = start(&a);
    let metric = |text: &str, name: &str| -> u64 {
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let keys: Vec<String> = (0..12).map(|i| format!("fwd-{i}")).collect();
    for http2 in [true, false] {
        let c = client(&server, http2);
        for k in &keys {
            c.put(k, vec![payload(k)]).await.unwrap();
        }
        for k in &keys {
            let (body, tier) = c.get(k).await.unwrap().unwrap();
            assert_eq!(tier.as_deref(), Some("nvme"));
            assert!(body.to_bytes() == payload(k), "{k}");
        }
    }
    let c = client(&server, true);
    let m = c.send(http::Method::GET, "/metrics", kvtier_loadgen::client::ChunkedBody::default(), None).await.unwrap();
    let text = String::from_utf8(m.body.to_bytes().to_vec()).unwrap();
    let forwarded: u64 = text
        .lines()
        .filter(|l| l.starts_with("kvtier_shard_forwarded_requests_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(forwarded > 0, "no request was forwarded: {text}");
    // A chunk is sent home once the accepting shard has sent it.
    assert!(metric(&text, "kvtier_dma_chunks_sent_home_total") > 0, "{text}");
    assert_eq!(metric(&text, "kvtier_dma_chunks_leaked_total"), 0);
    assert!(server.stop().success());
}

/// `args` with `--io-memory-mib` set to `mib`, no RAM tier, and no stall
/// detector: a stall report loads the binary's debug information to name
/// its frames (tens of MiB of a debug build), which would count in one
/// server's resident memory and not the other's.
fn with_io_memory(data: &Path, mib: &str) -> Vec<String> {
    let mut a = args(data);
    set_flag(&mut a, "--ram-gb", "0");
    set_flag(&mut a, "--io-memory-mib", mib);
    set_flag(&mut a, "--stall-threshold-ms", "0");
    a
}

/// `--io-memory-mib` is allocated at start, then faulted in and registered
/// once the shards serve (io_uring pins the registered buffers; each shard
/// says when in `/v1/stats`): two otherwise equal servers, 128 and 512 MiB
/// across their 2 shards, differ in resident memory by about 384 MiB. And
/// each shard gets at least 64 MiB: on 4 shards, 128 and 256 MiB both give
/// 64 MiB per shard, so the same resident memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_memory_is_registered_once_serving_and_split_across_shards() {
    let dir = tempfile::tempdir().unwrap();
    let small = start(&with_io_memory(&dir.path().join("small"), "128"));
    let large = start(&with_io_memory(&dir.path().join("large"), "512"));
    let on_four_shards = |name: &str, mib: &str| {
        let mut a = with_io_memory(&dir.path().join(name), mib);
        set_flag(&mut a, "--shards", "4");
        start(&a)
    };
    let (four_128, four_256) = (on_four_shards("four-128", "128"), on_four_shards("four-256", "256"));
    for s in [&small, &large, &four_128, &four_256] {
        common::wait_for_io_memory_registration(s).await;
    }
    let (small_rss, large_rss) = (small.rss_bytes(), large.rss_bytes());
    let grown = large_rss.saturating_sub(small_rss) >> 20;
    assert!((352..=416).contains(&grown), "512 against 128 MiB of I/O memory: RSS {} against {} MiB", large_rss >> 20, small_rss >> 20);
    let (rss_128, rss_256) = (four_128.rss_bytes() >> 20, four_256.rss_bytes() >> 20);
    assert!(rss_128.abs_diff(rss_256) < 32, "4 shards, 64 MiB each either way: RSS {rss_128} and {rss_256} MiB");
    assert!(rss_128 > (small_rss >> 20) + 96, "4 shards of 64 MiB against 2: RSS {rss_128} against {} MiB", small_rss >> 20);
    // Blocks are read and written as before.
    let c = client(&large, true);
    c.put("io-memory", vec![payload("io-memory")]).await.unwrap();
    assert!(c.get("io-memory").await.unwrap().unwrap().0.to_bytes() == payload("io-memory"));
    for s in [small, large, four_128, four_256] {
        assert!(s.stop().success());
    }
}

/// Too little (below one shard's 64 MiB) or more than half of the
/// machine's memory is refused before anything starts, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_io_memory_values_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for (mib, why) in [("63", "--io-memory-mib must be at least 64, got 63"), ("1099511627776", "more than half of this machine's memory")]
    {
        match common::try_start(&with_io_memory(&data, mib)) {
            Ok(s) => {
                let log = s.log();
                s.stop();
                panic!("started with --io-memory-mib {mib}:\n{log}");
            }
            Err((status, log)) => {
                assert!(log.contains(why), "--io-memory-mib {mib} ({status:?}):\n{log}");
                assert!(!data.join("store.json").exists(), "a refused start created the store");
            }
        }
    }
}
