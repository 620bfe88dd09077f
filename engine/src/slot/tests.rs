//! The slot header's encoding, every version's decoding, and the chunk CRC-32s.

use super::*;
use proptest::prelude::*;

fn header(key: Vec<u8>, seq: u64, payload_len: u64, crc: u32, tomb: bool) -> SlotHeader {
    let payload_len = if tomb { 0 } else { payload_len % (super::super::geometry::BLOCK_BYTES_MAX + 1) };
    let chunk_bytes = if tomb { 0 } else { chunk_bytes_for(payload_len) };
    let chunks = chunk_count(payload_len, chunk_bytes);
    SlotHeader {
        kind: if tomb { RecordKind::Tombstone } else { RecordKind::Block },
        seq,
        hash: BlockHash::of(&key),
        payload_len,
        payload_crc: crc,
        write_time_us: 1_700_000_000_000_000,
        key,
        scope_bytes: 0,
        chunk_bytes,
        chunk_crcs: (0..chunks).map(|i| crc ^ i as u32).collect(),
        tag: Vec::new(),
    }
}

/// `h` encoded as a version 1 to 3 writer laid it out: no scope length,
/// the chunk CRC-32s right after a 256-byte key area.
fn encode_as(h: &SlotHeader, version: u16) -> Vec<u8> {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    h.encode(&mut page);
    put(&mut page, OFF_VERSION, &version.to_le_bytes());
    page[OFF_SCOPE_LEN] = 0;
    let crcs = page[OFF_CHUNK_CRCS..OFF_CHUNK_CRCS + 4 * h.chunk_crcs.len()].to_vec();
    page[OFF_CHUNK_CRCS_V3..OFF_CHUNK_CRCS + 4 * h.chunk_crcs.len()].fill(0);
    put(&mut page, OFF_CHUNK_CRCS_V3, &crcs);
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    put(&mut page, OFF_HEADER_CRC, &crc.to_le_bytes());
    page
}

proptest! {
    #[test]
    fn encode_decode_round_trip(
        scope in proptest::collection::vec(proptest::sample::select(b"abz09_-".to_vec()), 0..=crate::tenant::OWNER_NAME_BYTES_MAX),
        key in proptest::collection::vec(proptest::sample::select(b"abcXYZ019._~-".to_vec()), 1..=KEY_BYTES_MAX),
        seq in any::<u64>(), len in any::<u64>(), crc in any::<u32>(), tomb in any::<bool>(),
        tag in proptest::collection::vec(any::<u8>(), 0..=crate::events::TAG_BYTES_MAX),
    ) {
        // "." and ".." are reserved, not keys (key::validate).
        prop_assume!(key != b"." && key != b"..");
        let scoped = if scope.is_empty() { key } else { [&scope[..], b"/", &key[..]].concat() };
        let mut h = header(scoped, seq, len, crc, tomb);
        h.scope_bytes = scope.len() as u8;
        prop_assert!(h.stored_key().is_some());
        h.tag = tag;
        h.tag.truncate(tag_room_for(h.chunk_crcs.len()));
        let mut page = vec![0xAAu8; PAGE_BYTES as usize];
        h.encode(&mut page);
        prop_assert_eq!(SlotHeader::decode(&page), Ok(h));
    }

    #[test]
    fn any_flipped_bit_is_caught(byte in 0usize..PAGE_BYTES as usize, bit in 0u8..8) {
        let h = header(b"block-0001".to_vec(), 42, 65_536, 0xDEAD_BEEF, false);
        let mut page = vec![0u8; PAGE_BYTES as usize];
        h.encode(&mut page);
        page[byte] ^= 1 << bit;
        prop_assert!(SlotHeader::decode(&page).is_err());
    }
}

#[test]
fn a_tombstone_with_a_payload_is_a_bad_field() {
    let mut page = vec![0u8; PAGE_BYTES as usize];
    header(b"k".to_vec(), 1, 0, 0, true).encode(&mut page);
    page[OFF_PAYLOAD_LEN] = 1;
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    page[OFF_HEADER_CRC..].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(SlotHeader::decode(&page), Err(HeaderFault::BadField));
}

#[test]
fn payload_fault_names_the_length_the_chunk_or_the_header() {
    let payload: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
    let mut h = header(b"k".to_vec(), 1, payload.len() as u64, 0, false);
    h.chunk_bytes = 4096;
    let mut crcs = ChunkHasher::new(4096);
    crcs.update(&payload);
    (h.payload_crc, h.chunk_crcs) = crcs.finish();
    assert_eq!(payload_fault(&h, &payload), None);
    assert!(payload_fault(&h, &payload[..9_999]).unwrap().contains("payload is 9999 bytes, the header says 10000"));
    let mut bad = payload.clone();
    bad[5000] ^= 1;
    assert!(payload_fault(&h, &bad).unwrap().contains("in chunk 1 of 3 (4096 bytes each)"));
    let mut wrong_whole = h.clone();
    wrong_whole.payload_crc ^= 1;
    assert!(payload_fault(&wrong_whole, &payload).unwrap().contains("the header's whole-block CRC is wrong"));
    let v1 = SlotHeader { chunk_bytes: 0, chunk_crcs: Vec::new(), ..h };
    assert_eq!(payload_fault(&v1, &payload), None);
    assert_eq!(payload_fault(&v1, &bad).as_deref(), Some("payload CRC-32 mismatch"));
}

#[test]
fn empty_page_is_empty_not_corrupt() {
    assert_eq!(SlotHeader::decode(&[0u8; 4096]), Err(HeaderFault::Empty));
    assert_eq!(SlotHeader::decode(&[7u8; 4096]), Err(HeaderFault::BadMagic));
}

#[test]
fn version_1_headers_still_decode_without_chunk_crcs() {
    // A version 1 header as the previous release wrote it: bytes 56..64
    // zero, nothing after the key.
    let mut h = header(b"old-block".to_vec(), 7, 16 << 20, 0x1234_5678, false);
    h.chunk_bytes = 0;
    h.chunk_crcs.clear();
    let mut page = encode_as(&h, 1);
    assert_eq!(SlotHeader::decode(&page), Ok(h));
    // A version 5 header is not ours.
    put(&mut page, OFF_VERSION, &5u16.to_le_bytes());
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    put(&mut page, OFF_HEADER_CRC, &crc.to_le_bytes());
    assert_eq!(SlotHeader::decode(&page), Err(HeaderFault::BadField));
}

#[test]
fn version_2_headers_decode_without_a_tag_and_a_tag_may_not_overlap_the_chunk_crcs() {
    let mut h = header(b"v2-block".to_vec(), 9, 16 << 20, 0x55AA, false);
    h.tag = vec![0xEE; 100];
    // As the previous release wrote it: version 2, bytes 46..48 and the
    // page's end zero.
    let mut page = encode_as(&h, 2);
    put(&mut page, OFF_TAG_LEN, &0u16.to_le_bytes());
    page[OFF_HEADER_CRC - 100..OFF_HEADER_CRC].fill(0);
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    put(&mut page, OFF_HEADER_CRC, &crc.to_le_bytes());
    h.tag.clear();
    assert_eq!(SlotHeader::decode(&page), Ok(h.clone()));
    // Version 3 with a tag length reaching into the chunk CRC-32s.
    put(&mut page, OFF_VERSION, &3u16.to_le_bytes());
    put(&mut page, OFF_TAG_LEN, &((OFF_HEADER_CRC - OFF_CHUNK_CRCS_V3 - 4 * h.chunk_crcs.len() + 1) as u16).to_le_bytes());
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    put(&mut page, OFF_HEADER_CRC, &crc.to_le_bytes());
    assert_eq!(SlotHeader::decode(&page), Err(HeaderFault::BadField));
    assert_eq!(OFF_CHUNK_CRCS, 356);
    assert_eq!(tag_room(16 << 20), 3072);
    assert_eq!(tag_room(1 << 30), OFF_HEADER_CRC - OFF_CHUNK_CRCS - 4 * 512);
}

#[test]
fn a_version_3_tenant_key_reads_with_its_scope_and_its_chunk_crcs_where_they_were() {
    let mut h = header(b"acme/k-1".to_vec(), 11, 16 << 20, 0xABCD, false);
    h.scope_bytes = 4;
    h.tag = vec![0x5A; 64];
    let page = encode_as(&h, 3);
    let got = SlotHeader::decode(&page).unwrap();
    assert_eq!(got, h);
    let key = got.stored_key().unwrap();
    assert_eq!((key.scope(), key.key()), ("acme", "k-1"));
    // A version 3 key may not use the wider key area.
    let mut long = header(vec![b'k'; KEY_BYTES_MAX + 1], 1, 0, 0, true);
    long.scope_bytes = 0;
    assert_eq!(SlotHeader::decode(&encode_as(&long, 3)), Err(HeaderFault::BadField));
    assert_eq!(SlotHeader::decode(&encode_as(&long, 4)).map(|h| h.key.len()), Ok(KEY_BYTES_MAX + 1));
}

#[test]
fn a_version_3_tag_that_filled_its_room_is_dropped_before_the_header_is_written_again() {
    // 200 MiB: 200 chunk CRC-32s, a version 3 room of 2972 bytes.
    let mut h = header(b"big".to_vec(), 3, 200 << 20, 1, false);
    let v3_room = OFF_HEADER_CRC - OFF_CHUNK_CRCS_V3 - 4 * h.chunk_crcs.len();
    h.tag = vec![0x77; v3_room - 36];
    let mut page = encode_as(&h, 3);
    put(&mut page, OFF_TAG_LEN, &(v3_room as u16).to_le_bytes());
    page[OFF_HEADER_CRC - v3_room..OFF_HEADER_CRC].fill(0x77);
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    put(&mut page, OFF_HEADER_CRC, &crc.to_le_bytes());
    let mut old = SlotHeader::decode(&page).unwrap();
    assert_eq!(old.tag.len(), v3_room);
    assert!(old.drop_tag_past_room());
    assert!(old.tag.is_empty());
    old.encode(&mut page);
    // One that fits keeps its tag.
    let mut fits = SlotHeader::decode(&encode_as(&h, 3)).unwrap();
    assert!(!fits.drop_tag_past_room());
    assert_eq!(fits.tag.len(), v3_room - 36);
}

#[test]
fn a_scope_length_that_does_not_end_at_a_slash_is_not_a_stored_key() {
    let mut h = header(b"acme/k-1".to_vec(), 11, 0, 0, true);
    h.scope_bytes = 3;
    let mut page = vec![0u8; PAGE_BYTES as usize];
    h.encode(&mut page);
    let got = SlotHeader::decode(&page).unwrap();
    assert_eq!(got.stored_key(), None);
    assert!(!got.is_consistent(4096));
    page[OFF_SCOPE_LEN] = 8;
    let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
    put(&mut page, OFF_HEADER_CRC, &crc.to_le_bytes());
    assert_eq!(SlotHeader::decode(&page), Err(HeaderFault::BadField));
}

proptest! {
    #[test]
    fn chunk_hasher_matches_hashing_each_chunk(len in 0usize..40_000, cut in 1usize..9_000, chunk in 1u32..5_000) {
        let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let mut h = ChunkHasher::new(chunk);
        for piece in data.chunks(cut) {
            h.update(piece);
        }
        let (whole, crcs) = h.finish();
        prop_assert_eq!(whole, crc32fast::hash(&data));
        let expect: Vec<u32> = data.chunks(chunk as usize).map(crc32fast::hash).collect();
        prop_assert_eq!(crcs, expect);
    }
}

#[test]
fn chunk_sizes_fit_every_block_size() {
    assert_eq!(chunk_bytes_for(16 << 20), 1 << 20);
    assert_eq!(chunk_count(16 << 20, 1 << 20), 16);
    assert_eq!(chunk_count(1_228_800, 1 << 20), 2);
    assert_eq!(chunk_count(4096, 1 << 20), 1);
    assert_eq!(chunk_bytes_for(934 << 20), 1 << 20);
    assert_eq!(chunk_bytes_for(935 << 20), 2 << 20);
    let max = super::super::geometry::BLOCK_BYTES_MAX;
    assert!(chunk_count(max, chunk_bytes_for(max)) <= CHUNK_CRCS_MAX as u64);
    assert_eq!(CHUNK_CRCS_MAX, 934);
}

#[test]
fn slot_sizes() {
    assert_eq!(slot_bytes(16 << 20), 4096 + (16 << 20));
    // 1.2 MB = 1,228,800 B = 300 pages exactly.
    assert_eq!(slot_bytes(1_228_800), 4096 + 1_228_800);
    assert_eq!(slot_bytes(1), 8192);
}
