//! The HTTP front door: the block API over HTTP/2 (h2c) and HTTP/1.1 on
//! one port (docs/API.md). It parses requests, asks the shard's
//! [`crate::service::Service`], and encodes the answers; it knows nothing
//! of the same-host socket.
//!
//! - [`accept`]: each shard's accept loop on its own `SO_REUSEPORT` socket, the
//!   hyper connection builder, idle connections, draining at shutdown.
//! - [`routes`]: the route table and authentication of each request;
//!   `blocks` and `status` the handlers; [`request`] reading bodies and
//!   key lists; [`reply`] the replies and the one mapping from engine
//!   errors to statuses.
//! - [`tag`]: a PUT's block tag, read from its `x-kvtier-*` headers.
//! - [`admin`]: `/v1/admin/tenants*` and the SIGHUP reload task.
//! - [`body`]: response bodies (whole, or a block streamed chunk by chunk).
//! - [`io`]: hyper on glommio (executor, timer, vectored socket I/O).

pub mod accept;
pub mod admin;
mod blocks;
pub mod body;
pub mod io;
pub mod reply;
pub mod request;
pub mod routes;
mod status;
pub mod table;
pub mod tag;

use std::rc::Rc;

use kvtier_engine::Store;

use crate::metrics::RequestStats;
use crate::service::Service;

pub use accept::builder;
pub use io::{GlommioIo, GlommioTimer, LocalExec};

/// Everything a request handler needs, one per shard.
pub struct Ctx {
    /// This shard's service: store, callers, key scoping, PUT budget,
    /// shutdown (shared with the same-host socket).
    pub service: Rc<Service>,
    /// The process's Prometheus registry and the sources `/v1/stats` reads.
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// HTTP request metrics of every shard (this one records into its own).
    pub http: std::sync::Arc<RequestStats>,
    /// A request body must arrive in full within this.
    pub body_timeout: std::time::Duration,
}

impl Ctx {
    /// This shard's store handle.
    pub fn store(&self) -> &Store {
        &self.service.store
    }
}

/// The HTTP door's part of `/metrics` (`kvtier_http_*`) and `/v1/stats`
/// (`http`).
pub struct HttpDoor(pub std::sync::Arc<RequestStats>);

impl crate::metrics::Door for HttpDoor {
    fn name(&self) -> &'static str {
        "http"
    }

    fn put_bytes_refusals(&self) -> u64 {
        self.0.put_bytes_refusals()
    }

    fn write_metrics(&self, registry: &mut kvtier_engine::latency::Scrape<'_>, durations: &mut crate::metrics::Durations) {
        self.0.write_metrics(registry, durations, "http", "HTTP requests", "Request body bytes", "PUTs refused with 503");
    }

    fn stats_json(&self) -> serde_json::Value {
        serde_json::json!({ "routes": self.0.routes_json(), "per_shard": self.0.shards_json() })
    }
}
