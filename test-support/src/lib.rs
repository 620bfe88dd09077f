//! # kvtier-test-support
//!
//! What the integration tests of the loadgen (`loadgen/tests/`) and of the
//! server (`server/tests/`) share, kept out of both libraries: a
//! dev-dependency only, never shipped.
//!
//! - [`server_args`]: the command line of a test `kvtier serve` (where it
//!   listens, its data directory, a small store), written once for every
//!   test that starts one.
//! - [`browser`]: opening an HTML report in headless Chromium, as a person
//!   would, and reading back what it parsed, logged and drew.
//!
//! It depends on none of kvtier's crates, so both can depend on it.
#![deny(missing_docs)]

pub mod browser;
pub mod server_args;
