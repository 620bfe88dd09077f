//! The `--kv-events*` flags of `kvtier serve`, and the start of the
//! publisher from them.

use std::sync::Arc;
use std::time::Duration;

use super::encode::{Encoding, HashFormat};
use super::{endpoint, Publisher, Settings};

/// Default `--kv-events-interval-ms`: events wait at most this long for
/// their batch (vLLM sends one batch per scheduler step, some ms apart).
pub const INTERVAL_MS_DEFAULT: u64 = 10;

/// Longest `--kv-events-interval-ms`.
pub const INTERVAL_MS_MAX: u64 = 10_000;

/// Default `--kv-events-queue-events`: about 100 MB of waiting events at
/// most (a `TierEvent` is ~40 bytes plus its shared tag of ~100 to 3,000).
pub const QUEUE_EVENTS_DEFAULT: usize = 1_000_000;

/// Most `--kv-events-queue-events` (a batch is one msgpack array).
pub const QUEUE_EVENTS_MAX: usize = 100_000_000;

/// Default `--kv-events-replay-batches`, as vLLM's `buffer_steps`.
pub const REPLAY_BATCHES_DEFAULT: usize = 10_000;

/// Command-line settings of the KV event publisher.
#[derive(clap::Args, Debug, Clone)]
pub struct EventsArgs {
    /// Publish KV events for KV-aware routers on a ZeroMQ PUB socket bound
    /// here, in vLLM's format (docs/OPERATIONS.md, "KV events for
    /// routers"): a BlockStored or BlockRemoved per block and tier as
    /// tagged blocks (x-kvtier-block-hashes) move between GPU, RAM, NVMe
    /// and S3, batched every --kv-events-interval-ms; the first batch, an
    /// AllBlocksCleared, tells routers to forget this node's earlier run.
    /// HOST: an IP address, localhost or *; loopback only unless
    /// --kv-events-public. Off by default.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub kv_events: Option<String>,
    /// Also answer replay requests on a ZeroMQ ROUTER socket bound here, as
    /// vLLM's publisher does: a subscriber that saw a gap in the sequence
    /// numbers sends the first one it missed (8 bytes, big-endian) and
    /// gets every kept batch from there, then an end marker (seq -1).
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    pub kv_events_replay: Option<String>,
    /// Allow --kv-events and --kv-events-replay on an address other than
    /// loopback: every subscriber learns which blocks this node holds (the
    /// engine's block hashes and token ids, never keys or bytes) with no
    /// authentication.
    #[arg(long, requires = "kv_events")]
    pub kv_events_public: bool,
    /// First frame of every published message (subscribers filter on it).
    #[arg(long, default_value = "", requires = "kv_events")]
    pub kv_events_topic: String,
    /// Milliseconds between batches: every interval, all events queued are
    /// sent as one batch (none when nothing happened).
    #[arg(long, default_value_t = INTERVAL_MS_DEFAULT, requires = "kv_events")]
    pub kv_events_interval_ms: u64,
    /// Events waiting for their batch at most; past it the oldest are
    /// dropped, counted (kvtier_kv_events_dropped_total), and the next
    /// batch skips a sequence number so subscribers see the gap.
    #[arg(long, default_value_t = QUEUE_EVENTS_DEFAULT, requires = "kv_events")]
    pub kv_events_queue_events: usize,
    /// Batches kept for replay (and at most 256 MiB of them).
    #[arg(long, default_value_t = REPLAY_BATCHES_DEFAULT, requires = "kv_events")]
    pub kv_events_replay_batches: usize,
    /// Block hashes as vLLM's default writes them, `int`: the hash's bytes
    /// big-endian, low 64 bits (what Dynamo and llm-d index); or `bytes`:
    /// the hash as sent, a msgpack bin.
    #[arg(long, value_enum, default_value_t = HashFormat::Int, requires = "kv_events")]
    pub kv_events_hash: HashFormat,
    /// The `ownership` field of every event, naming the tier below the
    /// engine that published it; "" leaves the field out. Dynamo 1.6.1's
    /// indexer drops events that carry it: pass "" for Dynamo.
    #[arg(long, default_value = "kvtier", value_name = "NAME", requires = "kv_events")]
    pub kv_events_ownership: String,
}

impl EventsArgs {
    /// The publisher's settings, checked (no socket bound); `None` without
    /// `--kv-events`.
    ///
    /// # Errors
    /// A message naming the flag at fault.
    pub fn settings(&self) -> Result<Option<Settings>, String> {
        let Some(pub_text) = &self.kv_events else { return Ok(None) };
        let endpoint = endpoint::parse("--kv-events", pub_text, self.kv_events_public)?;
        let replay =
            self.kv_events_replay.as_deref().map(|t| endpoint::parse("--kv-events-replay", t, self.kv_events_public)).transpose()?;
        if !(1..=INTERVAL_MS_MAX).contains(&self.kv_events_interval_ms) {
            return Err(format!("--kv-events-interval-ms must be 1 to {INTERVAL_MS_MAX}, got {}", self.kv_events_interval_ms));
        }
        if !(1..=QUEUE_EVENTS_MAX).contains(&self.kv_events_queue_events) {
            return Err(format!("--kv-events-queue-events must be 1 to {QUEUE_EVENTS_MAX}, got {}", self.kv_events_queue_events));
        }
        if self.kv_events_replay_batches == 0 {
            return Err("--kv-events-replay-batches must be at least 1".into());
        }
        Ok(Some(Settings {
            endpoint,
            replay,
            topic: self.kv_events_topic.clone(),
            interval: Duration::from_millis(self.kv_events_interval_ms),
            queue_events: self.kv_events_queue_events,
            replay_batches: self.kv_events_replay_batches,
            encoding: Encoding {
                hash: self.kv_events_hash,
                ownership: (!self.kv_events_ownership.is_empty()).then(|| self.kv_events_ownership.clone()),
            },
        }))
    }

    /// Checks the flags, binds both ports and starts the publisher; `None`
    /// without `--kv-events`. Call before the store opens: the store's
    /// first events (blocks found by recovery) then follow batch 0.
    ///
    /// # Errors
    /// A message naming the flag at fault: a malformed endpoint, a host
    /// beyond loopback without `--kv-events-public`, a port in use.
    pub fn open(&self) -> Result<Option<Arc<Publisher>>, String> {
        let Some(settings) = self.settings()? else { return Ok(None) };
        let pub_listener = endpoint::bind("--kv-events", settings.endpoint)?;
        let replay_listener = settings.replay.map(|addr| endpoint::bind("--kv-events-replay", addr)).transpose()?;
        Publisher::start(settings, (pub_listener, replay_listener)).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        events: EventsArgs,
    }

    fn parse(args: &[&str]) -> Result<EventsArgs, String> {
        Cli::try_parse_from(std::iter::once("kvtier").chain(args.iter().copied())).map(|c| c.events).map_err(|e| e.to_string())
    }

    #[test]
    fn off_by_default_with_vllms_defaults() {
        let a = parse(&[]).unwrap();
        assert!(a.settings().unwrap().is_none());
        let s = parse(&["--kv-events", "tcp://127.0.0.1:5557"]).unwrap().settings().unwrap().unwrap();
        assert_eq!((s.topic.as_str(), s.interval, s.queue_events, s.replay_batches), ("", Duration::from_millis(10), 1_000_000, 10_000));
        assert_eq!((s.encoding.hash, s.encoding.ownership.as_deref()), (HashFormat::Int, Some("kvtier")));
        assert!(s.replay.is_none());
    }

    #[test]
    fn an_empty_ownership_leaves_the_field_out() {
        let a = parse(&["--kv-events", "tcp://127.0.0.1:1", "--kv-events-ownership", "", "--kv-events-hash", "bytes"]).unwrap();
        let s = a.settings().unwrap().unwrap();
        assert_eq!((s.encoding.hash, s.encoding.ownership), (HashFormat::Bytes, None));
    }

    #[test]
    fn tuning_flags_without_kv_events_are_refused() {
        for flag in [&["--kv-events-replay", "tcp://127.0.0.1:1"][..], &["--kv-events-interval-ms", "5"], &["--kv-events-public"]] {
            let e = parse(flag).err().unwrap_or_else(|| panic!("{flag:?} accepted"));
            assert!(e.contains("--kv-events <tcp://HOST:PORT>"), "{e}");
        }
    }

    #[test]
    fn out_of_range_values_name_their_flag() {
        let with = |extra: &[&str]| {
            let mut args = vec!["--kv-events", "tcp://127.0.0.1:1"];
            args.extend_from_slice(extra);
            parse(&args).unwrap().settings().unwrap_err()
        };
        assert!(with(&["--kv-events-interval-ms", "0"]).starts_with("--kv-events-interval-ms"));
        assert!(with(&["--kv-events-queue-events", "0"]).starts_with("--kv-events-queue-events"));
        assert!(with(&["--kv-events-replay-batches", "0"]).starts_with("--kv-events-replay-batches"));
        assert!(with(&["--kv-events-replay", "tcp://0.0.0.0:2"]).starts_with("--kv-events-replay "));
    }
}
