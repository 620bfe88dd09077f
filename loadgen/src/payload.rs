//! Block payloads: deterministic pseudo-random bytes of `block_bytes`, the
//! same for a given seed on every run, stamped with the block's key so a
//! read can be checked against the key it asked for.
//!
//! One base buffer is generated at start (xoshiro256++ from the seed); a
//! block's payload is its key's ASCII followed by the base from byte
//! `KEY_CHARS` on, sent as two `Bytes` (no per-request copy of the
//! multi-MiB base).

use bytes::Bytes;
use rand::{RngCore, SeedableRng};

use crate::client::BodyChunks;
use crate::keys::KEY_CHARS;

/// Generates and checks payloads for one block size.
#[derive(Clone)]
pub struct Payloads {
    base: Bytes,
}

impl Payloads {
    /// A generator for blocks of `block_bytes` from `seed`.
    pub fn new(block_bytes: usize, seed: u64) -> Self {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut base = vec![0u8; block_bytes];
        rng.fill_bytes(&mut base);
        Payloads { base: Bytes::from(base) }
    }

    /// Block size in bytes.
    pub fn block_bytes(&self) -> usize {
        self.base.len()
    }

    fn stamp_len(&self) -> usize {
        KEY_CHARS.min(self.base.len())
    }

    /// The payload of `key` as chunks totalling `block_bytes`.
    pub fn chunks(&self, key: &str) -> Vec<Bytes> {
        let n = self.stamp_len();
        let mut stamp = key.as_bytes()[..n.min(key.len())].to_vec();
        stamp.resize(n, b'.');
        vec![Bytes::from(stamp), self.base.slice(n..)]
    }

    /// Whether `body` is exactly the payload of `key` (the stamp is compared
    /// in full; with `full`, the rest too).
    pub fn verify(&self, key: &str, body: &[u8], full: bool) -> bool {
        self.verify_parts(key, std::iter::once(body), body.len(), full)
    }

    /// [`Payloads::verify`] of a body kept as the frames it arrived in.
    pub fn verify_body(&self, key: &str, body: &BodyChunks, full: bool) -> bool {
        self.verify_parts(key, body.chunks().iter().map(|c| &c[..]), body.len(), full)
    }

    fn verify_parts<'a>(&self, key: &str, parts: impl Iterator<Item = &'a [u8]>, len: usize, full: bool) -> bool {
        if len != self.base.len() {
            return false;
        }
        let n = self.stamp_len();
        let stamp = &self.chunks(key)[0];
        let mut offset = 0;
        for part in parts {
            let end = offset + part.len();
            if offset < n {
                let k = n.min(end) - offset;
                if part[..k] != stamp[offset..offset + k] {
                    return false;
                }
            }
            if end > n {
                if !full {
                    return true;
                }
                let from = offset.max(n);
                if part[from - offset..] != self.base[from..end] {
                    return false;
                }
            }
            offset = end;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_deterministic_and_checkable() {
        let p = Payloads::new(4096, 7);
        let body: Vec<u8> = p.chunks("k1").concat();
        assert_eq!(body.len(), 4096);
        assert!(p.verify("k1", &body, true));
        assert!(!p.verify("k2", &body, false));
        assert_eq!(Payloads::new(4096, 7).chunks("k1").concat(), body);
        assert_ne!(Payloads::new(4096, 8).chunks("k1").concat(), body);
    }

    #[test]
    fn bodies_in_frames_verify_like_whole_ones() {
        let p = Payloads::new(4096, 7);
        let whole = Bytes::from(p.chunks("k1").concat());
        for cuts in [vec![4096], vec![1, 4095], vec![10, 30, 4056], vec![32, 1, 4063], vec![100, 100, 3896]] {
            let mut body = BodyChunks::default();
            let mut at = 0;
            for cut in cuts {
                body = body.with(whole.slice(at..at + cut));
                at += cut;
            }
            assert!(p.verify_body("k1", &body, true));
            assert!(p.verify_body("k1", &body, false));
            assert!(!p.verify_body("k2", &body, false));
        }
        let mut flipped = whole.to_vec();
        flipped[2000] ^= 1;
        let body = BodyChunks::from(Bytes::from(flipped[..1000].to_vec())).with(Bytes::from(flipped[1000..].to_vec()));
        assert!(p.verify_body("k1", &body, false), "a stamp check reads only the stamp");
        assert!(!p.verify_body("k1", &body, true), "a full check finds the flipped byte");
        assert!(!p.verify_body("k1", &BodyChunks::from(whole.slice(..4095)), false), "short");
    }
}
