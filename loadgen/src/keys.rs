//! Chained block keys, as inference-engine connectors build them: a block's
//! key depends on its own token ids and on the key of the block before it,
//! so a prompt's prefix is a chain of keys and equal prefixes give equal
//! chains.
//!
//! `key[i] = hex128(xxh3_128(parent ‖ le32(tokens of block i)))` where
//! `parent` is the ASCII of `key[i-1]` (empty for block 0), `le32` writes each
//! token id as 4 little-endian bytes, and `hex128` is the 128-bit value as
//! 32 lowercase hex digits, most significant first (the canonical form
//! Python's `xxhash.xxh3_128_hexdigest` prints). docs/LOADGEN.md has a
//! Python version.

/// Length of a chained key: 32 hex digits.
pub const KEY_CHARS: usize = 32;

/// The key of one block given its parent's key (empty for the first block).
pub fn block_key(parent: &str, tokens: &[u32]) -> String {
    let mut input = Vec::with_capacity(parent.len() + tokens.len() * 4);
    input.extend_from_slice(parent.as_bytes());
    for t in tokens {
        input.extend_from_slice(&t.to_le_bytes());
    }
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&input))
}

/// Extends `keys` (the chain of the first `keys.len()` full blocks of
/// `tokens`) to cover every full block of `tokens`.
pub fn extend_chain(keys: &mut Vec<String>, tokens: &[u32], block_tokens: usize) {
    let full = tokens.len() / block_tokens;
    while keys.len() < full {
        let i = keys.len();
        let parent = keys.last().map(String::as_str).unwrap_or("");
        let key = block_key(parent, &tokens[i * block_tokens..(i + 1) * block_tokens]);
        keys.push(key);
    }
}

/// The chain of keys for every full block of `tokens`.
pub fn chain(tokens: &[u32], block_tokens: usize) -> Vec<String> {
    let mut keys = Vec::new();
    extend_chain(&mut keys, tokens, block_tokens);
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vectors computed by the Python version in docs/LOADGEN.md with the
    /// `xxhash` package (`xxh3_128_hexdigest`), so both stay in step.
    #[test]
    fn matches_python_reference_vectors() {
        let tokens: Vec<u32> = (0..300).collect();
        assert_eq!(chain(&tokens, 128), ["a00ea5e600c0bdb124b21cb5803a6432", "a95c81d839dd5e836e231160785d7366"]);
        let tokens: Vec<u32> = (1000..1256).collect();
        assert_eq!(chain(&tokens, 128), ["1c305dda8633d9730a8ad3bf8a1f74b1", "f68c49c05fb7fd4bbb346170ce403587"]);
    }

    /// The key-spec vectors the Python client asserts too
    /// (`tests/data/key_vectors.json`, docs/KEYS.md): every chain, and every
    /// namespace fingerprint as `xxh3_64` of its canonical text.
    #[test]
    fn matches_the_shared_key_vectors() {
        let vectors: serde_json::Value = serde_json::from_str(include_str!("../../tests/data/key_vectors.json")).expect("valid JSON");
        let chains = vectors["chains"].as_array().expect("chains");
        assert!(!chains.is_empty());
        for case in chains {
            let first = case["first_token"].as_u64().expect("first_token") as u32;
            let count = case["tokens"].as_u64().expect("tokens") as u32;
            let block_tokens = case["block_tokens"].as_u64().expect("block_tokens") as usize;
            let tokens: Vec<u32> = (first..first + count).collect();
            let keys: Vec<String> = case["keys"].as_array().expect("keys").iter().map(|k| k.as_str().expect("key").to_string()).collect();
            assert_eq!(chain(&tokens, block_tokens), keys, "chain from token {first}");
        }
        let namespaces = vectors["namespaces"].as_array().expect("namespaces");
        assert!(!namespaces.is_empty());
        for case in namespaces {
            let canonical = case["canonical"].as_str().expect("canonical");
            let fingerprint = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(canonical.as_bytes()));
            assert_eq!(fingerprint, case["fingerprint"].as_str().expect("fingerprint"));
            let key = format!("{fingerprint}-{}", case["block_id_hex"].as_str().expect("block_id_hex"));
            assert_eq!(key, case["key"].as_str().expect("key"));
        }
    }

    #[test]
    fn chain_shares_prefixes_and_ignores_partial_blocks() {
        let a: Vec<u32> = (0..300).collect();
        let mut b = a.clone();
        b[200] = 7;
        let (ka, kb) = (chain(&a, 128), chain(&b, 128));
        assert_eq!(ka.len(), 2);
        assert_eq!(ka[0], kb[0]);
        assert_ne!(ka[1], kb[1]);
        assert!(ka.iter().all(|k| k.len() == KEY_CHARS && k.bytes().all(|c| c.is_ascii_hexdigit())));
        let mut grown = vec![ka[0].clone()];
        extend_chain(&mut grown, &a, 128);
        assert_eq!(grown, ka);
    }
}
