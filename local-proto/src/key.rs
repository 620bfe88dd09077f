//! The key rule, written once for the server (`engine/src/key.rs`, whose
//! `validate` names what is wrong) and the clients that check keys before
//! sending them (`kvtier-client`): 1 to [`KEY_BYTES_MAX`] bytes from the
//! URL-safe set `[A-Za-z0-9._~-]` (RFC 3986's unreserved characters), not
//! `.` or `..` (docs/KEYS.md). And the shard that owns a block hash
//! ([`shard_of`]), which the server routes by and a client probes the
//! shared index with.

/// Longest key accepted, in bytes. Fits in the slot header with room to spare.
pub const KEY_BYTES_MAX: usize = 256;

/// Whether `b` may appear in a key: `[A-Za-z0-9._~-]`.
pub fn is_key_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-')
}

/// Whether the server accepts `key` (module docs).
pub fn key_is_valid(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= KEY_BYTES_MAX && key.iter().all(|&b| is_key_byte(b)) && key != b"." && key != b".."
}

/// The shard that owns the block hash `hash` (xxh3-128 of the key's
/// bytes) among `shards` shards: `hash mod shards`, in 64-bit arithmetic.
/// With `hash = hi·2⁶⁴ + lo` it is `((hi mod s)·(2⁶⁴ mod s) + lo mod s)
/// mod s`, whose product fits in 64 bits for any `s < 2³²` (u128's `%` is a
/// library call: 64 shared-index probes took 4.9 µs with it, 3.2 without).
///
/// # Panics
/// In debug builds, `shards` is 0 or not below 2³².
pub fn shard_of(hash: u128, shards: usize) -> usize {
    debug_assert!(shards > 0 && shards as u64 <= u32::MAX as u64);
    if shards == 1 {
        return 0;
    }
    let s = shards as u64;
    let (hi, lo) = ((hash >> 64) as u64, hash as u64);
    let two_64 = (u64::MAX % s + 1) % s;
    (((hi % s) * two_64 + lo % s) % s) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_takes_unreserved_bytes_and_refuses_the_rest() {
        assert!(key_is_valid(b"a") && key_is_valid(b"Model-1_x.y~z") && key_is_valid(&[b'k'; KEY_BYTES_MAX]));
        for bad in [&b""[..], b".", b"..", b"a/b", b"a b", b"\xc3\xa9", &[b'k'; KEY_BYTES_MAX + 1]] {
            assert!(!key_is_valid(bad), "{bad:?}");
        }
        assert!(key_is_valid(b"...") && key_is_valid(b".a"));
    }

    #[test]
    fn shard_of_is_hash_mod_shards() {
        let hashes = [0u128, 1, u64::MAX as u128, u128::MAX, 0x1234_5678_9abc_def0_0fed_cba9_8765_4321, 1 << 64, (1 << 64) - 1];
        for shards in [1usize, 2, 3, 7, 64, 1000, u32::MAX as usize] {
            for h in hashes.iter().copied().chain((0..200u128).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))) {
                assert_eq!(shard_of(h, shards), (h % shards as u128) as usize, "{h:#x} mod {shards}");
            }
        }
    }
}
