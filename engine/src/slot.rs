//! The slot: the unit the log writes. A slot is a 4 KiB header followed by
//! the payload rounded up to 4 KiB, written with one aligned `O_DIRECT`
//! write. Byte offsets are in docs/FORMAT.md and in the constants below;
//! every integer is little-endian.
//!
//! The header carries the full key (so a 128-bit hash collision is caught at
//! read time), a per-shard sequence number (so recovery keeps the newest
//! record of a key and ignores slots left over from a segment's earlier
//! life), the payload's CRC-32 (checked before a byte is served) and a CRC-32
//! of the header itself (so a torn or stale header is never believed).

use crate::key::{BlockHash, KEY_BYTES_MAX};

/// Size of a slot header and of a segment superblock: one 4 KiB page, the
/// `O_DIRECT` alignment of every filesystem we target.
pub const PAGE_BYTES: u64 = 4096;

/// `"KVSL"`: first four bytes of every slot header.
pub const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"KVSL");

/// Version of the slot header layout.
pub const SLOT_VERSION: u16 = 1;

// Header field offsets (bytes from the start of the slot).
const OFF_MAGIC: usize = 0; // u32
const OFF_VERSION: usize = 4; // u16
const OFF_KIND: usize = 6; // u8
const OFF_SEQ: usize = 8; // u64
const OFF_HASH: usize = 16; // u128
const OFF_PAYLOAD_LEN: usize = 32; // u64
const OFF_PAYLOAD_CRC: usize = 40; // u32
const OFF_KEY_LEN: usize = 44; // u16
const OFF_WRITE_TIME: usize = 48; // u64, microseconds since the Unix epoch
const OFF_KEY: usize = 64; // KEY_BYTES_MAX bytes
/// Offset of the header's own CRC-32, which covers bytes `0..OFF_HEADER_CRC`.
const OFF_HEADER_CRC: usize = PAGE_BYTES as usize - 4;

// The header must fit in its page with the key and its own CRC.
const _: () = assert!(OFF_KEY + KEY_BYTES_MAX <= OFF_HEADER_CRC);

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
    /// The full key, 1..=[`KEY_BYTES_MAX`] bytes.
    pub key: Vec<u8>,
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
    /// length over the limit).
    BadField,
}

impl SlotHeader {
    /// Encodes into the first [`PAGE_BYTES`] of `page`, zeroing the rest of
    /// the page first.
    ///
    /// # Panics
    /// If `page` is shorter than a page or the key breaks the key rules;
    /// callers validate keys before this point.
    pub fn encode(&self, page: &mut [u8]) {
        assert!(page.len() >= PAGE_BYTES as usize, "header page is {} bytes", page.len());
        assert!(!self.key.is_empty() && self.key.len() <= KEY_BYTES_MAX, "key length {}", self.key.len());
        assert!(self.kind == RecordKind::Block || self.payload_len == 0, "tombstone with a payload");
        let page = &mut page[..PAGE_BYTES as usize];
        page.fill(0);
        put(page, OFF_MAGIC, &SLOT_MAGIC.to_le_bytes());
        put(page, OFF_VERSION, &SLOT_VERSION.to_le_bytes());
        page[OFF_KIND] = self.kind as u8;
        put(page, OFF_SEQ, &self.seq.to_le_bytes());
        put(page, OFF_HASH, &self.hash.0.to_le_bytes());
        put(page, OFF_PAYLOAD_LEN, &self.payload_len.to_le_bytes());
        put(page, OFF_PAYLOAD_CRC, &self.payload_crc.to_le_bytes());
        put(page, OFF_KEY_LEN, &(self.key.len() as u16).to_le_bytes());
        put(page, OFF_WRITE_TIME, &self.write_time_us.to_le_bytes());
        put(page, OFF_KEY, &self.key);
        let crc = crc32fast::hash(&page[..OFF_HEADER_CRC]);
        put(page, OFF_HEADER_CRC, &crc.to_le_bytes());
        // Pair assertion: what we are about to write must read back as itself.
        debug_assert_eq!(SlotHeader::decode(page).as_ref(), Ok(self));
    }

    /// Decodes and checks a header page.
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
        if u16::from_le_bytes(get(page, OFF_VERSION)) != SLOT_VERSION || key_len == 0 || key_len > KEY_BYTES_MAX {
            return Err(HeaderFault::BadField);
        }
        Ok(SlotHeader {
            kind,
            seq: u64::from_le_bytes(get(page, OFF_SEQ)),
            hash: BlockHash(u128::from_le_bytes(get(page, OFF_HASH))),
            payload_len: u64::from_le_bytes(get(page, OFF_PAYLOAD_LEN)),
            payload_crc: u32::from_le_bytes(get(page, OFF_PAYLOAD_CRC)),
            write_time_us: u64::from_le_bytes(get(page, OFF_WRITE_TIME)),
            key: page[OFF_KEY..OFF_KEY + key_len].to_vec(),
        })
    }
}

impl SlotHeader {
    /// Whether a decoded header is a record this store can hold: its hash is
    /// its key's, and its length fits its kind (`block_bytes` for a block,
    /// 0 for a tombstone). Recovery skips, and fsck reports, any that is not.
    pub fn is_consistent(&self, block_bytes: u64) -> bool {
        self.hash == BlockHash::of(&self.key)
            && match self.kind {
                RecordKind::Block => self.payload_len == block_bytes,
                RecordKind::Tombstone => self.payload_len == 0,
            }
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(key: Vec<u8>, seq: u64, payload_len: u64, crc: u32, tomb: bool) -> SlotHeader {
        SlotHeader {
            kind: if tomb { RecordKind::Tombstone } else { RecordKind::Block },
            seq,
            hash: BlockHash::of(&key),
            payload_len: if tomb { 0 } else { payload_len },
            payload_crc: crc,
            write_time_us: 1_700_000_000_000_000,
            key,
        }
    }

    proptest! {
        #[test]
        fn encode_decode_round_trip(
            key in proptest::collection::vec(proptest::sample::select(b"abcXYZ019._~-".to_vec()), 1..=KEY_BYTES_MAX),
            seq in any::<u64>(), len in any::<u64>(), crc in any::<u32>(), tomb in any::<bool>(),
        ) {
            let h = header(key, seq, len, crc, tomb);
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
    fn empty_page_is_empty_not_corrupt() {
        assert_eq!(SlotHeader::decode(&[0u8; 4096]), Err(HeaderFault::Empty));
        assert_eq!(SlotHeader::decode(&[7u8; 4096]), Err(HeaderFault::BadMagic));
    }

    #[test]
    fn slot_sizes() {
        assert_eq!(slot_bytes(16 << 20), 4096 + (16 << 20));
        // 1.2 MB = 1,228,800 B = 300 pages exactly.
        assert_eq!(slot_bytes(1_228_800), 4096 + 1_228_800);
        assert_eq!(slot_bytes(1), 8192);
    }
}
