//! The key space of each caller: a client key as its tenant stores it.

use std::borrow::Cow;

use kvtier_engine::tenant::scoped_key;

use super::file::Tenant;

/// Why a client key cannot be used by its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeError {
    /// The key breaks the key rules, or is too long once scoped.
    InvalidKey(String),
    /// A write (PUT, DELETE) into a namespace the tenant may only read.
    ReadOnly(String),
}

impl std::fmt::Display for ScopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScopeError::InvalidKey(m) | ScopeError::ReadOnly(m) => f.write_str(m),
        }
    }
}

/// The stored key of `key` for `caller` (`None`: no tenants file, the key
/// itself, borrowed). `write`: the caller stores or deletes it.
///
/// # Errors
/// [`ScopeError::InvalidKey`] for a key that breaks the key rules or is too
/// long with its scope; [`ScopeError::ReadOnly`] for a write into a
/// namespace the caller only reads.
pub fn stored_key<'k>(caller: Option<&Tenant>, key: &'k str, write: bool) -> Result<Cow<'k, str>, ScopeError> {
    kvtier_engine::key::validate(key).map_err(|e| ScopeError::InvalidKey(e.to_string()))?;
    let Some(t) = caller else { return Ok(Cow::Borrowed(key)) };
    let scope = match t.namespaces.iter().find(|a| key.starts_with(&a.key_prefix)) {
        Some(a) if write && !a.write => {
            return Err(ScopeError::ReadOnly(format!(
                "tenant {:?} may read namespace {:?} (keys starting {:?}) but not write it",
                t.name, a.scope, a.key_prefix
            )))
        }
        Some(a) => &a.scope,
        None => &t.name,
    };
    let stored = scoped_key(scope, key);
    kvtier_engine::key::validate_stored(&stored).map_err(|e| ScopeError::InvalidKey(e.to_string()))?;
    Ok(Cow::Owned(stored))
}
