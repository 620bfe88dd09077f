//! The publisher's part of `/v1/stats` (`kv_events`) and `/metrics`
//! (`kvtier_kv_event*`), as a [`Door`].

use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_engine::latency::Scrape;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use serde_json::{json, Value};

use super::encode::HashFormat;
use super::Publisher;
use crate::metrics::{Door, Durations};

/// The door's name: its key in `/v1/stats`.
const NAME: &str = "kv_events";

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

impl Door for Publisher {
    fn name(&self) -> &'static str {
        NAME
    }

    fn put_bytes_refusals(&self) -> u64 {
        0
    }

    fn write_metrics(&self, registry: &mut Scrape<'_>, _: &mut Durations) {
        let c = self.counters();
        let counters: [(&str, &str, &AtomicU64); 10] = [
            ("kv_events_submitted", "KV events the shards handed to the publisher", &c.events_submitted),
            ("kv_events_published", "KV events sent on the PUB socket (--kv-events)", &c.events_published),
            ("kv_event_batches", "KV event batches sent on the PUB socket, [AllBlocksCleared] at start included", &c.batches_published),
            (
                "kv_events_dropped",
                "KV events dropped because --kv-events-queue-events were waiting; the next batch skips a sequence number",
                &c.events_dropped,
            ),
            ("kv_event_batches_unsent", "KV event batches the PUB socket did not take (kept for replay)", &c.batches_unsent),
            (
                "kv_event_tags_undecodable",
                "KV events left out because their block tag did not decode (a bug if not 0)",
                &c.tags_undecodable,
            ),
            ("kv_event_replays", "Replay requests answered on --kv-events-replay", &c.replay_requests),
            ("kv_event_batches_replayed", "KV event batches sent in answer to replay requests", &c.batches_replayed),
            (
                "kv_event_replays_malformed",
                "Replay requests of another shape than [empty frame, 8-byte sequence number], ignored",
                &c.replay_requests_malformed,
            ),
            (
                "kv_event_replays_abandoned",
                "Replay answers cut short: the client took no message for a second, or went away",
                &c.replays_abandoned,
            ),
        ];
        for (name, help, value) in counters {
            registry.register(name, help, ConstCounter::new(load(value)));
        }
        registry.register(
            "kv_event_subscribers",
            "Connections to the KV event PUB socket now",
            ConstGauge::new(load(&c.subscribers) as i64),
        );
        registry.register("kv_events_queued", "KV events waiting for their batch now", ConstGauge::new(self.queued_events() as i64));
        registry.register(
            "kv_event_last_sequence",
            "Sequence number of the latest KV event batch sent",
            ConstGauge::new(load(&c.last_seq) as i64),
        );
    }

    fn stats_json(&self) -> Value {
        let c = self.counters();
        let settings = &self.shared.settings;
        let ring = self.shared.ring.lock().expect("replay ring lock");
        json!({
            "endpoint": format!("tcp://{}", self.endpoint()),
            "replay_endpoint": self.replay_endpoint().map(|a| format!("tcp://{a}")),
            "topic": settings.topic,
            "interval_ms": settings.interval.as_millis() as u64,
            "hash": match settings.encoding.hash { HashFormat::Int => "int", HashFormat::Bytes => "bytes" },
            "ownership": settings.encoding.ownership,
            "queue_events_max": settings.queue_events,
            "queued_events": self.queued_events(),
            "subscribers": load(&c.subscribers),
            "last_seq": load(&c.last_seq),
            "events_submitted": load(&c.events_submitted),
            "events_published": load(&c.events_published),
            "batches_published": load(&c.batches_published),
            "events_dropped": load(&c.events_dropped),
            "batches_unsent": load(&c.batches_unsent),
            "tags_undecodable": load(&c.tags_undecodable),
            "replay_batches_kept": ring.len(),
            "replay_bytes_kept": ring.bytes(),
            "replay_requests": load(&c.replay_requests),
            "batches_replayed": load(&c.batches_replayed),
            "replay_requests_malformed": load(&c.replay_requests_malformed),
            "replays_abandoned": load(&c.replays_abandoned),
        })
    }
}

/// The door when `--kv-events` is not given: `"kv_events": {"endpoint":
/// null}` in `/v1/stats`, no series.
#[derive(Debug)]
pub struct EventsOff;

impl Door for EventsOff {
    fn name(&self) -> &'static str {
        NAME
    }

    fn put_bytes_refusals(&self) -> u64 {
        0
    }

    fn write_metrics(&self, _: &mut Scrape<'_>, _: &mut Durations) {}

    fn stats_json(&self) -> Value {
        json!({ "endpoint": null })
    }
}
