//! # kvtier-loadgen
//!
//! Load generation for kvtier: concurrency sweeps with a fixed operation mix
//! ([`sweep`]) and replay of real conversations ([`replay`], ShareGPT V3),
//! against kvtier (over HTTP or its same-host local socket, [`local`]) or
//! Redis ([`target`]), with chained block keys, verified
//! payloads, hdrhistogram latency percentiles, JSON results and HTML
//! reports ([`report`]); KV-aware routing over a fleet of nodes on their
//! KV events ([`route`], blocks tagged by [`tag`]). The binary `kvtier-loadgen` wraps it; the server's
//! integration tests use it directly.
#![deny(missing_docs)]

pub mod blocks;
pub mod cli;
pub mod client;
pub mod crash;
pub mod engine_report;
pub mod keys;
pub mod local;
pub mod mrc;
pub mod oracle;
pub mod payload;
pub mod replay;
pub mod report;
pub mod retry;
pub mod route;
pub mod server_process;
pub mod sharegpt;
pub mod size;
pub mod soak;
pub mod stats;
pub mod sweep;
pub mod tag;
pub mod target;
