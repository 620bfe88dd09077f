//! # kvtier-fuzz
//!
//! kvtier's fuzz targets, each a plain function from the fuzzer's bytes to
//! one decoder or front door of kvtier, with the properties it must keep
//! written as assertions: it never panics on any input, it allocates only
//! within the limits libFuzzer is run with (`-malloc_limit_mb`, see
//! [`Target::malloc_limit_mb`]), and whatever it accepts round-trips
//! (decode → encode → decode gives the same value) where kvtier has an
//! encoder.
//!
//! Two harnesses run the same functions (docs/TESTING.md):
//! - `make fuzz`: libFuzzer through cargo-fuzz (`fuzz/libfuzzer/`, one
//!   one-line `fuzz_target!` per entry of [`TARGETS`]), coverage-guided,
//!   with AddressSanitizer;
//! - `cargo test -p kvtier-fuzz` (so `make test`): every committed input of
//!   `fuzz/corpus/TARGET/` and `fuzz/artifacts/TARGET/` run once, no
//!   fuzzing engine needed.
//!
//! Where a checksum guards a decoder (slot header, index snapshot, S3
//! object), the first input byte is a mode: one mode hands the bytes over
//! as they are, the others fix the checksum up (or write an honest record
//! and flip one byte of it), so the fuzzer reaches the field checks behind
//! the CRC instead of spending itself on the CRC.

#![deny(missing_docs)]

pub mod front;
pub mod records;
pub mod store_ops;

/// One fuzz target.
pub struct Target {
    /// Name: the cargo-fuzz target, and the folder under `fuzz/corpus/` and
    /// `fuzz/artifacts/`.
    pub name: &'static str,
    /// What it feeds and what it asserts.
    pub about: &'static str,
    /// The target itself: panics on a violated property.
    pub run: fn(&[u8]),
    /// Longest input the fuzzer makes, bytes (libFuzzer `-max_len`).
    pub max_len: usize,
    /// Largest single allocation allowed, MiB (libFuzzer
    /// `-malloc_limit_mb`): the bound behind "never allocates without
    /// bound".
    pub malloc_limit_mb: usize,
    /// Seconds one input may take before libFuzzer calls it a hang
    /// (`-timeout`).
    pub timeout_s: u32,
    /// LeakSanitizer on (`-detect_leaks`): off only where a leak outside
    /// the target's reach is known and bounded (said at the target).
    pub detect_leaks: bool,
}

/// Every target, in the order `make fuzz` runs them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "slot_header",
        about: "engine/src/slot.rs SlotHeader::decode on one header page (raw, CRC fixed up, or magic and CRC fixed up); an accepted header re-encodes to a page that decodes to itself",
        run: records::slot_header,
        max_len: 4097,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "slot",
        about: "a whole slot: header page + payload through SlotHeader::decode and slot::payload_fault with per-chunk CRC-32s; an honestly written slot passes, and one with any one byte flipped is refused",
        run: records::slot,
        max_len: 16 << 10,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "index_snapshot",
        about: "engine/src/index.rs snapshot::decode (preamble, CRC-32, rkyv validation; raw or with the preamble fixed up); an accepted snapshot re-encodes to itself",
        run: records::index_snapshot,
        max_len: 64 << 10,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "store_json",
        about: "engine/src/geometry.rs StoreManifest::parse on store.json bytes; an accepted manifest serializes and parses to itself",
        run: records::store_json,
        max_len: 4096,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "s3_object",
        about: "s3/src/object.rs decode_object (header, key, block size, payload CRC-32) on raw objects and on honest objects with one byte flipped; an accepted object is its own header + payload",
        run: records::s3_object,
        max_len: 16 << 10,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "key",
        about: "engine/src/key.rs validate against an independent statement of the key rules; a valid key hashes, picks a shard in range, names an S3 object, fits a slot header and routes as /v1/blocks/KEY unchanged",
        run: records::key,
        max_len: 1024,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "key_list",
        about: "server/src/routes.rs parse_keys, the /v1/lookup and /v1/prefetch body; accepted keys are valid, within the limit, and re-serialize to the same list",
        run: front::key_list,
        max_len: 64 << 10,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "http_route",
        about: "an HTTP/1.1 request head (parsed with httparse, as hyper does) through server/src/routes.rs plan: header limit, bearer token, route table, declared Content-Length; never a handler without the token",
        run: front::http_route,
        max_len: 24 << 10,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "local_frames",
        about: "a byte stream on the same-host socket: kvtier-local-proto frame headers, item and key batches (round-tripped through their encoders), HELLO, REGISTER descriptors against a real memfd region and span bounds checks",
        run: front::local_frames,
        max_len: 16 << 10,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "tenants_file",
        about: "server/src/tenants.rs Table::parse on a tenants file (TOML): an accepted file's owners are unique and fit the capacity it was checked against, its tokens and uids find their tenants, and its keys are scoped to an owner of the file",
        run: front::tenants_file,
        max_len: 4096,
        malloc_limit_mb: 64,
        timeout_s: 10,
        detect_leaks: true,
    },
    Target {
        name: "store_ops",
        about: "a real store on real files: put, get, contains, delete, concurrent puts, clean restart, kill -9 of a forked store mid-write, forced reclaim and a byte flipped on disk, against a model of what must be readable",
        run: store_ops::run,
        max_len: 512,
        malloc_limit_mb: 512,
        timeout_s: 120,
        // Each store life leaks the two glommio tasks that its shutdown
        // ends with `Task::cancel` (health and memory warm-up, about
        // 1.5 KB: LeakSanitizer's stacks); a process opens its store
        // once, the fuzzer hundreds of times a minute.
        detect_leaks: false,
    },
];

/// The target named `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

fn inputs(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<std::path::PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    files
}

/// Runs every committed input of `target` once: its seed corpus
/// (`fuzz/corpus/NAME/`) and every input that ever made it fail
/// (`fuzz/artifacts/NAME/`). Returns how many of each ran.
///
/// # Errors
/// The paths of the inputs that panicked (each panic's message is printed
/// as it happens), or that the corpus is empty.
pub fn replay_committed(target: &Target) -> Result<(usize, usize), Vec<String>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let corpus = inputs(&root.join("corpus").join(target.name));
    let artifacts = inputs(&root.join("artifacts").join(target.name));
    if corpus.is_empty() {
        return Err(vec![format!("fuzz/corpus/{} has no seeds (make fuzz-seeds)", target.name)]);
    }
    let mut failed = Vec::new();
    for path in corpus.iter().chain(&artifacts) {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        if std::panic::catch_unwind(|| (target.run)(&data)).is_err() {
            failed.push(path.display().to_string());
        }
    }
    if failed.is_empty() {
        Ok((corpus.len(), artifacts.len()))
    } else {
        Err(failed)
    }
}
