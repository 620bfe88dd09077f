//! Payloads: the bodies of each op's requests and replies, encoded and
//! decoded (item batches, key lists, results, registrations, tiers).

use crate::{Code, Op, ITEMS_MAX, PARTS_MAX};

/// Reads a payload front to back; every read checks the length left.
pub struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    /// A cursor over `payload`.
    pub fn new(payload: &'a [u8]) -> Self {
        Cursor { rest: payload }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.rest.len() < n {
            return Err(format!("payload ends inside {what} (needs {n} bytes, {} left)", self.rest.len()));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// A byte.
    pub fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    /// A little-endian u16.
    pub fn u16(&mut self, what: &str) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes")))
    }

    /// A little-endian u32.
    pub fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }

    /// A little-endian u64.
    pub fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }

    /// A `str`: u16 length and UTF-8 bytes.
    pub fn str(&mut self, what: &str) -> Result<&'a str, String> {
        std::str::from_utf8(self.bytes(what)?).map_err(|_| format!("{what} is not UTF-8"))
    }

    /// Bytes with a u16 length in front (a `str` that need not be UTF-8).
    pub fn bytes(&mut self, what: &str) -> Result<&'a [u8], String> {
        let n = self.u16(what)? as usize;
        self.take(n, what)
    }

    /// A batch count: at most [`ITEMS_MAX`], and no more than the payload
    /// left could hold at `min_item_bytes` each.
    pub fn count(&mut self, min_item_bytes: usize) -> Result<usize, String> {
        let n = self.u32("the item count")? as usize;
        if n > ITEMS_MAX {
            return Err(format!("{n} items in one batch; the limit is {ITEMS_MAX}"));
        }
        if n * min_item_bytes > self.rest.len() {
            return Err(format!("{n} items cannot fit in the {} payload bytes left", self.rest.len()));
        }
        Ok(n)
    }

    /// Fails unless the whole payload was read.
    pub fn end(&self) -> Result<(), String> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected bytes after the payload", self.rest.len()))
        }
    }
}

/// One span of registered memory: `length` bytes at `offset` in the
/// region `handle` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Registration handle.
    pub handle: u64,
    /// Offset within the registered region, bytes.
    pub offset: u64,
    /// Bytes of the span.
    pub length: u64,
}

/// One item of a `GET_INTO`/`PUT_FROM` batch (one part) or of a
/// `GET_INTO_V`/`PUT_FROM_V` batch (1 to [`PARTS_MAX`] parts): the block's
/// bytes, in order, laid across the parts in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item<'a> {
    /// The spans: room for the block (get) or its bytes (put).
    pub parts: Vec<Span>,
    /// Block key.
    pub key: &'a str,
    /// The block tag a tagged put item carries (the engine's binary form,
    /// docs/FORMAT.md "Block tags"), as sent: unchecked here; empty for an
    /// untagged item and for every item of an untagged batch.
    pub tag: &'a [u8],
}

impl Item<'_> {
    /// Bytes of all the parts together (saturating at `u64::MAX`).
    pub fn length(&self) -> u64 {
        self.parts.iter().fold(0u64, |sum, p| sum.saturating_add(p.length))
    }
}

/// Decodes a `GET_INTO`/`PUT_FROM` payload: each item one span.
///
/// # Errors
/// [`Code::BadRequest`] with a message for a payload that does not parse
/// (truncated, trailing bytes); [`Code::Limit`] for over [`ITEMS_MAX`] items.
pub fn decode_items(payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    decode_batch(payload, false, false)
}

/// Decodes a `GET_INTO_V`/`PUT_FROM_V` payload: each item a u16 `parts`
/// count (1 to [`PARTS_MAX`]) before its spans.
///
/// # Errors
/// As [`decode_items`]; a `parts` of 0 or over [`PARTS_MAX`] is
/// [`Code::BadRequest`].
pub fn decode_items_v(payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    decode_batch(payload, true, false)
}

/// Decodes a version-2 `PUT_FROM` payload ([`crate::VERSION_TAGS`]): each
/// item as [`decode_items`] reads it, then u16 `tag_bytes` and that many
/// bytes of block tag (0: untagged).
///
/// # Errors
/// As [`decode_items`]. The tag's bytes are not checked here (the server
/// answers a bad one `INVALID_TAG` for its item).
pub fn decode_tagged_items(payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    decode_batch(payload, false, true)
}

/// Decodes a version-2 `PUT_FROM_V` payload: each item as
/// [`decode_items_v`] reads it, then its tag as [`decode_tagged_items`].
///
/// # Errors
/// As [`decode_items_v`].
pub fn decode_tagged_items_v(payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    decode_batch(payload, true, true)
}

/// Decodes the items of `op` (`GET_INTO`, `PUT_FROM` and their vectored
/// forms) on a connection that speaks `version`: the one rule of which form
/// a batch takes ([`Op::carries_tags`]), for the server's reader and the
/// fuzz target `local_frames`.
///
/// # Errors
/// As the decoder of that form.
///
/// # Panics
/// For an op that carries no items (`HELLO`, `EXISTS`, ...): a caller bug.
pub fn decode_op_items(op: Op, version: u32, payload: &[u8]) -> Result<Vec<Item<'_>>, (Code, String)> {
    assert!(matches!(op, Op::GetInto | Op::PutFrom | Op::GetIntoV | Op::PutFromV), "{} carries no items", op.name());
    decode_batch(payload, op.is_vectored(), op.carries_tags(version))
}

/// The one decoder of item batches; `vectored` items carry a `parts` count,
/// `tagged` ones end with a tag.
fn decode_batch(payload: &[u8], vectored: bool, tagged: bool) -> Result<Vec<Item<'_>>, (Code, String)> {
    let mut c = Cursor::new(payload);
    // Smallest item: one span and an empty key's length (and an empty
    // tag's); a vectored item's is counted from its `parts` and key length
    // alone, so an item with 0 parts is refused for that, not for its size.
    let min_item_bytes = if vectored { 2 + 2 } else { 24 + 2 } + if tagged { 2 } else { 0 };
    let n = c.count(min_item_bytes).map_err(count_code)?;
    let mut items = Vec::with_capacity(n);
    for i in 0..n {
        let bad = |e: String| (Code::BadRequest, format!("item {i}: {e}"));
        let parts = if vectored { c.u16("a parts count").map_err(bad)? as usize } else { 1 };
        if !(1..=PARTS_MAX).contains(&parts) {
            return Err(bad(format!("{parts} parts; an item has 1 to {PARTS_MAX}")));
        }
        let parts = (0..parts)
            .map(|_| Ok(Span { handle: c.u64("a handle")?, offset: c.u64("an offset")?, length: c.u64("a length")? }))
            .collect::<Result<Vec<_>, String>>()
            .map_err(bad)?;
        let key = c.str("a key").map_err(bad)?;
        let tag = if tagged { c.bytes("a block tag").map_err(bad)? } else { &[] };
        items.push(Item { parts, key, tag });
    }
    c.end().map_err(|e| (Code::BadRequest, e))?;
    Ok(items)
}

/// Decodes a payload of keys (`EXISTS`, `LOOKUP`, `DELETE`, `PREFETCH`).
pub fn decode_keys(payload: &[u8]) -> Result<Vec<&str>, (Code, String)> {
    let mut c = Cursor::new(payload);
    let n = c.count(2).map_err(count_code)?;
    let keys = (0..n).map(|i| c.str("a key").map_err(|e| (Code::BadRequest, format!("key {i}: {e}")))).collect::<Result<Vec<_>, _>>()?;
    c.end().map_err(|e| (Code::BadRequest, e))?;
    Ok(keys)
}

fn count_code(e: String) -> (Code, String) {
    if e.contains("the limit is") {
        (Code::Limit, e)
    } else {
        (Code::BadRequest, e)
    }
}

/// Tier names by wire number: 0 none, 1 `gpu`, 2 `ram`, 3 `nvme`, 4 `s3`
/// (the words of `x-kvtier-tier`).
pub const TIER_NAMES: [&str; 5] = ["none", "gpu", "ram", "nvme", "s3"];

/// The tier a wire number names ([`TIER_NAMES`]); `unknown` past them.
pub fn tier_name(tier: u8) -> &'static str {
    TIER_NAMES.get(tier as usize).copied().unwrap_or("unknown")
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A `GET_INTO`/`PUT_FROM` payload: `(handle, offset, length, key)` items
/// ([`decode_items`] reads it).
pub fn encode_items(items: &[(u64, u64, u64, &str)]) -> Vec<u8> {
    encode_batch(items.iter().map(|&(handle, offset, length, key)| (None, [(handle, offset, length)].into_iter(), key, None)))
}

/// One item for [`encode_tagged_items`]: handle, offset and length (bytes),
/// key, and the encoded block tag (empty: untagged).
pub type TaggedItem<'a> = (u64, u64, u64, &'a str, &'a [u8]);

/// A version-2 `PUT_FROM` payload ([`decode_tagged_items`] reads it).
///
/// # Panics
/// A tag over 65,535 bytes (its u16 length cannot say it); the server
/// refuses any over 3,072 anyway.
pub fn encode_tagged_items(items: &[TaggedItem<'_>]) -> Vec<u8> {
    encode_batch(items.iter().map(|&(handle, offset, length, key, tag)| (None, [(handle, offset, length)].into_iter(), key, Some(tag))))
}

/// One item for [`encode_tagged_items_v`]: its parts, its key and its
/// encoded block tag (empty: untagged).
pub type TaggedItemV<'a> = (&'a [(u64, u64, u64)], &'a str, &'a [u8]);

/// A version-2 `PUT_FROM_V` payload ([`decode_tagged_items_v`] reads it);
/// nothing is checked, as [`encode_items_v`].
///
/// # Panics
/// As [`encode_tagged_items`].
pub fn encode_tagged_items_v(items: &[TaggedItemV<'_>]) -> Vec<u8> {
    encode_batch(items.iter().map(|&(parts, key, tag)| (Some(parts.len() as u16), parts.iter().copied(), key, Some(tag))))
}

/// One item for [`encode_items_v`]: its parts, each a `(handle, offset,
/// length)` span (bytes), and its key.
pub type ItemV<'a> = (&'a [(u64, u64, u64)], &'a str);

/// A `GET_INTO_V`/`PUT_FROM_V` payload: items of `(parts, key)`, each part a
/// `(handle, offset, length)` span ([`decode_items_v`] reads it). Nothing is
/// checked: a part count of 0 or over [`PARTS_MAX`] is sent as it is (the
/// server refuses it with `BAD_REQUEST`).
pub fn encode_items_v(items: &[ItemV<'_>]) -> Vec<u8> {
    encode_batch(items.iter().map(|&(parts, key)| (Some(parts.len() as u16), parts.iter().copied(), key, None)))
}

/// What [`encode_batch`] writes of one item: its `parts` count (vectored
/// ops only), its spans, its key and its tag (tagged batches only).
type BatchItem<'k, S> = (Option<u16>, S, &'k str, Option<&'k [u8]>);

/// The one encoder of item batches: u32 `n`, then per item its `parts`
/// count (vectored ops only), its spans, its key and, in a tagged batch,
/// u16 `tag_bytes` and its tag.
fn encode_batch<'k, S: Iterator<Item = (u64, u64, u64)>>(items: impl ExactSizeIterator<Item = BatchItem<'k, S>>) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + items.len() * 64);
    p.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for (parts, spans, key, tag) in items {
        if let Some(parts) = parts {
            p.extend_from_slice(&parts.to_le_bytes());
        }
        for (handle, offset, length) in spans {
            p.extend_from_slice(&handle.to_le_bytes());
            p.extend_from_slice(&offset.to_le_bytes());
            p.extend_from_slice(&length.to_le_bytes());
        }
        put_str(&mut p, key);
        if let Some(tag) = tag {
            let n = u16::try_from(tag.len()).unwrap_or_else(|_| panic!("a {}-byte block tag does not fit its u16 length", tag.len()));
            p.extend_from_slice(&n.to_le_bytes());
            p.extend_from_slice(tag);
        }
    }
    p
}

/// A payload of keys (`EXISTS`, `LOOKUP`, `DELETE`, `PREFETCH`;
/// [`decode_keys`] reads it).
pub fn encode_keys<S: AsRef<str>>(keys: &[S]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + keys.iter().map(|k| 2 + k.as_ref().len()).sum::<usize>());
    p.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        put_str(&mut p, k.as_ref());
    }
    p
}

/// A batch's per-item body: u32 `n`, then `n` × (i64 `result`, u8 `extra`).
pub fn encode_results(results: &[(i64, u8)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + results.len() * 9);
    out.extend_from_slice(&(results.len() as u32).to_le_bytes());
    for (r, x) in results {
        out.extend_from_slice(&r.to_le_bytes());
        out.push(*x);
    }
    out
}

/// A `REGISTER` payload: u64 `offset` and u64 `length`, bytes of the file
/// whose descriptor travels with the frame (`SCM_RIGHTS`).
pub fn encode_register(offset: u64, length: u64) -> Vec<u8> {
    let mut p = offset.to_le_bytes().to_vec();
    p.extend_from_slice(&length.to_le_bytes());
    p
}

/// A `REGISTER` response body: u64 `handle`, u8 `access` (1 mapped, 2 file
/// I/O, 3 guarded).
pub fn encode_registered(handle: u64, access: u8) -> Vec<u8> {
    let mut b = handle.to_le_bytes().to_vec();
    b.push(access);
    b
}

/// An `UNREGISTER` payload: u64 `handle`. (Its response body is empty.)
pub fn encode_unregister(handle: u64) -> Vec<u8> {
    handle.to_le_bytes().to_vec()
}

/// An `EXISTS` response body: u32 `n`, then `n` × u8 `tier` (0: not stored;
/// [`TIER_NAMES`]).
pub fn encode_tiers(tiers: &[u8]) -> Vec<u8> {
    let mut b = (tiers.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(tiers);
    b
}

/// A `LOOKUP` response body: u32 `prefix_hits`, u32 `n` (the same number),
/// then `n` × u8 `tier`: the tiers of the chain's leading hits.
pub fn encode_lookup(hit_tiers: &[u8]) -> Vec<u8> {
    let mut b = (hit_tiers.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&encode_tiers(hit_tiers));
    b
}

/// A `DELETE` response body: u32 `n`, then `n` × i64 `result` (0 deleted,
/// or a negative [`Code`]: `NOT_FOUND` for a key with no block).
pub fn encode_deleted(results: &[i64]) -> Vec<u8> {
    let mut b = (results.len() as u32).to_le_bytes().to_vec();
    b.extend(results.iter().flat_map(|r| r.to_le_bytes()));
    b
}

/// A `PREFETCH` response body: u32 `requested` (keys asked for), u32
/// `found` (of those, stored locally).
pub fn encode_prefetched(requested: u32, found: u32) -> Vec<u8> {
    let mut b = requested.to_le_bytes().to_vec();
    b.extend_from_slice(&found.to_le_bytes());
    b
}
