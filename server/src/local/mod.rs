//! The same-host data plane: a Unix-domain socket beside the HTTP port,
//! where an engine on this host registers memory and has blocks copied
//! into and out of it (docs/LOCAL.md).
//!
//! - `proto`: frames, operations, codes (pure decoding and encoding);
//! - `region`: a registered buffer, mapped or reached with `pread`/`pwrite`;
//! - `conn`: one connection (reader, per-request tasks, writer);
//! - `revoke`: when a client gives up, no copy into or out of its memory;
//! - here: the socket's set-up (path checks, a stale socket replaced, mode
//!   0660), the peer check (`SO_PEERCRED`) and each shard's accept loop.
//!
//! Every shard accepts on the same listening socket, so connections spread
//! over the shards; a request is served on the shard that accepted it and
//! its items go to the shards owning their keys through the same [`Store`]
//! calls as HTTP.

pub(crate) mod conn;
pub(crate) mod guard;
mod inbox;
mod lease;
mod lease_table;
mod ops;
pub(crate) mod proto;
pub mod region;
mod revoke;
mod session;
mod watch;

pub use lease::{LeaseCounters, LEASES_PER_CONNECTION_MAX, LEASE_MS_DEFAULT};
pub use ops::{parse_hello, Hello};

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use glommio::sync::Semaphore;
use serde_json::{json, Value};

use crate::limits::CONNECTIONS_PER_SHARD_MAX;
use crate::metrics::RequestStats;
use crate::service::Service;

/// Bytes a Unix socket address holds for the path (`sun_path` is 108
/// bytes, one for the terminating NUL).
pub const SOCKET_PATH_BYTES_MAX: usize = 107;

/// Command-line settings of the local socket.
#[derive(clap::Args, Debug, Clone)]
pub struct LocalArgs {
    /// Unix socket of the same-host data plane (docs/LOCAL.md): engines on
    /// this host register shared memory and have blocks copied into and
    /// out of it. Default `<data-dir>/kvtier.sock` (off, with a warning,
    /// when that is over the 107 bytes a socket path holds); `none` turns
    /// it off.
    /// Created mode 0660; a stale socket left by a killed server is
    /// replaced; one another server answers on is an error.
    #[arg(long, value_name = "PATH|none")]
    pub local_socket: Option<String>,
    /// Also accept local peers running as this uid (repeatable); the
    /// server's own uid is always accepted. Checked with SO_PEERCRED.
    #[arg(long, value_name = "UID")]
    pub local_allow_uid: Vec<u32>,
    /// Also accept local peers whose primary gid is this (repeatable).
    #[arg(long, value_name = "GID")]
    pub local_allow_gid: Vec<u32>,
    /// How long a lease lasts unless its client releases it first, in ms
    /// (docs/LOCAL.md, "Leases"): past it the server may reuse the leased
    /// RAM slot, and a client that checks the slot's generation after
    /// reading sees that it changed. Keeps a stuck client from pinning the
    /// RAM tier.
    #[arg(long, default_value_t = LEASE_MS_DEFAULT, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_ms: u64,
}

/// The local socket and what every shard's accept loop shares.
pub struct LocalShared {
    /// Where the socket is.
    pub path: PathBuf,
    listener: UnixListener,
    uid: u32,
    allow_uids: Vec<u32>,
    allow_gids: Vec<u32>,
    /// Drawn at start-up; a client seeing another one after reconnecting
    /// talks to a restarted server.
    pub epoch: u64,
    /// Per-op request counters, apart from HTTP's.
    pub stats: Arc<RequestStats>,
    /// Registrations held now, over all connections.
    pub registrations_open: AtomicU64,
    /// Registrations made since start.
    pub registrations_total: AtomicU64,
    /// Bytes of the registrations held now.
    pub registered_bytes: AtomicU64,
    /// Bytes of registered regions the server mapped ahead since start
    /// ([`region::Region::map_ahead`]: the pages the client's file held).
    pub registered_bytes_mapped_ahead: AtomicU64,
    /// Connections closed for a framing error.
    pub frame_errors: AtomicU64,
    /// Peers refused by the uid/gid check.
    pub peers_refused: AtomicU64,
    /// `GET_INTO`/`PUT_FROM` items (vectored ones too) dropped `CANCELLED`
    /// because their client had given up on the memory (docs/LOCAL.md, "When
    /// a client gives up").
    pub items_cancelled: AtomicU64,
    /// The HTTP address, once bound, for the HELLO (where `/v1/stats` is).
    pub http_addr: std::sync::OnceLock<std::net::SocketAddr>,
    /// How long a lease lasts (`--lease-ms`).
    pub lease_ms: u64,
    /// Leases over all connections.
    pub leases: LeaseCounters,
}

impl LocalArgs {
    /// The socket path these settings ask for (`None`: off).
    pub fn path(&self, data_dir: &Path) -> Option<PathBuf> {
        match self.local_socket.as_deref() {
            Some("none") => None,
            Some(p) => Some(PathBuf::from(p)),
            None => Some(data_dir.join("kvtier.sock")),
        }
    }

    /// Binds the socket (see [`bind`]) and makes the shared state.
    ///
    /// # Errors
    /// As [`bind`].
    pub fn open(&self, data_dir: &Path, shards: usize) -> Result<Option<Arc<LocalShared>>, String> {
        let Some(path) = self.path(data_dir) else { return Ok(None) };
        // Absolute, so `/v1/stats` tells clients in any directory where it is.
        let path = std::path::absolute(&path).map_err(|e| format!("--local-socket {}: {e}", path.display()))?;
        if self.local_socket.is_none() && path.as_os_str().len() > SOCKET_PATH_BYTES_MAX {
            tracing::warn!(
                "the default local socket {} is over the {SOCKET_PATH_BYTES_MAX} bytes a Unix socket path holds; the same-host data plane is off (give --local-socket a shorter path to turn it on)",
                path.display()
            );
            return Ok(None);
        }
        let listener = bind(&path)?;
        Ok(Some(Arc::new(LocalShared {
            path,
            listener,
            // SAFETY: getuid has no preconditions.
            uid: unsafe { libc::getuid() },
            allow_uids: self.local_allow_uid.clone(),
            allow_gids: self.local_allow_gid.clone(),
            epoch: random_epoch(),
            stats: RequestStats::new(shards, &proto::ROUTE_NAMES),
            registrations_open: AtomicU64::new(0),
            registrations_total: AtomicU64::new(0),
            registered_bytes: AtomicU64::new(0),
            registered_bytes_mapped_ahead: AtomicU64::new(0),
            frame_errors: AtomicU64::new(0),
            peers_refused: AtomicU64::new(0),
            items_cancelled: AtomicU64::new(0),
            http_addr: std::sync::OnceLock::new(),
            lease_ms: self.lease_ms,
            leases: LeaseCounters::default(),
        })))
    }
}

fn random_epoch() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok() {
        return u64::from_le_bytes(b) | 1;
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (now.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)) | 1
}

/// Creates the listening socket at `path`, mode 0660, non-blocking.
///
/// # Errors
/// A path over [`SOCKET_PATH_BYTES_MAX`] bytes; a path that exists and is
/// not a socket; a socket another server answers a hello on; bind errors.
pub fn bind(path: &Path) -> Result<UnixListener, String> {
    let len = path.as_os_str().len();
    if len > SOCKET_PATH_BYTES_MAX {
        return Err(format!(
            "--local-socket {} is {len} bytes; a Unix socket path holds at most {SOCKET_PATH_BYTES_MAX} (pick a shorter path, or `none`)",
            path.display()
        ));
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(format!("--local-socket {} exists and is not a socket; not removing it", path.display()));
        }
        Ok(_) if answers_hello(path) => {
            return Err(format!("another kvtier server is serving on --local-socket {} (is another kvtier running?)", path.display()));
        }
        Ok(_) => {
            tracing::info!("replacing the stale socket {} (left by a server that is gone)", path.display());
            std::fs::remove_file(path).map_err(|e| format!("removing the stale socket {}: {e}", path.display()))?;
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(|e| format!("cannot listen on --local-socket {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(|e| format!("chmod 0660 {}: {e}", path.display()))?;
    listener.set_nonblocking(true).map_err(|e| format!("--local-socket {}: {e}", path.display()))?;
    Ok(listener)
}

/// Whether a server answers a hello on `path` within half a second. A
/// socket file that refuses connections is stale; so is one that accepts
/// but never answers (a killed server's io_uring can keep its listener
/// accepting for about a second after exit).
fn answers_hello(path: &Path) -> bool {
    let Ok(mut s) = UnixStream::connect(path) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let payload = br#"{"versions":[1],"client":"kvtier start-up probe"}"#;
    let header = proto::Header { op: proto::Op::Hello as u8, payload_bytes: payload.len() as u32, request_id: 0 };
    if s.write_all(&header.encode()).and_then(|_| s.write_all(payload)).is_err() {
        return false;
    }
    let mut reply = [0u8; proto::HEADER_BYTES];
    s.read_exact(&mut reply).is_ok() && proto::Header::decode(&reply).is_ok()
}

/// The same-host door's part of `/metrics` (`kvtier_local_*`) and
/// `/v1/stats` (`local`): the socket's counters when it is on.
impl crate::metrics::Door for LocalShared {
    fn name(&self) -> &'static str {
        "local"
    }

    fn put_bytes_refusals(&self) -> u64 {
        self.stats.put_bytes_refusals()
    }

    fn write_metrics(&self, registry: &mut kvtier_engine::latency::Scrape<'_>, durations: &mut crate::metrics::Durations) {
        use prometheus_client::metrics::{counter::ConstCounter, gauge::ConstGauge};
        let gauge = |v: u64| ConstGauge::new(v as i64);
        self.stats.write_metrics(registry, durations, "local", "Local-socket requests", "Block bytes", "PUT_FROM items refused OVERLOADED");
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        registry.register("local_registrations_open", "Buffers registered on the local socket now", gauge(load(&self.registrations_open)));
        registry.register("local_registered_bytes", "Bytes of the buffers registered now", gauge(load(&self.registered_bytes)));
        registry.register("local_registrations", "Buffers registered since start", ConstCounter::new(load(&self.registrations_total)));
        registry.register(
            "local_registered_bytes_mapped_ahead",
            "Bytes of registered buffers the server mapped in its page tables at registration (the pages the client held), so copies take no page faults",
            ConstCounter::new(load(&self.registered_bytes_mapped_ahead)),
        );
        registry.register(
            "local_frame_errors",
            "Local connections closed for a framing error",
            ConstCounter::new(load(&self.frame_errors)),
        );
        registry.register(
            "local_items_cancelled",
            "GET_INTO/PUT_FROM items that copied nothing (and stored nothing) because their client had given up on its memory",
            ConstCounter::new(load(&self.items_cancelled)),
        );
        registry.register(
            "local_peers_refused",
            "Local peers refused by the SO_PEERCRED uid/gid check",
            ConstCounter::new(load(&self.peers_refused)),
        );
        let leases = &self.leases;
        registry.register(
            "local_leases_open",
            "Leases held on the local socket now (RAM slots pinned for clients)",
            gauge(load(&leases.open)),
        );
        registry.register("local_leases_granted", "Leases granted since start", ConstCounter::new(load(&leases.granted)));
        registry.register("local_leases_released", "Leases ended by RELEASE", ConstCounter::new(load(&leases.released)));
        registry.register("local_leases_expired", "Leases ended by --lease-ms", ConstCounter::new(load(&leases.expired)));
        registry.register(
            "local_leases_dropped_at_close",
            "Leases ended by their connection closing",
            ConstCounter::new(load(&leases.dropped_at_close)),
        );
        registry.register(
            "local_sigbus_caught",
            "Copies that met a client's buffer file shrunk under the server's mapping (SIGBUS caught; that registration is lost)",
            ConstCounter::new(guard::faults_caught()),
        );
    }

    fn stats_json(&self) -> Value {
        json!({
            "socket": self.path.display().to_string(),
            "epoch": self.epoch,
            "registrations_open": self.registrations_open.load(Ordering::Relaxed),
            "registrations_total": self.registrations_total.load(Ordering::Relaxed),
            "registered_bytes": self.registered_bytes.load(Ordering::Relaxed),
            "registered_bytes_mapped_ahead_total": self.registered_bytes_mapped_ahead.load(Ordering::Relaxed),
            "frame_errors": self.frame_errors.load(Ordering::Relaxed),
            "peers_refused": self.peers_refused.load(Ordering::Relaxed),
            "items_cancelled_total": self.items_cancelled.load(Ordering::Relaxed),
            "sigbus_caught": guard::faults_caught(),
            "leases": self.leases.json(self.lease_ms),
            "routes": self.stats.routes_json(),
            "per_shard": self.stats.shards_json(),
        })
    }
}

/// The same-host door when `--local-socket` is off: `/v1/stats` shows
/// `"local": {"socket": null}`, `/metrics` nothing.
pub struct LocalOff;

impl crate::metrics::Door for LocalOff {
    fn name(&self) -> &'static str {
        "local"
    }

    fn put_bytes_refusals(&self) -> u64 {
        0
    }

    fn write_metrics(&self, _: &mut kvtier_engine::latency::Scrape<'_>, _: &mut crate::metrics::Durations) {}

    fn stats_json(&self) -> Value {
        json!({ "socket": null })
    }
}

/// The peer's uid, gid and pid (`SO_PEERCRED`).
fn peer_credentials(s: &UnixStream) -> std::io::Result<libc::ucred> {
    // SAFETY: getsockopt into a zeroed ucred of the size passed.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc =
        unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred)
}

impl LocalShared {
    /// Why a peer is refused, if it is: it is let in as the server's uid,
    /// an allowed uid or gid, or a uid a tenant lists (`tenancy`).
    fn refuse(&self, c: &libc::ucred, tenancy: Option<&crate::tenants::Tenancy>) -> Option<String> {
        let a_tenant = tenancy.is_some_and(|t| t.table().by_uid(c.uid).is_some());
        if c.uid == self.uid || self.allow_uids.contains(&c.uid) || self.allow_gids.contains(&c.gid) || a_tenant {
            return None;
        }
        Some(format!(
            "peer uid {} gid {} (pid {}) is not allowed on this socket: the server runs as uid {} (add --local-allow-uid {} or --local-allow-gid {})",
            c.uid, c.gid, c.pid, self.uid, c.uid, c.gid
        ))
    }
}

/// Accepts local connections on this shard until shutdown.
pub async fn serve_shard(service: Rc<Service>, local: Arc<LocalShared>) {
    let fd = local.listener.as_raw_fd();
    let shard = service.store.shard_id();
    let connections = Rc::new(Semaphore::new(CONNECTIONS_PER_SHARD_MAX));
    let watching = glommio::spawn_local(watch::watch(shard));
    loop {
        let accepted = match local.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let woke = futures_lite::future::or(async { Some(glommio::executor().wait_readable(fd).await) }, async {
                    service.shutdown.requested().await;
                    None
                })
                .await;
                if woke.is_none() {
                    break;
                }
                continue;
            }
            Err(e) => {
                tracing::warn!(shard, "local accept failed: {e}");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(permit) = connections.clone().try_acquire_static_permit(1) else {
            tracing::warn!(shard, "local connection refused: {CONNECTIONS_PER_SHARD_MAX} open on this shard");
            continue;
        };
        if accepted.set_nonblocking(true).is_err() {
            continue;
        }
        let (refusal, peer_uid) = match peer_credentials(&accepted) {
            Ok(c) => (local.refuse(&c, service.access.tenancy().map(|t| &**t)), c.uid),
            Err(e) => (Some(format!("cannot read the peer's credentials: {e}")), u32::MAX),
        };
        if let Some(why) = refusal {
            local.peers_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(shard, "local socket: {why}");
            let frame = proto::response(proto::OP_CONNECTION_ERROR, 0, proto::Code::Unauthorized as i32, 0, why.as_bytes());
            // Small enough for the socket buffer of a new connection.
            let _ = (&accepted).write_all(&frame);
            continue;
        }
        let stats = local.stats.clone();
        stats.shard(shard).connections_open.fetch_add(1, Ordering::Relaxed);
        stats.shard(shard).connections_total.fetch_add(1, Ordering::Relaxed);
        let (service, local) = (service.clone(), local.clone());
        glommio::spawn_local(async move {
            conn::serve(accepted, peer_uid, service, local).await;
            stats.shard(shard).connections_open.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        })
        .detach();
    }
    // Connections still draining are not watched any more.
    drop(watching);
}
