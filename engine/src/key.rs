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

use kvtier_local_proto::is_key_byte;
pub use kvtier_local_proto::KEY_BYTES_MAX;

/// 128-bit hash of a key: xxh3-128 of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// Hashes a key's bytes (no validation).
    pub fn of(key: &[u8]) -> Self {
        BlockHash(xxhash_rust::xxh3::xxh3_128(key))
    }

    /// The shard that owns this hash among `shards` shards: `hash mod shards`
    /// (`kvtier_local_proto::shard_of`, which clients use too).
    pub fn shard(&self, shards: usize) -> usize {
        kvtier_local_proto::shard_of(self.0, shards)
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

/// Longest stored key, in bytes: a client key of [`KEY_BYTES_MAX`] under
/// the longest owner scope ([`crate::tenant::OWNER_NAME_BYTES_MAX`]) and
/// the `/` between them (289). The slot header's key area holds this many.
pub const STORED_KEY_BYTES_MAX: usize = crate::tenant::OWNER_NAME_BYTES_MAX + 1 + KEY_BYTES_MAX;

/// A key as the engine stores it: the owner's scope and the client's key,
/// typed once where a front door scopes the client's key, and passed as
/// such through [`crate::Store`] to the tiers and the shared tier, so no
/// layer parses the owner back out of a string.
///
/// Its persisted form ([`StoredKey::as_str`]) is `SCOPE/KEY`, or `KEY` for
/// the default owner: what the block hash is taken of, what a slot header
/// and an S3 object header carry. A slot header also records the scope's
/// length (format 4, docs/FORMAT.md), so recovery rebuilds the typed key
/// from the header's fields.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct StoredKey {
    /// Shared, so the tiers' maps and the mesh's messages clone it cheaply.
    text: std::sync::Arc<str>,
    /// Bytes of `text` before the `/`; 0 for the default owner.
    scope_bytes: u8,
}

impl StoredKey {
    /// `key` stored by the owner whose scope is `scope` (an owner's name,
    /// [`crate::tenant::check_name`]; empty for the default owner). The key
    /// may be [`KEY_BYTES_MAX`] bytes under any scope.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] as [`validate`] says, or naming a bad scope.
    pub fn new(scope: &str, key: &str) -> Result<StoredKey> {
        validate(key)?;
        if scope.is_empty() {
            return Ok(StoredKey { text: key.into(), scope_bytes: 0 });
        }
        crate::tenant::check_name(scope).map_err(|reason| Error::InvalidKey { reason: format!("scope of {key:?}: {reason}") })?;
        Ok(StoredKey { text: format!("{scope}/{key}").into(), scope_bytes: scope.len() as u8 })
    }

    /// `key` of the default owner: [`StoredKey::new`] with no scope.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] as [`validate`] says.
    pub fn unscoped(key: &str) -> Result<StoredKey> {
        StoredKey::new("", key)
    }

    /// The typed key of a persisted form (`text`, as a slot header holds it)
    /// whose first `scope_bytes` bytes are the scope; `None` when the two do
    /// not make a valid stored key.
    pub fn from_persisted(text: &[u8], scope_bytes: u8) -> Option<StoredKey> {
        let text = std::str::from_utf8(text).ok()?;
        let (scope, key) = match scope_bytes as usize {
            0 => ("", text),
            n => (text.get(..n)?, text.get(n..)?.strip_prefix('/')?),
        };
        StoredKey::new(scope, key).ok()
    }

    /// The owner's scope: an owner's name, empty for the default owner.
    pub fn scope(&self) -> &str {
        match self.scope_bytes {
            0 => "",
            n => &self.text[..n as usize],
        }
    }

    /// The client's key, without its scope.
    pub fn key(&self) -> &str {
        match self.scope_bytes {
            0 => &self.text,
            n => &self.text[n as usize + 1..],
        }
    }

    /// Length of [`StoredKey::scope`] in bytes, as a slot header records it.
    pub fn scope_bytes(&self) -> u8 {
        self.scope_bytes
    }

    /// The persisted form: `SCOPE/KEY`, or `KEY` for the default owner
    /// (1 to [`STORED_KEY_BYTES_MAX`] bytes).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The block hash: [`BlockHash::of`] the persisted form.
    pub fn hash(&self) -> BlockHash {
        BlockHash::of(self.text.as_bytes())
    }
}

impl std::fmt::Debug for StoredKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.text, f)
    }
}

impl std::fmt::Display for StoredKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
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
    fn a_stored_key_keeps_its_scope_typed() {
        let k = StoredKey::new("acme", "k-1").unwrap();
        assert_eq!((k.scope(), k.key(), k.as_str(), k.scope_bytes()), ("acme", "k-1", "acme/k-1", 4));
        assert_eq!(k.hash(), BlockHash::of(b"acme/k-1"));
        let d = StoredKey::unscoped("k-1").unwrap();
        assert_eq!((d.scope(), d.key(), d.as_str(), d.scope_bytes()), ("", "k-1", "k-1", 0));
        for (scope, key) in [("acme", ""), ("Acme", "k"), ("acme", "a/b"), ("acme", "a b"), ("a/b", "k"), (&*"s".repeat(33), "k")] {
            assert!(matches!(StoredKey::new(scope, key), Err(Error::InvalidKey { .. })), "{scope:?} {key:?} accepted");
        }
    }

    #[test]
    fn a_key_may_be_the_longest_under_any_scope() {
        let scope = "s".repeat(crate::tenant::OWNER_NAME_BYTES_MAX);
        let k = StoredKey::new(&scope, &"k".repeat(KEY_BYTES_MAX)).unwrap();
        assert_eq!(k.as_str().len(), STORED_KEY_BYTES_MAX);
        let e = StoredKey::new("acme", &"k".repeat(KEY_BYTES_MAX + 1)).unwrap_err().to_string();
        assert!(e.contains("the limit is 256"), "{e}");
    }

    #[test]
    fn the_persisted_form_reads_back_only_with_its_scope_length() {
        let k = StoredKey::new("acme", "k-1").unwrap();
        assert_eq!(StoredKey::from_persisted(k.as_str().as_bytes(), 4), Some(k));
        assert_eq!(StoredKey::from_persisted(b"k-1", 0), Some(StoredKey::unscoped("k-1").unwrap()));
        for (text, scope_bytes) in
            [(&b"acme/k-1"[..], 0), (b"acme/k-1", 3), (b"acme/k-1", 5), (b"acme/k-1", 200), (b"k-1", 3), (b"\xff", 0)]
        {
            assert_eq!(StoredKey::from_persisted(text, scope_bytes), None, "{text:?} {scope_bytes}");
        }
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

/// Keys for the crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::StoredKey;

    /// The default owner's stored key of `key`.
    pub(crate) fn sk(key: &str) -> StoredKey {
        StoredKey::unscoped(key).expect("a valid test key")
    }
}
