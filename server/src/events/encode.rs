//! The payload of one event batch, byte for byte what msgspec writes for
//! vLLM's classes (vLLM 0.32.0, `vllm/distributed/kv_events.py`), so a
//! router decodes it with vLLM's own `msgspec.msgpack.Decoder(KVEventBatch)`:
//!
//! ```text
//! KVEventBatch   array_like: [ts (float64), [event, ...], data_parallel_rank (0)]
//! event          a map tagged "type", fields in declaration order; a field
//!                with a default is left out when it equals the default
//!                (omit_defaults=True), a field without one is always there
//! BlockStored    type, block_hashes, parent_block_hash, token_ids, block_size,
//!                lora_id (nil), medium, lora_name (nil)[, ownership]
//! BlockRemoved   type, block_hashes, medium[, ownership]
//! AllBlocksCleared  type
//! ```
//!
//! msgspec writes every integer in its shortest msgpack form and every
//! float as float64; `rmp`'s `write_uint` and `write_f64` do the same. The
//! unit tests below pin bytes msgspec produced.

use kvtier_engine::events::{BlockTag, Medium, TierEvent};

/// How block hashes are written (`--kv-events-hash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HashFormat {
    /// vLLM's default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`,
    /// `maybe_convert_block_hash`): the hash's bytes read big-endian, its
    /// low 64 bits, a msgpack unsigned integer. What Dynamo's and llm-d's
    /// indexers take.
    Int,
    /// The hash's bytes as they are, a msgpack bin.
    Bytes,
}

/// The name vLLM's `medium` field gives a tier: vLLM names `GPU`, `CPU`
/// and `STORAGE`; the shared tier is `EXTERNAL` (Dynamo maps `CPU` to its
/// host-pinned tier, `STORAGE` to disk and `EXTERNAL` to external).
pub fn medium_name(medium: Medium) -> &'static str {
    match medium {
        Medium::Gpu => "GPU",
        Medium::Ram => "CPU",
        Medium::Nvme => "STORAGE",
        Medium::S3 => "EXTERNAL",
    }
}

/// The engine hash `bytes` as vLLM's `maybe_convert_block_hash` makes it an
/// integer: `int.from_bytes(bytes, "big") & (2**64 - 1)`.
pub fn hash_as_int(bytes: &[u8]) -> u64 {
    // Shifting a u64 left by 8 drops its top byte: what the mask keeps.
    bytes.iter().fold(0u64, |value, b| (value << 8) | u64::from(*b))
}

/// What every batch of one publisher shares.
#[derive(Debug, Clone)]
pub struct Encoding {
    /// How hashes are written.
    pub hash: HashFormat,
    /// `ownership` of every event; `None`: the field is left out (Dynamo
    /// 1.6.1 drops events that carry it).
    pub ownership: Option<String>,
}

/// One batch's payload and what went into it.
#[derive(Debug, Default)]
pub struct Encoded {
    /// The msgpack bytes.
    pub payload: Vec<u8>,
    /// Events written.
    pub events: u64,
    /// Events left out because their tag did not decode (a bug upstream:
    /// the engine keeps only tags that validated at PUT).
    pub undecodable: u64,
}

/// A msgpack writer into a `Vec`, which cannot fail.
struct Writer<'a>(&'a mut Vec<u8>);

const VEC_WRITE: &str = "writing msgpack into a Vec cannot fail";

impl Writer<'_> {
    fn map(&mut self, len: u32) {
        rmp::encode::write_map_len(self.0, len).expect(VEC_WRITE);
    }

    fn array(&mut self, len: usize) {
        let len = u32::try_from(len).expect("a msgpack array holds under 2^32 items");
        rmp::encode::write_array_len(self.0, len).expect(VEC_WRITE);
    }

    fn str(&mut self, s: &str) {
        rmp::encode::write_str(self.0, s).expect(VEC_WRITE);
    }

    fn uint(&mut self, v: u64) {
        rmp::encode::write_uint(self.0, v).expect(VEC_WRITE);
    }

    fn nil(&mut self) {
        rmp::encode::write_nil(self.0).expect(VEC_WRITE);
    }

    fn f64(&mut self, v: f64) {
        rmp::encode::write_f64(self.0, v).expect(VEC_WRITE);
    }

    fn hash(&mut self, format: HashFormat, bytes: &[u8]) {
        match format {
            HashFormat::Int => self.uint(hash_as_int(bytes)),
            HashFormat::Bytes => rmp::encode::write_bin(self.0, bytes).expect(VEC_WRITE),
        }
    }
}

impl Encoding {
    /// The payload of a batch holding `events` (in order), stamped `ts`
    /// (seconds since the Unix epoch, as vLLM's `time.time()`).
    pub fn batch(&self, ts: f64, events: impl IntoIterator<Item = TierEvent>) -> Encoded {
        let mut body = Vec::new();
        let (mut written, mut undecodable) = (0u64, 0u64);
        for event in events {
            let (medium, tag, stored) = match &event {
                TierEvent::Stored { medium, tag } => (*medium, tag, true),
                TierEvent::Removed { medium, tag } => (*medium, tag, false),
            };
            let Ok(tag) = BlockTag::decode(tag) else {
                undecodable += 1;
                continue;
            };
            if stored {
                self.block_stored(&mut body, &tag, medium);
            } else {
                self.block_removed(&mut body, &tag, medium);
            }
            written += 1;
        }
        let mut payload = Vec::with_capacity(body.len() + 16);
        let mut w = Writer(&mut payload);
        w.array(3);
        w.f64(ts);
        w.array(written as usize);
        payload.extend_from_slice(&body);
        // vLLM's publisher sets the rank it runs as (0 without data
        // parallelism); msgspec then writes it, not being the default None.
        Writer(&mut payload).uint(0);
        Encoded { payload, events: written, undecodable }
    }

    /// The payload of the batch `[AllBlocksCleared]`.
    pub fn cleared(&self, ts: f64) -> Vec<u8> {
        let mut payload = Vec::with_capacity(32);
        let mut w = Writer(&mut payload);
        w.array(3);
        w.f64(ts);
        w.array(1);
        w.map(1);
        w.str("type");
        w.str("AllBlocksCleared");
        w.uint(0);
        payload
    }

    /// An event map's start: its size (`fields` and the ownership, if
    /// any), the `type` tag, then `block_hashes`.
    fn head(&self, w: &mut Writer<'_>, kind: &str, fields: u32, tag: &BlockTag) {
        w.map(fields + u32::from(self.ownership.is_some()));
        w.str("type");
        w.str(kind);
        w.str("block_hashes");
        w.array(tag.block_hashes.len());
        for h in &tag.block_hashes {
            w.hash(self.hash, h);
        }
    }

    /// An event map's last field, `ownership`, when one is set.
    fn ownership(&self, w: &mut Writer<'_>) {
        if let Some(owner) = &self.ownership {
            w.str("ownership");
            w.str(owner);
        }
    }

    fn block_stored(&self, out: &mut Vec<u8>, tag: &BlockTag, medium: Medium) {
        let mut w = Writer(out);
        self.head(&mut w, "BlockStored", 8, tag);
        w.str("parent_block_hash");
        match &tag.parent_hash {
            Some(p) => w.hash(self.hash, p),
            None => w.nil(),
        }
        w.str("token_ids");
        w.array(tag.token_ids.len());
        for t in &tag.token_ids {
            w.uint(u64::from(*t));
        }
        w.str("block_size");
        w.uint(u64::from(tag.block_size));
        // No default in vLLM's class, so always written.
        w.str("lora_id");
        w.nil();
        w.str("medium");
        w.str(medium_name(medium));
        w.str("lora_name");
        w.nil();
        // extra_keys, group_idx, kv_cache_spec_*, locality: defaults, left out.
        self.ownership(&mut w);
    }

    fn block_removed(&self, out: &mut Vec<u8>, tag: &BlockTag, medium: Medium) {
        let mut w = Writer(out);
        self.head(&mut w, "BlockRemoved", 3, tag);
        w.str("medium");
        w.str(medium_name(medium));
        self.ownership(&mut w);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn tag(hashes: &[&[u8]], parent: Option<&[u8]>, block_size: u32, token_ids: &[u32]) -> Bytes {
        BlockTag {
            block_hashes: hashes.iter().map(|h| h.to_vec()).collect(),
            parent_hash: parent.map(<[u8]>::to_vec),
            block_size,
            token_ids: token_ids.to_vec(),
        }
        .encode()
    }

    fn encoding(hash: HashFormat, ownership: Option<&str>) -> Encoding {
        Encoding { hash, ownership: ownership.map(str::to_string) }
    }

    // The reference bytes below are msgspec 0.22.0's encoding of vLLM 0.32.0's
    // classes, from:
    //
    // target/py-vllm/bin/python -c 'import msgspec; from vllm.distributed.kv_events import *
    // e = msgspec.msgpack.Encoder(); p = lambda *ev: print(e.encode(KVEventBatch(ts=1.5, events=list(ev), data_parallel_rank=0)).hex())
    // p(AllBlocksCleared())
    // p(BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=0x0102, token_ids=[1, 2, 300, 70000], block_size=2, lora_id=None, medium="CPU", lora_name=None, ownership="kvtier"), BlockRemoved(block_hashes=[5], medium="STORAGE", ownership="kvtier"))
    // p(BlockStored(block_hashes=[b"\x01\x02"], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium="GPU", lora_name=None), BlockRemoved(block_hashes=[b"\xff\xee"], medium="EXTERNAL"))'

    #[test]
    fn all_blocks_cleared_is_msgspecs_bytes() {
        let payload = encoding(HashFormat::Int, Some("kvtier")).cleared(1.5);
        assert_eq!(hex(&payload), "93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c656172656400");
    }

    #[test]
    fn int_hashes_with_ownership_are_msgspecs_bytes() {
        let e = encoding(HashFormat::Int, Some("kvtier"));
        // 2^64 - 1 as the low 8 bytes of a 32-byte hash; 0x0102 as a 2-byte parent.
        let mut wide = [0xabu8; 32];
        wide[24..].copy_from_slice(&[0xff; 8]);
        let one = [0u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let parent = [0u8; 30].iter().copied().chain([1, 2]).collect::<Vec<u8>>();
        let stored = TierEvent::Stored { medium: Medium::Ram, tag: tag(&[&one, &wide], Some(&parent), 2, &[1, 2, 300, 70000]) };
        let five = [0xeeu8, 0, 0, 0, 0, 0, 0, 0, 5];
        let removed = TierEvent::Removed { medium: Medium::Nvme, tag: tag(&[&five], None, 16, &[]) };
        let out = e.batch(1.5, [stored, removed]);
        assert_eq!((out.events, out.undecodable), (2, 0));
        assert_eq!(
            hex(&out.payload),
            "93cb3ff80000000000009289a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cfffffffffff\
             ffffffb1706172656e745f626c6f636b5f68617368cd0102a9746f6b656e5f696473940102cd012cce00011170aa626c6f63\
             6b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0a96f776e657273686970a66b\
             767469657284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756da753544f\
             52414745a96f776e657273686970a66b767469657200"
        );
    }

    #[test]
    fn bytes_hashes_without_ownership_are_msgspecs_bytes() {
        let e = encoding(HashFormat::Bytes, None);
        let stored = TierEvent::Stored { medium: Medium::Gpu, tag: tag(&[&[1, 2]], None, 16, &[]) };
        let removed = TierEvent::Removed { medium: Medium::S3, tag: tag(&[&[0xff, 0xee]], None, 16, &[]) };
        let out = e.batch(1.5, [stored, removed]);
        assert_eq!(
            hex(&out.payload),
            "93cb3ff80000000000009288a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c4020102b17061\
             72656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d\
             656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368\
             657391c402ffeea66d656469756da845585445524e414c00"
        );
    }

    #[test]
    fn an_undecodable_tag_is_left_out_and_counted() {
        let e = encoding(HashFormat::Int, None);
        let bad = TierEvent::Stored { medium: Medium::Ram, tag: Bytes::from_static(b"\x09garbage") };
        let good = TierEvent::Removed { medium: Medium::Ram, tag: tag(&[&[7]], None, 1, &[]) };
        let out = e.batch(0.0, [bad, good]);
        assert_eq!((out.events, out.undecodable), (1, 1));
        // [ts, [one event], 0]: the array header counts what was written.
        assert_eq!(&out.payload[..1], &[0x93]);
        assert_eq!(out.payload[10], 0x91);
    }

    #[test]
    fn hashes_become_their_low_64_bits_big_endian() {
        assert_eq!(hash_as_int(&[1]), 1);
        assert_eq!(hash_as_int(&[1, 0]), 256);
        assert_eq!(hash_as_int(&[0xaa; 8]), 0xaaaa_aaaa_aaaa_aaaa);
        let mut wide = vec![0x55u8; 32];
        wide[24..].copy_from_slice(&0x0123_4567_89ab_cdefu64.to_be_bytes());
        assert_eq!(hash_as_int(&wide), 0x0123_4567_89ab_cdef);
    }

    #[test]
    fn media_use_vllms_and_dynamos_names() {
        let names: Vec<&str> = Medium::ALL.iter().map(|m| medium_name(*m)).collect();
        assert_eq!(names, ["GPU", "CPU", "STORAGE", "EXTERNAL"]);
    }
}
