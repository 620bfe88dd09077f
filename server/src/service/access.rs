//! Who is calling: the one answer both front doors get from the token they
//! were shown (HTTP's bearer token, the same-host socket's HELLO token) or,
//! on the socket without a token, the peer's uid.

use std::sync::Arc;

use crate::tenants::{Table, Tenancy, Tenant};

/// The tenant a request acts for; `None` without `--tenants`.
pub type Caller = Option<Arc<Tenant>>;

/// How callers are told apart, as one request sees it (the tenants table
/// in use is read once per request). Pure: the fuzz target `http_route`
/// builds one.
#[derive(Clone, Copy)]
pub enum Auth<'a> {
    /// No token and no tenants: every caller may use every route.
    Open,
    /// `--auth-token-file`: the one token every caller must show.
    Token(&'a [u8]),
    /// `--tenants`: a tenant's token names the caller.
    Tenants(&'a Table),
}

/// A caller refused: no token, or one that is no one's; the reason, for
/// the socket's `UNAUTHORIZED` message (HTTP says 401 without it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied(pub String);

impl Auth<'_> {
    /// The caller `token` names.
    ///
    /// # Errors
    /// [`Denied`] when the server needs a token and `token` is absent or
    /// matches none.
    pub fn identify(&self, token: Option<&[u8]>) -> Result<Caller, Denied> {
        match *self {
            Auth::Open => Ok(None),
            Auth::Token(expected) if token.is_some_and(|t| tokens_equal(t, expected)) => Ok(None),
            Auth::Token(_) => Err(Denied("the server has a bearer token and the one given does not match it".into())),
            Auth::Tenants(table) => match token.and_then(|t| table.by_token(t)) {
                Some(t) => Ok(Some(t.clone())),
                None => Err(Denied("the token given is no tenant's (--tenants)".into())),
            },
        }
    }

    /// The caller of a same-host connection's HELLO: as
    /// [`Auth::identify`], except that with tenants and no token the
    /// peer's uid names it (a tenant's `uids`).
    ///
    /// # Errors
    /// [`Denied`] naming what failed: the token, or (with tenants and no
    /// token) a uid no tenant lists.
    pub fn identify_peer(&self, token: Option<&[u8]>, peer_uid: u32) -> Result<Caller, Denied> {
        match (*self, token) {
            (Auth::Tenants(table), None) => table
                .by_uid(peer_uid)
                .map(|t| Some(t.clone()))
                .ok_or_else(|| Denied(format!("the HELLO has no `token` and peer uid {peer_uid} is no tenant's `uids` (--tenants)"))),
            (Auth::Tenants(_), Some(_)) => {
                self.identify(token).map_err(|_| Denied("the HELLO's `token` is no tenant's (--tenants)".into()))
            }
            _ => self.identify(token).map_err(|_| Denied("the server has a bearer token and the HELLO's `token` does not match it".into())),
        }
    }
}

/// Whether two tokens are equal, in time that does not depend on how many
/// leading bytes match (only on the lengths). Tenants' tokens are compared
/// as SHA-256 digests instead (`tenants.rs`): the time then depends on the
/// digest, which tells nothing about the token.
pub fn tokens_equal(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len() && given.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// What a shard knows of its callers: the token or the tenants.
pub struct Access {
    token: Option<Arc<[u8]>>,
    tenancy: Option<Arc<Tenancy>>,
}

impl Access {
    /// Callers as `--auth-token-file` (`token`) or `--tenants` (`tenancy`)
    /// make them; neither: open.
    pub fn new(token: Option<Arc<[u8]>>, tenancy: Option<Arc<Tenancy>>) -> Self {
        Access { token, tenancy }
    }

    /// Runs `f` with the rules in use now (the tenants table is read once).
    pub fn with<R>(&self, f: impl FnOnce(Auth<'_>) -> R) -> R {
        let table = self.tenancy.as_ref().map(|t| t.table());
        let auth = match (&table, &self.token) {
            (Some(table), _) => Auth::Tenants(table),
            (None, Some(token)) => Auth::Token(token),
            (None, None) => Auth::Open,
        };
        f(auth)
    }

    /// Counts a caller refused for its token or uid
    /// (`kvtier_tenants_unauthorized_total`, with tenants).
    pub fn count_refusal(&self) {
        if let Some(t) = &self.tenancy {
            t.unauthorized.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The tenants, with `--tenants`.
    pub fn tenancy(&self) -> Option<&Arc<Tenancy>> {
        self.tenancy.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_equal_only_when_equal() {
        assert!(tokens_equal(b"s3cret", b"s3cret"));
        assert!(!tokens_equal(b"s3cret", b"s3creT"));
        assert!(!tokens_equal(b"s3cre", b"s3cret"));
        assert!(!tokens_equal(b"", b"s3cret"));
    }

    #[test]
    fn a_token_server_refuses_a_missing_or_wrong_token_on_both_doors() {
        let auth = Auth::Token(b"tok");
        assert_eq!(auth.identify(Some(b"tok")), Ok(None));
        assert!(auth.identify(Some(b"bad")).is_err() && auth.identify(None).is_err());
        assert!(auth.identify_peer(None, 0).is_err());
        assert_eq!(Auth::Open.identify_peer(None, 7), Ok(None));
    }
}
