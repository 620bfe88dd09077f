//! The key space of each caller: a client key as its tenant stores it.

use kvtier_engine::key::StoredKey;

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

/// The stored key of `key` for `caller`: in the scope of the namespace it
/// falls in, else of the tenant itself (`None`: no tenants file, the
/// default owner's key). `write`: the caller stores or deletes it.
///
/// # Errors
/// [`ScopeError::InvalidKey`] for a key that breaks the key rules;
/// [`ScopeError::ReadOnly`] for a write into a namespace the caller only
/// reads.
pub fn stored_key(caller: Option<&Tenant>, key: &str, write: bool) -> Result<StoredKey, ScopeError> {
    let invalid = |e: kvtier_engine::Error| ScopeError::InvalidKey(e.to_string());
    let Some(t) = caller else { return StoredKey::unscoped(key).map_err(invalid) };
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
    StoredKey::new(scope, key).map_err(invalid)
}
