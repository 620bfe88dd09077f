//! Block tags (issue 42; docs/API.md "Block tags", docs/LOCAL.md): a PUT
//! over either front door may carry the inference engine's block hashes,
//! their parent, the tokens per engine block and the token ids. A good tag
//! is stored with the block; a bad one is refused with `invalid_tag` (HTTP
//! 400, naming the header) or `INVALID_TAG` (the socket's item code) and
//! stores nothing: neither a new key nor over an old block. A version-1
//! socket client, which sends no tags, is served as before.

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::local::{items_payload, memfd, read_at, write_at, Raw, EXISTS, GET_INTO, HELLO, PUT_FROM, PUT_FROM_V};
use common::{payload, start, test_args, Server, BLOCK_BYTES};
use kvtier_local_proto::{encode_tagged_items, encode_tagged_items_v, Code};

/// The tag pinned in tests/data/local_frame_vectors.json and beside the
/// Python client's encoder (clients/python/tests/test_block_tag.py): two
/// 8-byte hashes, a parent, 2 tokens per block, token ids 1, 2, 300, 70000.
const TAG_HEX: &str = "010802000102030405060708090a0b0c0d0e0f08f0f1f2f3f4f5f6f702000000040001000000020000002c01000070110100";

/// The headers that make [`TAG_HEX`] (`server/src/http/tag.rs` checks the
/// bytes they encode to; here the server takes them end to end).
const TAG_HEADERS: [&str; 4] = [
    "x-kvtier-block-hashes: 0001020304050607,08090a0b0c0d0e0f",
    "x-kvtier-parent-hash: f0f1f2f3f4f5f6f7",
    "x-kvtier-block-size: 2",
    "x-kvtier-token-ids: 1,2,300,70000",
];

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// `curl` of `method url` with `headers` and the body in `file` (if any),
/// over HTTP/2 (prior knowledge) or HTTP/1.1: (status, body).
fn curl(method: &str, url: &str, headers: &[&str], file: Option<&Path>, http1: bool) -> (u16, String) {
    let out_file = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-o", out_file.path().to_str().unwrap(), "-w", "%{http_code}"]);
    // curl's -I is a HEAD that expects no body (-X HEAD would wait for one).
    cmd.args(if method == "HEAD" { vec!["-I"] } else { vec!["-X", method] });
    cmd.arg(if http1 { "--http1.1" } else { "--http2-prior-knowledge" });
    for h in headers {
        cmd.args(["-H", h]);
    }
    if let Some(f) = file {
        cmd.args(["--data-binary", &format!("@{}", f.display())]);
    }
    cmd.arg(url);
    let out = cmd.output().expect("curl is installed (make deps)");
    let status = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
    (status, std::fs::read_to_string(out_file.path()).unwrap_or_default())
}

fn block_file(dir: &Path, key: &str) -> PathBuf {
    let path = dir.join(format!("{key}.bin"));
    std::fs::write(&path, payload(key)).unwrap();
    path
}

#[test]
fn http_put_stores_a_tag_from_headers_and_refuses_a_bad_one_storing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(&dir.path().join("data")));
    let at = |key: &str| format!("{}/v1/blocks/{key}", server.url);
    let body = block_file(dir.path(), "tagged");
    let old = block_file(dir.path(), "old");

    for http1 in [false, true] {
        let key = if http1 { "tagged-h1" } else { "tagged-h2" };
        // A whole tag, upper-case hex too, and the smallest one (no parent,
        // no token ids).
        assert_eq!(curl("PUT", &at(key), &TAG_HEADERS, Some(&body), http1).0, 201, "{key}");
        let upper = ["x-kvtier-block-hashes: 0001020304050607,08090A0B0C0D0E0F", "x-kvtier-block-size: 16"];
        assert_eq!(curl("PUT", &at(key), &upper, Some(&body), http1).0, 200, "{key}");
        let (status, _) = curl("GET", &at(key), &[], None, http1);
        assert_eq!(status, 200);
        // A PUT without tag headers is the untagged PUT of before.
        assert_eq!(curl("PUT", &at(&format!("{key}-plain")), &[], Some(&body), http1).0, 201);
    }
    let got = Command::new("curl").args(["-s", "--http2-prior-knowledge", &at("tagged-h2")]).output().unwrap().stdout;
    assert_eq!(got, std::fs::read(&body).unwrap(), "the tagged block reads back as stored");

    // Each bad tag: 400 invalid_tag, the message naming the header and what
    // is wrong, and nothing stored, neither a new key nor over an old block.
    assert_eq!(curl("PUT", &at("kept"), &[], Some(&old), false).0, 201);
    let sixty_five = format!("x-kvtier-block-hashes: {}", vec!["ab"; 65].join(","));
    let long_tokens = format!("x-kvtier-token-ids: {}", vec!["7"; 640].join(","));
    let wide = format!("x-kvtier-block-hashes: {}", vec!["ab".repeat(32); 64].join(","));
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["x-kvtier-block-hashes: 00zz", "x-kvtier-block-size: 2"], "x-kvtier-block-hashes: hash 0: \\\"00zz\\\" is not hex"),
        (vec!["x-kvtier-block-hashes: 0011,223344", "x-kvtier-block-size: 2"], "hash 1 is 3 bytes, hash 0 is 2"),
        (vec!["x-kvtier-block-hashes: 0011"], "x-kvtier-block-hashes without x-kvtier-block-size"),
        (vec!["x-kvtier-block-hashes: 0011", "x-kvtier-block-size: 0"], "x-kvtier-block-size"),
        (
            vec!["x-kvtier-block-hashes: 0011", "x-kvtier-block-size: 2", "x-kvtier-token-ids: 1,2,3"],
            "holds 3 ids for 1 block(s) of 2 tokens",
        ),
        (vec!["x-kvtier-parent-hash: 0011"], "x-kvtier-parent-hash without x-kvtier-block-hashes"),
        (vec!["x-kvtier-block-hashes: 0011", "x-kvtier-block-size: 2", "x-kvtier-parent-hash: 00"], "x-kvtier-parent-hash is 1 bytes"),
        (vec![&sixty_five, "x-kvtier-block-size: 1"], "more than 64 hashes"),
        (vec![&wide, "x-kvtier-block-size: 10", &long_tokens], "over 3072"),
    ];
    for (headers, want) in &cases {
        for (key, file) in [("never", &old), ("kept", &body)] {
            for http1 in [false, true] {
                let (status, reply) = curl("PUT", &at(key), headers, Some(file), http1);
                assert_eq!(status, 400, "{headers:?} over {}: {reply}", if http1 { "HTTP/1.1" } else { "h2" });
                assert!(reply.contains("\"invalid_tag\"") && reply.contains(want), "{headers:?}: {reply} does not say {want}");
            }
        }
    }
    assert_eq!(curl("HEAD", &at("never"), &[], None, false).0, 404, "a refused tag stored nothing");
    let kept = Command::new("curl").args(["-s", "--http2-prior-knowledge", &at("kept")]).output().unwrap().stdout;
    assert_eq!(kept, std::fs::read(&old).unwrap(), "a refused PUT left the old block");
    assert!(server.stop().success());
}

fn socket_of(server: &Server) -> PathBuf {
    server.data_dir.join("kvtier.sock")
}

/// Connected, hello with `versions`, a sealed memfd of two blocks
/// registered: the connection, the version the server chose, the memfd and
/// its handle.
fn connect(server: &Server, versions: &str) -> (Raw, u64, std::os::fd::OwnedFd, u64) {
    let mut r = Raw::connect(&socket_of(server));
    let a = r.call(HELLO, format!(r#"{{"versions":{versions}}}"#).as_bytes());
    assert_eq!(a.status, 0, "{}", a.message());
    let hello: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    let fd = memfd(2 * BLOCK_BYTES, true);
    let a = r.register(&[fd.as_raw_fd()], 0, 2 * BLOCK_BYTES);
    assert_eq!(a.status, 0, "{}", a.message());
    (r, hello["version"].as_u64().unwrap(), fd, u64::from_le_bytes(a.body[..8].try_into().unwrap()))
}

fn stored(r: &mut Raw, key: &str) -> bool {
    let a = r.call(EXISTS, &kvtier_local_proto::encode_keys(&[key]));
    assert_eq!(a.status, 0, "{}", a.message());
    a.body[4] != 0
}

#[test]
fn socket_put_items_carry_tags_from_version_2_and_a_bad_tag_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&test_args(dir.path()));
    let tag = unhex(TAG_HEX);
    let (mut r, version, fd, h) = connect(&server, "[1,2]");
    assert_eq!(version, 2, "the server picks the highest version both speak");
    let block = payload("tagged");
    write_at(&fd, 0, &block);

    // A tagged item and an untagged one (tag_bytes 0) in one batch.
    let items = [(h, 0, BLOCK_BYTES, "tagged-0", &tag[..]), (h, 0, BLOCK_BYTES, "untagged-0", &[][..])];
    let got = r.call(PUT_FROM, &encode_tagged_items(&items)).items();
    assert_eq!(got, vec![(0, 1), (0, 1)]);
    let parts: &[(u64, u64, u64)] = &[(h, 0, BLOCK_BYTES / 2), (h, BLOCK_BYTES / 2, BLOCK_BYTES / 2)];
    assert_eq!(r.call(PUT_FROM_V, &encode_tagged_items_v(&[(parts, "tagged-v", &tag)])).items(), vec![(0, 1)]);
    let (result, _) = r.call(GET_INTO, &items_payload(&[(h, BLOCK_BYTES, BLOCK_BYTES, "tagged-0")])).items()[0];
    assert_eq!(result, BLOCK_BYTES as i64);
    assert_eq!(read_at(&fd, BLOCK_BYTES, BLOCK_BYTES), block.to_vec());

    // Bad tags: a cut one, an unknown version, trailing bytes, a token
    // count that is not hashes x block size. Each item fails INVALID_TAG
    // and stores nothing; its neighbour in the batch is stored.
    let mut cut = tag.clone();
    cut.pop();
    let mut version_2 = tag.clone();
    version_2[0] = 2;
    let mut trailing = tag.clone();
    trailing.push(0);
    let mut tokens = tag.clone();
    tokens[32] = 3; // token_count (bytes 32-33) 3 for 2 blocks of 2, and 3 ids
    tokens.truncate(tag.len() - 4);
    write_at(&fd, 0, &payload("old"));
    assert_eq!(r.call(PUT_FROM, &encode_tagged_items(&[(h, 0, BLOCK_BYTES, "kept", &[])])).items(), vec![(0, 1)]);
    write_at(&fd, 0, &block);
    for (name, bad) in [("cut", &cut), ("version 2", &version_2), ("trailing", &trailing), ("token count", &tokens)] {
        let items = [(h, 0, BLOCK_BYTES, "never", &bad[..]), (h, 0, BLOCK_BYTES, "kept", &bad[..]), (h, 0, BLOCK_BYTES, "fine", &tag[..])];
        let got = r.call(PUT_FROM, &encode_tagged_items(&items)).items();
        let refused = (Code::InvalidTag as i64, 0);
        assert_eq!((got[0], got[1]), (refused, refused), "{name}");
        assert_eq!(got[2].0, 0, "{name}: the good item of the batch is stored");
        assert_eq!(r.call(PUT_FROM_V, &encode_tagged_items_v(&[(parts, "never", bad)])).items(), vec![refused], "{name}");
        assert!(!stored(&mut r, "never"), "{name}: a refused tag stored nothing");
    }
    let (result, _) = r.call(GET_INTO, &items_payload(&[(h, BLOCK_BYTES, BLOCK_BYTES, "kept")])).items()[0];
    assert_eq!(result, BLOCK_BYTES as i64);
    assert_eq!(read_at(&fd, BLOCK_BYTES, BLOCK_BYTES), payload("old").to_vec(), "a refused PUT left the old block");

    // A version-2 PUT payload without its tag lengths does not parse: the
    // whole request is BAD_REQUEST (a client must speak the version it chose).
    let a = r.call(PUT_FROM, &items_payload(&[(h, 0, BLOCK_BYTES, "v1-framed")]));
    assert_eq!(a.status, Code::BadRequest as i32, "{}", a.message());

    // A version-1 client (the loadgen, older Python clients) sends no tags
    // and is served as before.
    let (mut old_client, version, fd1, h1) = connect(&server, "[1]");
    assert_eq!(version, 1);
    write_at(&fd1, 0, &block);
    assert_eq!(old_client.call(PUT_FROM, &items_payload(&[(h1, 0, BLOCK_BYTES, "from-v1")])).items(), vec![(0, 1)]);
    assert!(stored(&mut r, "from-v1"));
    assert!(server.stop().success());
}
