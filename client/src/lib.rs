//! kvtier's same-host client core (docs/LOCAL.md), under the Python
//! package's native module (`clients/python/native`, `kvtier._native`).
//!
//! So far it holds the shared index read in the client ([`index`]): the
//! table layout and its reader are `kvtier_local_proto::shared_index`, the same
//! code the server's shards write with, so the layout is written once.

pub mod index;

pub use index::{IndexError, SharedIndex, Table, BAD_KEY};
