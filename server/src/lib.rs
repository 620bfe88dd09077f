//! The kvtier server's pieces, shared by its two binaries: `kvtier` (the
//! sidecar, `src/main.rs`) and `kvtier-http-reference` (a bare HTTP block
//! server on the same hyper-on-glommio plumbing, the yardstick
//! `make bench-http` measures kvtier's HTTP path against:
//! `src/bin/kvtier-http-reference.rs`).

pub mod body;
pub mod gpu;
pub mod http;
pub mod limits;
pub mod local;
pub mod metrics;
pub mod routes;
pub mod server;
pub mod tenants;
