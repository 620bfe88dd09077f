//! The block tag of an HTTP PUT, read from its headers (docs/API.md,
//! "Block tags"): the inference engine's block hashes, their parent, the
//! tokens per engine block and the token ids, which KV events name the
//! block by ([`kvtier_engine::events::BlockTag`]).
//!
//! ```text
//! x-kvtier-block-hashes: 0001020304050607,08090a0b0c0d0e0f   hex, one width, 1 to 32 bytes each
//! x-kvtier-parent-hash:  f0f1f2f3f4f5f6f7                    optional; none: the first block starts a sequence
//! x-kvtier-block-size:   2                                   tokens per engine block; required with hashes
//! x-kvtier-token-ids:    1,2,300,70000                       optional; hashes × block size of them
//! ```
//!
//! Read before the body (a bad tag is answered 400 `invalid_tag` and the
//! body drained, nothing stored). Each message names the header and what is
//! wrong with it, so a client writer can fix the request from the message.

use bytes::Bytes;
use http::HeaderMap;
use kvtier_engine::events::tag::{BlockTag, TAG_HASHES_MAX, TAG_HASH_BYTES_MAX, TAG_TOKENS_MAX};

/// The engine's block hashes, comma-separated hex.
pub const BLOCK_HASHES_HEADER: &str = "x-kvtier-block-hashes";
/// The hash of the engine block before the first, hex.
pub const PARENT_HASH_HEADER: &str = "x-kvtier-parent-hash";
/// Tokens per engine block, decimal.
pub const BLOCK_SIZE_HEADER: &str = "x-kvtier-block-size";
/// The blocks' token ids, comma-separated decimal u32s.
pub const TOKEN_IDS_HEADER: &str = "x-kvtier-token-ids";

/// The encoded block tag the headers give, `None` when they give none
/// (no tag header at all). `block_bytes` is the store's: a tag must fit its
/// slot header ([`kvtier_engine::slot::tag_room`]). Pure: the fuzz target
/// `http_route` may drive it.
///
/// # Errors
/// A message naming the header and what is wrong: not ASCII, given twice,
/// bad hex, hashes of different widths or over 32 bytes, more than 64
/// hashes, a parent of another width, a block size missing or out of
/// range, token ids not decimal u32s or not hashes × block size of them,
/// a parent, block size or token ids without hashes, a tag too long for
/// this store.
pub fn tag_from_headers(headers: &HeaderMap, block_bytes: u64) -> Result<Option<Bytes>, String> {
    let hashes = one(headers, BLOCK_HASHES_HEADER)?;
    let parent = one(headers, PARENT_HASH_HEADER)?;
    let size = one(headers, BLOCK_SIZE_HEADER)?;
    let tokens = one(headers, TOKEN_IDS_HEADER)?;
    let Some(hashes) = hashes else {
        if let Some(name) = [(PARENT_HASH_HEADER, parent), (BLOCK_SIZE_HEADER, size), (TOKEN_IDS_HEADER, tokens)]
            .into_iter()
            .find_map(|(name, v)| v.map(|_| name))
        {
            return Err(format!("{name} without {BLOCK_HASHES_HEADER}: a block tag starts with the engine's block hashes"));
        }
        return Ok(None);
    };
    let block_hashes = hex_list(hashes)?;
    let parent_hash = parent.map(|p| hex(p).map_err(|e| format!("{PARENT_HASH_HEADER}: {e}"))).transpose()?;
    if let Some(p) = &parent_hash {
        if p.len() != block_hashes[0].len() {
            return Err(format!(
                "{PARENT_HASH_HEADER} is {} bytes, the {BLOCK_HASHES_HEADER} {}: every hash of a tag has one width",
                p.len(),
                block_hashes[0].len()
            ));
        }
    }
    let Some(size) = size else {
        return Err(format!("{BLOCK_HASHES_HEADER} without {BLOCK_SIZE_HEADER}: say how many tokens each engine block holds"));
    };
    let block_size = size
        .parse::<u32>()
        .ok()
        .filter(|n| (1..=65536).contains(n))
        .ok_or_else(|| format!("{BLOCK_SIZE_HEADER} {size:?} is not a number of tokens from 1 to 65536"))?;
    let token_ids = tokens.map(|t| token_list(t, block_hashes.len(), block_size)).transpose()?.unwrap_or_default();
    let tag = BlockTag { block_hashes, parent_hash, block_size, token_ids };
    // The checks above name the header; these are the tag's own rules
    // (kept in one place, the engine's), reached only by a combination
    // the checks above let through.
    tag.validate().map_err(|e| format!("block tag: {e}"))?;
    let room = kvtier_engine::slot::tag_room(block_bytes);
    if tag.encoded_len() > room {
        return Err(format!(
            "block tag: {} bytes encoded; a slot header of this store's {block_bytes}-byte blocks holds {room}: send fewer token ids or hashes",
            tag.encoded_len()
        ));
    }
    Ok(Some(tag.encode()))
}

/// The value of header `name`, if given once; ASCII (HTTP allows other
/// bytes, none of which any of these headers has).
fn one<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, String> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let more = values.count();
    if more > 0 {
        return Err(format!("{name} given {} times; send it once", more + 1));
    }
    let value = value.to_str().map_err(|_| format!("{name} has bytes that are not visible ASCII"))?.trim();
    if value.is_empty() {
        return Err(format!("{name} is empty; leave the header out instead"));
    }
    Ok(Some(value))
}

/// Comma-separated hashes of one width, at most [`TAG_HASHES_MAX`].
fn hex_list(value: &str) -> Result<Vec<Vec<u8>>, String> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for (i, item) in value.split(',').enumerate() {
        if i == TAG_HASHES_MAX {
            return Err(format!(
                "{BLOCK_HASHES_HEADER} lists more than {TAG_HASHES_MAX} hashes; a block tag holds at most {TAG_HASHES_MAX}"
            ));
        }
        let hash = hex(item.trim()).map_err(|e| format!("{BLOCK_HASHES_HEADER}: hash {i}: {e}"))?;
        if let Some(first) = out.first() {
            if first.len() != hash.len() {
                return Err(format!(
                    "{BLOCK_HASHES_HEADER}: hash {i} is {} bytes, hash 0 is {}: every hash of a tag has one width",
                    hash.len(),
                    first.len()
                ));
            }
        }
        out.push(hash);
    }
    Ok(out)
}

/// One hash: an even number of hex digits (either case), 1 to
/// [`TAG_HASH_BYTES_MAX`] bytes.
fn hex(text: &str) -> Result<Vec<u8>, String> {
    if text.is_empty() || !text.len().is_multiple_of(2) || text.len() > 2 * TAG_HASH_BYTES_MAX {
        return Err(format!("{text:?} is not 2 to {} hex digits, an even number of them", 2 * TAG_HASH_BYTES_MAX));
    }
    text.as_bytes()
        .chunks_exact(2)
        .map(|pair| {
            std::str::from_utf8(pair).ok().and_then(|p| u8::from_str_radix(p, 16).ok()).ok_or_else(|| format!("{text:?} is not hex"))
        })
        .collect()
}

/// Comma-separated decimal u32 token ids: `hashes × block_size` of them,
/// at most [`TAG_TOKENS_MAX`].
fn token_list(value: &str, hashes: usize, block_size: u32) -> Result<Vec<u32>, String> {
    let want = hashes as u64 * u64::from(block_size);
    if want > TAG_TOKENS_MAX as u64 {
        return Err(format!(
            "{TOKEN_IDS_HEADER} would hold {want} ids ({hashes} block(s) of {block_size} tokens); a block tag holds at most {TAG_TOKENS_MAX}: leave it out"
        ));
    }
    let mut out = Vec::with_capacity(want as usize);
    for (i, item) in value.split(',').enumerate() {
        if i as u64 == want {
            break;
        }
        let item = item.trim();
        out.push(item.parse::<u32>().map_err(|_| format!("{TOKEN_IDS_HEADER}: id {i} {item:?} is not a decimal u32"))?);
    }
    let given = value.split(',').count();
    if given as u64 != want {
        return Err(format!(
            "{TOKEN_IDS_HEADER} holds {given} ids for {hashes} block(s) of {block_size} tokens: send {want}, or leave the header out"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// The tag pinned beside the Python client's encoder
    /// (clients/python/tests/test_block_tag.py) and in
    /// tests/data/local_frame_vectors.json.
    const TAG_HEX: &str = "010802000102030405060708090a0b0c0d0e0f08f0f1f2f3f4f5f6f702000000040001000000020000002c01000070110100";

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, HeaderValue::from_str(value).unwrap());
        }
        h
    }

    fn hex_of(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    const BLOCK_BYTES: u64 = 65536;

    #[test]
    fn the_headers_make_the_pinned_tag() {
        let h = headers(&[
            (BLOCK_HASHES_HEADER, "0001020304050607,08090A0B0C0D0E0F"),
            (PARENT_HASH_HEADER, "f0f1f2f3f4f5f6f7"),
            (BLOCK_SIZE_HEADER, "2"),
            (TOKEN_IDS_HEADER, "1, 2,300,70000"),
        ]);
        assert_eq!(hex_of(&tag_from_headers(&h, BLOCK_BYTES).unwrap().unwrap()), TAG_HEX);
        assert_eq!(tag_from_headers(&HeaderMap::new(), BLOCK_BYTES), Ok(None));
        let bare = headers(&[(BLOCK_HASHES_HEADER, "ab"), (BLOCK_SIZE_HEADER, "16")]);
        let tag = BlockTag::decode(&tag_from_headers(&bare, BLOCK_BYTES).unwrap().unwrap()).unwrap();
        assert_eq!(tag, BlockTag { block_hashes: vec![vec![0xab]], parent_hash: None, block_size: 16, token_ids: vec![] });
    }

    #[test]
    fn each_bad_header_is_named_with_what_is_wrong() {
        let good = [(BLOCK_HASHES_HEADER, "00ff,11ee"), (BLOCK_SIZE_HEADER, "2")];
        let with = |extra: &[(&'static str, &str)]| {
            let mut pairs = good.to_vec();
            pairs.extend_from_slice(extra);
            tag_from_headers(&headers(&pairs), BLOCK_BYTES).unwrap_err()
        };
        let only = |pairs: &[(&'static str, &str)]| tag_from_headers(&headers(pairs), BLOCK_BYTES).unwrap_err();
        let cases: Vec<(String, &str)> = vec![
            (only(&[(BLOCK_HASHES_HEADER, "zz"), (BLOCK_SIZE_HEADER, "1")]), "x-kvtier-block-hashes: hash 0: \"zz\" is not hex"),
            (only(&[(BLOCK_HASHES_HEADER, "abc"), (BLOCK_SIZE_HEADER, "1")]), "an even number"),
            (only(&[(BLOCK_HASHES_HEADER, "ab,abcd"), (BLOCK_SIZE_HEADER, "1")]), "hash 1 is 2 bytes, hash 0 is 1"),
            (only(&[(BLOCK_HASHES_HEADER, &"ab".repeat(33)), (BLOCK_SIZE_HEADER, "1")]), "2 to 64 hex digits"),
            (only(&[(BLOCK_HASHES_HEADER, &vec!["ab"; 65].join(",")), (BLOCK_SIZE_HEADER, "1")]), "more than 64 hashes"),
            (only(&[(BLOCK_HASHES_HEADER, "ab,,cd"), (BLOCK_SIZE_HEADER, "1")]), "hash 1: \"\""),
            (only(&[(BLOCK_HASHES_HEADER, "ab")]), "x-kvtier-block-hashes without x-kvtier-block-size"),
            (only(&[(PARENT_HASH_HEADER, "ab")]), "x-kvtier-parent-hash without x-kvtier-block-hashes"),
            (only(&[(BLOCK_SIZE_HEADER, "16")]), "x-kvtier-block-size without x-kvtier-block-hashes"),
            (only(&[(TOKEN_IDS_HEADER, "1")]), "x-kvtier-token-ids without x-kvtier-block-hashes"),
            (with(&[(PARENT_HASH_HEADER, "ab")]), "x-kvtier-parent-hash is 1 bytes, the x-kvtier-block-hashes 2"),
            (with(&[(PARENT_HASH_HEADER, "xyxy")]), "x-kvtier-parent-hash: \"xyxy\" is not hex"),
            (only(&[(BLOCK_HASHES_HEADER, "ab"), (BLOCK_SIZE_HEADER, "0")]), "x-kvtier-block-size \"0\" is not a number of tokens"),
            (only(&[(BLOCK_HASHES_HEADER, "ab"), (BLOCK_SIZE_HEADER, "65537")]), "from 1 to 65536"),
            (only(&[(BLOCK_HASHES_HEADER, "ab"), (BLOCK_SIZE_HEADER, "two")]), "\"two\""),
            (with(&[(TOKEN_IDS_HEADER, "1,2,3")]), "holds 3 ids for 2 block(s) of 2 tokens: send 4"),
            (with(&[(TOKEN_IDS_HEADER, "1,2,3,4,5")]), "holds 5 ids"),
            (with(&[(TOKEN_IDS_HEADER, "1,2,-3,4")]), "id 2 \"-3\" is not a decimal u32"),
            (with(&[(TOKEN_IDS_HEADER, "1,2,4294967296,4")]), "id 2"),
            (
                only(&[(BLOCK_HASHES_HEADER, "ab,cd"), (BLOCK_SIZE_HEADER, "512"), (TOKEN_IDS_HEADER, "1")]),
                "would hold 1024 ids (2 block(s) of 512 tokens); a block tag holds at most 640",
            ),
            (with(&[(TOKEN_IDS_HEADER, "")]), "x-kvtier-token-ids is empty"),
            (with(&[(BLOCK_SIZE_HEADER, "2")]), "x-kvtier-block-size given 2 times"),
        ];
        for (got, want) in cases {
            assert!(got.contains(want), "{got:?} does not say {want:?}");
        }
        let mut h = headers(&good);
        h.insert(PARENT_HASH_HEADER, HeaderValue::from_bytes(b"ab\xffcd").unwrap());
        assert!(tag_from_headers(&h, BLOCK_BYTES).unwrap_err().contains("not visible ASCII"));
    }

    #[test]
    fn a_tag_too_long_for_the_stores_slot_header_is_refused() {
        // 64 hashes of 32 bytes and 10 tokens each: 2,048 + 2,560 bytes,
        // over the 3,072 any store keeps room for.
        let hashes = vec!["ab".repeat(32); 64].join(",");
        let tokens = vec!["7"; 640].join(",");
        let h = headers(&[(BLOCK_HASHES_HEADER, &hashes), (BLOCK_SIZE_HEADER, "10"), (TOKEN_IDS_HEADER, &tokens)]);
        let e = tag_from_headers(&h, BLOCK_BYTES).unwrap_err();
        assert!(e.contains("block tag:") && e.contains("3072"), "{e}");
        // 10 hashes and 640 tokens: 2,890 bytes, which a 16 MiB block's
        // slot header holds (3,672) and a 512 MiB block's does not (1,688:
        // its 512 chunk CRC-32s take the rest of the page).
        let hashes = vec!["ab".repeat(32); 10].join(",");
        let h = headers(&[(BLOCK_HASHES_HEADER, &hashes), (BLOCK_SIZE_HEADER, "64"), (TOKEN_IDS_HEADER, &tokens)]);
        assert_eq!(tag_from_headers(&h, 16 << 20).unwrap().unwrap().len(), 2890);
        let e = tag_from_headers(&h, 512 << 20).unwrap_err();
        assert!(e.contains("2890 bytes encoded; a slot header of this store's 536870912-byte blocks holds 1688"), "{e}");
    }
}
