//! Decoding the KV events a kvtier node publishes (vLLM 0.32.0's format,
//! docs/OPERATIONS.md "KV events for routers"; the encoder is
//! server/src/events/encode.rs): a ZeroMQ message of three frames, the
//! topic, an 8-byte big-endian sequence number and a msgpack payload
//!
//! ```text
//! [ts, [event, ...], data_parallel_rank]
//! event: {"type": "BlockStored", "block_hashes": [...], "medium": "CPU", ...}
//!        {"type": "BlockRemoved", "block_hashes": [...], "medium": "STORAGE", ...}
//!        {"type": "AllBlocksCleared"}
//! ```
//!
//! A router needs only the type, the hashes and the medium; every other
//! field is skipped, so a publisher adding fields (vLLM adds some in most
//! releases) decodes the same. Hashes come as integers (vLLM's default) or
//! as bytes (`--kv-events-hash bytes`); both become the integer vLLM makes
//! of them (the low 64 bits, big-endian).

use rmp::Marker;

/// Deepest nesting of msgpack containers decoded (an event map inside the
/// events array inside the batch is 3; the rest is a malformed payload).
const DEPTH_MAX: usize = 8;

/// Where a block is, as an event names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `GPU`.
    Gpu,
    /// `CPU`: kvtier's RAM tier.
    Cpu,
    /// `STORAGE`: kvtier's NVMe log.
    Storage,
    /// `EXTERNAL`: the shared tier (S3), reachable from every node.
    External,
}

impl Medium {
    /// Every medium, in the order of [`Medium::bit`].
    pub const ALL: [Medium; 4] = [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::External];

    /// The medium vLLM's `medium` field names; `None` for another name.
    pub fn from_name(name: &str) -> Option<Medium> {
        match name {
            "GPU" => Some(Medium::Gpu),
            "CPU" => Some(Medium::Cpu),
            "STORAGE" => Some(Medium::Storage),
            "EXTERNAL" => Some(Medium::External),
            _ => None,
        }
    }

    /// Its bit in a set of media (one byte per block in a router's index).
    pub const fn bit(self) -> u8 {
        1 << (self as u8)
    }

    /// Whether a node serves a block in this medium from its own tiers
    /// (GPU, RAM, NVMe), as opposed to the bucket every node shares.
    pub fn is_local(self) -> bool {
        !matches!(self, Medium::External)
    }
}

/// One event, as much of it as a router uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `BlockStored`: the blocks arrived in `medium`.
    Stored {
        /// The engine's block hashes, as integers.
        hashes: Vec<u64>,
        /// Where.
        medium: Medium,
    },
    /// `BlockRemoved`: the blocks left `medium`.
    Removed {
        /// The engine's block hashes, as integers.
        hashes: Vec<u64>,
        /// Where from.
        medium: Medium,
    },
    /// `AllBlocksCleared`: the node holds nothing it published before.
    Cleared,
}

/// A payload that is not a batch of vLLM's format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The msgpack ends early or nests too deep.
    #[error("malformed msgpack at byte {0}")]
    Malformed(usize),
    /// Valid msgpack, not `[ts, [events], rank]`.
    #[error("not a KV event batch: {0}")]
    NotABatch(String),
}

/// A decoded msgpack value (extension types are kept as nothing).
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Nil,
    Bool,
    Uint(u64),
    Int,
    Float,
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
    Ext,
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or(WireError::Malformed(self.at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, WireError> {
        Ok(self.take(n)?.iter().fold(0u64, |v, b| (v << 8) | u64::from(*b)))
    }

    /// A length read from `n` bytes, no larger than what is left (every
    /// item takes at least a byte, so a larger one is malformed, and never
    /// an allocation of what a header claims).
    fn len(&mut self, n: usize) -> Result<usize, WireError> {
        let at = self.at;
        let len = self.be(n)? as usize;
        if len > self.bytes.len() - self.at {
            return Err(WireError::Malformed(at));
        }
        Ok(len)
    }

    fn value(&mut self, depth: usize) -> Result<Value, WireError> {
        if depth > DEPTH_MAX {
            return Err(WireError::Malformed(self.at));
        }
        let marker = Marker::from_u8(self.take(1)?[0]);
        let container = |r: &mut Self, len: usize, map: bool| -> Result<Value, WireError> {
            if map {
                (0..len).map(|_| Ok((r.value(depth + 1)?, r.value(depth + 1)?))).collect::<Result<_, _>>().map(Value::Map)
            } else {
                (0..len).map(|_| r.value(depth + 1)).collect::<Result<_, _>>().map(Value::Array)
            }
        };
        let text =
            |r: &mut Self, len: usize| -> Result<Value, WireError> { Ok(Value::Str(String::from_utf8_lossy(r.take(len)?).into_owned())) };
        Ok(match marker {
            Marker::FixPos(v) => Value::Uint(u64::from(v)),
            Marker::U8 => Value::Uint(self.be(1)?),
            Marker::U16 => Value::Uint(self.be(2)?),
            Marker::U32 => Value::Uint(self.be(4)?),
            Marker::U64 => Value::Uint(self.be(8)?),
            Marker::FixNeg(_) => Value::Int,
            Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                let n = match marker {
                    Marker::I8 => 1,
                    Marker::I16 => 2,
                    Marker::I32 => 4,
                    _ => 8,
                };
                self.take(n)?;
                Value::Int
            }
            Marker::Null => Value::Nil,
            Marker::True | Marker::False => Value::Bool,
            Marker::F32 => {
                self.take(4)?;
                Value::Float
            }
            Marker::F64 => {
                self.take(8)?;
                Value::Float
            }
            Marker::FixStr(n) => text(self, usize::from(n))?,
            Marker::Str8 => {
                let n = self.len(1)?;
                text(self, n)?
            }
            Marker::Str16 => {
                let n = self.len(2)?;
                text(self, n)?
            }
            Marker::Str32 => {
                let n = self.len(4)?;
                text(self, n)?
            }
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                let n = match marker {
                    Marker::Bin8 => self.len(1)?,
                    Marker::Bin16 => self.len(2)?,
                    _ => self.len(4)?,
                };
                Value::Bin(self.take(n)?.to_vec())
            }
            Marker::FixArray(n) => container(self, usize::from(n), false)?,
            Marker::Array16 => {
                let n = self.len(2)?;
                container(self, n, false)?
            }
            Marker::Array32 => {
                let n = self.len(4)?;
                container(self, n, false)?
            }
            Marker::FixMap(n) => container(self, usize::from(n), true)?,
            Marker::Map16 => {
                let n = self.len(2)?;
                container(self, n, true)?
            }
            Marker::Map32 => {
                let n = self.len(4)?;
                container(self, n, true)?
            }
            Marker::FixExt1 | Marker::FixExt2 | Marker::FixExt4 | Marker::FixExt8 | Marker::FixExt16 => {
                let n = match marker {
                    Marker::FixExt1 => 1,
                    Marker::FixExt2 => 2,
                    Marker::FixExt4 => 4,
                    Marker::FixExt8 => 8,
                    _ => 16,
                };
                self.take(1 + n)?;
                Value::Ext
            }
            Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => {
                let n = match marker {
                    Marker::Ext8 => self.len(1)?,
                    Marker::Ext16 => self.len(2)?,
                    _ => self.len(4)?,
                };
                self.take(1 + n)?;
                Value::Ext
            }
            Marker::Reserved => return Err(WireError::Malformed(self.at - 1)),
        })
    }
}

/// The integer vLLM makes of a hash: an integer as it is; bytes read
/// big-endian, their low 64 bits.
fn hash_of(v: &Value) -> Option<u64> {
    match v {
        Value::Uint(h) => Some(*h),
        Value::Bin(b) => Some(b.iter().fold(0u64, |h, x| (h << 8) | u64::from(*x))),
        _ => None,
    }
}

fn event(v: &Value) -> Result<Option<KvEvent>, WireError> {
    let Value::Map(fields) = v else { return Err(WireError::NotABatch("an event that is not a map".into())) };
    let field = |name: &str| fields.iter().find(|(k, _)| matches!(k, Value::Str(s) if s == name)).map(|(_, v)| v);
    let Some(Value::Str(kind)) = field("type") else { return Err(WireError::NotABatch("an event without its \"type\"".into())) };
    let hashes = || -> Result<Vec<u64>, WireError> {
        match field("block_hashes") {
            Some(Value::Array(hs)) => {
                hs.iter().map(|h| hash_of(h).ok_or_else(|| WireError::NotABatch(format!("a block hash {h:?}")))).collect()
            }
            _ => Err(WireError::NotABatch(format!("{kind} without block_hashes"))),
        }
    };
    let medium = || match field("medium") {
        Some(Value::Str(m)) => Ok(Medium::from_name(m)),
        _ => Err(WireError::NotABatch(format!("{kind} without a medium"))),
    };
    match kind.as_str() {
        "BlockStored" | "BlockRemoved" => {
            // A medium no router here knows: nothing to index.
            let Some(medium) = medium()? else { return Ok(None) };
            let hashes = hashes()?;
            Ok(Some(if kind == "BlockStored" { KvEvent::Stored { hashes, medium } } else { KvEvent::Removed { hashes, medium } }))
        }
        "AllBlocksCleared" => Ok(Some(KvEvent::Cleared)),
        // Another type (a newer vLLM's): nothing a prefix index uses.
        _ => Ok(None),
    }
}

/// The events of one batch payload, in order. Events of a medium no
/// router here knows, and of a type it does not use, are left out.
///
/// # Errors
/// [`WireError`] for a payload that is not msgpack or not a batch.
pub fn decode_batch(payload: &[u8]) -> Result<Vec<KvEvent>, WireError> {
    let mut r = Reader { bytes: payload, at: 0 };
    let batch = r.value(0)?;
    if r.at != payload.len() {
        return Err(WireError::NotABatch(format!("{} bytes after the batch", payload.len() - r.at)));
    }
    let Value::Array(items) = batch else { return Err(WireError::NotABatch("not an array".into())) };
    let Some(Value::Array(events)) = items.get(1) else { return Err(WireError::NotABatch("no events array".into())) };
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        if let Some(e) = event(e)? {
            out.push(e);
        }
    }
    Ok(out)
}

/// The sequence number of a message's second frame (8 bytes, big-endian);
/// `None` for another length.
pub fn sequence(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    // msgspec 0.22.0's encoding of vLLM 0.32.0's classes, the same bytes
    // server/src/events/encode.rs pins its encoder to.

    #[test]
    fn decodes_msgspecs_all_blocks_cleared() {
        let p = unhex("93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c656172656400");
        assert_eq!(decode_batch(&p).unwrap(), vec![KvEvent::Cleared]);
    }

    #[test]
    fn decodes_msgspecs_int_hashes_with_ownership() {
        let p = unhex(
            "93cb3ff80000000000009289a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffffffff\
             ffffffb1706172656e745f626c6f636b5f68617368cd0102a9746f6b656e5f696473940102cd012cce00011170aa626c6f63\
             6b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0a96f776e657273686970a66b\
             767469657284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da753544f\
             52414745a96f776e657273686970a66b767469657200",
        );
        assert_eq!(
            decode_batch(&p).unwrap(),
            vec![
                KvEvent::Stored { hashes: vec![1, u64::MAX], medium: Medium::Cpu },
                KvEvent::Removed { hashes: vec![5], medium: Medium::Storage },
            ]
        );
    }

    #[test]
    fn decodes_msgspecs_bytes_hashes() {
        let p = unhex(
            "93cb3ff80000000000009288a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4020102b17061\
             72656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d\
             656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368\
             657391c402ffeea66d656469756da845585445524e414c00",
        );
        assert_eq!(
            decode_batch(&p).unwrap(),
            vec![
                KvEvent::Stored { hashes: vec![0x0102], medium: Medium::Gpu },
                KvEvent::Removed { hashes: vec![0xffee], medium: Medium::External },
            ]
        );
    }

    #[test]
    fn refuses_what_is_not_a_batch_without_panicking() {
        let good = unhex("93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c656172656400");
        for cut in 0..good.len() {
            assert!(decode_batch(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert!(matches!(decode_batch(&[0xc1]), Err(WireError::Malformed(0))));
        // An array claiming 2^32 - 1 items in 5 bytes: refused, not allocated.
        assert!(matches!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]), Err(WireError::Malformed(_))));
        // 20 nested arrays.
        assert!(decode_batch(&[0x91; 20]).is_err());
        assert!(matches!(decode_batch(&[0x01]), Err(WireError::NotABatch(_))));
        assert_eq!(sequence(&7u64.to_be_bytes()), Some(7));
        assert_eq!(sequence(&[1, 2]), None);
    }

    #[test]
    fn media_bits_are_distinct_and_only_external_is_shared() {
        let bits: Vec<u8> = Medium::ALL.iter().map(|m| m.bit()).collect();
        assert_eq!(bits, [1, 2, 4, 8]);
        assert_eq!(Medium::ALL.iter().filter(|m| m.is_local()).count(), 3);
        assert_eq!(Medium::from_name("NVME"), None);
    }
}
