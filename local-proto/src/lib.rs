//! The framed protocol of kvtier's same-host data plane (docs/LOCAL.md):
//! frame headers, operations, status codes, and the encoding and decoding of
//! payloads, both ways. One definition for the server (`server/src/local/`)
//! and the client core (`client/`, under the Python package and the load
//! generator). Pure functions over bytes, so every decoder is tested (and
//! can be fuzzed) without a socket; [`fds`] lays out the descriptors that
//! travel beside them. Its frames are written down, byte for byte, in
//! `tests/data/local_frame_vectors.json` (`tests/frame_vectors.rs`) for
//! other clients to check themselves against.

/// Frame magic, `b"TK"` on the wire (0x4B54 little-endian).
pub const MAGIC: u16 = 0x4B54;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;
/// Largest payload of one frame: 1 MiB.
pub const PAYLOAD_BYTES_MAX: usize = 1 << 20;
/// Most items in one batch.
pub const ITEMS_MAX: usize = 4096;
/// Most spans (`parts`) of one `GET_INTO_V`/`PUT_FROM_V` item.
pub const PARTS_MAX: usize = 256;
/// Protocol versions this server speaks: 2 adds a block tag to every
/// `PUT_FROM`/`PUT_FROM_V` item ([`VERSION_TAGS`]), 3 the lease ops
/// ([`VERSION_LEASES`]); a version-1 client's frames are read as they always
/// were.
pub const VERSIONS: [u32; 3] = [1, 2, 3];
/// The first version whose `PUT_FROM` and `PUT_FROM_V` items end with a
/// block tag (u16 `tag_bytes`, then the tag; docs/LOCAL.md).
pub const VERSION_TAGS: u32 = 2;
/// The first version with `MAP_ARENA`, `LEASE` and `RELEASE` (docs/LOCAL.md,
/// "Leases").
pub const VERSION_LEASES: u32 = 3;
/// Bytes of one `LEASE` answer item: i64 `result`, u8 `tier`, u32 `arena`,
/// u64 `offset`, u64 `generation`, u64 `lease`.
pub const LEASE_ITEM_BYTES: usize = 8 + 1 + 4 + 8 + 8 + 8;
/// `op` of the frame the server sends before closing on a framing error.
pub const OP_CONNECTION_ERROR: u8 = 0xFF;
/// Set in a response's `op`.
pub const RESPONSE_BIT: u8 = 0x80;

/// An operation (the request frame's `op`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// 1: version, token and geometry check; must come first.
    Hello = 1,
    /// 2: a buffer (one `SCM_RIGHTS` descriptor) → handle.
    Register = 2,
    /// 3: drop a handle.
    Unregister = 3,
    /// 4: copy blocks into registered memory.
    GetInto = 4,
    /// 5: store blocks from registered memory.
    PutFrom = 5,
    /// 6: the tier holding each key.
    Exists = 6,
    /// 7: prefix hits of a chain of keys.
    Lookup = 7,
    /// 8: delete keys.
    Delete = 8,
    /// 9: promote keys toward the fastest tier.
    Prefetch = 9,
    /// 10: copy blocks into registered memory, each scattered over spans.
    GetIntoV = 10,
    /// 11: store blocks from registered memory, each gathered from spans.
    PutFromV = 11,
    /// 12: a RAM-tier arena's descriptor (`SCM_RIGHTS` in the answer).
    MapArena = 12,
    /// 13: pin blocks in the RAM tier for reading in place.
    Lease = 13,
    /// 14: end leases.
    Release = 14,
    /// 15: a shard's index table's descriptor (`SCM_RIGHTS` in the
    /// answer).
    MapIndex = 15,
}

impl Op {
    /// Every operation, in `op` order (metrics label order).
    pub const ALL: [Op; 15] = [
        Op::Hello,
        Op::Register,
        Op::Unregister,
        Op::GetInto,
        Op::PutFrom,
        Op::Exists,
        Op::Lookup,
        Op::Delete,
        Op::Prefetch,
        Op::GetIntoV,
        Op::PutFromV,
        Op::MapArena,
        Op::Lease,
        Op::Release,
        Op::MapIndex,
    ];

    /// The operation numbered `op`, if known.
    pub fn from_u8(op: u8) -> Option<Op> {
        Op::ALL.into_iter().find(|o| *o as u8 == op)
    }

    /// `HELLO`, `GET_INTO`, ... as docs/LOCAL.md names them.
    pub fn name(self) -> &'static str {
        [
            "HELLO",
            "REGISTER",
            "UNREGISTER",
            "GET_INTO",
            "PUT_FROM",
            "EXISTS",
            "LOOKUP",
            "DELETE",
            "PREFETCH",
            "GET_INTO_V",
            "PUT_FROM_V",
            "MAP_ARENA",
            "LEASE",
            "RELEASE",
            "MAP_INDEX",
        ][self as usize - 1]
    }

    /// Whether the op copies blocks into registered memory (`GET_INTO`,
    /// `GET_INTO_V`).
    pub fn is_get(self) -> bool {
        matches!(self, Op::GetInto | Op::GetIntoV)
    }

    /// Whether the op's items carry a `parts` count and several spans
    /// (`GET_INTO_V`, `PUT_FROM_V`).
    pub fn is_vectored(self) -> bool {
        matches!(self, Op::GetIntoV | Op::PutFromV)
    }

    /// Whether the op's items end with a block tag on a connection that
    /// speaks `version` (`PUT_FROM`, `PUT_FROM_V` from [`VERSION_TAGS`] on).
    pub fn carries_tags(self, version: u32) -> bool {
        matches!(self, Op::PutFrom | Op::PutFromV) && version >= VERSION_TAGS
    }

    /// The first protocol version that has the op.
    pub fn since_version(self) -> u32 {
        match self {
            Op::MapArena | Op::Lease | Op::Release | Op::MapIndex => VERSION_LEASES,
            _ => 1,
        }
    }
}

/// Metrics labels (`/v1/stats` `local.routes`, `kvtier_local_requests`):
/// op `n` is `ROUTE_NAMES[n - 1]`, then `other` (unknown ops).
pub const ROUTE_NAMES: [&str; 16] = [
    "hello",
    "register",
    "unregister",
    "get_into",
    "put_from",
    "exists",
    "lookup",
    "delete",
    "prefetch",
    "get_into_v",
    "put_from_v",
    "map_arena",
    "lease",
    "release",
    "map_index",
    "other",
];

/// A status or per-item code (docs/LOCAL.md, "Codes"). Negative on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // each is documented in the table in docs/LOCAL.md
pub enum Code {
    IoError = -1,
    NotFound = -2,
    InvalidKey = -3,
    WrongSize = -4,
    UnknownHandle = -5,
    OutOfBounds = -6,
    BufferShrunk = -7,
    Corrupt = -8,
    Overloaded = -9,
    DiskFull = -10,
    ShuttingDown = -11,
    Unauthorized = -12,
    BadRequest = -13,
    UnsupportedVersion = -14,
    GeometryMismatch = -15,
    Limit = -16,
    UnknownOp = -17,
    BadBuffer = -18,
    BadFrame = -19,
    // -20 and -21 are the Python client's own (NOT_REGISTERED,
    // CONNECTION_LOST, docs/LOCAL.md): never sent by the server.
    InvalidTag = -22,
    NotInRam = -23,
    LeasesOff = -24,
    Cancelled = -25,
}

impl Code {
    /// Every code, from -1 down.
    pub const ALL: [Code; 23] = [
        Code::IoError,
        Code::NotFound,
        Code::InvalidKey,
        Code::WrongSize,
        Code::UnknownHandle,
        Code::OutOfBounds,
        Code::BufferShrunk,
        Code::Corrupt,
        Code::Overloaded,
        Code::DiskFull,
        Code::ShuttingDown,
        Code::Unauthorized,
        Code::BadRequest,
        Code::UnsupportedVersion,
        Code::GeometryMismatch,
        Code::Limit,
        Code::UnknownOp,
        Code::BadBuffer,
        Code::BadFrame,
        Code::InvalidTag,
        Code::NotInRam,
        Code::LeasesOff,
        Code::Cancelled,
    ];

    /// The name docs/LOCAL.md gives a status or item code (`NOT_FOUND` for
    /// -2, `OK` for 0); `UNKNOWN_CODE` for one the table does not have.
    pub fn name_of(code: i64) -> &'static str {
        const NAMES: [&str; 25] = [
            "IO_ERROR",
            "NOT_FOUND",
            "INVALID_KEY",
            "WRONG_SIZE",
            "UNKNOWN_HANDLE",
            "OUT_OF_BOUNDS",
            "BUFFER_SHRUNK",
            "CORRUPT",
            "OVERLOADED",
            "DISK_FULL",
            "SHUTTING_DOWN",
            "UNAUTHORIZED",
            "BAD_REQUEST",
            "UNSUPPORTED_VERSION",
            "GEOMETRY_MISMATCH",
            "LIMIT",
            "UNKNOWN_OP",
            "BAD_BUFFER",
            "BAD_FRAME",
            "UNKNOWN_CODE", // -20, the Python client's NOT_REGISTERED
            "UNKNOWN_CODE", // -21, the Python client's CONNECTION_LOST
            "INVALID_TAG",
            "NOT_IN_RAM",
            "LEASES_OFF",
            "CANCELLED",
        ];
        match code {
            0 => "OK",
            -25..=-1 => NAMES[(-code - 1) as usize],
            _ => "UNKNOWN_CODE",
        }
    }

    /// Whether the server is at fault (counted as a server error), rather
    /// than the request or the data asked for.
    pub fn is_server_side(self) -> bool {
        matches!(self, Code::IoError | Code::DiskFull | Code::ShuttingDown | Code::Overloaded)
    }
}

pub mod fds;
mod frame;
mod key;
mod lease;
mod payload;
/// The shared index's table layout and its reader (a module of its own:
/// its `HEADER_BYTES` is the table's, not a frame's).
pub mod shared_index;

pub use frame::*;
pub use key::*;
pub use lease::*;
pub use payload::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_frame_waits_for_whole_frames_and_refuses_a_bad_header() {
        let f = frame(Op::Exists as u8, 7, &encode_keys(&["a", "bc"]));
        assert_eq!(next_frame(&[]), Ok(Next::Need(HEADER_BYTES)));
        assert_eq!(next_frame(&f[..HEADER_BYTES - 1]), Ok(Next::Need(HEADER_BYTES)));
        assert_eq!(next_frame(&f[..HEADER_BYTES + 2]), Ok(Next::Need(f.len() - HEADER_BYTES - 2)));
        let header = Header { op: Op::Exists as u8, payload_bytes: (f.len() - HEADER_BYTES) as u32, request_id: 7 };
        assert_eq!(next_frame(&f), Ok(Next::Frame(header, f.len())));
        let mut two = f.clone();
        two.extend_from_slice(&f);
        assert_eq!(next_frame(&two), Ok(Next::Frame(header, f.len())));
        let mut bad = f.clone();
        bad[3] = 1;
        assert!(next_frame(&bad).unwrap_err().contains("flags must be 0"));
    }

    #[test]
    fn a_header_round_trips_and_bad_ones_say_why() {
        let h = Header { op: 4, payload_bytes: 1234, request_id: u64::MAX - 7 };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[0] = b'G';
        assert!(Header::decode(&b).unwrap_err().contains("magic"));
        let mut b = h.encode();
        b[3] = 1;
        assert!(Header::decode(&b).unwrap_err().contains("flags"));
        let b = Header { op: 4, payload_bytes: PAYLOAD_BYTES_MAX as u32 + 1, request_id: 1 }.encode();
        assert!(Header::decode(&b).unwrap_err().contains("over the limit"));
    }

    #[test]
    fn items_decode_and_malformed_payloads_are_bad_requests() {
        let p = encode_items(&[(1, 0, 16, "a"), (2, 4096, 16, "key-b")]);
        let items = decode_items(&p).unwrap();
        assert_eq!(items[1], Item { parts: vec![Span { handle: 2, offset: 4096, length: 16 }], key: "key-b", tag: &[] });
        assert_eq!(items[1].length(), 16);
        for cut in 1..p.len() {
            let e = decode_items(&p[..cut]).unwrap_err();
            assert_eq!(e.0, Code::BadRequest, "cut at {cut}: {}", e.1);
        }
        let mut extra = p.clone();
        extra.push(0);
        assert!(decode_items(&extra).unwrap_err().1.contains("unexpected bytes"));
        let mut many = (ITEMS_MAX as u32 + 1).to_le_bytes().to_vec();
        many.resize(1 << 20, 0);
        assert_eq!(decode_items(&many).unwrap_err().0, Code::Limit);
        // A count the payload cannot hold is refused before any allocation.
        assert_eq!(decode_items(&4000u32.to_le_bytes()).unwrap_err().0, Code::BadRequest);
    }

    #[test]
    fn vectored_items_round_trip() {
        let two: &[(u64, u64, u64)] = &[(1, 0, 40), (3, 1000, 60)];
        let one: &[(u64, u64, u64)] = &[(2, 8, 100)];
        let most: Vec<(u64, u64, u64)> = (0..PARTS_MAX as u64).map(|i| (1, i * 10, 10)).collect();
        let p = encode_items_v(&[(two, "k-two"), (one, "k-one"), (&most, "")]);
        let items = decode_items_v(&p).unwrap();
        assert_eq!(items.len(), 3);
        assert_eq!(items[0].parts, vec![Span { handle: 1, offset: 0, length: 40 }, Span { handle: 3, offset: 1000, length: 60 }]);
        assert_eq!((items[0].key, items[0].length()), ("k-two", 100));
        assert_eq!(items[1], Item { parts: vec![Span { handle: 2, offset: 8, length: 100 }], key: "k-one", tag: &[] });
        assert_eq!((items[2].parts.len(), items[2].key, items[2].length()), (PARTS_MAX, "", 10 * PARTS_MAX as u64));
        // One part is the plain item with a u16 count in front of it.
        let plain = encode_items(&[(2, 8, 100, "k-one")]);
        let v = encode_items_v(&[(one, "k-one")]);
        assert_eq!((&v[..4], &v[4..6], &v[6..]), (&plain[..4], &1u16.to_le_bytes()[..], &plain[4..]));
        assert_eq!(decode_items_v(&v).unwrap(), decode_items(&plain).unwrap());
        assert_eq!(decode_items_v(&encode_items_v(&[])).unwrap(), vec![]);
        // Lengths that would overflow a u64 saturate.
        let huge: &[(u64, u64, u64)] = &[(1, 0, u64::MAX), (1, 0, 2)];
        assert_eq!(decode_items_v(&encode_items_v(&[(huge, "x")])).unwrap()[0].length(), u64::MAX);
    }

    #[test]
    fn malformed_vectored_payloads_are_bad_requests_and_too_many_items_a_limit() {
        let two: &[(u64, u64, u64)] = &[(1, 0, 40), (3, 1000, 60)];
        let p = encode_items_v(&[(two, "a"), (two, "key-b")]);
        for cut in 1..p.len() {
            let e = decode_items_v(&p[..cut]).unwrap_err();
            assert_eq!(e.0, Code::BadRequest, "cut at {cut}: {}", e.1);
        }
        let mut extra = p.clone();
        extra.push(0);
        let e = decode_items_v(&extra).unwrap_err();
        assert!(e.0 == Code::BadRequest && e.1.contains("unexpected bytes"), "{e:?}");
        // parts 0 and PARTS_MAX + 1, with room for the spans they claim.
        for parts in [0usize, PARTS_MAX + 1] {
            let spans = vec![(1, 0, 1); parts];
            let mut bad = encode_items_v(&[(&spans, "k")]);
            bad.extend_from_slice(&[0; 64]);
            let e = decode_items_v(&bad).unwrap_err();
            assert_eq!(e.0, Code::BadRequest, "{parts} parts: {}", e.1);
            assert!(e.1.contains(&format!("{parts} parts")) && e.1.contains("item 0"), "{}", e.1);
        }
        // A second item's bad count names it.
        let zero: &[(u64, u64, u64)] = &[];
        let e = decode_items_v(&encode_items_v(&[(two, "a"), (zero, "b")])).unwrap_err();
        assert!(e.1.starts_with("item 1: 0 parts"), "{}", e.1);
        let mut many = (ITEMS_MAX as u32 + 1).to_le_bytes().to_vec();
        many.resize(1 << 20, 0);
        assert_eq!(decode_items_v(&many).unwrap_err().0, Code::Limit);
        // A count the payload cannot hold is refused before any allocation.
        assert_eq!(decode_items_v(&4000u32.to_le_bytes()).unwrap_err().0, Code::BadRequest);
        // Bad UTF-8 in a key.
        let mut bad_key = encode_items_v(&[(two, "k")]);
        *bad_key.last_mut().unwrap() = 0xFF;
        assert!(decode_items_v(&bad_key).unwrap_err().1.contains("UTF-8"));
        // A plain payload is not a vectored one (its handle's low bytes
        // read as a parts count).
        let plain = encode_items(&[(0, 0, 16, "a")]);
        assert_eq!(decode_items_v(&plain).unwrap_err().0, Code::BadRequest);
    }

    #[test]
    fn tagged_put_items_carry_their_tag_after_the_key() {
        let tag: &[u8] = &[1, 2, 3];
        let p = encode_tagged_items(&[(1, 0, 16, "a", tag), (2, 16, 16, "b", &[])]);
        // The plain item's bytes (after the count), then u16 tag_bytes and the tag.
        let plain = encode_items(&[(1, 0, 16, "a")]);
        assert_eq!(&p[4..plain.len()], &plain[4..]);
        assert_eq!(&p[plain.len()..plain.len() + 5], &[3, 0, 1, 2, 3]);
        let items = decode_tagged_items(&p).unwrap();
        assert_eq!((items[0].key, items[0].tag, items[1].key, items[1].tag), ("a", tag, "b", &[][..]));
        assert_eq!(decode_op_items(Op::PutFrom, VERSION_TAGS, &p).unwrap(), items);
        // Version 1 reads the same op untagged, and GET_INTO never has tags.
        assert_eq!(decode_op_items(Op::PutFrom, 1, &plain).unwrap(), decode_items(&plain).unwrap());
        assert_eq!(decode_op_items(Op::GetInto, VERSION_TAGS, &plain).unwrap(), decode_items(&plain).unwrap());
        assert!(decode_op_items(Op::PutFrom, 1, &p).is_err(), "a tagged payload is not a version-1 one");
        for cut in 1..p.len() {
            assert_eq!(decode_tagged_items(&p[..cut]).unwrap_err().0, Code::BadRequest, "cut at {cut}");
        }
        let two: &[(u64, u64, u64)] = &[(1, 0, 40), (3, 1000, 60)];
        let v = encode_tagged_items_v(&[(two, "k", tag)]);
        let items = decode_op_items(Op::PutFromV, VERSION_TAGS, &v).unwrap();
        assert_eq!((items[0].parts.len(), items[0].key, items[0].tag), (2, "k", tag));
        assert_eq!(&v[..v.len() - 5], &encode_items_v(&[(two, "k")])[..]);
        assert!(Op::PutFromV.carries_tags(2) && !Op::PutFromV.carries_tags(1) && !Op::GetIntoV.carries_tags(2));
    }

    #[test]
    fn register_and_reply_bodies_have_the_documented_layout() {
        let register = encode_register(4096, 1 << 40);
        let mut c = Cursor::new(&register);
        assert_eq!((c.u64("offset"), c.u64("length"), c.end()), (Ok(4096), Ok(1 << 40), Ok(())));
        assert_eq!(encode_unregister(0x0102_0304_0506_0708), [8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(encode_registered(0x0102, 3), [2, 1, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(encode_tiers(&[2, 0, 4]), [3, 0, 0, 0, 2, 0, 4]);
        assert_eq!(encode_tiers(&[]), [0, 0, 0, 0]);
        // prefix_hits and n are the same number.
        assert_eq!(encode_lookup(&[1, 2]), [2, 0, 0, 0, 2, 0, 0, 0, 1, 2]);
        let deleted = encode_deleted(&[0, Code::NotFound as i64]);
        assert_eq!(deleted.len(), 4 + 2 * 8);
        assert_eq!((&deleted[..4], &deleted[4..12], &deleted[12..]), (&[2, 0, 0, 0][..], &[0; 8][..], &(-2i64).to_le_bytes()[..]));
        assert_eq!(encode_prefetched(3, 2), [3, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(encode_results(&[(-9, 0)])[4..12], (-9i64).to_le_bytes());
    }

    #[test]
    fn keys_decode_and_bad_utf8_is_refused() {
        assert_eq!(decode_keys(&encode_keys(&["x", "yz"])).unwrap(), vec!["x", "yz"]);
        let bad = [1, 0, 0, 0, 1, 0, 0xFF];
        assert!(decode_keys(&bad).unwrap_err().1.contains("UTF-8"));
    }

    #[test]
    fn every_op_and_code_has_one_number() {
        for op in Op::ALL {
            assert_eq!(Op::from_u8(op as u8), Some(op));
        }
        assert_eq!(Op::from_u8(0), None);
        assert_eq!(Op::from_u8(16), None);
        assert_eq!((Op::from_u8(12), Op::from_u8(14)), (Some(Op::MapArena), Some(Op::Release)));
        assert_eq!((Op::Lease.since_version(), Op::GetInto.since_version()), (VERSION_LEASES, 1));
        assert_eq!(Op::from_u8(10), Some(Op::GetIntoV));
        assert_eq!(Op::PutFromV as u8, 11);
        for (i, op) in Op::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, i + 1, "ops are numbered 1.. in ALL's order");
            assert_eq!(ROUTE_NAMES[i], op.name().to_lowercase(), "the route label is the op's name");
        }
        assert_eq!(ROUTE_NAMES[ROUTE_NAMES.len() - 1], "other");
        assert_eq!((Op::GetIntoV.name(), Op::PutFromV.name()), ("GET_INTO_V", "PUT_FROM_V"));
        assert!(Op::GetIntoV.is_get() && Op::GetIntoV.is_vectored() && Op::PutFromV.is_vectored());
        assert!(!Op::PutFrom.is_get() && !Op::PutFromV.is_get() && !Op::GetInto.is_vectored());
        assert_eq!(Code::BadFrame as i32, -19);
        assert_eq!(ROUTE_NAMES[Op::GetInto as usize - 1], "get_into");
        assert_eq!(ROUTE_NAMES.len(), Op::ALL.len() + 1);
        assert_eq!(Op::GetInto.name(), "GET_INTO");
        for code in Code::ALL {
            assert_ne!(Code::name_of(code as i64), "UNKNOWN_CODE");
        }
        assert_eq!(Code::name_of(-2), "NOT_FOUND");
        assert_eq!(Code::name_of(-19), "BAD_FRAME");
        assert_eq!(Code::name_of(0), "OK");
        assert_eq!(Code::name_of(-20), "UNKNOWN_CODE");
        assert_eq!(Code::name_of(-21), "UNKNOWN_CODE");
        assert_eq!(Code::name_of(Code::InvalidTag as i64), "INVALID_TAG");
        assert_eq!((Code::name_of(-23), Code::name_of(-24)), ("NOT_IN_RAM", "LEASES_OFF"));
        assert_eq!(Code::name_of(-25), "CANCELLED");
        assert_eq!(Code::name_of(-26), "UNKNOWN_CODE");
        assert_eq!(tier_name(3), "nvme");
        assert_eq!(tier_name(9), "unknown");
    }
}
