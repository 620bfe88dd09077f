//! Where blocks live in the bucket and the bytes of one object
//! (docs/FORMAT.md, "Shared tier objects"): `PREFIX/kvtier/v2/BLOCK_BYTES/XX/KEY`,
//! `XX` the key's block hash's low byte in hex (spreads keys over S3's
//! partitions); the object is a header (magic, header length, block size,
//! payload CRC-32, key, block tag (format 2), header CRC-32) followed by the
//! payload. A read checks all of it before a byte is served; format 1
//! objects (no tag) still read.

use bytes::{BufMut, Bytes, BytesMut};
use kvtier_engine::key::StoredKey;

/// Object header magic: "KVTS3" + format 2 (format 1 had no block tag).
pub const OBJECT_MAGIC: [u8; 8] = *b"KVTS3\0\0\x02";

/// Format 1's magic: still read, never written.
const OBJECT_MAGIC_V1: [u8; 8] = *b"KVTS3\0\0\x01";

/// Fixed part of the object header before the key: magic (8), header
/// length (u32), block bytes (u64), payload CRC-32 (u32), key length (u16).
const HEADER_FIXED_BYTES: usize = 8 + 4 + 8 + 4 + 2;

/// Where the shared tier lives, parsed from `--s3-url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Location {
    /// Bucket name.
    pub bucket: String,
    /// Prefix inside the bucket, without leading or trailing `/` (may be
    /// empty).
    pub prefix: String,
}

/// Parses `s3://BUCKET[/PREFIX]`.
///
/// # Errors
/// A message naming what is wrong: another scheme, no bucket, an empty
/// path segment.
pub fn parse_url(url: &str) -> Result<S3Location, String> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| format!("--s3-url {url:?} must look like s3://BUCKET[/PREFIX]"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(format!("--s3-url {url:?} names no bucket; expected s3://BUCKET[/PREFIX]"));
    }
    if !bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.') {
        return Err(format!("--s3-url {url:?}: bucket {bucket:?} may hold only a-z, 0-9, '-' and '.'"));
    }
    let prefix = prefix.trim_matches('/');
    if prefix.split('/').any(|s| s.is_empty() || s == "." || s == "..") && !prefix.is_empty() {
        return Err(format!("--s3-url {url:?}: the prefix {prefix:?} has an empty, '.' or '..' segment"));
    }
    Ok(S3Location { bucket: bucket.to_string(), prefix: prefix.to_string() })
}

/// The object name of the stored `key` for blocks of `block_bytes`:
/// `PREFIX/kvtier/v2/BLOCK_BYTES/XX/KEY`, and for a tenant's key (one with
/// a scope, docs/OPERATIONS.md "Tenants")
/// `PREFIX/tenants/SCOPE/kvtier/v2/BLOCK_BYTES/XX/KEY`: each tenant's
/// blocks under a prefix of their own, which the bucket's lifecycle rules,
/// quotas and policies can name. `XX` is the low byte of the block hash, in
/// hex, spreading keys over 256 prefixes.
pub fn object_name(prefix: &str, block_bytes: u64, key: &StoredKey) -> String {
    let spread = key.hash().0 as u8;
    let base = match key.scope() {
        "" => format!("kvtier/v2/{block_bytes}/{spread:02x}/{}", key.key()),
        scope => format!("tenants/{scope}/kvtier/v2/{block_bytes}/{spread:02x}/{}", key.key()),
    };
    if prefix.is_empty() {
        base
    } else {
        format!("{prefix}/{base}")
    }
}

/// The object header for `key` and a payload of `block_bytes` with CRC-32
/// `payload_crc` and the block's encoded tag, if any (docs/FORMAT.md).
pub fn encode_header(key: &str, block_bytes: u64, payload_crc: u32, tag: Option<&[u8]>) -> Bytes {
    let tag = tag.unwrap_or_default();
    let header_len = HEADER_FIXED_BYTES + key.len() + 2 + tag.len() + 4;
    let mut b = BytesMut::with_capacity(header_len);
    b.put_slice(&OBJECT_MAGIC);
    b.put_u32_le(header_len as u32);
    b.put_u64_le(block_bytes);
    b.put_u32_le(payload_crc);
    b.put_u16_le(key.len() as u16);
    b.put_slice(key.as_bytes());
    b.put_u16_le(tag.len() as u16);
    b.put_slice(tag);
    let crc = crc32fast::hash(&b);
    b.put_u32_le(crc);
    b.freeze()
}

/// Why an object read back is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectFault {
    /// Shorter than its header says, or than the block.
    Truncated,
    /// Not a kvtier block object (magic or header CRC wrong).
    BadHeader,
    /// Holds another key (a wrong object name or a copied object).
    WrongKey,
    /// Written for another block size.
    WrongBlockBytes(u64),
    /// Longer than header + block.
    TrailingBytes,
    /// The payload's CRC-32 does not match the header's.
    PayloadCrc,
}

/// A checked object: its payload and block tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// The payload (a slice of the object read, no copy).
    pub payload: Bytes,
    /// The encoded block tag it was uploaded with; `None` for none (and for
    /// format 1 objects).
    pub tag: Option<Bytes>,
}

/// Checks an object read back and returns its payload and tag.
///
/// # Errors
/// The first check that failed.
pub fn decode_object(object: &Bytes, key: &str, block_bytes: u64) -> Result<Object, ObjectFault> {
    if object.len() < HEADER_FIXED_BYTES + 4 {
        return Err(ObjectFault::Truncated);
    }
    let v1 = match object[..8].try_into().expect("8 bytes") {
        OBJECT_MAGIC => false,
        OBJECT_MAGIC_V1 => true,
        _ => return Err(ObjectFault::BadHeader),
    };
    let u32_at = |i: usize| u32::from_le_bytes(object[i..i + 4].try_into().expect("4 bytes"));
    let header_len = u32_at(8) as usize;
    let key_len = u16::from_le_bytes(object[24..26].try_into().expect("2 bytes")) as usize;
    let tag_at = HEADER_FIXED_BYTES + key_len;
    let tag_len = match v1 {
        true => None,
        false if object.len() >= tag_at + 2 => Some(u16::from_le_bytes(object[tag_at..tag_at + 2].try_into().expect("2 bytes")) as usize),
        false => return Err(ObjectFault::Truncated),
    };
    if header_len != tag_at + tag_len.map_or(0, |t| 2 + t) + 4 {
        return Err(ObjectFault::BadHeader);
    }
    if object.len() < header_len {
        return Err(ObjectFault::Truncated);
    }
    if crc32fast::hash(&object[..header_len - 4]) != u32_at(header_len - 4) {
        return Err(ObjectFault::BadHeader);
    }
    let tag = tag_len.filter(|t| *t > 0).map(|t| object.slice(tag_at + 2..tag_at + 2 + t));
    let stored_block_bytes = u64::from_le_bytes(object[12..20].try_into().expect("8 bytes"));
    if stored_block_bytes != block_bytes {
        return Err(ObjectFault::WrongBlockBytes(stored_block_bytes));
    }
    if &object[HEADER_FIXED_BYTES..HEADER_FIXED_BYTES + key_len] != key.as_bytes() {
        return Err(ObjectFault::WrongKey);
    }
    let end = header_len as u64 + block_bytes;
    if (object.len() as u64) < end {
        return Err(ObjectFault::Truncated);
    }
    if object.len() as u64 > end {
        return Err(ObjectFault::TrailingBytes);
    }
    let payload = object.slice(header_len..);
    if crc32fast::hash(&payload) != u32_at(20) {
        return Err(ObjectFault::PayloadCrc);
    }
    Ok(Object { payload, tag })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_are_refused_with_the_reason() {
        assert_eq!(parse_url("s3://kv-cache").unwrap(), S3Location { bucket: "kv-cache".into(), prefix: "".into() });
        assert_eq!(parse_url("s3://kv-cache/fleet/a/").unwrap(), S3Location { bucket: "kv-cache".into(), prefix: "fleet/a".into() });
        assert!(parse_url("https://kv-cache").unwrap_err().contains("s3://BUCKET"));
        assert!(parse_url("s3://").unwrap_err().contains("names no bucket"));
        assert!(parse_url("s3:///prefix").unwrap_err().contains("names no bucket"));
        assert!(parse_url("s3://Kv_Cache").unwrap_err().contains("may hold only"));
        assert!(parse_url("s3://kv/a//b").unwrap_err().contains("empty"));
        assert!(parse_url("s3://kv/a/../b").unwrap_err().contains("'..'"));
    }

    #[test]
    fn object_names_carry_prefix_block_size_and_a_spread_byte() {
        let key = |scope: &str, key: &str| StoredKey::new(scope, key).unwrap();
        let name = object_name("fleet", 65_536, &key("", "k-1"));
        let spread = kvtier_engine::key::BlockHash::of(b"k-1").0 as u8;
        assert_eq!(name, format!("fleet/kvtier/v2/65536/{spread:02x}/k-1"));
        assert_eq!(object_name("", 65_536, &key("", "k-1")), format!("kvtier/v2/65536/{spread:02x}/k-1"));
        let spread = kvtier_engine::key::BlockHash::of(b"acme/k-1").0 as u8;
        assert_eq!(object_name("fleet", 65_536, &key("acme", "k-1")), format!("fleet/tenants/acme/kvtier/v2/65536/{spread:02x}/k-1"));
    }

    fn object(key: &str, payload: &[u8]) -> Bytes {
        let mut b = encode_header(key, payload.len() as u64, crc32fast::hash(payload), None).to_vec();
        b.extend_from_slice(payload);
        b.into()
    }

    #[test]
    fn a_tag_round_trips_and_format_1_objects_still_read() {
        let payload = vec![7u8; 4096];
        let mut b = encode_header("k-1", 4096, crc32fast::hash(&payload), Some(b"tag-bytes")).to_vec();
        b.extend_from_slice(&payload);
        let got = decode_object(&b.into(), "k-1", 4096).unwrap();
        assert_eq!((got.payload.len(), got.tag.as_deref()), (4096, Some(&b"tag-bytes"[..])));
        // Format 1, as the previous release wrote it: no tag length.
        let mut v1 = Vec::new();
        v1.extend_from_slice(&OBJECT_MAGIC_V1);
        v1.extend_from_slice(&((HEADER_FIXED_BYTES + 3 + 4) as u32).to_le_bytes());
        v1.extend_from_slice(&4096u64.to_le_bytes());
        v1.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        v1.extend_from_slice(&3u16.to_le_bytes());
        v1.extend_from_slice(b"k-1");
        let crc = crc32fast::hash(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        v1.extend_from_slice(&payload);
        assert_eq!(decode_object(&v1.into(), "k-1", 4096).unwrap(), Object { payload: payload.into(), tag: None });
    }

    #[test]
    fn an_object_round_trips_and_every_damage_is_refused() {
        let payload: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        let good = object("k-1", &payload);
        assert_eq!(decode_object(&good, "k-1", 4096).unwrap().payload, &payload[..]);
        assert_eq!(decode_object(&good, "k-2", 4096), Err(ObjectFault::WrongKey));
        assert_eq!(decode_object(&good, "k-1", 8192), Err(ObjectFault::WrongBlockBytes(4096)));
        assert_eq!(decode_object(&good.slice(..good.len() - 1), "k-1", 4096), Err(ObjectFault::Truncated));
        assert_eq!(decode_object(&good.slice(..10), "k-1", 4096), Err(ObjectFault::Truncated));
        let mut longer = good.to_vec();
        longer.push(0);
        assert_eq!(decode_object(&longer.into(), "k-1", 4096), Err(ObjectFault::TrailingBytes));
        // A flipped payload byte, header byte, or magic byte.
        for (at, fault) in [(good.len() - 7, ObjectFault::PayloadCrc), (21, ObjectFault::BadHeader), (0, ObjectFault::BadHeader)] {
            let mut bad = good.to_vec();
            bad[at] ^= 0x5a;
            assert_eq!(decode_object(&bad.into(), "k-1", 4096), Err(fault), "flip at {at}");
        }
    }
}
