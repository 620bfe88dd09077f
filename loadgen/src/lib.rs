//! # kvtier-loadgen
//!
//! Load generation for kvtier: replay of real conversations (ShareGPT V3)
//! through the block API, with chained block keys, verified payloads and
//! hdrhistogram latency percentiles. The binary `kvtier-loadgen` wraps it;
//! the server's integration tests use [`client`] directly.
#![deny(missing_docs)]

pub mod blocks;
pub mod client;
pub mod keys;
pub mod payload;
pub mod replay;
pub mod sharegpt;
pub mod stats;
