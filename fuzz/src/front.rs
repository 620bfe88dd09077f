//! Targets for the front doors: what a client sends over HTTP (the
//! request head, the key-list bodies) and over the same-host socket
//! (frames, batches, HELLO, buffer descriptors); docs/API.md and
//! docs/LOCAL.md.

use std::os::fd::{FromRawFd, OwnedFd};

use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use kvtier_local_proto::{self as proto, Code, Cursor, Next, Op, Span};
use kvtier_server::http::request::{declared_length, parse_keys};
use kvtier_server::http::routes::{self, Plan, Route};
use kvtier_server::http::tag::tag_from_headers;
use kvtier_server::limits;
use kvtier_server::local::region::Region;
use kvtier_server::service::Auth;
use kvtier_server::tenants::{Capacity, Table};

/// `key_list`: the bytes as a `/v1/lookup` (or `/v1/prefetch`) body.
pub fn key_list(data: &[u8]) {
    match parse_keys(data) {
        Ok(keys) => {
            assert!(keys.len() <= limits::LOOKUP_KEYS_MAX, "{} keys accepted", keys.len());
            for k in &keys {
                assert!(kvtier_engine::key::validate(k).is_ok(), "invalid key {k:?} accepted");
            }
            let again = serde_json::to_vec(&serde_json::json!({ "keys": keys })).expect("keys serialize");
            assert_eq!(parse_keys(&again).ok(), Some(keys), "key list does not round-trip");
        }
        Err(reply) => {
            let s = reply.status();
            assert!(s == StatusCode::BAD_REQUEST || s == StatusCode::PAYLOAD_TOO_LARGE, "a key list refused with {s}");
        }
    }
}

/// The bearer token the `http_route` target's server holds when its first
/// byte is odd.
const TOKEN: &[u8] = b"fuzz-token-0123456789";

/// A tenants table whose tenant `fuzz` has [`TOKEN`] (an admin when
/// `admin`), beside another tenant.
fn tenants_table(admin: bool) -> Table {
    let text = format!(
        "[[tenant]]\nname = \"fuzz\"\ntoken = \"{}\"\nadmin = {admin}\n[[tenant]]\nname = \"other\"\ntoken = \"another-token\"\n",
        std::str::from_utf8(TOKEN).expect("ASCII")
    );
    Table::parse(&text, "fuzz.toml", &Capacity { shard_blocks: [0, 0, 0], shards: 1, block_bytes: 4096 }).expect("a valid tenants file")
}

/// `http_route`: byte 0 the mode (bit 0: the server has a bearer token;
/// bit 1: HTTP/2 instead of HTTP/1.1, so no header-size check here; bit 2:
/// the harness adds the right `Authorization` header), then an HTTP/1.1
/// request head, parsed with httparse (hyper's HTTP/1 parser) into the
/// method, path and headers hyper would hand the server.
pub fn http_route(data: &[u8]) {
    let Some((&mode, head)) = data.split_first() else { return };
    let mut slots = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut slots);
    let Ok(httparse::Status::Complete(_)) = req.parse(head) else { return };
    let (Some(method), Some(target)) = (req.method, req.path) else { return };
    // hyper refuses what `http` cannot represent before any route runs.
    let Ok(method) = Method::from_bytes(method.as_bytes()) else { return };
    let Ok(uri) = http::Uri::try_from(target) else { return };
    let mut headers = HeaderMap::new();
    for h in req.headers.iter() {
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(h.name.as_bytes()), HeaderValue::from_bytes(h.value)) else { return };
        headers.append(name, value);
    }
    let token = (mode & 1 != 0).then_some(TOKEN);
    // Bit 3: tenants, one of whom (an admin with bit 4) has the token.
    static TABLES: std::sync::OnceLock<[Table; 2]> = std::sync::OnceLock::new();
    let tables = TABLES.get_or_init(|| [tenants_table(false), tenants_table(true)]);
    let tenants = (mode & 8 != 0).then(|| &tables[usize::from(mode & 16 != 0)]);
    if mode & 4 != 0 {
        let mut bearer = b"Bearer ".to_vec();
        bearer.extend_from_slice(TOKEN);
        headers.insert(http::header::AUTHORIZATION, HeaderValue::from_bytes(&bearer).expect("a valid header value"));
    }
    let version = if mode & 2 != 0 { Version::HTTP_2 } else { Version::HTTP_11 };
    let path = uri.path();
    let route = routes::route_of(&method, path);
    let authorized = headers.get(http::header::AUTHORIZATION).is_some_and(|v| v.as_bytes().strip_prefix(b"Bearer ") == Some(TOKEN));
    let auth = match (&tenants, token) {
        (Some(t), _) => Auth::Tenants(t),
        (None, Some(t)) => Auth::Token(t),
        (None, None) => Auth::Open,
    };
    match routes::plan(&method, path, version, &headers, auth) {
        Plan::Handle(r, key, caller) => {
            assert!(r == route && r != Route::Other, "planned {r:?} for {method} {path}, the route table says {route:?}");
            assert!(token.is_none() || authorized, "{method} {path} handled without the bearer token");
            assert!(tenants.is_none() || (authorized && caller.as_ref().is_some_and(|c| c.name == "fuzz")), "{method} {path}: no tenant");
            assert!(tenants.is_some() || caller.is_none());
            assert!(!r.is_admin() || caller.as_ref().is_none_or(|c| c.admin), "{method} {path}: an admin route for a tenant not admin");
            let is_block = matches!(r, Route::PutBlock | Route::GetBlock | Route::HeadBlock | Route::DeleteBlock);
            let want = if is_block {
                path.strip_prefix("/v1/blocks/")
            } else if r == Route::AdminTenantSet {
                path.strip_prefix("/v1/admin/tenants/")
            } else {
                None
            };
            assert_eq!(key.as_deref(), want);
            if r == Route::PutBlock {
                match declared_length(&headers, 4096, "PUT") {
                    Ok(n) => assert_eq!(Some(n), headers[http::header::CONTENT_LENGTH].to_str().ok().and_then(|v| v.parse().ok())),
                    Err(reply) => assert!(matches!(reply.status(), StatusCode::LENGTH_REQUIRED | StatusCode::BAD_REQUEST)),
                }
                // A PUT's block tag headers: a tag the engine reads back as
                // it is, or a message naming what is wrong.
                match tag_from_headers(&headers, 4096) {
                    Ok(Some(tag)) => {
                        let decoded = kvtier_engine::events::BlockTag::decode(&tag).expect("a tag from headers decodes");
                        assert_eq!(decoded.encode(), tag, "a tag from headers does not round-trip");
                    }
                    Ok(None) => assert!(["x-kvtier-block-hashes", "x-kvtier-parent-hash", "x-kvtier-block-size", "x-kvtier-token-ids"]
                        .iter()
                        .all(|h| !headers.contains_key(*h))),
                    Err(why) => assert!(why.contains("x-kvtier-") || why.starts_with("block tag:"), "{why}"),
                }
            }
        }
        Plan::Probe(r) => {
            assert!(matches!(r, Route::Healthz | Route::Readyz) && r == route, "{method} {path} answered as a probe ({r:?})");
            assert!(token.is_some() || tenants.is_some(), "{method} {path}: a probe plan on an open server");
            assert!(!authorized, "{method} {path}: a probe plan for a valid bearer token");
        }
        Plan::Refuse(reply) => {
            let s = reply.status();
            let expected = [
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                StatusCode::UNAUTHORIZED,
                StatusCode::FORBIDDEN,
                StatusCode::METHOD_NOT_ALLOWED,
                StatusCode::NOT_FOUND,
            ];
            assert!(expected.contains(&s), "{method} {path} refused with {s}");
            if s == StatusCode::FORBIDDEN {
                assert!(tenants.is_some() && mode & 16 == 0, "{method} {path} refused with 403 without a tenant that is not admin");
            }
            if s == StatusCode::METHOD_NOT_ALLOWED || s == StatusCode::NOT_FOUND {
                assert_eq!(route, Route::Other, "{method} {path} refused with {s} but routes to {route:?}");
            }
        }
    }
}

/// A memfd of `len` bytes, as an engine registers its host buffer.
fn memfd(len: u64, sealed: bool) -> Option<OwnedFd> {
    let flags = libc::MFD_CLOEXEC | if sealed { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: a NUL-terminated name; the returned descriptor is ours alone.
    let fd = unsafe { libc::memfd_create(c"kvtier-fuzz".as_ptr(), flags) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd was just created and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate/fcntl on the descriptor we own.
    if unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as libc::off_t) } != 0 {
        return None;
    }
    if sealed {
        unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
    }
    Some(fd)
}

/// Checks every span of `items` against the registered `regions` as the
/// server does before a copy (server/src/local/conn.rs, item_parts): a
/// span is accepted exactly when it lies inside its region.
fn check_spans(items: &[proto::Item<'_>], regions: &[(u64, Region)]) {
    for item in items {
        for Span { handle, offset, length } in &item.parts {
            let Some((_, region)) = regions.iter().find(|(h, _)| h == handle) else { continue };
            let inside = offset.checked_add(*length).is_some_and(|end| end <= region.len());
            match region.check(*offset, *length) {
                Ok(()) => assert!(inside, "span {offset}+{length} accepted in a {}-byte region", region.len()),
                Err((code, _)) => {
                    assert!(!inside || code == Code::BufferShrunk, "span {offset}+{length} inside a {}-byte region refused", region.len());
                    assert!(inside || code == Code::OutOfBounds);
                }
            }
        }
    }
}

/// `local_frames`: the bytes as what a client wrote on the socket, framed
/// with the server's framing rule (proto::next_frame); each whole frame's
/// payload decoded as its op says. Accepted batches and key lists
/// re-encode to their payload; a HELLO names a version the server speaks;
/// a REGISTER's descriptor (offset, length) is registered against a real
/// memfd (its size from the frame's request id, up to 64 KiB, sealed or
/// not), and later items' spans are bounds-checked against it.
pub fn local_frames(data: &[u8]) {
    let mut buf = data;
    let mut regions: Vec<(u64, Region)> = Vec::new();
    loop {
        let (header, frame_bytes) = match proto::next_frame(buf) {
            Ok(Next::Frame(h, n)) => (h, n),
            Ok(Next::Need(n)) => {
                assert!(n > 0);
                return;
            }
            Err(why) => {
                assert!(!why.is_empty());
                return;
            }
        };
        assert_eq!(&header.encode()[..], &buf[..proto::HEADER_BYTES], "a frame header does not round-trip");
        let payload = &buf[proto::HEADER_BYTES..frame_bytes];
        buf = &buf[frame_bytes..];
        let Some(op) = Op::from_u8(header.op) else { continue };
        match op {
            Op::Hello => {
                if let Ok(hello) = kvtier_server::local::parse_hello(payload) {
                    assert!(proto::VERSIONS.contains(&hello.version));
                }
            }
            Op::Register => {
                let mut c = Cursor::new(payload);
                let (Ok(offset), Ok(length)) = (c.u64("the offset"), c.u64("the length")) else { continue };
                if c.end().is_err() || regions.len() >= 4 {
                    continue;
                }
                let file_bytes = header.request_id % (64 << 10);
                let Some(fd) = memfd(file_bytes, header.request_id & (1 << 20) != 0) else { continue };
                match Region::new(fd, offset, length) {
                    Ok(region) => {
                        assert!(length > 0 && offset.checked_add(length).is_some_and(|end| end <= file_bytes));
                        assert_eq!(region.len(), length);
                        regions.push((regions.len() as u64 + 1, region));
                    }
                    Err(why) => assert!(!why.is_empty()),
                }
            }
            Op::Unregister => {
                let mut c = Cursor::new(payload);
                if let Ok(handle) = c.u64("a handle") {
                    regions.retain(|(h, _)| *h != handle);
                }
            }
            Op::PutFrom | Op::PutFromV if header.request_id & 1 == 1 => {
                // Odd request ids read the batch as a version-2 connection
                // would: tagged put items.
                if let Ok(items) = proto::decode_op_items(op, proto::VERSION_TAGS, payload) {
                    let parts: Vec<Vec<(u64, u64, u64)>> =
                        items.iter().map(|i| i.parts.iter().map(|s| (s.handle, s.offset, s.length)).collect()).collect();
                    let again = if op.is_vectored() {
                        let v: Vec<proto::TaggedItemV<'_>> = items.iter().zip(&parts).map(|(i, p)| (&p[..], i.key, i.tag)).collect();
                        proto::encode_tagged_items_v(&v)
                    } else {
                        let flat: Vec<proto::TaggedItem<'_>> =
                            items.iter().zip(&parts).map(|(i, p)| (p[0].0, p[0].1, p[0].2, i.key, i.tag)).collect();
                        proto::encode_tagged_items(&flat)
                    };
                    assert_eq!(again, payload, "a tagged batch does not round-trip");
                    for item in &items {
                        // A tag that decodes is one the engine would keep (or refuse with a message).
                        if let Ok(tag) = kvtier_engine::events::BlockTag::decode(item.tag) {
                            assert_eq!(&tag.encode()[..], item.tag, "a block tag does not round-trip");
                        }
                    }
                    check_spans(&items, &regions);
                }
            }
            Op::GetInto | Op::PutFrom => {
                if let Ok(items) = proto::decode_items(payload) {
                    let flat: Vec<(u64, u64, u64, &str)> =
                        items.iter().map(|i| (i.parts[0].handle, i.parts[0].offset, i.parts[0].length, i.key)).collect();
                    assert!(items.iter().all(|i| i.parts.len() == 1));
                    assert_eq!(proto::encode_items(&flat), payload, "an item batch does not round-trip");
                    check_spans(&items, &regions);
                }
            }
            Op::GetIntoV | Op::PutFromV => {
                if let Ok(items) = proto::decode_items_v(payload) {
                    assert!(items.len() <= proto::ITEMS_MAX);
                    let parts: Vec<Vec<(u64, u64, u64)>> =
                        items.iter().map(|i| i.parts.iter().map(|s| (s.handle, s.offset, s.length)).collect()).collect();
                    let v: Vec<proto::ItemV<'_>> = items.iter().zip(&parts).map(|(i, p)| (&p[..], i.key)).collect();
                    assert_eq!(proto::encode_items_v(&v), payload, "a vectored batch does not round-trip");
                    check_spans(&items, &regions);
                }
            }
            Op::MapArena | Op::MapIndex => {
                if let Ok(arena) = proto::decode_map_arena(payload) {
                    assert_eq!(proto::encode_map_arena(arena), payload, "a MAP_ARENA or MAP_INDEX request does not round-trip");
                }
            }
            Op::Release => {
                if let Ok(ids) = proto::decode_release(payload) {
                    assert!(ids.len() <= proto::ITEMS_MAX);
                    assert_eq!(proto::encode_release(&ids), payload, "a RELEASE request does not round-trip");
                }
            }
            Op::Exists | Op::Lookup | Op::Delete | Op::Prefetch | Op::Lease => {
                if let Ok(keys) = proto::decode_keys(payload) {
                    assert!(keys.len() <= proto::ITEMS_MAX);
                    assert_eq!(proto::encode_keys(&keys), payload, "a key batch does not round-trip");
                }
            }
        }
    }
}

/// A tenants file (`--tenants`, server/src/tenants.rs) as bytes through
/// `Table::parse`: never a panic; an accepted file's owners are the
/// engine's (unique names), its reservations fit the capacity it was
/// checked against, every tenant's token and uids find it, its keys are
/// scoped to its own name or a namespace's, and an empty quota change
/// keeps the table valid.
pub fn tenants_file(data: &[u8]) {
    use kvtier_server::tenants::{stored_key, QuotaChange};
    let text = String::from_utf8_lossy(data);
    let capacity = Capacity { shard_blocks: [4, 8, 100], shards: 2, block_bytes: 65_536 };
    let Ok(table) = Table::parse(&text, "fuzz.toml", &capacity) else { return };
    let owners = table.owners();
    assert_eq!(owners.len(), table.entries.len() + 1, "every entry an owner, beside the default one");
    table.check_capacity(&capacity).expect("an accepted file fits its capacity");
    for e in &table.entries {
        assert_eq!(owners.specs[owners.id_of(&e.name).expect("named") as usize].name, e.name);
        if let Some(t) = table.tenant(&e.name) {
            for uid in &t.uids {
                assert_eq!(table.by_uid(*uid).map(|x| &x.name), Some(&t.name));
            }
            for key in ["k", "sys-x", "a"] {
                if let Ok(stored) = stored_key(Some(t), key, false) {
                    let scope = stored.scope();
                    assert!(!scope.is_empty() && stored.key() == key, "{key} stored as {stored:?}");
                    assert!(owners.id_of(scope).is_some(), "{key} scoped to {scope}, no owner of the file");
                    assert!(scope == t.name || table.entries.iter().any(|n| n.name == scope && n.kind == "namespace"));
                }
            }
        }
        let next = table.with_quotas(&e.name, &QuotaChange::new(), &capacity).expect("unchanged quotas stay valid");
        assert!(next.is_some());
    }
}
