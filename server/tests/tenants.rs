//! Tenants (`--tenants`, docs/OPERATIONS.md "Tenants") on a real server:
//! isolation of keys on every HTTP route and local-socket op, shared
//! namespaces, reservations and limits in the RAM tier and the log, the
//! admin route, SIGHUP reloads, bad files, restarts, and the policy oracle
//! run as a tenant.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use kvtier_engine::key::BlockHash;
use kvtier_loadgen::client::{ChunkedBody, Client};
use serde_json::Value;

use common::local::{items_payload, keys_payload, memfd, Raw, EXISTS, GET_INTO, HELLO, PUT_FROM};
use common::{json_call as call, set_flag, start, test_args, try_start, Server, BLOCK_BYTES};

const LOOKUP: u8 = 7;
const DELETE: u8 = 8;

/// `n` blocks of the test size, in GiB (the tenants file's unit).
fn gib(blocks: u64) -> String {
    format!("{}", (blocks * BLOCK_BYTES) as f64 / (1u64 << 30) as f64)
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

fn as_tenant(server: &Server, token: &str) -> Client {
    common::client(server, false).with_token(token).unwrap()
}

/// The tenant's entry in `/v1/stats`.
async fn usage(c: &Client, name: &str) -> Value {
    let stats = c.stats().await.unwrap();
    stats["tenants"].as_array().unwrap().iter().find(|t| t["name"] == name).cloned().unwrap_or_else(|| panic!("no {name} in {stats}"))
}

/// A payload of its own for `tenant`'s `key` (two tenants' same key hold
/// different bytes).
fn payload_of(tenant: &str, key: &str) -> Bytes {
    common::payload(&format!("{tenant}:{key}"))
}

async fn put(c: &Client, tenant: &str, key: &str) {
    let a = c.send(Method::PUT, &format!("/v1/blocks/{key}"), ChunkedBody::new(vec![payload_of(tenant, key)]), None).await.unwrap();
    assert!(a.status.is_success(), "{tenant} PUT {key}: {}", a.status);
}

/// GET `key`: the status, the body's owner (whose payload it is), tier.
async fn get(c: &Client, key: &str) -> (StatusCode, Bytes, Option<String>) {
    let a = c.send(Method::GET, &format!("/v1/blocks/{key}"), ChunkedBody::default(), None).await.unwrap();
    (a.status, a.body.to_bytes(), a.tier)
}

/// Keys `prefix0, prefix1, ...` whose stored key (`scope/key`) is owned by
/// `shard` of 2, `n` of them.
fn keys_on_shard(scope: &str, prefix: &str, shard: usize, n: usize) -> Vec<String> {
    (0..).map(|i| format!("{prefix}{i}")).filter(|k| BlockHash::of(format!("{scope}/{k}").as_bytes()).shard(2) == shard).take(n).collect()
}

const ISOLATION: &str = r#"
[[tenant]]
name = "a"
token = "tok-a"
admin = true

[[tenant]]
name = "b"
token = "tok-b"

[[tenant]]
name = "c"
token = "tok-c"
uids = [UID]

[[namespace]]
name = "sys"
key_prefix = "sys-"
readers = ["a", "b"]
writers = ["a"]
"#;

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_and_local_op_keeps_tenants_apart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.toml");
    write(&file, &ISOLATION.replace("UID", &uid().to_string()));
    let mut args = test_args(&dir.path().join("data"));
    set_flag(&mut args, "--tenants", file.to_str().unwrap());
    let server = start(&args);
    assert!(server.listening_line().contains("kvtier listening"));
    let (a, b, c) = (as_tenant(&server, "tok-a"), as_tenant(&server, "tok-b"), as_tenant(&server, "tok-c"));

    // The same client key is two blocks for two tenants.
    put(&a, "a", "k1").await;
    put(&b, "b", "k1").await;
    assert_eq!(get(&a, "k1").await.1, payload_of("a", "k1"));
    assert_eq!(get(&b, "k1").await.1, payload_of("b", "k1"));

    // Another tenant's key is a miss on every route, like an absent key.
    put(&a, "a", "only-a").await;
    let absent = call(&b, Method::GET, "/v1/blocks/never-stored", None).await;
    let theirs = call(&b, Method::GET, "/v1/blocks/only-a", None).await;
    assert_eq!(absent.0, StatusCode::NOT_FOUND);
    assert_eq!(theirs, absent, "another tenant's key answers exactly as an absent one");
    for (method, want) in [(Method::HEAD, StatusCode::NOT_FOUND), (Method::DELETE, StatusCode::NOT_FOUND)] {
        let a2 = b.send(method.clone(), "/v1/blocks/only-a", ChunkedBody::default(), None).await.unwrap();
        let absent2 = b.send(method.clone(), "/v1/blocks/never-stored", ChunkedBody::default(), None).await.unwrap();
        assert_eq!((a2.status, a2.body.to_bytes()), (want, absent2.body.to_bytes()), "{method}");
    }
    let (s, v) = call(&b, Method::POST, "/v1/lookup", Some(serde_json::json!({"keys": ["only-a", "k1"]}))).await;
    assert_eq!((s, v["prefix_hits"].as_u64()), (StatusCode::OK, Some(0)), "{v}");
    let (s, v) = call(&b, Method::POST, "/v1/prefetch", Some(serde_json::json!({"keys": ["only-a"]}))).await;
    assert_eq!((s, v["found"].as_u64()), (StatusCode::ACCEPTED, Some(0)), "{v}");
    assert_eq!(get(&a, "only-a").await.0, StatusCode::OK, "b's DELETE did not reach a's key");
    let (_, v) = call(&a, Method::POST, "/v1/lookup", Some(serde_json::json!({"keys": ["only-a", "k1"]}))).await;
    assert_eq!(v["prefix_hits"], 2);

    // A shared namespace: read by its readers, written by its writers,
    // and for anyone else a key of their own.
    put(&a, "a", "sys-prompt").await;
    assert_eq!(get(&b, "sys-prompt").await.1, payload_of("a", "sys-prompt"));
    let a2 = b.send(Method::PUT, "/v1/blocks/sys-prompt", ChunkedBody::new(vec![payload_of("b", "sys-prompt")]), None).await.unwrap();
    assert_eq!(a2.status, StatusCode::FORBIDDEN);
    assert!(String::from_utf8_lossy(&a2.body.to_bytes()).contains("namespace_read_only"));
    assert_eq!(b.send(Method::DELETE, "/v1/blocks/sys-prompt", ChunkedBody::default(), None).await.unwrap().status, StatusCode::FORBIDDEN);
    assert_eq!(get(&c, "sys-prompt").await.0, StatusCode::NOT_FOUND, "c is not named in the namespace");
    put(&c, "c", "sys-prompt").await;
    assert_eq!(get(&c, "sys-prompt").await.1, payload_of("c", "sys-prompt"), "c's own key");
    assert_eq!(get(&b, "sys-prompt").await.1, payload_of("a", "sys-prompt"), "the namespace's block is untouched");

    // Who may call at all, and the admin routes.
    for client in [common::client(&server, false), as_tenant(&server, "tok-zz")] {
        assert_eq!(get(&client, "k1").await.0, StatusCode::UNAUTHORIZED);
        let put = client.send(Method::PUT, "/v1/blocks/k1", ChunkedBody::new(vec![payload_of("x", "k1")]), None).await.unwrap();
        assert_eq!(put.status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(call(&b, Method::GET, "/v1/admin/tenants", None).await.0, StatusCode::FORBIDDEN);
    assert_eq!(call(&b, Method::POST, "/v1/admin/trace/start", None).await.0, StatusCode::FORBIDDEN);
    let (s, v) = call(&a, Method::GET, "/v1/admin/tenants", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["owners"].as_array().unwrap().len(), 4, "three tenants and a namespace: {v}");
    assert_eq!(v["unauthorized_requests"], 4, "{v}");
    assert_eq!(usage(&a, "a").await["hits"], 2, "a's own GETs of k1 and only-a");
    assert_eq!(b.stats().await.unwrap()["tenant"], "b");

    // The local socket: a tenant by its HELLO token, or by its peer uid.
    let sock = server.data_dir.join("kvtier.sock");
    let mut raw = Raw::connect(&sock);
    let hello = raw.call(HELLO, br#"{"versions":[1],"token":"tok-b"}"#);
    assert_eq!(hello.status, 0, "{}", hello.message());
    assert_eq!(serde_json::from_slice::<Value>(&hello.body).unwrap()["tenant"], "b");
    let fd = memfd(2 * BLOCK_BYTES, true);
    let reg = raw.register(&[std::os::fd::AsRawFd::as_raw_fd(&fd)], 0, 2 * BLOCK_BYTES);
    assert_eq!(reg.status, 0, "{}", reg.message());
    let handle = u64::from_le_bytes(reg.body[..8].try_into().unwrap());
    let item = |key: &str| items_payload(&[(handle, 0, BLOCK_BYTES, key)]);
    let code = kvtier_local_proto::Code::NotFound as i64;
    assert_eq!(raw.call(GET_INTO, &item("only-a")).items()[0].0, code, "GET_INTO of a's key");
    assert_eq!(raw.call(GET_INTO, &item("never-stored")).items()[0].0, code);
    assert_eq!(raw.call(EXISTS, &keys_payload(&["only-a", "k1"])).body[4..], [0u8, 3u8][..], "a's only-a absent, b's k1 in the log");
    assert_eq!(raw.call(LOOKUP, &keys_payload(&["only-a"])).body[..4], 0u32.to_le_bytes());
    let deleted = raw.call(DELETE, &keys_payload(&["only-a"])).body;
    assert_eq!(i64::from_le_bytes(deleted[4..12].try_into().unwrap()), code, "DELETE of a's key");
    assert_eq!(raw.call(GET_INTO, &item("k1")).items()[0].0, BLOCK_BYTES as i64, "b's own k1");
    assert_eq!(raw.call(GET_INTO, &item("sys-prompt")).items()[0].0, BLOCK_BYTES as i64, "the namespace, read");
    let unauthorized = kvtier_local_proto::Code::Unauthorized as i64;
    assert_eq!(raw.call(PUT_FROM, &item("sys-prompt")).items()[0].0, unauthorized, "the namespace, not written");
    assert_eq!(get(&a, "only-a").await.0, StatusCode::OK, "b's local DELETE did not reach a's key");
    let mut stranger = Raw::connect(&sock);
    let refused = stranger.call(HELLO, br#"{"versions":[1],"token":"tok-zz"}"#);
    assert_eq!(refused.status as i64, unauthorized, "{}", refused.message());
    let mut by_uid = Raw::connect(&sock);
    let hello = by_uid.call(HELLO, br#"{"versions":[1]}"#);
    assert_eq!(hello.status, 0, "{}", hello.message());
    assert_eq!(serde_json::from_slice::<Value>(&hello.body).unwrap()["tenant"], "c", "no token: the peer's uid names c");
    assert_eq!(by_uid.call(EXISTS, &keys_payload(&["sys-prompt", "only-a"])).body[4..], [3u8, 0u8][..], "c's own sys-prompt; not a's");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_protect_a_quiet_tenant_and_limits_hold_in_ram_and_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.toml");
    // RAM: 16 blocks, 8 a shard. quiet reserves 6 (3 a shard); open has
    // no quota; capped may hold 4 (2 a shard); noisy has no quota; logcap
    // may keep 6 blocks in the log.
    let text = format!(
        "[[tenant]]\nname = \"quiet\"\ntoken = \"q\"\nadmin = true\nram_reserved_gb = {}\n\
         [[tenant]]\nname = \"open\"\ntoken = \"o\"\n\
         [[tenant]]\nname = \"capped\"\ntoken = \"c\"\nram_limit_gb = {}\n\
         [[tenant]]\nname = \"noisy\"\ntoken = \"n\"\n\
         [[tenant]]\nname = \"logcap\"\ntoken = \"l\"\nnvme_limit_gb = {}\n",
        gib(6),
        gib(4),
        gib(6)
    );
    write(&file, &text);
    let mut args = test_args(&dir.path().join("data"));
    set_flag(&mut args, "--tenants", file.to_str().unwrap());
    set_flag(&mut args, "--ram-gb", &gib(16));
    let server = start(&args);
    let (quiet, open, capped, noisy) = (as_tenant(&server, "q"), as_tenant(&server, "o"), as_tenant(&server, "c"), as_tenant(&server, "n"));
    let mut quiet_keys = keys_on_shard("quiet", "q", 0, 3);
    quiet_keys.extend(keys_on_shard("quiet", "q", 1, 3));
    let mut open_keys = keys_on_shard("open", "o", 0, 2);
    open_keys.extend(keys_on_shard("open", "o", 1, 2));
    for k in &quiet_keys {
        put(&quiet, "quiet", k).await;
    }
    for k in &open_keys {
        put(&open, "open", k).await;
    }
    // capped at its limit evicts only its own, though RAM has room.
    for i in 0..20 {
        put(&capped, "capped", &format!("c{i}")).await;
    }
    let u = usage(&quiet, "capped").await;
    assert_eq!(u["tiers"]["ram"]["blocks"], 4, "{u}");
    assert_eq!(u["tiers"]["ram"]["evicted_own"], 16, "{u}");
    assert_eq!(usage(&quiet, "open").await["tiers"]["ram"]["blocks"], 4);
    // noisy writes four times the RAM tier.
    for i in 0..64 {
        put(&noisy, "noisy", &format!("n{i}")).await;
    }
    for k in &quiet_keys {
        assert_eq!(get(&quiet, k).await.2.as_deref(), Some("ram"), "quiet's {k} kept in RAM by its reservation");
    }
    for k in &open_keys {
        assert_eq!(get(&open, k).await.2.as_deref(), Some("nvme"), "open's {k} was moved down for noisy");
    }
    let (q, o) = (usage(&quiet, "quiet").await, usage(&quiet, "open").await);
    assert_eq!(
        (q["tiers"]["ram"]["evicted_by_other"].as_u64(), q["tiers"]["ram"]["reserved_bytes"].as_u64()),
        (Some(0), Some(6 * BLOCK_BYTES))
    );
    assert!(o["tiers"]["ram"]["evicted_by_other"].as_u64().unwrap() >= 4, "{o}");
    assert!(usage(&quiet, "noisy").await["tiers"]["ram"]["evicted_own"].as_u64().unwrap() > 0);

    // The log's limit: logcap keeps its newest 6 blocks.
    let logcap = as_tenant(&server, "l");
    for i in 0..30 {
        put(&logcap, "logcap", &format!("l{i}")).await;
    }
    let u = usage(&quiet, "logcap").await;
    assert_eq!(u["tiers"]["nvme"]["blocks"], 6, "{u}");
    assert_eq!(u["tiers"]["nvme"]["evicted_own"], 24, "{u}");

    // The admin route: shrinking quiet's limit moves its oldest down.
    let change = serde_json::json!({"ram_reserved_gb": 0, "ram_limit_gb": gib(2).parse::<f64>().unwrap()});
    let (s, v) = call(&quiet, Method::PUT, "/v1/admin/tenants/quiet", Some(change)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while usage(&quiet, "quiet").await["tiers"]["ram"]["blocks"] != 2 {
        assert!(Instant::now() < deadline, "{}", usage(&quiet, "quiet").await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (body, want, code) in [
        (serde_json::json!({"ram_reserved_gb": 1, "ram_limit_gb": null}), StatusCode::CONFLICT, "over_capacity"),
        (serde_json::json!({"ram_reserved_gb": -1}), StatusCode::BAD_REQUEST, "bad_quota"),
        (serde_json::json!({"ram_gb": 1}), StatusCode::BAD_REQUEST, "bad_json"),
    ] {
        let (s, v) = call(&quiet, Method::PUT, "/v1/admin/tenants/quiet", Some(body)).await;
        assert_eq!((s, v["error"]["code"].as_str()), (want, Some(code)), "{v}");
    }
    let (s, v) = call(&quiet, Method::PUT, "/v1/admin/tenants/nobody", Some(serde_json::json!({}))).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_tenant")));
    let metrics =
        String::from_utf8(quiet.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap().body.to_bytes().to_vec())
            .unwrap();
    assert!(metrics.contains("kvtier_tenant_blocks{tenant=\"quiet\",tier=\"ram\"} 2"), "{metrics}");
    assert!(metrics.contains("kvtier_tenant_evictions_total{tenant=\"open\",tier=\"ram\",cause=\"other\"}"));
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tenants_files_are_refused_at_start_and_a_reload_keeps_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.toml");
    let mut args = test_args(&dir.path().join("data"));
    set_flag(&mut args, "--tenants", file.to_str().unwrap());
    set_flag(&mut args, "--ram-gb", &gib(16));
    for (text, says) in [
        ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\n[[tenant]]\nname = \"a\"\ntoken = \"y\"\n", "the name \"a\" is given twice"),
        (&format!("[[tenant]]\nname = \"a\"\ntoken = \"x\"\nram_reserved_gb = {}\n", gib(17)), "ram reservations add up to"),
        ("[[tenant]\nname = \"a\"\n", "TOML parse error"),
        ("[[tenant]]\nname = \"a\"\n", "needs a token"),
    ] {
        write(&file, text);
        let (status, stderr) = try_start(&args).err().unwrap_or_else(|| panic!("started with {text:?}"));
        assert!(status.is_some_and(|s| !s.success()), "{status:?}");
        assert!(stderr.contains(says), "{text:?}: {stderr}");
    }
    std::fs::remove_file(&file).unwrap();
    let (_, stderr) = try_start(&args).err().unwrap();
    assert!(stderr.contains("cannot read tenants file"), "{stderr}");
    let mut both = args.clone();
    std::fs::write(dir.path().join("token"), "t").unwrap();
    set_flag(&mut both, "--auth-token-file", dir.path().join("token").to_str().unwrap());
    let (_, stderr) = try_start(&both).err().unwrap();
    assert!(stderr.contains("cannot be used with"), "{stderr}");

    write(&file, "[[tenant]]\nname = \"a\"\ntoken = \"tok-a\"\nadmin = true\n");
    let server = start(&args);
    let a = as_tenant(&server, "tok-a");
    put(&a, "a", "k").await;
    let hup = || assert_eq!(unsafe { libc::kill(server.pid() as i32, libc::SIGHUP) }, 0);
    let reload_state = || async { call(&a, Method::GET, "/v1/admin/tenants", None).await.1["reload"].clone() };
    // A broken file on SIGHUP: refused, said why, the old one serves.
    write(&file, "[[tenant]]\nname = \"a\"\ntoken = \"tok-a\"\n[[tenant]]\nname = \"a\"\ntoken = \"tok-b\"\n");
    hup();
    let deadline = Instant::now() + Duration::from_secs(10);
    while reload_state().await["reload_failures"] != 1 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reload_state().await["last_error"].as_str().unwrap().contains("given twice"));
    assert!(server.log().contains("the tenants in use are kept"), "{}", server.log());
    assert_eq!(get(&a, "k").await.0, StatusCode::OK);
    let (s, v) = call(&a, Method::POST, "/v1/admin/tenants/reload", None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("tenants_file_invalid")), "{v}");
    // A good one: a new tenant, and a's blocks still a's.
    write(&file, "[[tenant]]\nname = \"a\"\ntoken = \"tok-a\"\nadmin = true\n[[tenant]]\nname = \"d\"\ntoken = \"tok-d\"\n");
    hup();
    let deadline = Instant::now() + Duration::from_secs(10);
    while reload_state().await["reloads"] != 1 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = as_tenant(&server, "tok-d");
    assert_eq!(get(&d, "k").await.0, StatusCode::NOT_FOUND);
    put(&d, "d", "k").await;
    assert_eq!(get(&a, "k").await.1, payload_of("a", "k"));
    let metrics =
        String::from_utf8(a.send(Method::GET, "/metrics", ChunkedBody::default(), None).await.unwrap().body.to_bytes().to_vec()).unwrap();
    assert!(metrics.contains("kvtier_tenants_reload_failures_total 2"), "{metrics}");
    server.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_keep_every_tenants_blocks_and_accounting() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.toml");
    write(
        &file,
        &format!("[[tenant]]\nname = \"a\"\ntoken = \"tok-a\"\n[[tenant]]\nname = \"b\"\ntoken = \"tok-b\"\nnvme_limit_gb = {}\n", gib(5)),
    );
    let mut args = test_args(&dir.path().join("data"));
    set_flag(&mut args, "--tenants", file.to_str().unwrap());
    let server = start(&args);
    let (a, b) = (as_tenant(&server, "tok-a"), as_tenant(&server, "tok-b"));
    for i in 0..10 {
        put(&a, "a", &format!("k{i}")).await;
        put(&b, "b", &format!("k{i}")).await;
    }
    let before: Vec<Value> = vec![usage(&a, "a").await["tiers"]["nvme"].clone(), usage(&a, "b").await["tiers"]["nvme"].clone()];
    assert_eq!((before[0]["blocks"].as_u64(), before[1]["blocks"].as_u64()), (Some(10), Some(5)), "{before:?}");
    let check = |server: &Server| {
        let (a, b) = (as_tenant(server, "tok-a"), as_tenant(server, "tok-b"));
        // b's limit of 5 blocks is 3 on shard 0 and 2 on shard 1: each
        // shard keeps b's newest blocks up to its share.
        let kept: Vec<bool> = {
            let shard_of = |i: usize| BlockHash::of(format!("b/k{i}").as_bytes()).shard(2);
            (0..10).map(|i| (i + 1..10).filter(|j| shard_of(*j) == shard_of(i)).count() < [3, 2][shard_of(i)]).collect()
        };
        async move {
            for (i, kept) in kept.into_iter().enumerate() {
                let k = format!("k{i}");
                assert_eq!(get(&a, &k).await.1, payload_of("a", &k));
                let (status, body, _) = get(&b, &k).await;
                if kept {
                    assert_eq!(body, payload_of("b", &k), "b's {k} is among its newest on its shard");
                } else {
                    assert_eq!(status, StatusCode::NOT_FOUND, "b's {k} was over its log limit on its shard");
                }
            }
            assert_eq!(usage(&a, "a").await["tiers"]["nvme"]["blocks"], 10);
            assert_eq!(usage(&a, "b").await["tiers"]["nvme"]["blocks"], 5);
        }
    };
    check(&server).await;
    server.crash();
    let server = start(&args);
    check(&server).await;
    server.stop();
    let server = start(&args);
    check(&server).await;
    server.stop();
}

/// The policy oracle run as a tenant whose reservation is its limit, with
/// another tenant's blocks in RAM: every GET's tier as predicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oracle_predicts_a_partitioned_tenant_beside_another() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.toml");
    write(
        &file,
        &format!(
            "[[tenant]]\nname = \"part\"\ntoken = \"tok-p\"\nram_reserved_gb = {g}\nram_limit_gb = {g}\n[[tenant]]\nname = \"other\"\ntoken = \"tok-o\"\n",
            g = gib(8)
        ),
    );
    let mut args = test_args(&dir.path().join("data"));
    set_flag(&mut args, "--tenants", file.to_str().unwrap());
    set_flag(&mut args, "--ram-gb", &gib(24));
    let server = start(&args);
    let other = as_tenant(&server, "tok-o");
    for i in 0..40 {
        put(&other, "other", &format!("o{i}")).await;
    }
    let (config, r) = common::replay_matching_the_oracle_as(&server.url, "partitioned tenant", Some("tok-p")).await;
    assert_eq!((config.tenant.as_deref(), config.ram_limit_blocks), (Some("part"), Some(8)));
    let o = r.oracle.unwrap();
    assert!(o.measured_gets_by_tier.get("nvme").copied().unwrap_or(0) > 0, "the run outgrew its 8 blocks: {o:?}");
    server.stop();
}

/// Rewrites every slot header of a stopped store as format 3 wrote it
/// (version 3, no scope length at byte 7, the chunk CRC-32s at byte 320
/// instead of 356: docs/FORMAT.md), drops the index snapshots so the
/// restart rebuilds each block's owner from its header, and marks
/// `store.json` format 3.
fn downgrade_to_format_3(data: &Path) {
    use kvtier_engine::slot::{SlotHeader, PAGE_BYTES};
    use std::os::unix::fs::FileExt;
    for (key, (path, shard, _, at)) in common::locate(data, BLOCK_BYTES) {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let mut page = vec![0u8; PAGE_BYTES as usize];
        f.read_exact_at(&mut page, at).unwrap();
        let h = SlotHeader::decode(&page).unwrap();
        assert_eq!(u16::from_le_bytes([page[4], page[5]]), 4, "{key} written as format 4");
        assert_eq!(h.scope_bytes as usize, key.find('/').unwrap(), "{key}'s scope length recorded");
        let crcs = page[356..356 + 4 * h.chunk_crcs.len()].to_vec();
        page[320..356 + 4 * h.chunk_crcs.len()].fill(0);
        page[320..320 + crcs.len()].copy_from_slice(&crcs);
        page[4..6].copy_from_slice(&3u16.to_le_bytes());
        page[7] = 0;
        let crc = crc32fast::hash(&page[..4092]);
        page[4092..].copy_from_slice(&crc.to_le_bytes());
        f.write_all_at(&page, at).unwrap();
        let _ = std::fs::remove_file(data.join(format!("shard-{shard:03}")).join("index.snapshot"));
    }
    let manifest = data.join("store.json");
    let format = kvtier_engine::geometry::FORMAT_VERSION;
    let text = std::fs::read_to_string(&manifest).unwrap().replace(&format!("\"format_version\": {format}"), "\"format_version\": 3");
    std::fs::write(&manifest, text).unwrap();
}

/// A key may be the longest (256 bytes) under any tenant, and a store whose
/// tenant keys were written before format 4 recorded their scope opens with
/// every block under its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_key_fits_any_tenant_and_a_format_3_store_keeps_each_blocks_owner() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tenants.toml");
    let long_name = "t".repeat(kvtier_engine::tenant::OWNER_NAME_BYTES_MAX);
    write(&file, &format!("[[tenant]]\nname = \"a\"\ntoken = \"tok-a\"\n[[tenant]]\nname = \"{long_name}\"\ntoken = \"tok-t\"\n"));
    let args_over = |data: &Path| {
        let mut args = test_args(data);
        set_flag(&mut args, "--tenants", file.to_str().unwrap());
        args
    };
    // The longest key under the longest tenant name.
    let data = dir.path().join("longest");
    let args = args_over(&data);
    let server = start(&args);
    let t = as_tenant(&server, "tok-t");
    let longest = "k".repeat(kvtier_engine::key::KEY_BYTES_MAX);
    put(&t, &long_name, &longest).await;
    assert_eq!(get(&t, &longest).await.1, payload_of(&long_name, &longest));
    let too_long = "k".repeat(kvtier_engine::key::KEY_BYTES_MAX + 1);
    let refused = t.send(Method::PUT, &format!("/v1/blocks/{too_long}"), ChunkedBody::new(vec![payload_of("t", "x")]), None).await.unwrap();
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "a 257-byte key");
    // Restarted from its headers alone, the longest key is still t's.
    server.crash();
    for shard in 0..2 {
        let _ = std::fs::remove_file(data.join(format!("shard-{shard:03}")).join("index.snapshot"));
    }
    let server = start(&args);
    let t = as_tenant(&server, "tok-t");
    assert_eq!(get(&t, &longest).await.1, payload_of(&long_name, &longest));
    assert_eq!(usage(&t, &long_name).await["tiers"]["nvme"]["blocks"], 1);
    assert!(server.stop().success());

    // A's blocks written as format 3 wrote them.
    let data = dir.path().join("format-3");
    let args = args_over(&data);
    let server = start(&args);
    let a = as_tenant(&server, "tok-a");
    for i in 0..6 {
        put(&a, "a", &format!("k{i}")).await;
    }
    assert!(server.stop().success());
    downgrade_to_format_3(&data);
    let (clean, report) = common::fsck_json(&data);
    assert!(clean, "fsck reads format 3: {report}");
    let server = start(&args);
    let a = as_tenant(&server, "tok-a");
    for i in 0..6 {
        let k = format!("k{i}");
        assert_eq!(get(&a, &k).await.1, payload_of("a", &k), "a's {k} after the upgrade");
    }
    assert_eq!(usage(&a, "a").await["tiers"]["nvme"]["blocks"], 6, "each format 3 block counted under its owner");
    let manifest = std::fs::read_to_string(data.join("store.json")).unwrap();
    assert!(manifest.contains(&format!("\"format_version\": {}", kvtier_engine::geometry::FORMAT_VERSION)), "{manifest}");
    assert!(server.stop().success());
}
