//! The block tag: what a client attaches to a block at PUT so that KV
//! events name the block in the inference engine's hash space (its block
//! hashes, their parent, their token ids), not by kvtier's key.
//!
//! Binary form (docs/FORMAT.md, "Block tags"), the same in a slot header, a
//! shared-tier object header and a same-host socket PUT item; integers
//! little-endian:
//!
//! ```text
//! u8   version (1)
//! u8   hash_bytes       width of every hash below, 1..=32
//! u8   hash_count       engine blocks this kvtier block holds, 1..=64
//! [u8; hash_bytes] × hash_count   the engine's block hashes, in order
//! u8   parent_bytes     0 (the first block starts a sequence) or hash_bytes
//! [u8; parent_bytes]    the hash of the block before the first
//! u32  block_size       tokens per engine block, 1..=65536
//! u16  token_count      0, or hash_count × block_size
//! u32 × token_count     the token ids, in order
//! ```
//!
//! vLLM's `BlockStored` event carries exactly these fields (vLLM 0.32.0,
//! `vllm/distributed/kv_events.py`): `block_hashes`, `parent_block_hash`,
//! `token_ids`, `block_size`. One kvtier block may hold several engine
//! blocks (LMCache stores 256-token chunks of 16-token vLLM blocks), hence
//! the list.

use bytes::{BufMut, Bytes, BytesMut};

/// Version of the tag layout above.
pub const TAG_VERSION: u8 = 1;

/// Widest engine block hash, bytes (vLLM's sha256 block hashes are 32).
pub const TAG_HASH_BYTES_MAX: usize = 32;

/// Most engine blocks in one kvtier block.
pub const TAG_HASHES_MAX: usize = 64;

/// Most token ids in one tag (the u16 count's range, and a header page's
/// room: see [`TAG_BYTES_MAX`]).
pub const TAG_TOKENS_MAX: usize = 640;

/// Longest encoded tag, bytes: what a slot header keeps room for
/// (docs/FORMAT.md). A tag with 32-byte hashes and 4 bytes per token
/// fits 16 blocks of 16 tokens or one of 512 with room to spare.
pub const TAG_BYTES_MAX: usize = 3072;

/// The engine-side identity of a block, as [`BlockTag::decode`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTag {
    /// The engine's block hashes (1..=[`TAG_HASHES_MAX`], all the same
    /// width, 1..=[`TAG_HASH_BYTES_MAX`] bytes), in sequence order.
    pub block_hashes: Vec<Vec<u8>>,
    /// The hash of the engine block before the first one; `None` when the
    /// first starts a sequence.
    pub parent_hash: Option<Vec<u8>>,
    /// Tokens per engine block.
    pub block_size: u32,
    /// The blocks' token ids, `block_hashes.len() × block_size` of them, or
    /// none when the client does not send them.
    pub token_ids: Vec<u32>,
}

impl BlockTag {
    /// Checks the rules above.
    ///
    /// # Errors
    /// A message naming the first field out of range.
    pub fn validate(&self) -> Result<(), String> {
        let n = self.block_hashes.len();
        if n == 0 || n > TAG_HASHES_MAX {
            return Err(format!("a tag holds 1 to {TAG_HASHES_MAX} block hashes, got {n}"));
        }
        let width = self.block_hashes[0].len();
        if width == 0 || width > TAG_HASH_BYTES_MAX {
            return Err(format!("a block hash is 1 to {TAG_HASH_BYTES_MAX} bytes, got {width}"));
        }
        if let Some(h) = self.block_hashes.iter().find(|h| h.len() != width) {
            return Err(format!("block hashes differ in width: {width} and {} bytes", h.len()));
        }
        if let Some(p) = &self.parent_hash {
            if p.len() != width {
                return Err(format!("the parent hash is {} bytes, the block hashes {width}", p.len()));
            }
        }
        if self.block_size == 0 || self.block_size > 65536 {
            return Err(format!("block_size is 1 to 65536 tokens, got {}", self.block_size));
        }
        let want = n as u64 * self.block_size as u64;
        if !self.token_ids.is_empty() && self.token_ids.len() as u64 != want {
            return Err(format!("{} token ids for {n} block(s) of {} tokens: send {want} or none", self.token_ids.len(), self.block_size));
        }
        if self.token_ids.len() > TAG_TOKENS_MAX {
            return Err(format!("a tag holds at most {TAG_TOKENS_MAX} token ids, got {}", self.token_ids.len()));
        }
        if self.encoded_len() > TAG_BYTES_MAX {
            return Err(format!("the tag is {} bytes encoded, over {TAG_BYTES_MAX}", self.encoded_len()));
        }
        Ok(())
    }

    /// Bytes [`BlockTag::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        let width = self.block_hashes.first().map_or(0, Vec::len);
        3 + width * self.block_hashes.len() + 1 + self.parent_hash.as_ref().map_or(0, Vec::len) + 4 + 2 + 4 * self.token_ids.len()
    }

    /// The binary form above.
    ///
    /// # Panics
    /// If the tag breaks the rules ([`BlockTag::validate`]); callers
    /// validate first.
    pub fn encode(&self) -> Bytes {
        if let Err(e) = self.validate() {
            panic!("encoding an invalid block tag: {e}");
        }
        let mut b = BytesMut::with_capacity(self.encoded_len());
        b.put_u8(TAG_VERSION);
        b.put_u8(self.block_hashes[0].len() as u8);
        b.put_u8(self.block_hashes.len() as u8);
        for h in &self.block_hashes {
            b.put_slice(h);
        }
        match &self.parent_hash {
            Some(p) => {
                b.put_u8(p.len() as u8);
                b.put_slice(p);
            }
            None => b.put_u8(0),
        }
        b.put_u32_le(self.block_size);
        b.put_u16_le(self.token_ids.len() as u16);
        for t in &self.token_ids {
            b.put_u32_le(*t);
        }
        b.freeze()
    }

    /// Reads a tag written by [`BlockTag::encode`] (or by a client).
    ///
    /// # Errors
    /// A message saying what is wrong: a short or long buffer, an unknown
    /// version, a field out of range.
    pub fn decode(bytes: &[u8]) -> Result<BlockTag, String> {
        let mut r = Reader { bytes, at: 0 };
        let version = r.u8()?;
        if version != TAG_VERSION {
            return Err(format!("block tag version {version}; this server reads version {TAG_VERSION}"));
        }
        let width = r.u8()? as usize;
        let count = r.u8()? as usize;
        let mut block_hashes = Vec::with_capacity(count.min(TAG_HASHES_MAX));
        for _ in 0..count {
            block_hashes.push(r.take(width)?.to_vec());
        }
        let parent_bytes = r.u8()? as usize;
        let parent_hash = (parent_bytes > 0).then(|| r.take(parent_bytes).map(<[u8]>::to_vec)).transpose()?;
        let block_size = u32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
        let tokens = u16::from_le_bytes(r.take(2)?.try_into().expect("2 bytes")) as usize;
        if tokens > TAG_TOKENS_MAX {
            return Err(format!("a tag holds at most {TAG_TOKENS_MAX} token ids, got {tokens}"));
        }
        let token_ids = r.take(4 * tokens)?.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        if r.at != bytes.len() {
            return Err(format!("{} bytes after the tag's end", bytes.len() - r.at));
        }
        let tag = BlockTag { block_hashes, parent_hash, block_size, token_ids };
        tag.validate()?;
        Ok(tag)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.bytes.len())
            .ok_or_else(|| format!("the tag ends after {} bytes, {n} more expected at byte {}", self.bytes.len(), self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag() -> BlockTag {
        BlockTag {
            block_hashes: vec![vec![1; 32], vec![2; 32]],
            parent_hash: Some(vec![9; 32]),
            block_size: 4,
            token_ids: (0..8).collect(),
        }
    }

    #[test]
    fn round_trip() {
        let t = tag();
        let bytes = t.encode();
        assert_eq!(bytes.len(), t.encoded_len());
        assert_eq!(BlockTag::decode(&bytes), Ok(t));
        let bare = BlockTag { block_hashes: vec![vec![7; 8]], parent_hash: None, block_size: 16, token_ids: vec![] };
        assert_eq!(BlockTag::decode(&bare.encode()), Ok(bare));
    }

    #[test]
    fn bad_tags_are_refused_with_the_reason() {
        let bytes = tag().encode();
        for cut in [0, 1, 5, bytes.len() - 1] {
            assert!(BlockTag::decode(&bytes[..cut]).unwrap_err().contains("ends after"), "cut at {cut}");
        }
        let mut long = bytes.to_vec();
        long.push(0);
        assert!(BlockTag::decode(&long).unwrap_err().contains("after the tag's end"));
        let mut v = bytes.to_vec();
        v[0] = 2;
        assert!(BlockTag::decode(&v).unwrap_err().contains("version 2"));
        let mut t = tag();
        t.token_ids.pop();
        assert!(t.validate().unwrap_err().contains("7 token ids for 2 block(s) of 4 tokens"));
        let mut t = tag();
        t.parent_hash = Some(vec![1; 8]);
        assert!(t.validate().unwrap_err().contains("parent hash is 8 bytes"));
        let t = BlockTag { block_hashes: vec![], parent_hash: None, block_size: 1, token_ids: vec![] };
        assert!(t.validate().unwrap_err().contains("1 to 64 block hashes"));
        let t = BlockTag { block_hashes: vec![vec![1; 33]], parent_hash: None, block_size: 1, token_ids: vec![] };
        assert!(t.validate().unwrap_err().contains("1 to 32 bytes"));
    }

    #[test]
    fn the_largest_tag_fits_its_bound() {
        let t = BlockTag {
            block_hashes: vec![vec![1; 32]; 10],
            parent_hash: Some(vec![0; 32]),
            block_size: 64,
            token_ids: vec![5; TAG_TOKENS_MAX],
        };
        assert!(t.validate().is_ok(), "{:?}", t.validate());
        assert!(t.encoded_len() <= TAG_BYTES_MAX);
    }
}
