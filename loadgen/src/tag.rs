//! Block tags as an inference engine attaches them to a PUT (docs/API.md,
//! "Block tags"): the engine's hash of each block, its parent's hash, the
//! tokens per block and the token ids, sent as the four `x-kvtier-*`
//! headers so that a server with `--kv-events` publishes the block in the
//! engine's hash space, where a KV-aware router indexes it.
//!
//! The loadgen's engine hash is chained as vLLM's is (each block's hash
//! covers its parent's hash and its own token ids), 8 bytes wide:
//!
//! `hash[i] = xxh3_64(be64(hash[i-1]) ‖ le32(tokens of block i))`, with no
//! parent bytes for block 0.
//!
//! Eight bytes, because the events carry hashes as vLLM's integers (the low
//! 64 bits, big-endian: docs/OPERATIONS.md, "KV events for routers"), so an
//! 8-byte hash reads back from an event as exactly the `u64` sent.

use http::{HeaderName, HeaderValue};

/// Most token ids one tag may carry (`x-kvtier-token-ids`, docs/API.md); a
/// block of more tokens is tagged without its ids.
pub const TOKEN_IDS_MAX: usize = 640;

/// Most tokens per engine block a tag may name (`x-kvtier-block-size`).
pub const BLOCK_SIZE_MAX: usize = 65_536;

/// A tag's headers, ready to send (`Client::put_with_headers`).
pub type TagHeaders = Vec<(HeaderName, HeaderValue)>;

/// One block's tag: this block is one engine block of `block_size` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTag {
    /// The engine's hash of the block.
    pub hash: u64,
    /// The hash of the block before it; `None` for a prompt's first block.
    pub parent: Option<u64>,
    /// Tokens per block.
    pub block_size: u32,
    /// The block's token ids (empty: sent without them).
    pub token_ids: Vec<u32>,
}

/// The engine hash of a block of `tokens` after `parent` (module docs).
pub fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut input = Vec::with_capacity(8 + tokens.len() * 4);
    if let Some(p) = parent {
        input.extend_from_slice(&p.to_be_bytes());
    }
    for t in tokens {
        input.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&input)
}

/// Extends `hashes` (the engine hashes of the first `hashes.len()` full
/// blocks of `tokens`) to every full block of `tokens`, as
/// [`crate::keys::extend_chain`] extends the keys.
pub fn extend_hashes(hashes: &mut Vec<u64>, tokens: &[u32], block_tokens: usize) {
    assert!(block_tokens > 0, "a block holds at least one token");
    let full = tokens.len() / block_tokens;
    while hashes.len() < full {
        let i = hashes.len();
        let hash = engine_hash(hashes.last().copied(), &tokens[i * block_tokens..(i + 1) * block_tokens]);
        hashes.push(hash);
    }
}

impl BlockTag {
    /// The tag of block `i` of a prompt whose engine hashes are `hashes`
    /// and whose tokens are `tokens`, `block_tokens` to a block (token ids
    /// left out past [`TOKEN_IDS_MAX`]).
    pub fn of_block(hashes: &[u64], tokens: &[u32], block_tokens: usize, i: usize) -> BlockTag {
        assert!(i < hashes.len() && (i + 1) * block_tokens <= tokens.len(), "block {i} is a full block of the prompt");
        let token_ids = if block_tokens <= TOKEN_IDS_MAX { tokens[i * block_tokens..(i + 1) * block_tokens].to_vec() } else { Vec::new() };
        BlockTag { hash: hashes[i], parent: i.checked_sub(1).map(|p| hashes[p]), block_size: block_tokens as u32, token_ids }
    }

    /// The `x-kvtier-*` headers of this tag (hashes as 16 hex digits).
    pub fn headers(&self) -> TagHeaders {
        assert!((1..=BLOCK_SIZE_MAX).contains(&(self.block_size as usize)), "block size {} out of 1..=65536", self.block_size);
        assert!(self.token_ids.is_empty() || self.token_ids.len() == self.block_size as usize, "token ids: none or one per token");
        let value = |s: String| HeaderValue::from_str(&s).expect("hex and decimal digits are header bytes");
        let mut h = vec![
            (HeaderName::from_static("x-kvtier-block-hashes"), value(format!("{:016x}", self.hash))),
            (HeaderName::from_static("x-kvtier-block-size"), value(self.block_size.to_string())),
        ];
        if let Some(p) = self.parent {
            h.push((HeaderName::from_static("x-kvtier-parent-hash"), value(format!("{p:016x}"))));
        }
        if !self.token_ids.is_empty() {
            let ids: Vec<String> = self.token_ids.iter().map(u32::to_string).collect();
            h.push((HeaderName::from_static("x-kvtier-token-ids"), value(ids.join(","))));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_share_prefixes_and_ignore_partial_blocks() {
        let a: Vec<u32> = (0..300).collect();
        let mut b = a.clone();
        b[200] = 7;
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        extend_hashes(&mut ha, &a, 128);
        extend_hashes(&mut hb, &b, 128);
        assert_eq!(ha.len(), 2);
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        assert_eq!(ha[0], engine_hash(None, &a[..128]));
        assert_eq!(ha[1], engine_hash(Some(ha[0]), &a[128..256]));
        // The same tokens after another parent are another block.
        assert_ne!(engine_hash(Some(1), &a[..128]), engine_hash(Some(2), &a[..128]));
    }

    #[test]
    fn headers_are_the_apis_four() {
        let tokens: Vec<u32> = (0..8).collect();
        let mut hashes = Vec::new();
        extend_hashes(&mut hashes, &tokens, 4);
        let first = BlockTag::of_block(&hashes, &tokens, 4, 0);
        let names: Vec<String> = first.headers().iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(names, ["x-kvtier-block-hashes", "x-kvtier-block-size", "x-kvtier-token-ids"], "no parent for block 0");
        let second = BlockTag::of_block(&hashes, &tokens, 4, 1);
        let h = second.headers();
        assert_eq!(h[0].1.to_str().unwrap(), format!("{:016x}", hashes[1]));
        assert_eq!(h[0].1.len(), 16, "8 bytes: the event's integer is the whole hash");
        assert_eq!(h[2].1.to_str().unwrap(), format!("{:016x}", hashes[0]));
        assert_eq!(h[3].1.to_str().unwrap(), "4,5,6,7");
        let wide: Vec<u32> = vec![1; 1024];
        let mut hw = Vec::new();
        extend_hashes(&mut hw, &wide, 1024);
        assert!(BlockTag::of_block(&hw, &wide, 1024, 0).token_ids.is_empty(), "over 640 ids: sent without them");
    }
}
