//! The same-host socket's frames as this crate encodes them, written down in
//! `tests/data/local_frame_vectors.json` for the other implementations to
//! check themselves against (the Python client:
//! `clients/python/tests/test_local_vectors.py`, and the fake server of
//! `test_local_retries.py`). This crate is the source of truth: the server
//! and the load generator frame with it.
//!
//! The file holds the protocol's constants, every op's number and name,
//! every status/item code's number and name, the tier numbers, and for
//! representative requests of every op and replies (successes, failures,
//! `OVERLOADED` hints, connection-error frames) the exact frame in hex
//! beside the fields it encodes. Numbers are JSON integers, exact even past
//! 2^53 (request ids, `epoch`): read them as integers, not doubles. A
//! `HELLO` payload is JSON: compare it parsed, not byte for byte.

use std::fmt::Write as _;

use kvtier_local_proto::{
    decode_items, decode_items_v, decode_keys, decode_op_items, encode_arena, encode_deleted, encode_index, encode_items, encode_items_v,
    encode_keys, encode_leases, encode_lookup, encode_map_arena, encode_prefetched, encode_register, encode_registered, encode_release,
    encode_released, encode_results, encode_tagged_items, encode_tagged_items_v, encode_tiers, encode_unregister, failure, frame,
    next_frame, response, ArenaAnswer, Code, Cursor, Header, IndexAnswer, Item, ItemV, LeaseItem, Next, Op, Span, TaggedItem, TaggedItemV,
    HEADER_BYTES, ITEMS_MAX, LEASE_ITEM_BYTES, MAGIC, OP_CONNECTION_ERROR, PARTS_MAX, PAYLOAD_BYTES_MAX, RESPONSE_BIT, TIER_NAMES,
    VERSIONS, VERSION_LEASES, VERSION_TAGS,
};

/// A block tag in the engine's binary form (docs/FORMAT.md, "Block tags"):
/// two 8-byte hashes `0001..07` and `0809..0f`, parent `f0f1..f7`, 2
/// tokens per block, token ids 1, 2, 300, 70000. The same bytes are pinned
/// in the Python client's `tests/test_block_tag.py` (its encoder) and the
/// server's `tests/block_tags.rs` (the HTTP headers that make them).
const TAG_HEX: &str = "010802000102030405060708090a0b0c0d0e0f08f0f1f2f3f4f5f6f702000000040001000000020000002c01000070110100";

/// The committed vectors, from the repository root.
const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/local_frame_vectors.json");

/// A JSON value, written by [`J::write`] in the file's one layout.
enum J {
    Int(i128),
    Str(String),
    Null,
    Arr(Vec<J>),
    Obj(Vec<(&'static str, J)>),
    /// JSON text as it is (a `HELLO` payload).
    Raw(String),
}

impl J {
    fn s(s: &str) -> J {
        J::Str(s.to_string())
    }

    fn n(n: impl Into<i128>) -> J {
        J::Int(n.into())
    }

    fn has_object(&self) -> bool {
        match self {
            J::Obj(_) => true,
            J::Arr(a) => a.iter().any(J::has_object),
            _ => false,
        }
    }

    /// Characters of the value on one line (an object of scalars only).
    fn inline_len(&self) -> usize {
        match self {
            J::Obj(fields) => fields.iter().map(|(k, v)| k.len() + 6 + v.inline_len()).sum(),
            v => {
                let mut s = String::new();
                v.write(&mut s, 0);
                s.len()
            }
        }
    }

    /// Objects of a few scalars on one line, other objects one field a
    /// line; arrays without objects in them on one line.
    fn write(&self, out: &mut String, indent: usize) {
        let pad = |out: &mut String, n: usize| out.push_str(&" ".repeat(n));
        match self {
            J::Int(n) => write!(out, "{n}").unwrap(),
            J::Null => out.push_str("null"),
            J::Raw(text) => out.push_str(text),
            J::Str(s) => {
                out.push('"');
                for c in s.chars() {
                    match c {
                        '"' => out.push_str("\\\""),
                        '\\' => out.push_str("\\\\"),
                        '\n' => out.push_str("\\n"),
                        c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).unwrap(),
                        c => out.push(c),
                    }
                }
                out.push('"');
            }
            J::Arr(items) if !self.has_object() => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    v.write(out, indent);
                }
                out.push(']');
            }
            J::Arr(items) => {
                out.push_str("[\n");
                for (i, v) in items.iter().enumerate() {
                    pad(out, indent + 2);
                    v.write(out, indent + 2);
                    out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
                }
                pad(out, indent);
                out.push(']');
            }
            J::Obj(fields) if fields.is_empty() => out.push_str("{}"),
            J::Obj(fields) if fields.iter().all(|(_, v)| matches!(v, J::Int(_) | J::Str(_) | J::Null)) && self.inline_len() <= 100 => {
                out.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write!(out, "\"{k}\": ").unwrap();
                    v.write(out, indent);
                }
                out.push('}');
            }
            J::Obj(fields) => {
                out.push_str("{\n");
                for (i, (k, v)) in fields.iter().enumerate() {
                    pad(out, indent + 2);
                    write!(out, "\"{k}\": ").unwrap();
                    v.write(out, indent + 2);
                    out.push_str(if i + 1 < fields.len() { ",\n" } else { "\n" });
                }
                pad(out, indent);
                out.push('}');
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(2 * bytes.len()), |mut s, b| {
        write!(s, "{b:02x}").unwrap();
        s
    })
}

/// The header and payload of a whole frame, by the read loop's own rule
/// ([`next_frame`]).
fn split(f: &[u8]) -> (Header, &[u8]) {
    match next_frame(f) {
        Ok(Next::Frame(header, len)) => {
            assert_eq!(len, f.len(), "one frame, exactly");
            (header, &f[HEADER_BYTES..])
        }
        other => panic!("not a whole frame: {other:?}"),
    }
}

fn items_json(items: &[(u64, u64, u64, &str)]) -> J {
    J::Arr(items.iter().map(|&(h, o, l, k)| J::Arr(vec![J::n(h), J::n(o), J::n(l), J::s(k)])).collect())
}

fn items_v_json(items: &[ItemV<'_>]) -> J {
    J::Arr(
        items
            .iter()
            .map(|&(parts, key)| {
                let parts = parts.iter().map(|&(h, o, l)| J::Arr(vec![J::n(h), J::n(o), J::n(l)])).collect();
                J::Obj(vec![("parts", J::Arr(parts)), ("key", J::s(key))])
            })
            .collect(),
    )
}

fn tagged_items_json(items: &[TaggedItem<'_>]) -> J {
    J::Arr(items.iter().map(|&(h, o, l, k, t)| J::Arr(vec![J::n(h), J::n(o), J::n(l), J::s(k), J::s(&hex(t))])).collect())
}

fn tagged_items_v_json(items: &[TaggedItemV<'_>]) -> J {
    J::Arr(
        items
            .iter()
            .map(|&(parts, key, tag)| {
                let parts = parts.iter().map(|&(h, o, l)| J::Arr(vec![J::n(h), J::n(o), J::n(l)])).collect();
                J::Obj(vec![("parts", J::Arr(parts)), ("key", J::s(key)), ("tag_hex", J::s(&hex(tag)))])
            })
            .collect(),
    )
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn keys_json(keys: &[&str]) -> J {
    J::Arr(keys.iter().map(|k| J::s(k)).collect())
}

/// One request vector: `op`'s frame around `payload`, checked to frame back
/// to itself.
fn request(name: &str, op: u8, request_id: u64, payload: &[u8], fields: Vec<(&'static str, J)>) -> J {
    let f = frame(op, request_id, payload);
    let (header, got) = split(&f);
    assert_eq!(header, Header { op, payload_bytes: payload.len() as u32, request_id });
    assert_eq!(got, payload);
    J::Obj(vec![
        ("name", J::s(name)),
        ("op", J::n(op)),
        ("op_name", Op::from_u8(op).map_or(J::Null, |o| J::s(o.name()))),
        ("request_id", J::n(request_id)),
        ("fields", J::Obj(fields)),
        ("frame_hex", J::s(&hex(&f))),
    ])
}

/// One reply vector: a frame made by [`response`] or [`failure`], its
/// status and hint read back. `fields` are the body's (or the message).
fn reply(name: &str, f: Vec<u8>, request_id: u64, status: i32, retry_after_ms: u32, fields: Vec<(&'static str, J)>) -> J {
    let (header, payload) = split(&f);
    assert_eq!(header.request_id, request_id);
    let mut c = Cursor::new(payload);
    assert_eq!(c.u32("status").unwrap() as i32, status);
    assert_eq!(c.u32("retry_after_ms").unwrap(), retry_after_ms);
    let request_op = header.op & !RESPONSE_BIT;
    let connection_error = header.op == OP_CONNECTION_ERROR;
    assert!(connection_error || header.op & RESPONSE_BIT != 0, "a response has the response bit");
    J::Obj(vec![
        ("name", J::s(name)),
        ("op", J::n(header.op)),
        ("request_op", if connection_error { J::Null } else { J::n(request_op) }),
        (
            "request_op_name",
            match Op::from_u8(request_op) {
                Some(op) if !connection_error => J::s(op.name()),
                _ => J::Null,
            },
        ),
        ("request_id", J::n(request_id)),
        ("status", J::n(status)),
        ("status_name", J::s(Code::name_of(status.into()))),
        ("retry_after_ms", J::n(retry_after_ms)),
        ("fields", J::Obj(fields)),
        ("frame_hex", J::s(&hex(&f))),
    ])
}

/// A whole-request failure made by [`failure`] (retry hint 0).
fn failed(name: &str, op: u8, request_id: u64, code: Code, message: &str) -> J {
    let f = failure(op, request_id, code, message);
    assert_eq!(&f[HEADER_BYTES + 8..], message.as_bytes());
    reply(name, f, request_id, code as i32, 0, vec![("message", J::s(message))])
}

fn results_json(results: &[(i64, u8)]) -> J {
    J::Arr(results.iter().map(|&(r, x)| J::Arr(vec![J::n(r), J::n(x)])).collect())
}

/// A response whose status is 0, around `body`.
fn ok(op: Op, request_id: u64, retry_after_ms: u32, body: &[u8]) -> Vec<u8> {
    response(op as u8 | RESPONSE_BIT, request_id, 0, retry_after_ms, body)
}

fn requests() -> Vec<J> {
    let hello = r#"{"versions":[1,2],"client":"kvtier-python 0.1.0","token":"s3cret","block_bytes":65536,"model":"llama3-8b"}"#;
    let get_items: &[(u64, u64, u64, &str)] =
        &[(1, 0, 65536, "key-a"), (2, 4096, 65536, "ee468baf912ff911-00000000000000000000000000000000")];
    let put_items: &[(u64, u64, u64, &str)] = &[(1, 65536, 65536, "blk.0~x_Y")];
    let two: &[(u64, u64, u64)] = &[(1, 0, 40), (3, 1000, 60)];
    let one: &[(u64, u64, u64)] = &[(2, 8, 100)];
    let three: &[(u64, u64, u64)] = &[(1, 0, 16384), (2, 1 << 20, 16384), (1, 1 << 32, 32768)];
    let get_v: &[ItemV<'_>] = &[(two, "k-two"), (one, "k-one")];
    let put_v: &[ItemV<'_>] = &[(three, "k-three")];
    let tag = unhex(TAG_HEX);
    let put_tagged: &[TaggedItem<'_>] = &[(1, 0, 65536, "tagged-0", &tag), (1, 65536, 65536, "untagged-1", &[])];
    let put_v_tagged: &[TaggedItemV<'_>] = &[(two, "tagged-v", &tag)];
    // 256 bytes, the longest key: its u16 length is 0x0100, so a byte-order
    // slip shows (and the payload passes 255 bytes).
    let long_key = format!("blk-{}", "x".repeat(252));
    let exists: Vec<&str> = vec!["a", "bc", &long_key];
    let chain = ["chain-0", "chain-1", "chain-2"];
    let prefetch = ["k1", "k2", "k3"];

    // Every payload decodes back to what it was made of.
    let as_items = |items: &[(u64, u64, u64, &'static str)]| -> Vec<Item<'static>> {
        items.iter().map(|&(handle, offset, length, key)| Item { parts: vec![Span { handle, offset, length }], key, tag: &[] }).collect()
    };
    assert_eq!(decode_items(&encode_items(get_items)).unwrap(), as_items(get_items));
    assert_eq!(decode_items(&encode_items(put_items)).unwrap(), as_items(put_items));
    for items in [get_v, put_v] {
        let payload = encode_items_v(items);
        let decoded = decode_items_v(&payload).unwrap();
        assert_eq!(decoded.len(), items.len());
        for (d, (parts, key)) in decoded.iter().zip(items) {
            assert_eq!(d.key, *key);
            assert_eq!(d.parts.iter().map(|s| (s.handle, s.offset, s.length)).collect::<Vec<_>>(), parts.to_vec());
        }
    }
    let payload = encode_tagged_items(put_tagged);
    let decoded = decode_op_items(Op::PutFrom, VERSION_TAGS, &payload).unwrap();
    assert_eq!(decoded.iter().map(|i| (i.key, i.tag)).collect::<Vec<_>>(), vec![("tagged-0", &tag[..]), ("untagged-1", &[][..])]);
    let payload = encode_tagged_items_v(put_v_tagged);
    let decoded = decode_op_items(Op::PutFromV, VERSION_TAGS, &payload).unwrap();
    assert_eq!((decoded[0].key, decoded[0].tag, decoded[0].parts.len()), ("tagged-v", &tag[..], 2));
    for keys in [&exists[..], &chain[..], &prefetch[..], &[]] {
        assert_eq!(decode_keys(&encode_keys(keys)).unwrap(), keys.to_vec());
    }
    let register = encode_register(4096, 1 << 26);
    let mut c = Cursor::new(&register);
    assert_eq!((c.u64("offset").unwrap(), c.u64("length").unwrap(), c.end()), (4096, 1 << 26, Ok(())));
    let unregister = encode_unregister(0x1122_3344_5566_7788);
    let mut c = Cursor::new(&unregister);
    assert_eq!((c.u64("handle").unwrap(), c.end()), (0x1122_3344_5566_7788, Ok(())));

    vec![
        request(
            "HELLO with a token and the expected geometry",
            Op::Hello as u8,
            1,
            hello.as_bytes(),
            vec![("hello", J::Raw(hello.into()))],
        ),
        request(
            "REGISTER 64 MiB from offset 4096 (the descriptor travels beside the frame)",
            Op::Register as u8,
            2,
            &encode_register(4096, 1 << 26),
            vec![("offset", J::n(4096u64)), ("length", J::n(1u64 << 26))],
        ),
        request("UNREGISTER", Op::Unregister as u8, 3, &unregister, vec![("handle", J::n(0x1122_3344_5566_7788u64))]),
        request(
            "GET_INTO of two items, a request id of eight distinct bytes",
            Op::GetInto as u8,
            0x0102_0304_0506_0708,
            &encode_items(get_items),
            vec![("items", items_json(get_items))],
        ),
        request("PUT_FROM of one item", Op::PutFrom as u8, 5, &encode_items(put_items), vec![("items", items_json(put_items))]),
        request(
            "PUT_FROM on a version-2 connection: a tagged item, an untagged one (tag_bytes 0)",
            Op::PutFrom as u8,
            16,
            &encode_tagged_items(put_tagged),
            vec![("version", J::n(VERSION_TAGS)), ("items", tagged_items_json(put_tagged))],
        ),
        request(
            "PUT_FROM_V on a version-2 connection: one tagged item of two parts",
            Op::PutFromV as u8,
            17,
            &encode_tagged_items_v(put_v_tagged),
            vec![("version", J::n(VERSION_TAGS)), ("items", tagged_items_v_json(put_v_tagged))],
        ),
        request(
            "GET_INTO_V: an item of two parts, an item of one",
            Op::GetIntoV as u8,
            11,
            &encode_items_v(get_v),
            vec![("items", items_v_json(get_v))],
        ),
        request(
            "PUT_FROM_V: one item gathered from three parts, one past 4 GiB",
            Op::PutFromV as u8,
            12,
            &encode_items_v(put_v),
            vec![("items", items_v_json(put_v))],
        ),
        request("EXISTS, the last key 256 bytes long", Op::Exists as u8, 7, &encode_keys(&exists), vec![("keys", keys_json(&exists))]),
        request("EXISTS of no keys (the client's ping)", Op::Exists as u8, 15, &encode_keys::<&str>(&[]), vec![("keys", keys_json(&[]))]),
        request("LOOKUP of a chain", Op::Lookup as u8, 8, &encode_keys(&chain), vec![("keys", keys_json(&chain))]),
        request("DELETE", Op::Delete as u8, 9, &encode_keys(&["k1"]), vec![("keys", keys_json(&["k1"]))]),
        request("PREFETCH", Op::Prefetch as u8, 10, &encode_keys(&prefetch), vec![("keys", keys_json(&prefetch))]),
        request("an op the server does not know (42), empty", 42, 13, &[], vec![]),
        request("MAP_ARENA of arena 1 (version 3)", Op::MapArena as u8, 16, &encode_map_arena(1), vec![("arena", J::n(1u32))]),
        request("MAP_INDEX of shard 1 (version 3)", Op::MapIndex as u8, 20, &encode_map_arena(1), vec![("shard", J::n(1u32))]),
        request(
            "LEASE of two keys (version 3)",
            Op::Lease as u8,
            17,
            &encode_keys(&["k1", "k2"]),
            vec![("keys", keys_json(&["k1", "k2"]))],
        ),
        request(
            "RELEASE of two leases (version 3)",
            Op::Release as u8,
            18,
            &encode_release(&[5, 6]),
            vec![("leases", J::Arr(vec![J::n(5u64), J::n(6u64)]))],
        ),
    ]
}

fn replies() -> Vec<J> {
    let index = IndexAnswer { file_bytes: 4096 + 1024 * 32, buckets: 1024, shards: 2 };
    let arena = ArenaAnswer { file_bytes: 6 << 20, slot_bytes: 65_536, slots: 64, generations_offset: 4 << 20 };
    let leases = [
        LeaseItem { result: 65_536, tier: 2, arena: 1, offset: 131_072, generation: 3, lease: 5 },
        LeaseItem { result: Code::NotFound as i64, tier: 0, arena: 0, offset: 0, generation: 0, lease: 0 },
    ];
    let ops = Op::ALL.iter().map(|o| format!("\"{}\"", o.name())).collect::<Vec<_>>().join(",");
    let hello = format!(
        concat!(
            r#"{{"version":2,"epoch":9912345678901234567,"block_bytes":65536,"model":"llama3-8b","block_tokens":16,"#,
            r#""bytes_per_token":4096,"shards":2,"max_items":{},"max_payload_bytes":{},"max_registrations":4096,"ops":[{}],"#,
            r#""tenant":null,"server":"kvtier 0.1.0","http":"127.0.0.1:8085"}}"#
        ),
        ITEMS_MAX, PAYLOAD_BYTES_MAX, ops
    );
    let get = [(65536, 2), (-2, 0)];
    let put = [(0, 1), (Code::Overloaded as i64, 0)];
    let get_v = [(65536, 3), (Code::WrongSize as i64, 0)];
    let put_v = [(0, 0)];
    let put_tagged = [(0, 1), (Code::InvalidTag as i64, 0)];
    let bad_items = decode_items(&encode_items(&[(1, 0, 65536, "key-a")])[..10]).unwrap_err();
    assert_eq!(bad_items.0, Code::BadRequest);
    let mut bad_magic = Header { op: Op::Hello as u8, payload_bytes: 2, request_id: 1 }.encode();
    bad_magic[..2].copy_from_slice(b"GE");
    let bad_frame = Header::decode(&bad_magic).unwrap_err();
    let refused = "peer uid 65534 is not allowed on this socket (the server runs as uid 0; --local-allow-uid, --local-allow-gid)";
    let msg = |m: &str| vec![("message", J::s(m))];
    vec![
        reply("HELLO answered", ok(Op::Hello, 1, 0, hello.as_bytes()), 1, 0, 0, vec![("hello", J::Raw(hello.clone()))]),
        failed(
            "HELLO refused: another block size",
            Op::Hello as u8,
            1,
            Code::GeometryMismatch,
            "client expects block_bytes 4096, server has block_bytes 65536 (model llama3-8b, 16 tokens per block)",
        ),
        reply(
            "REGISTER answered: handle 1, mapped",
            ok(Op::Register, 2, 0, &encode_registered(1, 1)),
            2,
            0,
            0,
            vec![("handle", J::n(1u64)), ("access", J::n(1u8))],
        ),
        reply(
            "REGISTER answered: a handle of eight distinct bytes, guarded",
            ok(Op::Register, 2, 0, &encode_registered(0x1122_3344_5566_7788, 3)),
            2,
            0,
            0,
            vec![("handle", J::n(0x1122_3344_5566_7788u64)), ("access", J::n(3u8))],
        ),
        failed("REGISTER without a descriptor", Op::Register as u8, 2, Code::BadBuffer, "REGISTER carried no descriptor (SCM_RIGHTS)"),
        reply("UNREGISTER answered (empty body)", ok(Op::Unregister, 3, 0, &[]), 3, 0, 0, vec![]),
        reply(
            "GET_INTO answered: a block from RAM, a miss",
            ok(Op::GetInto, 0x0102_0304_0506_0708, 0, &encode_results(&get)),
            0x0102_0304_0506_0708,
            0,
            0,
            vec![("results", results_json(&get))],
        ),
        reply(
            "PUT_FROM answered: one stored (new key), one OVERLOADED, with the retry hint",
            ok(Op::PutFrom, 5, 1000, &encode_results(&put)),
            5,
            0,
            1000,
            vec![("results", results_json(&put))],
        ),
        reply(
            "PUT_FROM refused whole: OVERLOADED with a hint",
            response(Op::PutFrom as u8 | RESPONSE_BIT, 6, Code::Overloaded as i32, 250, b"shard 0 has 1 MiB of PUTs in flight"),
            6,
            Code::Overloaded as i32,
            250,
            msg("shard 0 has 1 MiB of PUTs in flight"),
        ),
        reply(
            "PUT_FROM (tagged) answered: one stored, one refused INVALID_TAG",
            ok(Op::PutFrom, 16, 0, &encode_results(&put_tagged)),
            16,
            0,
            0,
            vec![("results", results_json(&put_tagged))],
        ),
        reply(
            "GET_INTO_V answered: a block from NVMe, a WRONG_SIZE",
            ok(Op::GetIntoV, 11, 0, &encode_results(&get_v)),
            11,
            0,
            0,
            vec![("results", results_json(&get_v))],
        ),
        reply(
            "PUT_FROM_V answered: replaced",
            ok(Op::PutFromV, 12, 0, &encode_results(&put_v)),
            12,
            0,
            0,
            vec![("results", results_json(&put_v))],
        ),
        reply(
            "EXISTS answered: RAM, none, NVMe",
            ok(Op::Exists, 7, 0, &encode_tiers(&[2, 0, 3])),
            7,
            0,
            0,
            vec![("tiers", J::Arr(vec![J::n(2u8), J::n(0u8), J::n(3u8)]))],
        ),
        failed("EXISTS before HELLO", Op::Exists as u8, 7, Code::Unauthorized, "the first request on a connection must be HELLO"),
        reply(
            "LOOKUP answered: two leading hits",
            ok(Op::Lookup, 8, 0, &encode_lookup(&[1, 2])),
            8,
            0,
            0,
            vec![("prefix_hits", J::n(2u32)), ("tiers", J::Arr(vec![J::n(1u8), J::n(2u8)]))],
        ),
        reply(
            "DELETE answered: deleted, none stored",
            ok(Op::Delete, 9, 0, &encode_deleted(&[0, Code::NotFound as i64])),
            9,
            0,
            0,
            vec![("results", J::Arr(vec![J::n(0), J::n(Code::NotFound as i64)]))],
        ),
        reply(
            "PREFETCH answered: 3 asked for, 2 found",
            ok(Op::Prefetch, 10, 0, &encode_prefetched(3, 2)),
            10,
            0,
            0,
            vec![("requested", J::n(3u32)), ("found", J::n(2u32))],
        ),
        failed("an unknown op (42)", 42, 13, Code::UnknownOp, "unknown op 42; this server speaks ops 1-15 (docs/LOCAL.md)"),
        reply(
            "MAP_ARENA answered (the descriptor comes in SCM_RIGHTS with the first byte)",
            ok(Op::MapArena, 16, 0, &encode_arena(&arena)),
            16,
            0,
            0,
            vec![
                ("file_bytes", J::n(arena.file_bytes)),
                ("slot_bytes", J::n(arena.slot_bytes)),
                ("slots", J::n(arena.slots)),
                ("generations_offset", J::n(arena.generations_offset)),
            ],
        ),
        reply(
            "LEASE answered: one leased from RAM, one miss",
            ok(Op::Lease, 17, 0, &encode_leases(&leases)),
            17,
            0,
            0,
            vec![(
                "items",
                J::Arr(
                    leases
                        .iter()
                        .map(|l| {
                            J::Obj(vec![
                                ("result", J::n(l.result)),
                                ("tier", J::n(l.tier)),
                                ("arena", J::n(l.arena)),
                                ("offset", J::n(l.offset)),
                                ("generation", J::n(l.generation)),
                                ("lease", J::n(l.lease)),
                            ])
                        })
                        .collect(),
                ),
            )],
        ),
        reply("RELEASE answered: 2 released", ok(Op::Release, 18, 0, &encode_released(2)), 18, 0, 0, vec![("released", J::n(2u32))]),
        reply(
            "MAP_INDEX answered (the descriptor comes in SCM_RIGHTS with the first byte)",
            ok(Op::MapIndex, 20, 0, &encode_index(&index)),
            20,
            0,
            0,
            vec![("file_bytes", J::n(index.file_bytes)), ("buckets", J::n(index.buckets)), ("shards", J::n(index.shards))],
        ),
        failed(
            "LEASE where the server offers none",
            Op::Lease as u8,
            19,
            Code::LeasesOff,
            "no leases: the RAM tier is not shared with clients (--ram-shared off)",
        ),
        failed("GET_INTO whose payload does not parse", Op::GetInto as u8, 14, Code::BadRequest, &bad_items.1),
        reply(
            "connection error: a bad frame (the server closes)",
            response(OP_CONNECTION_ERROR, 0, Code::BadFrame as i32, 0, bad_frame.as_bytes()),
            0,
            Code::BadFrame as i32,
            0,
            msg(&bad_frame),
        ),
        reply(
            "connection error: a peer refused at accept",
            response(OP_CONNECTION_ERROR, 0, Code::Unauthorized as i32, 0, refused.as_bytes()),
            0,
            Code::Unauthorized as i32,
            0,
            msg(refused),
        ),
    ]
}

/// The whole file's text.
fn vectors() -> String {
    let codes = std::iter::once(J::Obj(vec![("code", J::n(0)), ("name", J::s(Code::name_of(0)))]))
        .chain(Code::ALL.iter().map(|&c| J::Obj(vec![("code", J::n(c as i32)), ("name", J::s(Code::name_of(c as i64)))])))
        .collect();
    let ops = Op::ALL.iter().map(|&o| J::Obj(vec![("op", J::n(o as u8)), ("name", J::s(o.name()))])).collect();
    let tiers = TIER_NAMES.iter().enumerate().map(|(i, n)| J::Obj(vec![("tier", J::n(i as u8)), ("name", J::s(n))])).collect();
    let doc = J::Obj(vec![
        (
            "about",
            J::s(
                "Same-host socket frames (docs/LOCAL.md) as crate kvtier-local-proto encodes them: written and checked by \
                 local-proto/tests/frame_vectors.rs (KVTIER_WRITE_VECTORS=1 cargo test -p kvtier-local-proto rewrites it), \
                 asserted by clients/python/tests/test_local_vectors.py. Integers are exact (read them as integers); \
                 HELLO payloads are JSON, equal when parsed.",
            ),
        ),
        (
            "constants",
            J::Obj(vec![
                ("magic", J::n(MAGIC)),
                ("magic_hex", J::s(&hex(&MAGIC.to_le_bytes()))),
                ("header_bytes", J::n(HEADER_BYTES as u32)),
                ("payload_bytes_max", J::n(PAYLOAD_BYTES_MAX as u32)),
                ("items_max", J::n(ITEMS_MAX as u32)),
                ("parts_max", J::n(PARTS_MAX as u32)),
                ("versions", J::Arr(VERSIONS.iter().map(|&v| J::n(v)).collect())),
                ("version_tags", J::n(VERSION_TAGS)),
                ("version_leases", J::n(VERSION_LEASES)),
                ("lease_item_bytes", J::n(LEASE_ITEM_BYTES as u32)),
                ("response_bit", J::n(RESPONSE_BIT)),
                ("op_connection_error", J::n(OP_CONNECTION_ERROR)),
            ]),
        ),
        ("ops", J::Arr(ops)),
        ("codes", J::Arr(codes)),
        ("tiers", J::Arr(tiers)),
        ("requests", J::Arr(requests())),
        ("replies", J::Arr(replies())),
    ]);
    let mut out = String::new();
    doc.write(&mut out, 0);
    out.push('\n');
    out
}

/// The committed `tests/data/local_frame_vectors.json` is exactly what
/// this crate's encoders produce: a change of any frame, constant, op or
/// code fails here until the file is written again, and the Python client's
/// test of the same file then shows whether the client agrees.
///
/// To rewrite the file after an intended change (review its diff):
/// `KVTIER_WRITE_VECTORS=1 cargo test -p kvtier-local-proto --test frame_vectors`.
#[test]
fn the_committed_frame_vectors_are_what_the_encoders_produce() {
    let want = vectors();
    if std::env::var_os("KVTIER_WRITE_VECTORS").is_some_and(|v| v == "1") {
        std::fs::write(PATH, &want).unwrap_or_else(|e| panic!("writing {PATH}: {e}"));
        return;
    }
    let have = std::fs::read_to_string(PATH).unwrap_or_else(|e| panic!("reading {PATH}: {e} (KVTIER_WRITE_VECTORS=1 writes it)"));
    if have != want {
        let (line, (h, w)) = have
            .lines()
            .zip(want.lines())
            .enumerate()
            .find(|(_, (h, w))| h != w)
            .unwrap_or((have.lines().count().min(want.lines().count()), ("(end of file)", "(end of file)")));
        panic!(
            "{PATH} differs from what the encoders produce, first at line {}:\n  file:     {h}\n  encoders: {w}\n\
             If the protocol change is intended, rewrite it with KVTIER_WRITE_VECTORS=1 cargo test -p kvtier-local-proto \
             --test frame_vectors, and make the Python client agree (clients/python/tests/test_local_vectors.py).",
            line + 1
        );
    }
}
