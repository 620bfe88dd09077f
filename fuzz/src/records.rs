//! Targets for the records kvtier reads back from storage it does not
//! trust: slot headers and payloads, the index snapshot, `store.json`, S3
//! objects, and keys (docs/FORMAT.md, docs/KEYS.md).

use arbitrary::Unstructured;
use bytes::Bytes;
use kvtier_engine::geometry::StoreManifest;
use kvtier_engine::index::snapshot;
use kvtier_engine::key::{self, BlockHash, StoredKey, KEY_BYTES_MAX, STORED_KEY_BYTES_MAX};
use kvtier_engine::slot::{self, ChunkHasher, HeaderFault, RecordKind, SlotHeader, CHUNK_CRCS_MAX, PAGE_BYTES, SLOT_MAGIC};
use kvtier_s3::object::{decode_object, encode_header, object_name};

const PAGE: usize = PAGE_BYTES as usize;
/// The header CRC-32 sits in the page's last 4 bytes and covers the rest
/// (docs/FORMAT.md, "Slot header").
const HEADER_CRC_AT: usize = PAGE - 4;

fn fix_header_crc(page: &mut [u8]) {
    let crc = crc32fast::hash(&page[..HEADER_CRC_AT]);
    page[HEADER_CRC_AT..PAGE].copy_from_slice(&crc.to_le_bytes());
}

/// Most chunk CRC-32s a version 2 or 3 header held: they started at byte
/// 320 (docs/FORMAT.md).
const CHUNK_CRCS_MAX_V3: usize = (4092 - 320) / 4;

/// Decodes `page` and checks what an accepted header promises: its key and
/// chunk CRC-32s within its version's bounds, a header of the version
/// written now re-encodes to a page that decodes to itself, and its
/// consistency check answers without panicking.
fn check_header(page: &[u8]) -> Option<SlotHeader> {
    match SlotHeader::decode(page) {
        Ok(h) => {
            let version = u16::from_le_bytes([page[4], page[5]]);
            let (key_max, crcs_max) =
                if version >= 4 { (STORED_KEY_BYTES_MAX, CHUNK_CRCS_MAX) } else { (KEY_BYTES_MAX, CHUNK_CRCS_MAX_V3) };
            assert!(!h.key.is_empty() && h.key.len() <= key_max, "accepted a key of {} bytes in version {version}", h.key.len());
            assert!(h.chunk_crcs.len() <= crcs_max);
            assert!((h.scope_bytes as usize) < h.key.len());
            if version == slot::SLOT_VERSION {
                let mut again = vec![0u8; PAGE];
                h.encode(&mut again);
                assert_eq!(SlotHeader::decode(&again).as_ref(), Ok(&h), "header does not round-trip");
            }
            let _ = h.is_consistent(h.payload_len);
            Some(h)
        }
        Err(HeaderFault::Empty) => {
            assert!(page[..PAGE].iter().all(|b| *b == 0), "a page with data called empty");
            None
        }
        Err(_) => None,
    }
}

/// `slot_header`: byte 0 is the mode (bit 0: fix the header CRC up; bit 1:
/// write the magic first), the rest the page (zero-padded to 4096 bytes).
pub fn slot_header(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut page = vec![0u8; PAGE];
    let n = rest.len().min(PAGE);
    page[..n].copy_from_slice(&rest[..n]);
    if mode & 2 != 0 {
        page[..4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
    }
    if mode & 1 != 0 {
        fix_header_crc(&mut page);
    }
    check_header(&page);
}

/// `slot`: a whole slot. Mode (byte 0) 0–1: the bytes as a slot as they
/// are (page, then payload), bit 0 fixing the header CRC up; every
/// payload_fault verdict must agree with a plain CRC-32 of the payload.
/// Mode 2–3: an honest slot (key, chunk size and payload from the input)
/// written with the engine's ChunkHasher and encoder, then, for mode 3,
/// one byte of header or payload xor-ed with a nonzero value: the honest
/// slot must pass and the damaged one must be refused, whichever byte.
pub fn slot(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode & 2 == 0 {
        let mut page = vec![0u8; PAGE];
        let n = rest.len().min(PAGE);
        page[..n].copy_from_slice(&rest[..n]);
        if mode & 1 != 0 {
            fix_header_crc(&mut page);
        }
        let payload = rest.get(PAGE..).unwrap_or(&[]);
        if let Some(h) = check_header(&page) {
            let fault = slot::payload_fault(&h, payload);
            if fault.is_none() {
                assert_eq!(payload.len() as u64, h.payload_len);
                assert_eq!(crc32fast::hash(payload), h.payload_crc, "payload passed with a wrong whole-block CRC-32");
            }
        }
        return;
    }
    let mut u = Unstructured::new(rest);
    let (Ok(key_len), Ok(chunk_pick), Ok(flip_at), Ok(flip_xor), Ok(seq)) =
        (u.int_in_range(1..=KEY_BYTES_MAX), u.arbitrary::<u16>(), u.arbitrary::<u32>(), u.int_in_range(1..=255u8), u.arbitrary::<u64>())
    else {
        return;
    };
    let key: Vec<u8> = (0..key_len).map(|i| b'a' + (i % 26) as u8).collect();
    let payload = u.take_rest();
    if payload.is_empty() {
        return;
    }
    // A chunk size from the input, large enough that the chunk CRCs fit
    // the header (the engine's is 1 MiB; small ones make many chunks).
    let least = payload.len().div_ceil(CHUNK_CRCS_MAX) as u32;
    let chunk_bytes = (chunk_pick as u32 % 4096 + 1).max(least);
    let mut hasher = ChunkHasher::new(chunk_bytes);
    // Fed in two uneven pieces, as HTTP frames arrive.
    let cut = (chunk_pick as usize) % payload.len();
    hasher.update(&payload[..cut]);
    hasher.update(&payload[cut..]);
    let (payload_crc, chunk_crcs) = hasher.finish();
    assert_eq!(payload_crc, crc32fast::hash(payload), "ChunkHasher's combined CRC-32 differs from a one-pass CRC-32");
    let header = SlotHeader {
        kind: RecordKind::Block,
        seq,
        hash: BlockHash::of(&key),
        payload_len: payload.len() as u64,
        payload_crc,
        write_time_us: 1,
        key,
        scope_bytes: 0,
        chunk_bytes,
        chunk_crcs,
        tag: Vec::new(),
    };
    let mut bytes = vec![0u8; PAGE];
    header.encode(&mut bytes);
    bytes.extend_from_slice(payload);
    if mode & 1 != 0 {
        let at = flip_at as usize % bytes.len();
        bytes[at] ^= flip_xor;
    }
    let verdict = match SlotHeader::decode(&bytes[..PAGE]) {
        Ok(h) => {
            assert!(h.is_consistent(payload.len() as u64) || mode & 1 != 0, "an honest header is inconsistent");
            slot::payload_fault(&h, &bytes[PAGE..]).map_or(Ok(h), Err)
        }
        Err(f) => Err(format!("{f:?}")),
    };
    match (mode & 1 != 0, verdict) {
        (false, Ok(h)) => assert_eq!(h, header),
        (false, Err(why)) => panic!("an honest slot was refused: {why}"),
        (true, Ok(h)) => panic!("a slot with one byte flipped at {} passed as {h:?}", flip_at as usize % bytes.len()),
        (true, Err(_)) => {}
    }
}

/// `index_snapshot`: mode (byte 0) bit 0 set: the rest is an rkyv body
/// and the harness writes a correct preamble (magic, version, CRC-32,
/// length) before it, so the fuzzer reaches rkyv's validation; clear: the
/// rest is the file as it is.
pub fn index_snapshot(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let file = if mode & 1 != 0 { snapshot::frame(rest) } else { rest.to_vec() };
    if let Ok(s) = snapshot::decode(&file) {
        let again = snapshot::encode(&s);
        assert_eq!(snapshot::decode(&again).as_ref(), Ok(&s), "snapshot does not round-trip");
    }
}

/// `store_json`: the bytes as `store.json`.
pub fn store_json(data: &[u8]) {
    if let Ok(m) = StoreManifest::parse(data) {
        let g = &m.geometry;
        assert!(g.block_bytes > 0 && g.block_tokens > 0 && m.shards > 0, "accepted {m:?}");
        assert!(m.segment_bytes >= PAGE_BYTES + slot::slot_bytes(g.block_bytes), "accepted a segment too small: {m:?}");
        let json = serde_json::to_vec(&m).expect("a manifest serializes");
        assert_eq!(StoreManifest::parse(&json).as_ref(), Ok(&m), "manifest does not round-trip");
    }
}

/// `s3_object`: byte 0 the mode, bytes 1–2 the block size (u16 LE, 0
/// skipped), byte 3 the key's length `n` and the next `n` bytes the key
/// (as UTF-8, lossy), then the object as it is (mode bit 1 clear) or the
/// payload of an honest object (bit 1 set) whose first two bytes, as a u16
/// LE, pick a bit to flip when mode bit 0 is set.
pub fn s3_object(data: &[u8]) {
    let (Some(&mode), Some(size), Some(&key_len)) = (data.first(), data.get(1..3), data.get(3)) else { return };
    let block_bytes = u16::from_le_bytes([size[0], size[1]]) as u64;
    let Some(key) = data.get(4..4 + key_len as usize) else { return };
    if block_bytes == 0 || key.is_empty() {
        return;
    }
    let key = String::from_utf8_lossy(key).into_owned();
    let rest = &data[4 + key_len as usize..];
    if mode & 2 == 0 {
        let object = Bytes::copy_from_slice(rest);
        if let Ok(got) = decode_object(&object, &key, block_bytes) {
            assert_eq!(got.payload.len() as u64, block_bytes);
            // Format 2 (written now) re-encodes to itself; format 1 is read only.
            if object[..8] == kvtier_s3::OBJECT_MAGIC {
                let mut again = encode_header(&key, block_bytes, crc32fast::hash(&got.payload), got.tag.as_deref()).to_vec();
                again.extend_from_slice(&got.payload);
                assert_eq!(again, object.to_vec(), "an accepted object is not its own header + payload");
            }
        }
        return;
    }
    // An honest object of the input's payload, the block size its length.
    if rest.len() < 3 {
        return;
    }
    let (flip, payload) = rest.split_at(2);
    let mut object = encode_header(&key, payload.len() as u64, crc32fast::hash(payload), None).to_vec();
    object.extend_from_slice(payload);
    let at = u16::from_le_bytes([flip[0], flip[1]]) as usize % object.len();
    if mode & 1 != 0 {
        object[at] ^= 1 << (flip[0] % 8);
    }
    let got = decode_object(&Bytes::from(object), &key, payload.len() as u64);
    match (mode & 1 != 0, got) {
        (false, Ok(p)) => assert_eq!(&p.payload[..], payload),
        (false, Err(f)) => panic!("an honest object was refused: {f:?}"),
        (true, Ok(_)) => panic!("an object with a bit flipped at {at} was served"),
        (true, Err(_)) => {}
    }
}

/// The key rules of docs/KEYS.md, stated again independently of
/// `key::validate`: 1 to 256 bytes of `[A-Za-z0-9._~-]`, not `.` or `..`.
fn key_is_valid(k: &str) -> bool {
    (1..=KEY_BYTES_MAX).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_alphanumeric() || b"._~-".contains(&b)) && k != "." && k != ".."
}

/// `key`: the bytes as a key (invalid UTF-8 is replaced, as a path would
/// not be UTF-8 either).
pub fn key(data: &[u8]) {
    let k = String::from_utf8_lossy(data);
    let valid = key::validate(&k).is_ok();
    assert_eq!(valid, key_is_valid(&k), "validate disagrees with the key rules on {k:?}");
    if !valid {
        return;
    }
    let hash = BlockHash::of(k.as_bytes());
    assert_eq!(hash, BlockHash::of(k.to_string().as_bytes()));
    for shards in [1usize, 2, 3, 7, 64, kvtier_engine::geometry::SHARDS_MAX as usize] {
        assert!(hash.shard(shards) < shards);
    }
    let stored = StoredKey::unscoped(&k).expect("a valid key is a stored key of the default owner");
    let name = object_name("p", 4096, &stored);
    assert!(name.starts_with("p/kvtier/v2/4096/") && name.ends_with(&format!("/{k}")));
    // A valid key fits a slot header and comes back byte for byte.
    let header = SlotHeader {
        kind: RecordKind::Tombstone,
        seq: 1,
        hash,
        payload_len: 0,
        payload_crc: 0,
        write_time_us: 0,
        key: k.as_bytes().to_vec(),
        scope_bytes: 0,
        chunk_bytes: 0,
        chunk_crcs: Vec::new(),
        tag: Vec::new(),
    };
    let mut page = vec![0u8; PAGE];
    header.encode(&mut page);
    assert_eq!(SlotHeader::decode(&page), Ok(header));
    // And it needs no escaping in a path: /v1/blocks/KEY routes to KEY.
    let uri = http::Uri::try_from(format!("/v1/blocks/{k}")).expect("a valid key makes a valid path");
    match kvtier_server::http::routes::plan(
        &http::Method::GET,
        uri.path(),
        http::Version::HTTP_11,
        &http::HeaderMap::new(),
        kvtier_server::service::Auth::Open,
    ) {
        kvtier_server::http::routes::Plan::Handle(_, Some(routed), _) => assert_eq!(routed, k),
        _ => panic!("GET /v1/blocks/{k} does not route to the key"),
    }
}
