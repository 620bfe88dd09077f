//! Tenants (docs/OPERATIONS.md, "Tenants"): the tenants file, who is
//! calling, and the key space each caller's keys live in.
//!
//! A tenants file (`--tenants PATH`, TOML) names each tenant once:
//!
//! ```toml
//! [[tenant]]
//! name = "team-a"                 # [a-z0-9_-], 1-32 bytes: its key scope
//! token_sha256 = "9f86d08..."     # or token = "..." (one of the two)
//! uids = [1001]                   # local-socket peers (SO_PEERCRED) that are this tenant
//! admin = false                   # may use /v1/admin/* (default false)
//! ram_reserved_gb = 8             # per tier: gpu_, ram_, nvme_ × reserved_gb, limit_gb
//! ram_limit_gb = 16
//!
//! [[namespace]]
//! name = "sysprompts"             # a shared key space, an owner of its own
//! key_prefix = "sys-"             # client keys starting with it are in this namespace
//! readers = ["team-a", "team-b"]
//! writers = ["team-a"]            # writers may read too
//! ram_reserved_gb = 1
//! ```
//!
//! The server scopes every client key before the engine sees it
//! ([`stored_key`]): `team-a`'s key `k` is stored as `team-a/k`; a key
//! starting with a namespace's `key_prefix`, for a tenant named in it, as
//! `sysprompts/sys-...`. A key of another tenant is therefore never reached
//! (a miss, like any absent key), and a client cannot spell another
//! tenant's stored key (`/` is not a key byte). GB here is GiB (2^30
//! bytes), as `--ram-gb` and `--disk-gb`.

mod file;
mod scope;

pub use file::{token_digest, Capacity, OwnerEntry, QuotaChange, QuotaGb, QuotaRefusal, Table, Tenant};
pub use scope::{stored_key, ScopeError};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use kvtier_engine::tenant::Owners;
use kvtier_engine::trace::unix_ms_now;
use serde::Serialize;

/// How the last reload of the tenants file went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadStatus {
    /// When the table in use was loaded (Unix ms).
    pub loaded_unix_ms: u64,
    /// Reloads that took effect.
    pub reloads: u64,
    /// Reloads refused (the table in use was kept).
    pub reload_failures: u64,
    /// Why the last refused reload was refused.
    pub last_error: Option<String>,
}

/// The tenants of a running server: the file, the table in use (swapped
/// whole on reload or change) and how reloads went.
pub struct Tenancy {
    path: PathBuf,
    capacity: Capacity,
    table: ArcSwap<Table>,
    /// The engine's owners for the table in use, ids kept across changes.
    engine_owners: Mutex<Arc<Owners>>,
    status: Mutex<ReloadStatus>,
    /// Set by SIGHUP; shard 0 reloads and clears it.
    reload_requested: AtomicBool,
    /// Wakes shard 0's reload task when SIGHUP sets `reload_requested`.
    reload_event: event_listener::Event,
    /// Requests refused for an unknown token or uid.
    pub unauthorized: AtomicU64,
}

impl Tenancy {
    /// Reads and checks `path`.
    ///
    /// # Errors
    /// The file cannot be read, or [`Table::parse`] refuses it.
    pub fn load(path: &Path, capacity: Capacity) -> Result<Tenancy, String> {
        let table = read_table(path, &capacity)?;
        let owners = Owners::default().reload(&table.owners())?;
        Ok(Tenancy {
            path: path.to_path_buf(),
            capacity,
            table: ArcSwap::from_pointee(table),
            engine_owners: Mutex::new(Arc::new(owners)),
            status: Mutex::new(ReloadStatus { loaded_unix_ms: unix_ms_now(), ..Default::default() }),
            reload_requested: AtomicBool::new(false),
            reload_event: event_listener::Event::new(),
            unauthorized: AtomicU64::new(0),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The table in use.
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// The engine's owners for the table in use (give them to the store
    /// with [`kvtier_engine::Store::set_owners`] after a change).
    pub fn owners(&self) -> Arc<Owners> {
        self.engine_owners.lock().expect("not poisoned").clone()
    }

    /// Puts `table` in use, with the engine's owners for it (known names
    /// keep their ids).
    fn adopt(&self, table: Table) -> Result<Arc<Owners>, String> {
        let mut owners = self.engine_owners.lock().expect("not poisoned");
        let next = Arc::new(owners.reload(&table.owners())?);
        *owners = next.clone();
        self.table.store(Arc::new(table));
        Ok(next)
    }

    /// How reloads went.
    pub fn status(&self) -> ReloadStatus {
        self.status.lock().expect("not poisoned").clone()
    }

    /// Asks for a reload (SIGHUP): wakes shard 0's task waiting in
    /// [`Tenancy::reload_requested`].
    pub fn request_reload(&self) {
        self.reload_requested.store(true, Ordering::SeqCst);
        self.reload_event.notify(usize::MAX);
    }

    /// Resolves once a reload was asked for since the last time it
    /// resolved (and clears the request).
    pub async fn reload_requested(&self) {
        loop {
            if self.reload_requested.swap(false, Ordering::SeqCst) {
                return;
            }
            let listener = self.reload_event.listen();
            if self.reload_requested.swap(false, Ordering::SeqCst) {
                return;
            }
            listener.await;
        }
    }

    /// Reads the file again; the table in use is kept when it is refused.
    /// Returns the engine's owners for the new table.
    ///
    /// # Errors
    /// Why the file was refused (also counted and kept in the status).
    pub fn reload(&self) -> Result<Arc<Owners>, String> {
        match read_table(&self.path, &self.capacity).and_then(|t| self.adopt(t)) {
            Ok(t) => {
                let mut s = self.status.lock().expect("not poisoned");
                s.loaded_unix_ms = unix_ms_now();
                s.reloads += 1;
                s.last_error = None;
                Ok(t)
            }
            Err(e) => {
                let mut s = self.status.lock().expect("not poisoned");
                s.reload_failures += 1;
                s.last_error = Some(e.clone());
                Err(e)
            }
        }
    }

    /// Changes `name`'s quotas in the table in use (until the next
    /// reload). Returns the engine's owners for the new table.
    ///
    /// # Errors
    /// `Ok(None)` for an unknown name; as [`Table::with_quotas`].
    pub fn set_quotas(&self, name: &str, change: &QuotaChange) -> Result<Option<Arc<Owners>>, QuotaRefusal> {
        let Some(next) = self.table().with_quotas(name, change, &self.capacity)? else { return Ok(None) };
        self.adopt(next).map(Some).map_err(QuotaRefusal::Invalid)
    }
}

fn read_table(path: &Path, capacity: &Capacity) -> Result<Table, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read tenants file {}: {e}", path.display()))?;
    Table::parse(&text, &path.display().to_string(), capacity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_engine::tenant::Quota;

    const CAP: Capacity = Capacity { shard_blocks: [0, 8, 100], shards: 2, block_bytes: 1 << 28 };

    fn parse(text: &str) -> Result<Table, String> {
        Table::parse(text, "t.toml", &CAP)
    }

    const GOOD: &str = r#"
[[tenant]]
name = "a"
token = "tok-a"
uids = [1001]
ram_reserved_gb = 1
ram_limit_gb = 2

[[tenant]]
name = "b"
token_sha256 = "9b3b7ae4aa0d5a44f6b5c3f0f5d43f3e1a7e1b4d0b0a4a0f2b6c2a8e6d1f4c33"

[[namespace]]
name = "sys"
key_prefix = "sys-"
readers = ["a", "b"]
writers = ["a"]
"#;

    #[test]
    fn a_good_file_scopes_keys() {
        let t = parse(GOOD).unwrap();
        let a = t.by_token(b"tok-a").unwrap().clone();
        assert_eq!(a.name, "a");
        assert!(t.by_token(b"tok-b").is_none());
        assert_eq!(t.by_uid(1001).unwrap().name, "a");
        let typed = |scope: &str, key: &str| kvtier_engine::key::StoredKey::new(scope, key).unwrap();
        assert_eq!(stored_key(Some(&a), "k1", false).unwrap(), typed("a", "k1"));
        assert_eq!(stored_key(Some(&a), "sys-p", true).unwrap(), typed("sys", "sys-p"));
        assert_eq!(stored_key(None, "k1", true).unwrap(), typed("", "k1"));
        let b = t.tenants[1].clone();
        assert_eq!(stored_key(Some(&b), "sys-p", false).unwrap(), typed("sys", "sys-p"));
        assert!(matches!(stored_key(Some(&b), "sys-p", true), Err(ScopeError::ReadOnly(_))));
        assert!(matches!(stored_key(Some(&a), "a/k", false), Err(ScopeError::InvalidKey(_))));
        // The longest key is the same under every tenant as without one.
        assert_eq!(stored_key(Some(&a), &"k".repeat(256), false).unwrap().key().len(), 256);
        let e = stored_key(Some(&a), &"k".repeat(257), false).unwrap_err().to_string();
        assert!(e.contains("the limit is 256"), "{e}");
        let owners = t.owners();
        assert_eq!(owners.id_of("sys"), Some(3));
        assert_eq!(owners.specs[1].quotas[1], Quota { reserved_bytes: 1 << 30, limit_bytes: Some(2 << 30) });
    }

    #[test]
    fn bad_files_say_why() {
        let cases: &[(&str, &str)] = &[
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\n[[tenant]]\nname = \"a\"\ntoken = \"y\"", "given twice"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\n[[tenant]]\nname = \"b\"\ntoken = \"x\"", "same token"),
            ("[[tenant]]\nname = \"a\"", "needs a token"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\ntoken_sha256 = \"00\"", "not both"),
            ("[[tenant]]\nname = \"a\"\ntoken_sha256 = \"zz\"", "64 hex digits"),
            ("[[tenant]]\nname = \"A\"\ntoken = \"x\"", "[a-z0-9_-]"),
            ("[[tenant]]\nname = \"default\"\ntoken = \"x\"", "reserved"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\nram_reserve_gb = 1", "unknown field"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\nram_reserved_gb = 3\nram_limit_gb = 2", "above ram_limit_gb"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\nram_reserved_gb = -1", "0 or more"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\nuids = [5]\n[[tenant]]\nname = \"b\"\ntoken = \"y\"\nuids = [5]", "uid 5"),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\n[[namespace]]\nname = \"n\"\nkey_prefix = \"p\"\nreaders = [\"zz\"]", "not a tenant"),
            (
                "[[tenant]]\nname = \"a\"\ntoken = \"x\"\n[[namespace]]\nname = \"n\"\nkey_prefix = \"p\"\n[[namespace]]\nname = \"m\"\nkey_prefix = \"pq\"",
                "is a prefix of",
            ),
            ("[[tenant]]\nname = \"a\"\ntoken = \"x\"\ngpu_reserved_gb = 1", "gpu reservations add up to 1 GiB (a 1 GiB)"),
            (
                "[[tenant]]\nname = \"a\"\ntoken = \"x\"\nram_reserved_gb = 3\n[[tenant]]\nname = \"b\"\ntoken = \"y\"\nram_reserved_gb = 2",
                "ram reservations add up to 5 GiB (a 3 GiB, b 2 GiB) but the RAM tier (--ram-gb) holds 4 GiB",
            ),
            ("[[tenant]\nname = 1", "t.toml"),
            ("", "names no tenant"),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e:?} lacks {want:?}");
        }
    }

    #[test]
    fn quotas_change_and_are_checked() {
        let t = parse(GOOD).unwrap();
        let change: QuotaChange = serde_json::from_str(r#"{"ram_reserved_gb": 2, "ram_limit_gb": null}"#).unwrap();
        assert_eq!(QuotaGb { ram_limit_gb: Some(5.0), ..Default::default() }.merged(&change).unwrap().ram_limit_gb, None);
        let next = t.with_quotas("a", &change, &CAP).unwrap().unwrap();
        assert_eq!(next.owners().specs[1].quotas[1], Quota { reserved_bytes: 2 << 30, limit_bytes: None });
        assert!(t.with_quotas("zz", &change, &CAP).unwrap().is_none());
        let too_much: QuotaChange = serde_json::from_str(r#"{"ram_reserved_gb": 9, "ram_limit_gb": null}"#).unwrap();
        assert!(matches!(t.with_quotas("a", &too_much, &CAP), Err(QuotaRefusal::OverCapacity(m)) if m.contains("add up to")));
        let bad: QuotaChange = serde_json::from_str(r#"{"ram_gb": 1}"#).unwrap();
        assert!(QuotaGb::default().merged(&bad).unwrap_err().to_string().contains("unknown field"));
        assert!(matches!(t.with_quotas("a", &bad, &CAP), Err(QuotaRefusal::Invalid(m)) if m.contains("unknown field")));
    }
}
