//! The payloads of the lease ops (docs/LOCAL.md, "Leases"): `MAP_ARENA`,
//! `LEASE` (its request is a key list, [`crate::decode_keys`]) and
//! `RELEASE`; and `MAP_INDEX` ("The shared index"), whose request is a
//! u32 shard as `MAP_ARENA`'s is a u32 arena.

use crate::{Code, Cursor, LEASE_ITEM_BYTES};

/// Where a RAM-tier arena's parts lie in its memory file (`MAP_ARENA`'s
/// answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaAnswer {
    /// Bytes to map from offset 0.
    pub file_bytes: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the arena.
    pub slots: u32,
    /// Offset of slot 0's u64 generation.
    pub generations_offset: u64,
}

/// A shard's index table (`MAP_INDEX`'s answer; the layout is the
/// engine's `shared_index` module and docs/LOCAL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexAnswer {
    /// Bytes to map from offset 0.
    pub file_bytes: u64,
    /// Buckets in the table (a power of two).
    pub buckets: u32,
    /// The store's shard count (a key's shard: its block hash mod this).
    pub shards: u32,
}

/// `MAP_INDEX` answer body (the descriptor travels beside it).
pub fn encode_index(a: &IndexAnswer) -> Vec<u8> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&a.file_bytes.to_le_bytes());
    b.extend_from_slice(&a.buckets.to_le_bytes());
    b.extend_from_slice(&a.shards.to_le_bytes());
    b
}

/// Decodes a `MAP_INDEX` answer body.
///
/// # Errors
/// Names the field the body ends in, or the bytes left over.
pub fn decode_index(body: &[u8]) -> Result<IndexAnswer, String> {
    let mut c = Cursor::new(body);
    let a = IndexAnswer { file_bytes: c.u64("file_bytes")?, buckets: c.u32("buckets")?, shards: c.u32("shards")? };
    c.end()?;
    Ok(a)
}

/// One key's `LEASE` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseItem {
    /// `block_bytes` when leased, else a negative [`Code`].
    pub result: i64,
    /// Wire number of the tier the block was found in (0: none).
    pub tier: u8,
    /// The arena holding the block (0 unless leased).
    pub arena: u32,
    /// The block's offset in the arena's file.
    pub offset: u64,
    /// The slot's generation when leased.
    pub generation: u64,
    /// The lease's id on its connection, for `RELEASE`.
    pub lease: u64,
}

/// `MAP_ARENA` request: u32 `arena`.
pub fn encode_map_arena(arena: u32) -> Vec<u8> {
    arena.to_le_bytes().to_vec()
}

/// Decodes a `MAP_ARENA` request.
///
/// # Errors
/// `BAD_REQUEST` for a payload that is not exactly a u32.
pub fn decode_map_arena(payload: &[u8]) -> Result<u32, (Code, String)> {
    let mut c = Cursor::new(payload);
    let arena = c.u32("the arena").map_err(|e| (Code::BadRequest, e))?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    Ok(arena)
}

/// `MAP_ARENA` answer body (the descriptor travels beside it).
pub fn encode_arena(a: &ArenaAnswer) -> Vec<u8> {
    let mut b = Vec::with_capacity(28);
    b.extend_from_slice(&a.file_bytes.to_le_bytes());
    b.extend_from_slice(&a.slot_bytes.to_le_bytes());
    b.extend_from_slice(&a.slots.to_le_bytes());
    b.extend_from_slice(&a.generations_offset.to_le_bytes());
    b
}

/// Decodes a `MAP_ARENA` answer body.
///
/// # Errors
/// Names the field the body ends in, or the bytes left over.
pub fn decode_arena(body: &[u8]) -> Result<ArenaAnswer, String> {
    let mut c = Cursor::new(body);
    let a = ArenaAnswer {
        file_bytes: c.u64("file_bytes")?,
        slot_bytes: c.u64("slot_bytes")?,
        slots: c.u32("slots")?,
        generations_offset: c.u64("generations_offset")?,
    };
    c.end()?;
    Ok(a)
}

/// `LEASE` answer body: u32 `n`, then each item's fields
/// ([`LEASE_ITEM_BYTES`] each).
pub fn encode_leases(items: &[LeaseItem]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + items.len() * LEASE_ITEM_BYTES);
    b.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for i in items {
        b.extend_from_slice(&i.result.to_le_bytes());
        b.push(i.tier);
        b.extend_from_slice(&i.arena.to_le_bytes());
        b.extend_from_slice(&i.offset.to_le_bytes());
        b.extend_from_slice(&i.generation.to_le_bytes());
        b.extend_from_slice(&i.lease.to_le_bytes());
    }
    b
}

/// Decodes a `LEASE` answer body.
///
/// # Errors
/// Names the field the body ends in, or the bytes left over.
pub fn decode_leases(body: &[u8]) -> Result<Vec<LeaseItem>, String> {
    let mut c = Cursor::new(body);
    let n = c.u32("the item count")? as usize;
    let mut items = Vec::with_capacity(n.min(body.len() / LEASE_ITEM_BYTES));
    for _ in 0..n {
        let result = c.u64("result")? as i64;
        let tier = c.u8("tier")?;
        items.push(LeaseItem {
            result,
            tier,
            arena: c.u32("arena")?,
            offset: c.u64("offset")?,
            generation: c.u64("generation")?,
            lease: c.u64("lease")?,
        });
    }
    c.end()?;
    Ok(items)
}

/// `RELEASE` request: u32 `n`, then `n` × u64 `lease`.
pub fn encode_release(leases: &[u64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + 8 * leases.len());
    b.extend_from_slice(&(leases.len() as u32).to_le_bytes());
    for l in leases {
        b.extend_from_slice(&l.to_le_bytes());
    }
    b
}

/// Decodes a `RELEASE` request: at most [`crate::ITEMS_MAX`] ids.
///
/// # Errors
/// `LIMIT` for too many ids, `BAD_REQUEST` for a payload that does not
/// parse.
pub fn decode_release(payload: &[u8]) -> Result<Vec<u64>, (Code, String)> {
    let mut c = Cursor::new(payload);
    let n = c.count(8).map_err(|e| if e.contains("the limit is") { (Code::Limit, e) } else { (Code::BadRequest, e) })?;
    let ids = (0..n).map(|_| c.u64("a lease")).collect::<Result<Vec<_>, _>>().map_err(|e| (Code::BadRequest, e))?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    Ok(ids)
}

/// `RELEASE` answer body: u32 `released`.
pub fn encode_released(released: u32) -> Vec<u8> {
    released.to_le_bytes().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_payloads_round_trip_and_bad_ones_say_why() {
        let a = ArenaAnswer { file_bytes: 6 << 20, slot_bytes: 65_536, slots: 64, generations_offset: 4 << 20 };
        assert_eq!(decode_arena(&encode_arena(&a)), Ok(a));
        assert_eq!(decode_map_arena(&encode_map_arena(7)), Ok(7));
        let i = IndexAnswer { file_bytes: 4096 + 64 * 32, buckets: 64, shards: 2 };
        assert_eq!(decode_index(&encode_index(&i)), Ok(i));
        assert_eq!(decode_map_arena(&[1, 2, 3]).unwrap_err().0, Code::BadRequest);
        let items = [
            LeaseItem { result: 65_536, tier: 2, arena: 1, offset: 131_072, generation: 3, lease: 9 },
            LeaseItem { result: Code::NotFound as i64, tier: 0, arena: 0, offset: 0, generation: 0, lease: 0 },
        ];
        let body = encode_leases(&items);
        assert_eq!(body.len(), 4 + 2 * LEASE_ITEM_BYTES);
        assert_eq!(decode_leases(&body).unwrap(), items);
        assert!(decode_leases(&body[..body.len() - 1]).unwrap_err().contains("lease"));
        assert_eq!(decode_release(&encode_release(&[1, 2, 3])), Ok(vec![1, 2, 3]));
        let mut too_many = 5000u32.to_le_bytes().to_vec();
        too_many.extend(vec![0u8; 5000 * 8]);
        assert_eq!(decode_release(&too_many).unwrap_err().0, Code::Limit);
        assert_eq!(decode_release(&[1, 0, 0, 0]).unwrap_err().0, Code::BadRequest);
    }
}
