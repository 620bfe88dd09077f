//! The kvtier server's pieces, shared by its two binaries: `kvtier` (the
//! sidecar, `src/main.rs`) and `kvtier-http-reference` (a bare HTTP block
//! server on the same hyper-on-glommio plumbing, the yardstick
//! `make bench-http` measures kvtier's HTTP path against:
//! `src/bin/kvtier-http-reference.rs`).
//!
//! Layers, each depending only on those below it:
//! - [`shard`]: what one shard runs, composed (`main.rs` starts it).
//! - the front doors, siblings: [`http`] (the block API), [`local`]
//!   (the same-host socket) and [`events`] (KV events for routers, a
//!   ZeroMQ publisher on a thread of its own).
//! - [`service`]: what both doors share: callers, key scoping, the PUT
//!   budget, shutdown.
//! - [`metrics`] (`/metrics` and `/v1/stats` rendering, request counters),
//!   [`tenants`] (the tenants file), [`gpu`] (the GPU tier's metrics),
//!   [`limits`].

pub mod events;
pub mod gpu;
pub mod http;
pub mod limits;
pub mod local;
pub mod metrics;
pub mod service;
pub mod shard;
pub mod tenants;
