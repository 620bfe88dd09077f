//! What one shard runs, composed: its [`Service`] and, over it, each front
//! door — the HTTP accept loop and, when on, the same-host socket — plus
//! shard 0's tenants-reload task. Neither door knows the other; a new door
//! (leases) is one more spawn here. The KV event publisher runs on a thread
//! of its own (`crate::events`) and is here only as a metrics door.

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{mpsc, Arc, Mutex, OnceLock};

use kvtier_engine::Store;

use crate::http::accept::{self, HttpConfig};
use crate::http::Ctx;
use crate::local::LocalShared;
use crate::metrics::{Metrics, Parts};
use crate::service::{Access, Service, Shutdown};
use crate::tenants::Tenancy;

/// What every shard shares with the others and with the main thread.
pub struct Process {
    /// Bearer token, with `--auth-token-file`.
    pub auth_token: Option<Arc<[u8]>>,
    /// Tenants, with `--tenants`: callers, key scopes, quotas.
    pub tenancy: Option<Arc<Tenancy>>,
    /// Set by the signal handler (or a failed start): stop and drain.
    pub shutdown: Arc<Shutdown>,
    /// PUT body bytes each shard admits at once (`--put-inflight-mib`).
    pub put_budget_bytes: u64,
    /// The HTTP front door.
    pub http: HttpConfig,
    /// The same-host front door's socket, when on (`--local-socket`).
    pub local: Option<Arc<LocalShared>>,
    /// The KV event publisher, when on (`--kv-events`): the engine hands it
    /// events itself (`StoreConfig::events`); here it is only a
    /// [`crate::metrics::Door`].
    pub events: Option<Arc<crate::events::Publisher>>,
    /// The Prometheus registry, built once by the first shard to serve
    /// (every shard's store has the same geometry and remote tier).
    pub metrics: OnceLock<Arc<Metrics>>,
    /// Every shard's stall counters, with `--stall-threshold-ms` above 0.
    pub stalls: Option<Arc<kvtier_engine::stall::Stalls>>,
    /// Each shard reports here once it accepts, or why it cannot.
    pub ready: Mutex<mpsc::Sender<Result<SocketAddr, String>>>,
}

impl Process {
    fn report(&self, r: Result<SocketAddr, String>) {
        let _ = self.ready.lock().expect("ready lock").send(r);
    }
}

/// Serves this shard until shutdown: builds its service, starts the
/// front doors over it, and returns once HTTP has drained.
pub async fn serve(store: Rc<Store>, process: Arc<Process>) {
    let listener = match accept::shard_listener(&process.http, store.shard_id()) {
        Ok(l) => l,
        Err(e) => return process.report(Err(e)),
    };
    match listener.local_addr() {
        Ok(a) => process.report(Ok(a)),
        Err(e) => return process.report(Err(e.to_string())),
    }
    let metrics = process
        .metrics
        .get_or_init(|| {
            let local: Arc<dyn crate::metrics::Door> = match &process.local {
                Some(l) => l.clone(),
                None => Arc::new(crate::local::LocalOff),
            };
            let events: Arc<dyn crate::metrics::Door> = match &process.events {
                Some(p) => p.clone(),
                None => Arc::new(crate::events::EventsOff),
            };
            Metrics::new(Parts {
                doors: vec![Arc::new(crate::http::HttpDoor(process.http.stats.clone())), local, events],
                geometry: store.geometry().clone(),
                remote: store.remote().cloned(),
                tenancy: process.tenancy.clone(),
                stalls: process.stalls.clone(),
            })
        })
        .clone();
    let access = Access::new(process.auth_token.clone(), process.tenancy.clone());
    let service = Rc::new(Service::new(store.clone(), access, process.put_budget_bytes, process.shutdown.clone()));
    if let (Some(tenancy), 0) = (&process.tenancy, store.shard_id()) {
        glommio::spawn_local(crate::http::admin::watch_reloads(service.clone(), tenancy.clone())).detach();
    }
    if let Some(local) = &process.local {
        glommio::spawn_local(crate::local::serve_shard(service.clone(), local.clone())).detach();
    }
    let ctx = Rc::new(Ctx { service, metrics, http: process.http.stats.clone(), body_timeout: process.http.body_timeout });
    accept::serve(ctx, listener, &process.http).await;
}
