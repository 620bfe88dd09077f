//! The frames of docs/LOCAL.md (`kvtier-local-proto`, shared with the load
//! generator), and the two mappings from the engine's types to them.

use kvtier_engine::{Error, Tier};
pub use kvtier_local_proto::*;

/// The engine error's code: the same causes the HTTP routes map to statuses
/// (`routes::engine_error`).
pub fn code_of(e: &Error) -> Code {
    match e {
        Error::InvalidKey { .. } => Code::InvalidKey,
        Error::InvalidTag(_) => Code::InvalidTag,
        Error::WrongSize { .. } => Code::WrongSize,
        Error::NotFound => Code::NotFound,
        Error::Corrupt { .. } => Code::Corrupt,
        Error::DiskFull(_) => Code::DiskFull,
        Error::Overloaded(_) => Code::Overloaded,
        Error::ShuttingDown => Code::ShuttingDown,
        Error::LeasesOff(_) => Code::LeasesOff,
        Error::Cancelled => Code::Cancelled,
        _ => Code::IoError,
    }
}

/// Wire number of a tier ([`TIER_NAMES`]); 0 for none.
pub fn tier_code(t: Option<Tier>) -> u8 {
    t.and_then(|t| TIER_NAMES.iter().position(|n| *n == t.as_str())).unwrap_or(0) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tier_has_its_wire_number() {
        assert_eq!(tier_code(None), 0);
        for (t, n) in [(Tier::Gpu, 1), (Tier::Ram, 2), (Tier::Nvme, 3), (Tier::Remote, 4)] {
            assert_eq!(tier_code(Some(t)), n, "{t:?}");
        }
    }
}
