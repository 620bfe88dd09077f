//! The tenants file: its TOML, checked whole into a [`Table`] (tenants,
//! shared namespaces, quotas in GiB and as the engine's owners), and quota
//! changes from the admin route.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_engine::tenant::{check_name, OwnerSpec, Owners, Quota, QuotaTier};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

const GIB: f64 = (1u64 << 30) as f64;

/// The six quota fields a `[[tenant]]` or `[[namespace]]` table may set, in
/// GiB (absent: no reservation, no limit).
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QuotaGb {
    /// GPU tier reservation.
    pub gpu_reserved_gb: Option<f64>,
    /// GPU tier limit.
    pub gpu_limit_gb: Option<f64>,
    /// RAM tier reservation.
    pub ram_reserved_gb: Option<f64>,
    /// RAM tier limit.
    pub ram_limit_gb: Option<f64>,
    /// NVMe log reservation.
    pub nvme_reserved_gb: Option<f64>,
    /// NVMe log limit.
    pub nvme_limit_gb: Option<f64>,
}

impl QuotaGb {
    fn pairs(&self) -> [(Option<f64>, Option<f64>); 3] {
        [(self.gpu_reserved_gb, self.gpu_limit_gb), (self.ram_reserved_gb, self.ram_limit_gb), (self.nvme_reserved_gb, self.nvme_limit_gb)]
    }

    /// The quotas in bytes, by [`QuotaTier`].
    ///
    /// # Errors
    /// A value that is negative or not a number, or a reservation above
    /// the limit; `who` names the table in the message.
    pub fn to_quotas(&self, who: &str) -> Result<[Quota; 3], String> {
        let mut out = [Quota::default(); 3];
        for (tier, (reserved, limit)) in QuotaTier::ALL.into_iter().zip(self.pairs()) {
            let t = tier.as_str();
            let bytes = |v: Option<f64>, what: &str| -> Result<Option<u64>, String> {
                match v {
                    None => Ok(None),
                    Some(g) if g.is_finite() && g >= 0.0 => Ok(Some((g * GIB) as u64)),
                    Some(g) => Err(format!("{who}: {t}_{what}_gb = {g} must be a number of GiB, 0 or more")),
                }
            };
            let (r, l) = (bytes(reserved, "reserved")?, bytes(limit, "limit")?);
            if let (Some(r), Some(l)) = (r, l) {
                if r > l {
                    return Err(format!("{who}: {t}_reserved_gb ({}) is above {t}_limit_gb ({})", gb(r), gb(l)));
                }
            }
            out[tier as usize] = Quota { reserved_bytes: r.unwrap_or(0), limit_bytes: l };
        }
        Ok(out)
    }

    /// `self` with the fields `change` sets replaced: each field given
    /// replaces the current value (`null` removes it), fields left out
    /// keep theirs.
    ///
    /// # Errors
    /// A field that is not one of the six, or a value that is not a number
    /// or `null`.
    pub fn merged(&self, change: &QuotaChange) -> Result<QuotaGb, serde_json::Error> {
        let mut fields = match serde_json::to_value(self)? {
            serde_json::Value::Object(m) => m,
            _ => unreachable!("a struct serializes to an object"),
        };
        fields.extend(change.iter().map(|(k, v)| (k.clone(), v.clone())));
        serde_json::from_value(serde_json::Value::Object(fields))
    }
}

/// The body of `PUT /v1/admin/tenants/{name}`: a JSON object of some of
/// [`QuotaGb`]'s fields ([`QuotaGb::merged`]).
pub type QuotaChange = serde_json::Map<String, serde_json::Value>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileToml {
    #[serde(default)]
    tenant: Vec<TenantToml>,
    #[serde(default)]
    namespace: Vec<NamespaceToml>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantToml {
    name: String,
    token: Option<String>,
    token_sha256: Option<String>,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    admin: bool,
    gpu_reserved_gb: Option<f64>,
    gpu_limit_gb: Option<f64>,
    ram_reserved_gb: Option<f64>,
    ram_limit_gb: Option<f64>,
    nvme_reserved_gb: Option<f64>,
    nvme_limit_gb: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NamespaceToml {
    name: String,
    key_prefix: String,
    #[serde(default)]
    readers: Vec<String>,
    #[serde(default)]
    writers: Vec<String>,
    gpu_reserved_gb: Option<f64>,
    gpu_limit_gb: Option<f64>,
    ram_reserved_gb: Option<f64>,
    ram_limit_gb: Option<f64>,
    nvme_reserved_gb: Option<f64>,
    nvme_limit_gb: Option<f64>,
}

/// The quota fields of a `[[tenant]]` or `[[namespace]]` table (serde's
/// `flatten` would lose `deny_unknown_fields`, which catches a misspelt
/// quota).
macro_rules! quotas_of {
    ($t:expr) => {
        QuotaGb {
            gpu_reserved_gb: $t.gpu_reserved_gb,
            gpu_limit_gb: $t.gpu_limit_gb,
            ram_reserved_gb: $t.ram_reserved_gb,
            ram_limit_gb: $t.ram_limit_gb,
            nvme_reserved_gb: $t.nvme_reserved_gb,
            nvme_limit_gb: $t.nvme_limit_gb,
        }
    };
}

/// A shared namespace a tenant is named in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Access {
    pub(crate) key_prefix: String,
    /// The namespace's name: the scope of its keys.
    pub(crate) scope: String,
    pub(crate) write: bool,
}

/// One tenant: who it is and which key spaces it reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Its name: the scope of its keys.
    pub name: String,
    /// Whether it may use `/v1/admin/*`.
    pub admin: bool,
    /// Local-socket peer uids that are this tenant.
    pub uids: Vec<u32>,
    pub(crate) namespaces: Vec<Access>,
}

/// One owner (tenant or namespace) as the file gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnerEntry {
    /// Name.
    pub name: String,
    /// `tenant` or `namespace`.
    pub kind: &'static str,
    /// Quotas as given, in GiB.
    pub quotas: QuotaGb,
    /// For a namespace: its key prefix, readers and writers.
    pub namespace: Option<(String, Vec<String>, Vec<String>)>,
}

/// A checked tenants file.
#[derive(Debug, Clone)]
pub struct Table {
    pub(crate) tenants: Vec<Arc<Tenant>>,
    by_token: HashMap<[u8; 32], usize>,
    by_uid: HashMap<u32, usize>,
    /// Every owner, tenants first, in file order.
    pub entries: Vec<OwnerEntry>,
}

/// Blocks each tier of one shard holds, and the shards
/// ([`kvtier_engine::StoreConfig::shard_capacity_blocks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// By [`QuotaTier`].
    pub shard_blocks: [u64; 3],
    /// Shards.
    pub shards: usize,
    /// Block size in bytes.
    pub block_bytes: u64,
}

impl Table {
    /// Parses and checks a tenants file's text. `file` names it in errors.
    ///
    /// # Errors
    /// One line saying what is wrong: TOML syntax (with line and column),
    /// an unknown field, a name given twice, a token missing, given twice
    /// or shared by two tenants, a uid given to two tenants, a namespace
    /// naming an unknown tenant, key prefixes that overlap, a reservation
    /// above its limit, or reservations adding up to more than a tier
    /// holds (with the sums).
    pub fn parse(text: &str, file: &str, capacity: &Capacity) -> Result<Table, String> {
        let parsed: FileToml = toml::from_str(text).map_err(|e| format!("tenants file {file}: {}", e.to_string().trim_end()))?;
        if parsed.tenant.is_empty() {
            return Err(format!("tenants file {file} names no tenant: add a [[tenant]] table with a name and a token"));
        }
        let mut names: HashMap<String, &str> = HashMap::new();
        let mut check_owner = |name: &str, kind: &'static str| -> Result<(), String> {
            check_name(name).map_err(|e| format!("tenants file {file}: {kind} {e}"))?;
            if name == "default" {
                return Err(format!("tenants file {file}: the name \"default\" is reserved for blocks written without tenants"));
            }
            if let Some(other) = names.insert(name.to_string(), kind) {
                return Err(format!("tenants file {file}: the name {name:?} is given twice (a {other} and a {kind})"));
            }
            Ok(())
        };
        let mut table = Table { tenants: Vec::new(), by_token: HashMap::new(), by_uid: HashMap::new(), entries: Vec::new() };
        for t in &parsed.tenant {
            check_owner(&t.name, "tenant")?;
            let who = format!("tenants file {file}: tenant {:?}", t.name);
            let digest = match (&t.token, &t.token_sha256) {
                (Some(token), None) if !token.trim().is_empty() => token_digest(token.trim().as_bytes()),
                (None, Some(hexed)) => {
                    let bytes = hex::decode(hexed.trim()).ok().filter(|b| b.len() == 32).ok_or_else(|| {
                        format!("{who}: token_sha256 must be 64 hex digits (the SHA-256 of the token, e.g. `printf %s TOKEN | sha256sum`)")
                    })?;
                    bytes.try_into().expect("32 bytes")
                }
                (Some(_), Some(_)) => return Err(format!("{who}: give token or token_sha256, not both")),
                _ => return Err(format!("{who}: needs a token (token = \"...\" or token_sha256 = \"<64 hex digits>\")")),
            };
            let i = table.tenants.len();
            if let Some(j) = table.by_token.insert(digest, i) {
                return Err(format!("{who}: has the same token as tenant {:?}; each tenant needs its own", table.tenants[j].name));
            }
            for uid in &t.uids {
                if let Some(j) = table.by_uid.insert(*uid, i) {
                    return Err(format!("{who}: uid {uid} is already tenant {:?}'s; a local peer is one tenant", table.tenants[j].name));
                }
            }
            let quotas = quotas_of!(t);
            quotas.to_quotas(&who)?;
            table.tenants.push(Arc::new(Tenant { name: t.name.clone(), admin: t.admin, uids: t.uids.clone(), namespaces: Vec::new() }));
            table.entries.push(OwnerEntry { name: t.name.clone(), kind: "tenant", quotas, namespace: None });
        }
        for n in &parsed.namespace {
            check_owner(&n.name, "namespace")?;
            let who = format!("tenants file {file}: namespace {:?}", n.name);
            kvtier_engine::key::validate(&n.key_prefix).map_err(|e| format!("{who}: key_prefix: {e}"))?;
            let quotas = quotas_of!(n);
            quotas.to_quotas(&who)?;
            for other in &parsed.namespace {
                if other.name != n.name && other.key_prefix.starts_with(&n.key_prefix) {
                    return Err(format!(
                        "{who}: key_prefix {:?} is a prefix of namespace {:?}'s {:?}; a key would be in both",
                        n.key_prefix, other.name, other.key_prefix
                    ));
                }
            }
            for name in n.readers.iter().chain(&n.writers) {
                let Some(i) = table.tenants.iter().position(|t| t.name == *name) else {
                    return Err(format!("{who}: names {name:?}, which is not a tenant of this file"));
                };
                let write = n.writers.contains(name);
                let t = Arc::make_mut(&mut table.tenants[i]);
                if !t.namespaces.iter().any(|a| a.scope == n.name) {
                    t.namespaces.push(Access { key_prefix: n.key_prefix.clone(), scope: n.name.clone(), write });
                }
            }
            table.entries.push(OwnerEntry {
                name: n.name.clone(),
                kind: "namespace",
                quotas,
                namespace: Some((n.key_prefix.clone(), n.readers.clone(), n.writers.clone())),
            });
        }
        table.check_capacity(capacity).map_err(|e| format!("tenants file {file}: {e}"))?;
        Ok(table)
    }

    /// The engine's owners for this file: its tenants and namespaces, in
    /// order, with their quotas.
    pub fn owners(&self) -> Owners {
        let specs = self
            .entries
            .iter()
            .map(|e| OwnerSpec { name: e.name.clone(), configured: true, quotas: e.quotas.to_quotas(&e.name).expect("checked at parse") })
            .collect();
        Owners::new(specs).expect("names checked at parse")
    }

    /// Refuses reservations that add up to more than a tier holds: in each
    /// tier, the shares of one shard (whole blocks, the first shard's,
    /// which is the largest) against that shard's blocks.
    ///
    /// # Errors
    /// The tier, the sum, what it holds, and who reserves what.
    pub fn check_capacity(&self, capacity: &Capacity) -> Result<(), String> {
        let owners = self.owners();
        for tier in QuotaTier::ALL {
            let held = capacity.shard_blocks[tier as usize];
            let per_shard = owners.shard_quotas(tier, capacity.block_bytes, 0, capacity.shards, u64::MAX);
            let reserved: u64 = per_shard.iter().map(|q| q.0).sum();
            if reserved > held {
                let who: Vec<String> = self
                    .entries
                    .iter()
                    .zip(&owners.specs[1..])
                    .filter(|(_, s)| s.quotas[tier as usize].reserved_bytes > 0)
                    .map(|(e, s)| format!("{} {}", e.name, gb(s.quotas[tier as usize].reserved_bytes)))
                    .collect();
                let total: u64 = owners.specs.iter().map(|s| s.quotas[tier as usize].reserved_bytes).sum();
                let holds = held * capacity.shards as u64 * capacity.block_bytes;
                let what = match tier {
                    QuotaTier::Gpu => "the GPU tier (--gpu-mem-gb)",
                    QuotaTier::Ram => "the RAM tier (--ram-gb)",
                    QuotaTier::Nvme => "the NVMe log (--disk-gb, less one segment a shard)",
                };
                return Err(format!(
                    "{} reservations add up to {} ({}) but {what} holds {}",
                    tier.as_str(),
                    gb(total),
                    who.join(", "),
                    gb(holds)
                ));
            }
        }
        Ok(())
    }

    /// The tenant named `name`.
    pub fn tenant(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.tenants.iter().find(|t| t.name == name)
    }

    /// The tenant whose token is `token`.
    pub fn by_token(&self, token: &[u8]) -> Option<&Arc<Tenant>> {
        self.by_token.get(&token_digest(token)).map(|&i| &self.tenants[i])
    }

    /// The tenant a local peer running as `uid` is.
    pub fn by_uid(&self, uid: u32) -> Option<&Arc<Tenant>> {
        self.by_uid.get(&uid).map(|&i| &self.tenants[i])
    }

    /// `self` with `name`'s quotas changed.
    ///
    /// # Errors
    /// `Ok(None)` when no owner is named `name`;
    /// [`QuotaRefusal::Invalid`] for a change [`QuotaGb::merged`] or
    /// [`QuotaGb::to_quotas`] refuses, [`QuotaRefusal::OverCapacity`] as
    /// [`Table::check_capacity`] says.
    pub fn with_quotas(&self, name: &str, change: &QuotaChange, capacity: &Capacity) -> Result<Option<Table>, QuotaRefusal> {
        let mut next = self.clone();
        let Some(e) = next.entries.iter_mut().find(|e| e.name == name) else { return Ok(None) };
        let who = format!("{} {name:?}", e.kind);
        e.quotas = e.quotas.merged(change).map_err(|err| QuotaRefusal::Invalid(format!("{who}: {err}")))?;
        e.quotas.to_quotas(&who).map_err(QuotaRefusal::Invalid)?;
        next.check_capacity(capacity).map_err(QuotaRefusal::OverCapacity)?;
        Ok(Some(next))
    }
}

/// Why a quota change was refused (the message says what).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaRefusal {
    /// An unknown field, a value that is not a number of GiB, or a
    /// reservation above its limit.
    Invalid(String),
    /// Reservations would add up to more than a tier holds.
    OverCapacity(String),
}

impl std::fmt::Display for QuotaRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuotaRefusal::Invalid(m) | QuotaRefusal::OverCapacity(m) => f.write_str(m),
        }
    }
}

/// SHA-256 of a token: how tokens are held and compared.
pub fn token_digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

/// `bytes` as GiB for messages (`2.5 GiB`).
fn gb(bytes: u64) -> String {
    format!("{} GiB", (bytes as f64 / GIB * 1000.0).round() / 1000.0)
}
