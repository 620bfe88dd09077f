//! Block geometry: how many bytes one 128-token KV-cache block takes, and the
//! `store.json` file that fixes it for the life of a data directory.
//!
//! `bytes_per_token = layers × 2 (K and V) × kv_heads × head_dim × dtype_bytes`
//! (the size of one token's attention KV cache, as vLLM and LMCache compute
//! it), and `block_bytes = block_tokens × bytes_per_token`.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Tokens per block unless a store says otherwise (vLLM and LMCache chunk
/// prompts into blocks of a fixed token count; 128 is the KVStore benchmark's).
pub const BLOCK_TOKENS_DEFAULT: u32 = 128;

/// Version of `store.json` and of the on-disk segment format (docs/FORMAT.md).
/// 2: slot headers carry a CRC-32 per chunk; 3: and the block's tag; 4: and
/// the length of the key's owner scope, in a key area wide enough for the
/// longest key under any tenant. An older store opens and serves (version 1
/// slots by their whole-block CRC, version 1 and 2 slots with no tag,
/// version 1 to 3 slots with the scope found as they wrote it) and is
/// marked 4 on open, since new slots are written in the new layout.
pub const FORMAT_VERSION: u32 = 4;

/// The model whose geometry a store uses when none is given.
pub const MODEL_DEFAULT: &str = "llama3.1-8b";

/// A model's attention shape, enough to size its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPreset {
    /// Preset name as given to `--model`.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads per layer (grouped-query attention shares them).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16).
    pub dtype_bytes: u32,
    /// Vectors cached per head, token and layer: 2 (K and V), or 1 for
    /// multi-head latent attention (MLA), whose one latent vector per token
    /// and layer (`kv_heads` 1, `head_dim` = `kv_lora_rank` +
    /// `qk_rope_head_dim`) is the same on every tensor-parallel rank.
    pub vectors: u32,
}

impl ModelPreset {
    /// `layers × vectors × kv_heads × head_dim × dtype_bytes`: bytes of the
    /// KV cache (K and V, or MLA's latent) for one token across all layers.
    pub const fn bytes_per_token(&self) -> u64 {
        self.layers as u64 * self.vectors as u64 * self.kv_heads as u64 * self.head_dim as u64 * self.dtype_bytes as u64
    }
}

/// Presets from the models' published configs (`config.json` on each model
/// card: `num_hidden_layers`, `num_key_value_heads`, `hidden_size /
/// num_attention_heads`), fp16. Bytes per token: tiny-1b 24,576;
/// mistral-7b 131,072; llama2-7b 524,288; llama3.1-8b 131,072 (16 MiB per
/// 128-token block); llama3.1-70b 327,680; deepseek-v3 70,272 (MLA: 61
/// layers × one 576-value latent, `kv_lora_rank` 512 + `qk_rope_head_dim`
/// 64, bf16; 4,497,408 bytes per 64-token block, vLLM's FlashMLA block).
pub const MODEL_PRESETS: &[ModelPreset] = &[
    // A 1B-class model with grouped-query attention (24 layers, 4 KV heads of
    // 64): 24·2·4·64·2 = 24,576 bytes per token, as the list above says.
    ModelPreset { name: "tiny-1b", layers: 24, kv_heads: 4, head_dim: 64, dtype_bytes: 2, vectors: 2 },
    ModelPreset { name: "mistral-7b", layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, vectors: 2 },
    ModelPreset { name: "llama2-7b", layers: 32, kv_heads: 32, head_dim: 128, dtype_bytes: 2, vectors: 2 },
    ModelPreset { name: "llama3.1-8b", layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2, vectors: 2 },
    ModelPreset { name: "llama3.1-70b", layers: 80, kv_heads: 8, head_dim: 128, dtype_bytes: 2, vectors: 2 },
    // DeepSeek-V3 (and R1, V3.1): config.json's num_hidden_layers 61,
    // kv_lora_rank 512, qk_rope_head_dim 64; vLLM caches 576 values per
    // token and layer (MLAAttentionSpec: one KV head of head size 576).
    ModelPreset { name: "deepseek-v3", layers: 61, kv_heads: 1, head_dim: 576, dtype_bytes: 2, vectors: 1 },
];

/// Looks a preset up by name.
///
/// # Errors
/// [`Error::Config`] naming the known presets when `name` is not one.
pub fn preset(name: &str) -> Result<&'static ModelPreset> {
    MODEL_PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<&str> = MODEL_PRESETS.iter().map(|p| p.name).collect();
        Error::Config(format!("unknown model {name:?}; known presets: {}", names.join(", ")))
    })
}

/// The fixed shape of every block in one store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// Model preset name, or `"custom"` when `--block-bytes` was given.
    pub model: String,
    /// Tokens per block.
    pub block_tokens: u32,
    /// KV bytes per token (0 when only `block_bytes` was given and it is not
    /// a multiple of `block_tokens`).
    pub bytes_per_token: u64,
    /// Payload bytes of one block: every PUT body has exactly this length.
    pub block_bytes: u64,
}

/// Largest block the engine accepts: 1 GiB (a llama2-7b block is 64 MiB).
pub const BLOCK_BYTES_MAX: u64 = 1 << 30;

impl Geometry {
    /// Geometry of `model` at `block_tokens` tokens per block.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown model or a zero token count.
    pub fn from_model(model: &str, block_tokens: u32) -> Result<Self> {
        let preset = preset(model)?;
        if block_tokens == 0 {
            return Err(Error::Config("block_tokens must be at least 1".into()));
        }
        let bytes_per_token = preset.bytes_per_token();
        Self::checked(Geometry {
            model: preset.name.to_string(),
            block_tokens,
            bytes_per_token,
            block_bytes: bytes_per_token * block_tokens as u64,
        })
    }

    /// Geometry with an explicit block size (`--block-bytes`), for models
    /// without a preset or for tests.
    ///
    /// # Errors
    /// [`Error::Config`] when `block_bytes` is 0 or above [`BLOCK_BYTES_MAX`].
    pub fn from_block_bytes(block_bytes: u64, block_tokens: u32) -> Result<Self> {
        if block_tokens == 0 {
            return Err(Error::Config("block_tokens must be at least 1".into()));
        }
        let bytes_per_token = if block_bytes.is_multiple_of(block_tokens as u64) { block_bytes / block_tokens as u64 } else { 0 };
        Self::checked(Geometry { model: "custom".into(), block_tokens, bytes_per_token, block_bytes })
    }

    fn checked(self) -> Result<Self> {
        if self.block_bytes == 0 || self.block_bytes > BLOCK_BYTES_MAX {
            return Err(Error::Config(format!("block_bytes must be between 1 and {BLOCK_BYTES_MAX}, got {}", self.block_bytes)));
        }
        Ok(self)
    }
}

/// What `store.json` records of one device of a store ([`crate::devices`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    /// Its place in the store's device list (shard `s` is on device `s mod D`).
    pub index: u32,
    /// The filesystem id of its directory when the store was made (`statvfs`'s `f_fsid`, hex).
    pub fs_id: String,
    /// Bytes of segments it holds, split evenly among its shards.
    pub capacity_bytes: u64,
    /// The shards whose logs it holds.
    pub shards: Vec<u32>,
}

/// Contents of `<data-dir>/store.json`: written once when the store is
/// created, checked on every open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreManifest {
    /// [`FORMAT_VERSION`] of the process that created the store.
    pub format_version: u32,
    /// Block geometry.
    pub geometry: Geometry,
    /// Number of shards; keys are routed by `block_hash mod shards`, so it
    /// cannot change without rewriting the store.
    pub shards: u32,
    /// Size of each segment file in bytes.
    pub segment_bytes: u64,
    /// The store's identity, the same in every data directory of it (128
    /// random bits, hex); absent in a store made before devices existed
    /// (one directory), which opens as it always did ([`crate::devices`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_id: Option<String>,
    /// The store's devices (data directories), the same list in each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceRecord>,
    /// Which of `devices` this directory is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_index: Option<u32>,
}

/// Most shards a manifest may name: one per core of the largest hosts we
/// target, with room to spare (a store's shard count is its executor
/// count).
pub const SHARDS_MAX: u32 = 1024;

/// Name of the manifest file inside a data directory.
pub const MANIFEST_FILE: &str = "store.json";

impl StoreManifest {
    /// Path of the manifest in `dir`.
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(MANIFEST_FILE)
    }

    /// Creates `store.json` in `dir` if absent (atomically: temp file, fsync,
    /// rename, fsync of the directory), or checks the existing one against
    /// `self`. An older store's manifest is rewritten with the current
    /// [`FORMAT_VERSION`] (its slots still read; new ones use the new
    /// layout, which an older kvtier must then refuse).
    ///
    /// # Errors
    /// [`Error::GeometryMismatch`] naming the stored and requested values of
    /// the first field that differs; [`Error::Config`] for an unreadable or
    /// newer-format manifest; [`Error::Io`] from the filesystem.
    pub fn create_or_check(&self, dir: &Path) -> Result<StoreManifest> {
        fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating data directory {}", dir.display()), e))?;
        let path = Self::path(dir);
        match fs::read(&path) {
            Ok(bytes) => {
                let stored = StoreManifest::parse(&bytes).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
                self.check_against(dir, &stored)?;
                if stored.format_version < FORMAT_VERSION {
                    let upgraded = StoreManifest { format_version: FORMAT_VERSION, ..stored.clone() };
                    upgraded.write(dir)?;
                    tracing::info!(
                        dir = %dir.display(),
                        "store format {} upgraded to {FORMAT_VERSION}: existing blocks read as before, new ones carry per-chunk CRC-32s, block tags and their key's scope",
                        stored.format_version
                    );
                    return Ok(upgraded);
                }
                Ok(stored)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.write(dir)?;
                Ok(self.clone())
            }
            Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
        }
    }

    /// Writes `store.json` atomically: temp file, fsync, rename, fsync of
    /// the directory.
    ///
    /// # Errors
    /// [`Error::Io`] when a step fails.
    pub(crate) fn write(&self, dir: &Path) -> Result<()> {
        let mut body = serde_json::to_vec_pretty(self).expect("manifest serializes");
        body.push(b'\n');
        write_durably(dir, MANIFEST_FILE, &body)
    }

    fn check_against(&self, dir: &Path, stored: &StoreManifest) -> Result<()> {
        let mismatch = |field: &'static str, stored: String, requested: String| Error::GeometryMismatch {
            dir: dir.to_path_buf(),
            field,
            stored,
            requested,
        };
        if let (Some(s), Some(r)) = (&stored.store_id, &self.store_id) {
            if s != r {
                return Err(Error::Config(format!("{} belongs to store {s}, not to store {r}", dir.display())));
            }
        }
        if stored.format_version > FORMAT_VERSION {
            return Err(Error::Config(format!(
                "{} has format version {}, this kvtier reads up to {FORMAT_VERSION}",
                dir.display(),
                stored.format_version
            )));
        }
        let (s, r) = (&stored.geometry, &self.geometry);
        if s.block_bytes != r.block_bytes {
            return Err(mismatch(
                "block_bytes",
                format!("{} (model {})", s.block_bytes, s.model),
                format!("{} (model {})", r.block_bytes, r.model),
            ));
        }
        if s.block_tokens != r.block_tokens {
            return Err(mismatch("block_tokens", s.block_tokens.to_string(), r.block_tokens.to_string()));
        }
        if stored.shards != self.shards {
            return Err(mismatch("shards", stored.shards.to_string(), self.shards.to_string()));
        }
        if stored.segment_bytes != self.segment_bytes {
            return Err(mismatch("segment_bytes", stored.segment_bytes.to_string(), self.segment_bytes.to_string()));
        }
        Ok(())
    }

    /// Reads the manifest of an existing store.
    ///
    /// # Errors
    /// [`Error::Io`] when absent or unreadable, [`Error::Config`] when it does
    /// not parse.
    pub fn read(dir: &Path) -> Result<StoreManifest> {
        let path = Self::path(dir);
        let bytes = fs::read(&path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        StoreManifest::parse(&bytes).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Parses and checks the bytes of a `store.json`: the JSON must have
    /// every field, and the values must describe a store this code could
    /// have made (a format version from 1, a block size from 1 to
    /// [`BLOCK_BYTES_MAX`], `block_bytes = block_tokens × bytes_per_token`
    /// unless `bytes_per_token` is 0, 1 to [`SHARDS_MAX`] shards, a segment
    /// that holds a superblock and at least one slot). A manifest is the
    /// one file that sizes everything else, so a damaged value is refused
    /// here rather than met later as a division by zero or a huge
    /// allocation. A newer format version parses; [`Self::create_or_check`]
    /// refuses it by name.
    ///
    /// # Errors
    /// A message naming the first problem (`not a kvtier manifest: ...` for
    /// JSON that does not parse).
    pub fn parse(bytes: &[u8]) -> std::result::Result<StoreManifest, String> {
        let m: StoreManifest = serde_json::from_slice(bytes).map_err(|e| format!("not a kvtier manifest: {e}"))?;
        let g = &m.geometry;
        if m.format_version == 0 {
            return Err("format_version 0 was never written".into());
        }
        if g.block_bytes == 0 || g.block_bytes > BLOCK_BYTES_MAX {
            return Err(format!("block_bytes must be between 1 and {BLOCK_BYTES_MAX}, got {}", g.block_bytes));
        }
        if g.block_tokens == 0 {
            return Err("block_tokens must be at least 1".into());
        }
        if g.bytes_per_token != 0 && g.bytes_per_token.checked_mul(g.block_tokens as u64) != Some(g.block_bytes) {
            return Err(format!(
                "block_bytes {} is not block_tokens {} × bytes_per_token {}",
                g.block_bytes, g.block_tokens, g.bytes_per_token
            ));
        }
        if m.shards == 0 || m.shards > SHARDS_MAX {
            return Err(format!("shards must be between 1 and {SHARDS_MAX}, got {}", m.shards));
        }
        let least = crate::slot::PAGE_BYTES + crate::slot::slot_bytes(g.block_bytes);
        if m.segment_bytes < least {
            return Err(format!(
                "segment_bytes {} cannot hold a superblock and one {}-byte block ({least} bytes)",
                m.segment_bytes, g.block_bytes
            ));
        }
        Ok(m)
    }
}

/// Writes `dir/name` atomically and durably: `name.tmp` written and
/// fsynced, renamed over `name`, then the directory fsynced. Blocking std
/// I/O: a shard calls it on the executor's blocking pool.
///
/// # Errors
/// [`Error::Io`] naming the file and the step that failed.
pub(crate) fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let path = dir.join(name);
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = fs::File::create(&tmp).map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    fs::rename(&tmp, &path).map_err(|e| Error::io(format!("renaming {} into place", tmp.display()), e))?;
    fsync_dir(dir)
}

/// fsyncs a directory so a rename or a new file in it survives power loss.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(format!("fsync of directory {}", dir.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_design_figures() {
        let expect = [
            ("tiny-1b", 24_576),
            ("mistral-7b", 131_072),
            ("llama2-7b", 524_288),
            ("llama3.1-8b", 131_072),
            ("llama3.1-70b", 327_680),
            ("deepseek-v3", 70_272),
        ];
        for (name, bytes) in expect {
            assert_eq!(preset(name).unwrap().bytes_per_token(), bytes, "{name}");
        }
        let g = Geometry::from_model(MODEL_DEFAULT, BLOCK_TOKENS_DEFAULT).unwrap();
        assert_eq!(g.block_bytes, 16 << 20);
        assert!(preset("gpt-5").unwrap_err().to_string().contains("llama3.1-8b"));
        // An MLA block at vLLM's FlashMLA block size, a whole number of pages.
        let mla = Geometry::from_model("deepseek-v3", 64).unwrap();
        assert_eq!(mla.block_bytes, 4_497_408);
        assert_eq!(mla.block_bytes % 4096, 0);
    }

    #[test]
    fn manifest_mismatch_names_both_values() {
        let dir = tempfile::tempdir().unwrap();
        let a = StoreManifest {
            format_version: FORMAT_VERSION,
            geometry: Geometry::from_block_bytes(65_536, 128).unwrap(),
            shards: 2,
            segment_bytes: 1 << 20,
            store_id: None,
            devices: Vec::new(),
            device_index: None,
        };
        a.create_or_check(dir.path()).unwrap();
        assert_eq!(a.create_or_check(dir.path()).unwrap(), a);
        let mut b = a.clone();
        b.geometry = Geometry::from_model("llama3.1-8b", 128).unwrap();
        let msg = b.create_or_check(dir.path()).unwrap_err().to_string();
        assert!(msg.contains("65536") && msg.contains("16777216"), "{msg}");
        let mut c = a.clone();
        c.shards = 4;
        let msg = c.create_or_check(dir.path()).unwrap_err().to_string();
        assert!(msg.contains("shards = 2") && msg.contains("but 4"), "{msg}");
    }

    #[test]
    fn a_damaged_manifest_is_refused_naming_the_field() {
        let good = StoreManifest {
            format_version: FORMAT_VERSION,
            geometry: Geometry::from_block_bytes(65_536, 128).unwrap(),
            shards: 2,
            segment_bytes: 1 << 20,
            store_id: None,
            devices: Vec::new(),
            device_index: None,
        };
        let json = serde_json::to_value(&good).unwrap();
        assert_eq!(StoreManifest::parse(json.to_string().as_bytes()), Ok(good.clone()));
        let bad = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = json.clone();
            edit(&mut v);
            StoreManifest::parse(v.to_string().as_bytes()).unwrap_err()
        };
        assert!(bad(&|v| v["format_version"] = 0.into()).contains("format_version 0"));
        assert!(bad(&|v| v["geometry"]["block_bytes"] = 0.into()).contains("block_bytes must be between 1 and"));
        assert!(bad(&|v| v["geometry"]["block_bytes"] = (BLOCK_BYTES_MAX + 1).into()).contains("block_bytes must be between 1 and"));
        assert!(bad(&|v| v["geometry"]["block_tokens"] = 0.into()).contains("block_tokens must be at least 1"));
        assert!(bad(&|v| v["geometry"]["bytes_per_token"] = 7.into()).contains("is not block_tokens 128 × bytes_per_token 7"));
        assert!(bad(&|v| v["shards"] = 0.into()).contains("shards must be between 1 and 1024, got 0"));
        assert!(bad(&|v| v["shards"] = (SHARDS_MAX + 1).into()).contains("got 1025"));
        assert!(bad(&|v| v["segment_bytes"] = 8192.into()).contains("cannot hold a superblock and one 65536-byte block"));
        assert!(bad(&|v| v["shards"] = "two".into()).starts_with("not a kvtier manifest"));
        assert!(StoreManifest::parse(b"{").unwrap_err().starts_with("not a kvtier manifest"));
        // Read from disk, the error names the file; nothing is rewritten.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(StoreManifest::path(dir.path()), br#"{"format_version":1}"#).unwrap();
        let msg = good.create_or_check(dir.path()).unwrap_err().to_string();
        assert!(msg.contains("store.json") && msg.contains("not a kvtier manifest"), "{msg}");
        assert_eq!(std::fs::read(StoreManifest::path(dir.path())).unwrap(), br#"{"format_version":1}"#);
    }

    #[test]
    fn an_older_store_is_marked_current_and_a_newer_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let v1 = StoreManifest {
            format_version: 1,
            geometry: Geometry::from_block_bytes(65_536, 128).unwrap(),
            shards: 2,
            segment_bytes: 1 << 20,
            store_id: None,
            devices: Vec::new(),
            device_index: None,
        };
        v1.write(dir.path()).unwrap();
        let current = StoreManifest { format_version: FORMAT_VERSION, ..v1.clone() };
        assert_eq!(current.create_or_check(dir.path()).unwrap().format_version, FORMAT_VERSION);
        assert_eq!(StoreManifest::read(dir.path()).unwrap().format_version, FORMAT_VERSION);
        let newer = StoreManifest { format_version: FORMAT_VERSION + 1, ..v1 };
        newer.write(dir.path()).unwrap();
        let msg = current.create_or_check(dir.path()).unwrap_err().to_string();
        assert!(msg.contains(&format!("format version {}", FORMAT_VERSION + 1)), "{msg}");
    }
}
