//! Reading a leased block in place (docs/LOCAL.md, "Leases"): the reader's
//! half of the RAM tier's generation protocol. The server, before it writes
//! a slot again, adds one to the slot's u64 generation and then issues a
//! release fence (`engine/src/ram/arena.rs`, `Arena::reuse`); a reader
//! reads the block's bytes, issues an acquire fence, and loads the
//! generation: if it still equals the lease's, no write of the slot began
//! before the reads ended, so the bytes were the block's. (If a read saw a
//! byte written after the server's fence, the two fences synchronize and
//! the generation load sees the increment.) `local-proto/tests/loom_model.rs`
//! checks the protocol under every interleaving loom explores.

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Whether the generation at `generation` still equals `leased`, checked
/// after the slot's bytes were read (module docs): `false` means the bytes
/// read are not to be trusted.
///
/// # Safety
/// `generation` points at a live, 8-byte aligned u64 of a mapped arena's
/// generation table.
pub unsafe fn still_leased(generation: *const u64, leased: u64) -> bool {
    fence(Ordering::Acquire);
    // SAFETY: the caller's live, aligned u64, which the server changes only
    // through atomic operations.
    unsafe { (*generation.cast::<AtomicU64>()).load(Ordering::Relaxed) == leased }
}

/// Copies `nbytes` from a leased block at `src` to `dst`, then checks the
/// generation ([`still_leased`]): `true` when `dst` holds the block.
///
/// # Safety
/// `src..src + nbytes` lies inside a mapped arena and `dst..dst + nbytes`
/// is writable memory of the caller's that does not overlap it;
/// `generation` as for [`still_leased`]. The server may be writing `src`
/// meanwhile (then the answer is `false`): the bytes are copied as plain
/// memory, the one racy read a seqlock reader makes, in memory another
/// process owns.
pub unsafe fn copy_leased(dst: *mut u8, src: *const u8, nbytes: usize, generation: *const u64, leased: u64) -> bool {
    // SAFETY: the caller's ranges (above).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, nbytes);
        still_leased(generation, leased)
    }
}
