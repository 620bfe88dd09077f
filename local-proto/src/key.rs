//! The key rule, written once for the server (`engine/src/key.rs`, whose
//! `validate` names what is wrong) and the clients that check keys before
//! sending them (`kvtier-client`): 1 to [`KEY_BYTES_MAX`] bytes from the
//! URL-safe set `[A-Za-z0-9._~-]` (RFC 3986's unreserved characters), not
//! `.` or `..` (docs/KEYS.md).

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
}
