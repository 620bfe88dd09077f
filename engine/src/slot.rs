//! The slot: the unit the log writes. A slot is a 4 KiB header followed by
//! the payload rounded up to 4 KiB, written with one aligned `O_DIRECT`
//! write. Byte offsets are in docs/FORMAT.md and in the constants below;
//! every integer is little-endian.
//!
//! The header carries the full key (so a 128-bit hash collision is caught at
//! read time), a per-shard sequence number (so recovery keeps the newest
//! record of a key and ignores slots left over from a segment's earlier
//! life), the payload's CRC-32, a CRC-32 per chunk of the payload (format 2:
//! each chunk is checked as soon as it is read, so a GET streams verified
//! chunks instead of waiting for the whole block) and a CRC-32 of the header
//! itself (so a torn or stale header is never believed). Format 3 adds the
//! block's tag (`events::tag`: the engine's block hashes and token ids),
//! at the end of the page, so every later KV event of the block names it.
//! Format 4 records the length of the key's owner scope
//! ([`crate::key::StoredKey`]) and widens the key area to
//! [`STORED_KEY_BYTES_MAX`], so a client key may be the longest under any
//! tenant and recovery rebuilds the typed key without parsing it.

use crate::key::{BlockHash, StoredKey, KEY_BYTES_MAX, STORED_KEY_BYTES_MAX};

/// Size of a slot header and of a segment superblock: one 4 KiB page, the
/// `O_DIRECT` alignment of every filesystem we target.
pub const PAGE_BYTES: u64 = 4096;

/// `"KVSL"`: first four bytes of every slot header.
pub const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"KVSL");

/// Version of the slot header layout written now: 2 adds the chunk size and
/// the per-chunk CRC-32s, 3 the block tag, 4 the scope length and the wider
/// key area (the chunk CRC-32s move from byte 320 to 356). Version 1
/// headers (whole-payload CRC only) still decode, with no chunk CRCs;
/// versions 1 and 2 with no tag; versions 1 to 3 with the scope found as
/// they wrote it (below [`SlotHeader::decode`]).
pub const SLOT_VERSION: u16 = 4;

/// Payload bytes covered by one chunk CRC-32 when the block is small enough:
/// 1 MiB, the unit a GET reads, verifies and sends (16 chunks for a 16 MiB
/// block; a 1.2 MB block is one full chunk and one of 180 KiB).
pub const CHUNK_BYTES_DEFAULT: u32 = 1 << 20;

/// Most chunk CRC-32s a header page holds: the 4-byte CRCs fill the page
/// from `OFF_CHUNK_CRCS` to the header's own CRC.
pub const CHUNK_CRCS_MAX: usize = (OFF_HEADER_CRC - OFF_CHUNK_CRCS) / 4;

// Header field offsets (bytes from the start of the slot).
const OFF_MAGIC: usize = 0; // u32
const OFF_VERSION: usize = 4; // u16
const OFF_KIND: usize = 6; // u8
const OFF_SCOPE_LEN: usize = 7; // u8, version 4 (zero before): bytes of the key's owner scope
const OFF_SEQ: usize = 8; // u64
const OFF_HASH: usize = 16; // u128
const OFF_PAYLOAD_LEN: usize = 32; // u64
const OFF_PAYLOAD_CRC: usize = 40; // u32
const OFF_KEY_LEN: usize = 44; // u16
const OFF_TAG_LEN: usize = 46; // u16, version 3 (0: no tag); the tag ends where the header CRC starts
const OFF_WRITE_TIME: usize = 48; // u64, microseconds since the Unix epoch
const OFF_CHUNK_BYTES: usize = 56; // u32, version 2 (0 in version 1 and for tombstones)
const OFF_CHUNK_COUNT: usize = 60; // u32, version 2
const OFF_KEY: usize = 64; // STORED_KEY_BYTES_MAX bytes (KEY_BYTES_MAX before version 4)
/// Where the chunk CRC-32s start (u32 × chunk count): after the key area,
/// rounded up to 4 bytes (356).
const OFF_CHUNK_CRCS: usize = (OFF_KEY + STORED_KEY_BYTES_MAX).div_ceil(4) * 4;
/// Where versions 2 and 3 put them: after a key area of [`KEY_BYTES_MAX`].
const OFF_CHUNK_CRCS_V3: usize = OFF_KEY + KEY_BYTES_MAX;
/// Offset of the header's own CRC-32, which covers bytes `0..OFF_HEADER_CRC`.
const OFF_HEADER_CRC: usize = PAGE_BYTES as usize - 4;

// The header must fit in its page with the key and its own CRC.
const _: () = assert!(OFF_CHUNK_CRCS <= OFF_HEADER_CRC);

/// What a slot records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// A block: the header is followed by `payload_len` bytes.
    Block = 1,
    /// A delete: the key is gone as of this sequence number; no payload.
    Tombstone = 2,
}

/// The decoded fields of a slot header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHeader {
    /// Block or tombstone.
    pub kind: RecordKind,
    /// Per-shard sequence number; higher is newer.
    pub seq: u64,
    /// xxh3-128 of `key`.
    pub hash: BlockHash,
    /// Payload length in bytes (0 for tombstones).
    pub payload_len: u64,
    /// CRC-32 (crc32fast, IEEE) of the payload bytes.
    pub payload_crc: u32,
    /// Microseconds since the Unix epoch at write time.
    pub write_time_us: u64,
    /// The key's persisted form ([`StoredKey::as_str`]), 1 to
    /// [`STORED_KEY_BYTES_MAX`] bytes (at most [`KEY_BYTES_MAX`] before
    /// version 4).
    pub key: Vec<u8>,
    /// Bytes of `key` that are its owner's scope, before a `/`; 0 for the
    /// default owner ([`StoredKey::scope_bytes`]).
    pub scope_bytes: u8,
    /// Payload bytes per chunk CRC ([`chunk_bytes_for`]); 0 when the record
    /// has no chunk CRCs (a version 1 slot, or a tombstone).
    pub chunk_bytes: u32,
    /// CRC-32 of each `chunk_bytes` chunk of the payload in order (the last
    /// one may be shorter); empty when `chunk_bytes` is 0.
    pub chunk_crcs: Vec<u32>,
    /// The block's encoded tag (`crate::events::BlockTag`), kept as bytes;
    /// empty when the client attached none (and in version 1 and 2 slots).
    pub tag: Vec<u8>,
}

/// Why a 4 KiB page is not a usable slot header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderFault {
    /// All zeroes: a slot never written (preallocated space).
    Empty,
    /// Wrong magic: not a slot header at all.
    BadMagic,
    /// Magic right, CRC wrong: torn or damaged.
    BadCrc,
    /// CRC right but a field is out of range (unknown version or kind, key
    /// length over the limit, a tombstone with a payload, chunk CRCs that
    /// do not cover the payload, a tag that overlaps them).
    BadField,
}

impl SlotHeader {
    /// Encodes into the first [`PAGE_BYTES`] of `page`, zeroing the rest of
    /// the page first.
    ///
    /// # Panics
    /// If `page` is shorter than a page or the key is out of bounds;
    /// callers pass keys of a [`StoredKey`].
    pub fn encode(&self, page: &mut [u8]) {
        assert!(page.len() >= PAGE_BYTES as usize, "header page is {} bytes", page.len());
        assert!(!self.key.is_empty() && self.key.len() <= STORED_KEY_BYTES_MAX, "key length {}", self.key.len());
        assert!((self.scope_bytes as usize) < self.key.len(), "scope of {} bytes in a key of {}", self.scope_bytes, self.key.len());
        assert!(self.kind == RecordKind::Block || self.payload_len == 0, "tombstone with a payload");
        assert_eq!(self.chunk_crcs.len() as u64, chunk_count(self.payload_len, self.chunk_bytes), "chunk CRCs cover the payload");
        assert!(
            self.tag.len() <= tag_room_for(self.chunk_crcs.len()),
            "a {}-byte tag beside {} chunk CRCs",
            self.tag.len(),
            self.chunk_crcs.len()
        );
        let page = &mut page[..PAGE_BYTES as usize];
        page.fill(0);
        put(page, OFF_MAGIC, &SLOT_MAGIC.to_le_bytes());
        put(page, OFF_VERSION, &SLOT_VERSION.to_le_bytes());
        page[OFF_KIND] = self.kind as u8;
        page[OFF_SCOPE_LEN] = self.scope_bytes;
        put(page, OFF_SEQ, &self.seq.to_le_bytes());
        put(page, OFF_HASH, &self.hash.0.to_le_bytes());
        put(page, OFF_PAYLOAD_LEN, &self.payload_len.to_le_bytes());
        put(page, OFF_PAYLOAD_CRC, &self.payload_crc.to_le_bytes());
        put(page, OFF_KEY_LEN, &(self.key.len() as u16).to_le_bytes());
        put(page, OFF_WRITE_TIME, &self.write_time_us.to_le_bytes());
        put(page, OFF_CHUNK_BYTES, &self.chunk_bytes.to_le_bytes());
        put(page, OFF_CHUNK_COUNT, &(self.chunk_crcs.len() as u32).to_le_bytes());
        put(page, OFF_TAG_LEN, &(self.tag.len() as u16).to_le_bytes());
        put(page, OFF_KEY, &self.key);
        put(page, OFF_HEADER_CRC - self.tag.len(), &self.tag);
        for (i, crc) in self.chunk_crcs.iter().enumerate() {
            put(page, OFF_CHUNK_CRCS + 4 * i, &crc.to_le_bytes());
        }
        let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
        put(page, OFF_HEADER_CRC, &crc.to_le_bytes());
        // Pair assertion: what we are about to write must read back as itself.
        debug_assert_eq!(SlotHeader::decode(page).as_ref(), Ok(self));
    }

    /// Decodes and checks a header page. Versions 1 to 3 recorded no scope
    /// length: they wrote a tenant's key as `SCOPE/KEY` and a client key has
    /// no `/`, so the scope of such a header is what precedes its first `/`.
    ///
    /// # Errors
    /// The [`HeaderFault`] that makes the page unusable.
    pub fn decode(page: &[u8]) -> Result<SlotHeader, HeaderFault> {
        assert!(page.len() >= PAGE_BYTES as usize, "header page is {} bytes", page.len());
        let page = &page[..PAGE_BYTES as usize];
        let magic = u32::from_le_bytes(get(page, OFF_MAGIC));
        if magic != SLOT_MAGIC {
            return Err(if page.iter().all(|b| *b == 0) { HeaderFault::Empty } else { HeaderFault::BadMagic });
        }
        let crc = u32::from_le_bytes(get(page, OFF_HEADER_CRC));
        if crc != crc32fast::hash(&page[..OFF_HEADER_CRC]) {
            return Err(HeaderFault::BadCrc);
        }
        let kind = match page[OFF_KIND] {
            1 => RecordKind::Block,
            2 => RecordKind::Tombstone,
            _ => return Err(HeaderFault::BadField),
        };
        let key_len = u16::from_le_bytes(get(page, OFF_KEY_LEN)) as usize;
        let version = u16::from_le_bytes(get(page, OFF_VERSION));
        let key_max = if version >= 4 { STORED_KEY_BYTES_MAX } else { KEY_BYTES_MAX };
        if !(1..=SLOT_VERSION).contains(&version) || key_len == 0 || key_len > key_max {
            return Err(HeaderFault::BadField);
        }
        let key = &page[OFF_KEY..OFF_KEY + key_len];
        let scope_bytes = match version {
            4.. => page[OFF_SCOPE_LEN],
            _ => key.iter().position(|b| *b == b'/').unwrap_or(0) as u8,
        };
        if scope_bytes as usize >= key_len {
            return Err(HeaderFault::BadField);
        }
        let crcs_at = if version >= 4 { OFF_CHUNK_CRCS } else { OFF_CHUNK_CRCS_V3 };
        let payload_len = u64::from_le_bytes(get(page, OFF_PAYLOAD_LEN));
        if kind == RecordKind::Tombstone && payload_len != 0 {
            return Err(HeaderFault::BadField);
        }
        let (chunk_bytes, count) = match version {
            1 => (0, 0),
            _ => (u32::from_le_bytes(get(page, OFF_CHUNK_BYTES)), u32::from_le_bytes(get(page, OFF_CHUNK_COUNT)) as usize),
        };
        if count > (OFF_HEADER_CRC - crcs_at) / 4 || count as u64 != chunk_count(payload_len, chunk_bytes) {
            return Err(HeaderFault::BadField);
        }
        let tag_len = if version >= 3 { u16::from_le_bytes(get(page, OFF_TAG_LEN)) as usize } else { 0 };
        if tag_len > OFF_HEADER_CRC - crcs_at - 4 * count {
            return Err(HeaderFault::BadField);
        }
        Ok(SlotHeader {
            kind,
            seq: u64::from_le_bytes(get(page, OFF_SEQ)),
            hash: BlockHash(u128::from_le_bytes(get(page, OFF_HASH))),
            payload_len,
            payload_crc: u32::from_le_bytes(get(page, OFF_PAYLOAD_CRC)),
            write_time_us: u64::from_le_bytes(get(page, OFF_WRITE_TIME)),
            key: key.to_vec(),
            scope_bytes,
            chunk_bytes,
            chunk_crcs: (0..count).map(|i| u32::from_le_bytes(get(page, crcs_at + 4 * i))).collect(),
            tag: page[OFF_HEADER_CRC - tag_len..OFF_HEADER_CRC].to_vec(),
        })
    }
}

impl SlotHeader {
    /// Makes a header decoded from an older version fit this version's page
    /// before it is written again (a reclaim keeping its block): a tag
    /// longer than the room beside its chunk CRC-32s now is dropped. Only a
    /// version 3 header of a block over 166 MiB can have one, since version
    /// 4's wider key area took 36 bytes of that room (a tag may be 3,072
    /// bytes; version 4 leaves less beside more than 166 chunk CRC-32s).
    /// Returns whether the tag was dropped.
    pub fn drop_tag_past_room(&mut self) -> bool {
        let past = self.tag.len() > tag_room_for(self.chunk_crcs.len());
        if past {
            self.tag.clear();
        }
        past
    }

    /// The typed key the header records; `None` when its key and scope
    /// length do not make one ([`StoredKey::from_persisted`]).
    pub fn stored_key(&self) -> Option<StoredKey> {
        StoredKey::from_persisted(&self.key, self.scope_bytes)
    }

    /// Whether a decoded header is a record this store can hold: its key is
    /// a valid [`StoredKey`], its hash is its key's, and its length fits its
    /// kind (`block_bytes` for a block, 0 for a tombstone). Recovery skips,
    /// and fsck reports, any that is not.
    pub fn is_consistent(&self, block_bytes: u64) -> bool {
        self.hash == BlockHash::of(&self.key)
            && self.stored_key().is_some()
            && match self.kind {
                RecordKind::Block => self.payload_len == block_bytes,
                RecordKind::Tombstone => self.payload_len == 0,
            }
    }
}

/// Payload bytes per chunk CRC for blocks of `block_bytes`:
/// [`CHUNK_BYTES_DEFAULT`], doubled until the chunk count fits in a header
/// page ([`CHUNK_CRCS_MAX`]; only blocks over 934 MiB need 2 MiB chunks).
pub const fn chunk_bytes_for(block_bytes: u64) -> u32 {
    let mut chunk = CHUNK_BYTES_DEFAULT as u64;
    while block_bytes.div_ceil(chunk) > CHUNK_CRCS_MAX as u64 {
        chunk *= 2;
    }
    chunk as u32
}

/// Bytes a header page has for a tag beside `chunk_crcs` chunk CRC-32s.
const fn tag_room_for(chunk_crcs: usize) -> usize {
    OFF_HEADER_CRC - OFF_CHUNK_CRCS - 4 * chunk_crcs
}

/// Longest block tag a slot of a `block_bytes` block can hold: the header
/// page's room after its chunk CRC-32s (3672 bytes for a 16 MiB block),
/// never over `events::tag::TAG_BYTES_MAX`.
pub const fn tag_room(block_bytes: u64) -> usize {
    let room = tag_room_for(chunk_count(block_bytes, chunk_bytes_for(block_bytes)) as usize);
    if room < crate::events::TAG_BYTES_MAX {
        room
    } else {
        crate::events::TAG_BYTES_MAX
    }
}

/// Number of chunks of `chunk_bytes` in a payload of `payload_len` (0 when
/// `chunk_bytes` is 0: no chunk CRCs).
pub const fn chunk_count(payload_len: u64, chunk_bytes: u32) -> u64 {
    if chunk_bytes == 0 {
        0
    } else {
        payload_len.div_ceil(chunk_bytes as u64)
    }
}

/// Computes a payload's CRC-32 and its per-chunk CRC-32s in one pass over
/// bytes fed in pieces of any size (a PUT body arrives as the frames the
/// client sent). The whole-payload CRC is combined from the chunk CRCs
/// (`crc32fast::Hasher::combine`), so no byte is hashed twice.
pub struct ChunkHasher {
    chunk_bytes: u64,
    in_chunk: u64,
    chunk: crc32fast::Hasher,
    whole: crc32fast::Hasher,
    crcs: Vec<u32>,
}

impl ChunkHasher {
    /// A hasher for chunks of `chunk_bytes` (> 0).
    pub fn new(chunk_bytes: u32) -> Self {
        assert!(chunk_bytes > 0, "chunk_bytes is positive");
        ChunkHasher {
            chunk_bytes: chunk_bytes as u64,
            in_chunk: 0,
            chunk: crc32fast::Hasher::new(),
            whole: crc32fast::Hasher::new(),
            crcs: Vec::new(),
        }
    }

    /// Feeds the next bytes of the payload.
    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = ((self.chunk_bytes - self.in_chunk) as usize).min(bytes.len());
            self.chunk.update(&bytes[..take]);
            self.in_chunk += take as u64;
            bytes = &bytes[take..];
            if self.in_chunk == self.chunk_bytes {
                self.end_chunk();
            }
        }
    }

    fn end_chunk(&mut self) {
        let done = std::mem::replace(&mut self.chunk, crc32fast::Hasher::new());
        self.whole.combine(&done);
        self.crcs.push(done.finalize());
        self.in_chunk = 0;
    }

    /// The whole-payload CRC-32 and the chunk CRC-32s (the last chunk may
    /// be short).
    pub fn finish(mut self) -> (u32, Vec<u32>) {
        if self.in_chunk > 0 {
            self.end_chunk();
        }
        (self.whole.finalize(), self.crcs)
    }
}

/// What is wrong with a block's payload, if anything: its whole-block
/// CRC-32, then (format 2) each chunk's CRC-32, naming the first chunk
/// that fails. `payload` is the payload as read (`header.payload_len`
/// bytes when the slot is whole; any other length is a fault).
pub fn payload_fault(header: &SlotHeader, payload: &[u8]) -> Option<String> {
    if payload.len() as u64 != header.payload_len {
        return Some(format!("payload is {} bytes, the header says {}", payload.len(), header.payload_len));
    }
    if header.chunk_bytes == 0 {
        return (crc32fast::hash(payload) != header.payload_crc).then(|| "payload CRC-32 mismatch".to_string());
    }
    let mut crcs = ChunkHasher::new(header.chunk_bytes);
    crcs.update(payload);
    let (whole, chunks) = crcs.finish();
    let chunk = chunks.iter().zip(&header.chunk_crcs).position(|(got, want)| got != want);
    match (whole == header.payload_crc, chunk) {
        (true, None) => None,
        (_, Some(i)) => Some(format!("payload CRC-32 mismatch in chunk {i} of {} ({} bytes each)", chunks.len(), header.chunk_bytes)),
        (false, None) => Some("payload CRC-32 mismatch (chunk CRC-32s match: the header's whole-block CRC is wrong)".to_string()),
    }
}

/// Bytes one slot takes on disk for a payload of `payload_bytes`: a header
/// page plus the payload rounded up to whole pages.
pub const fn slot_bytes(payload_bytes: u64) -> u64 {
    PAGE_BYTES + round_up_page(payload_bytes)
}

/// Rounds up to a multiple of [`PAGE_BYTES`].
pub const fn round_up_page(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES
}

pub(crate) fn put(page: &mut [u8], offset: usize, bytes: &[u8]) {
    page[offset..offset + bytes.len()].copy_from_slice(bytes);
}

pub(crate) fn get<const N: usize>(page: &[u8], offset: usize) -> [u8; N] {
    page[offset..offset + N].try_into().expect("field within page")
}

/// Microseconds since the Unix epoch, for write times.
pub fn now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests;
