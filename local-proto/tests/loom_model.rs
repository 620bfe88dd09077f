//! Loom models of the two reads a same-host client makes without a lock,
//! in the orderings the code uses (docs/LOCAL.md):
//!
//! - a shared index bucket (`engine/src/shared_index.rs` writes:
//!   `seq` odd, release fence, the fields, `seq` even with release;
//!   `local-proto/src/shared_index.rs` reads: `seq` with acquire, the
//!   fields, acquire fence, `seq` again): a reader that believes a bucket
//!   read one write's fields, never a mix;
//! - a leased RAM-tier slot (`engine/src/ram/arena.rs` `Arena::reuse`: the
//!   generation up by one, release fence, then the bytes;
//!   `client/src/lease.rs`: the bytes, acquire fence, the generation): a
//!   reader that finds the generation unchanged read the leased bytes.
//!
//! Loom runs each model under every interleaving and every outcome the
//! C++11 memory model allows for these orderings, so a weaker ordering
//! shows as a failed assertion (each model has its negative control,
//! below, where a fence is taken out). Run: `make model-check`
//! (`RUSTFLAGS="--cfg loom"`, its own target folder). These are models of
//! the protocols, written beside the code with the same orderings: the
//! code itself works on memory another process maps, which loom cannot.
#![cfg(loom)]

use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
use loom::sync::Arc;
use loom::thread;

struct Bucket {
    seq: AtomicU32,
    tiers: AtomicU8,
    lo: AtomicU64,
    hi: AtomicU64,
}

/// The engine's bucket write, with or without its release fence.
fn write_bucket(b: &Bucket, v: u64, fenced: bool) {
    let s = b.seq.load(Ordering::Relaxed);
    b.seq.store(s.wrapping_add(1), Ordering::Relaxed);
    if fenced {
        fence(Ordering::Release);
    }
    b.tiers.store(v as u8, Ordering::Relaxed);
    b.lo.store(v, Ordering::Relaxed);
    b.hi.store(v, Ordering::Relaxed);
    b.seq.store(s.wrapping_add(2), Ordering::Release);
}

/// The client's bucket read, with or without its acquire fence.
fn read_bucket(b: &Bucket, fenced: bool) -> Option<(u8, u64, u64)> {
    let before = b.seq.load(Ordering::Acquire);
    if before & 1 != 0 {
        return None;
    }
    let fields = (b.tiers.load(Ordering::Relaxed), b.lo.load(Ordering::Relaxed), b.hi.load(Ordering::Relaxed));
    if fenced {
        fence(Ordering::Acquire);
    }
    (b.seq.load(Ordering::Relaxed) == before).then_some(fields)
}

fn bucket_model(fenced: bool) {
    bucket_model_with(fenced, true);
}

fn bucket_model_with(fenced: bool, writer_fenced: bool) {
    loom::model(move || {
        let b = Arc::new(Bucket { seq: AtomicU32::new(0), tiers: AtomicU8::new(1), lo: AtomicU64::new(1), hi: AtomicU64::new(1) });
        let w = {
            let b = b.clone();
            thread::spawn(move || write_bucket(&b, 2, writer_fenced))
        };
        if let Some((t, lo, hi)) = read_bucket(&b, fenced) {
            assert!(t as u64 == lo && lo == hi, "a torn bucket was believed: tiers {t}, lo {lo}, hi {hi}");
        }
        w.join().unwrap();
    });
}

#[test]
fn a_reader_believes_only_a_whole_bucket() {
    bucket_model(true);
}

#[test]
#[should_panic(expected = "a torn bucket was believed")]
fn without_the_readers_fence_a_torn_bucket_is_believed() {
    bucket_model(false);
}

#[test]
#[should_panic(expected = "a torn bucket was believed")]
fn without_the_writers_fence_a_torn_bucket_is_believed() {
    bucket_model_with(true, false);
}

struct Slot {
    generation: AtomicU64,
    /// The block's bytes, as two words (enough for a torn read to show).
    bytes: [AtomicU64; 2],
}

/// The server reusing a slot: the generation up by one, the release fence
/// (unless `fenced` is false), then the new block's bytes.
fn reuse(s: &Slot, v: u64, fenced: bool) {
    s.generation.fetch_add(1, Ordering::Relaxed);
    if fenced {
        fence(Ordering::Release);
    }
    for b in &s.bytes {
        b.store(v, Ordering::Relaxed);
    }
}

/// The client reading a leased block and checking its generation, with or
/// without the acquire fence between the two.
fn read_leased(s: &Slot, leased: u64, fenced: bool) -> Option<[u64; 2]> {
    let bytes = [s.bytes[0].load(Ordering::Relaxed), s.bytes[1].load(Ordering::Relaxed)];
    if fenced {
        fence(Ordering::Acquire);
    }
    (s.generation.load(Ordering::Relaxed) == leased).then_some(bytes)
}

fn lease_model(fenced: bool) {
    lease_model_with(fenced, true);
}

fn lease_model_with(fenced: bool, writer_fenced: bool) {
    loom::model(move || {
        let s = Arc::new(Slot { generation: AtomicU64::new(7), bytes: [AtomicU64::new(1), AtomicU64::new(1)] });
        let w = {
            let s = s.clone();
            thread::spawn(move || reuse(&s, 2, writer_fenced))
        };
        if let Some(bytes) = read_leased(&s, 7, fenced) {
            assert_eq!(bytes, [1, 1], "bytes of a reused slot were taken for the leased block");
        }
        w.join().unwrap();
    });
}

#[test]
fn a_reader_that_finds_the_generation_unchanged_read_the_leased_block() {
    lease_model(true);
}

#[test]
#[should_panic(expected = "bytes of a reused slot were taken for the leased block")]
fn without_the_readers_fence_a_reused_slot_is_believed() {
    lease_model(false);
}

#[test]
#[should_panic(expected = "bytes of a reused slot were taken for the leased block")]
fn without_the_servers_fence_a_reused_slot_is_believed() {
    lease_model_with(true, false);
}
