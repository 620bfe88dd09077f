//! Keys and block hashes.
//!
//! A key is an opaque client-chosen string of 1 to [`KEY_BYTES_MAX`] bytes
//! from the URL-safe set `[A-Za-z0-9._~-]` (RFC 3986 unreserved characters,
//! so a key never needs escaping in a path). The engine hashes it to a
//! 128-bit [`BlockHash`] (xxh3-128) for the index and the shard choice, and
//! keeps the full key in the slot header so a hash collision is detected at
//! read time, never served.

use std::hash::Hasher;

use crate::error::{Error, Result};

/// Longest key accepted, in bytes. Fits in the slot header with room to spare.
pub const KEY_BYTES_MAX: usize = 256;

/// 128-bit hash of a key: xxh3-128 of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Hashes a key's bytes (no validation).
    pub fn of(key: &[u8]) -> Self {
        BlockHash(xxhash_rust::xxh3::xxh3_128(key))
    }

    /// The shard that owns this hash among `shards` shards: `hash mod shards`.
    pub fn shard(&self, shards: usize) -> usize {
        debug_assert!(shards > 0);
        (self.0 % shards as u128) as usize
    }
}

/// Hashes a table key by taking the low 64 bits of its block hash: it is
/// already the output of xxh3-128, so hashing it again would only cost time.
#[derive(Default)]
pub struct BlockHashHasher(u64);

impl Hasher for BlockHashHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached if something other than a u64 is hashed; fold it in.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0 ^ u64::from_le_bytes(word)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 ^= value;
    }
}

/// Checks a key against the rules above.
///
/// # Errors
/// [`Error::InvalidKey`] naming the length or the first offending byte.
pub fn validate(key: &str) -> Result<()> {
    let bytes = key.as_bytes();
    if bytes.is_empty() {
        return Err(Error::InvalidKey { reason: "key is empty".into() });
    }
    if bytes.len() > KEY_BYTES_MAX {
        return Err(Error::InvalidKey { reason: format!("key is {} bytes, the limit is {KEY_BYTES_MAX}", bytes.len()) });
    }
    if let Some((i, b)) = bytes.iter().enumerate().find(|(_, b)| !is_key_byte(**b)) {
        return Err(Error::InvalidKey { reason: format!("byte 0x{b:02x} at offset {i} is not in [A-Za-z0-9._~-]") });
    }
    if key == "." || key == ".." {
        return Err(Error::InvalidKey { reason: format!("{key:?} is reserved") });
    }
    Ok(())
}

/// Checks a stored key: a client key, or `SCOPE/KEY` with an owner's name
/// as its scope ([`crate::tenant`]), at most [`KEY_BYTES_MAX`] bytes in
/// all. The engine's calls take stored keys; the server scopes client keys
/// (checked with [`validate`]) before it calls them.
///
/// # Errors
/// [`Error::InvalidKey`] as [`validate`] says, or naming a bad scope.
pub fn validate_stored(key: &str) -> Result<()> {
    let Some((scope, rest)) = key.split_once('/') else { return validate(key) };
    crate::tenant::check_name(scope).map_err(|reason| Error::InvalidKey { reason: format!("scope of {key:?}: {reason}") })?;
    validate(rest)?;
    if key.len() > KEY_BYTES_MAX {
        return Err(Error::InvalidKey {
            reason: format!(
                "key is {} bytes; with the scope {scope:?} of its tenant a key may be at most {} bytes",
                rest.len(),
                KEY_BYTES_MAX - scope.len() - 1
            ),
        });
    }
    Ok(())
}

fn is_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_rules() {
        assert!(validate("a").is_ok());
        assert!(validate(&"k".repeat(256)).is_ok());
        assert!(validate("abc-DEF_0.9~x").is_ok());
        for bad in ["", "..", ".", "a/b", "a b", "a%00", "é", &"k".repeat(257)] {
            assert!(matches!(validate(bad), Err(Error::InvalidKey { .. })), "{bad:?} accepted");
        }
    }

    #[test]
    fn stored_keys_take_one_scope() {
        assert!(validate_stored("acme/k-1").is_ok());
        assert!(validate_stored("k-1").is_ok());
        for bad in ["/k", "acme/", "Acme/k", "a/b/c", "acme/a b"] {
            assert!(matches!(validate_stored(bad), Err(Error::InvalidKey { .. })), "{bad:?} accepted");
        }
        let long = format!("acme/{}", "k".repeat(252));
        let e = validate_stored(&long).unwrap_err().to_string();
        assert!(e.contains("at most 251 bytes"), "{e}");
    }

    #[test]
    fn shard_choice_is_stable_and_spread() {
        let mut counts = [0usize; 4];
        for i in 0..4000 {
            counts[BlockHash::of(format!("key-{i}").as_bytes()).shard(4)] += 1;
        }
        assert!(counts.iter().all(|c| *c > 800), "{counts:?}");
        assert_eq!(BlockHash::of(b"abc"), BlockHash::of(b"abc"));
    }
}
