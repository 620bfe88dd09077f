//! The per-shard accept loop: every shard accepts on its own socket on the
//! one port (`SO_REUSEPORT`, so the kernel spreads connections across the
//! shards) and serves HTTP/2 with prior knowledge or HTTP/1.1, detected
//! per connection from the first bytes.

use std::cell::Cell;
use std::os::unix::io::{AsRawFd, FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::net::TcpListener;
use glommio::sync::Semaphore;
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;

use super::io::{GlommioIo, GlommioTimer, LocalExec};
use super::Ctx;
use crate::limits;
use crate::metrics::RequestStats;

/// The HTTP front door's settings, the same for every shard.
pub struct HttpConfig {
    /// The block API's listening sockets, one per shard (bound by `kvtier
    /// serve` with `SO_REUSEPORT` under the port's lock; port 0 picks a
    /// free one).
    pub listeners: Vec<std::net::TcpListener>,
    /// Request metrics of every shard.
    pub stats: Arc<RequestStats>,
    /// Close a connection after this long without a request in flight.
    pub idle_timeout: Duration,
    /// HTTP/1 request headers must arrive within this.
    pub header_timeout: Duration,
    /// A request body must arrive within this (else 408).
    pub body_timeout: Duration,
}

/// What a connection's watchdog needs to know about its use.
#[derive(Default)]
struct ConnUse {
    in_flight: Cell<u32>,
    /// When the last request finished (or the connection opened).
    last: Cell<Option<Instant>>,
    closed: Cell<bool>,
}

/// Closes the connection's socket once it has had no request in flight for
/// `idle`. Runs on the connection's executor, so the `closed` check and the
/// `shutdown(2)` cannot be separated by the fd's reuse.
async fn idle_watchdog(fd: std::os::unix::io::RawFd, usage: Rc<ConnUse>, idle: Duration) {
    let tick = (idle / 4).max(Duration::from_millis(50));
    loop {
        glommio::timer::sleep(tick).await;
        if usage.closed.get() {
            return;
        }
        let quiet = usage.last.get().is_some_and(|t| t.elapsed() >= idle);
        if usage.in_flight.get() == 0 && quiet {
            tracing::debug!(fd, "closing connection idle for {idle:?}");
            // SAFETY: the connection task still owns this open fd (not
            // `closed`); shutdown only ends the stream, the task closes it.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            return;
        }
    }
}

/// The hyper connection builder of every shard: HTTP/1.1 with the header
/// timeout, HTTP/2 with the windows, frame size and stream limits of
/// [`limits`]. The reference server (`kvtier-http-reference`) serves with
/// the same builder, so the two differ only in what answers a request.
pub fn builder(header_timeout: Duration) -> auto::Builder<LocalExec> {
    let mut b = auto::Builder::new(LocalExec);
    b.http1()
        .timer(GlommioTimer)
        .header_read_timeout(header_timeout)
        .max_buf_size(limits::HEADER_BYTES_MAX as usize + (64 << 10))
        .keep_alive(true);
    b.http2()
        .timer(GlommioTimer)
        .max_concurrent_streams(limits::H2_STREAMS_MAX)
        .initial_stream_window_size(limits::H2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(limits::H2_CONNECTION_WINDOW_BYTES)
        .adaptive_window(false)
        .max_frame_size(limits::H2_FRAME_BYTES_MAX)
        .max_send_buf_size(limits::H2_SEND_BUFFER_BYTES)
        .max_header_list_size(limits::HEADER_BYTES_MAX)
        .keep_alive_interval(limits::H2_KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(limits::H2_KEEP_ALIVE_TIMEOUT);
    b
}

/// Shard `shard`'s listener: its own socket of [`HttpConfig::listeners`]
/// (a duplicate of it), accepted from on this shard's ring.
pub fn shard_listener(config: &HttpConfig, shard: usize) -> Result<TcpListener, String> {
    let socket = config.listeners.get(shard).ok_or_else(|| format!("no listening socket for shard {shard}"))?;
    let fd = socket.try_clone().map_err(|e| format!("cannot duplicate the listening socket: {e}"))?;
    // SAFETY: a bound, listening TCP socket this shard now owns.
    Ok(unsafe { TcpListener::from_raw_fd(fd.into_raw_fd()) })
}

/// Serves HTTP on this shard's `listener` until shutdown is requested,
/// then drains in-flight connections for up to [`limits::SHUTDOWN_GRACE`].
pub async fn serve(ctx: Rc<Ctx>, listener: TcpListener, config: &HttpConfig) {
    let store = ctx.service.store.clone();
    let shutdown = ctx.service.shutdown.clone();
    let shard_id = store.shard_id();
    let builder = builder(config.header_timeout);
    let graceful = GracefulShutdown::new();
    let connections = Rc::new(Semaphore::new(limits::CONNECTIONS_PER_SHARD_MAX));
    loop {
        let permit = match futures_lite::future::or(async { Some(connections.acquire_static_permit(1).await) }, async {
            shutdown.requested().await;
            None
        })
        .await
        {
            Some(Ok(p)) => p,
            _ => break,
        };
        let accepted = futures_lite::future::or(async { Some(listener.accept().await) }, async {
            shutdown.requested().await;
            None
        })
        .await;
        let stream = match accepted {
            None => break,
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                // EMFILE and friends: back off rather than spin.
                tracing::warn!(shard = store.shard_id(), "accept failed: {e}");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let stats = ctx.http.clone();
        stats.shard(shard_id).connections_open.fetch_add(1, Ordering::Relaxed);
        stats.shard(shard_id).connections_total.fetch_add(1, Ordering::Relaxed);
        let ctx = ctx.clone();
        let usage = Rc::new(ConnUse::default());
        usage.last.set(Some(Instant::now()));
        glommio::spawn_local(idle_watchdog(stream.as_raw_fd(), usage.clone(), config.idle_timeout)).detach();
        let closing = usage.clone();
        let service = hyper::service::service_fn(move |req| {
            let (ctx, usage) = (ctx.clone(), usage.clone());
            async move {
                usage.in_flight.set(usage.in_flight.get() + 1);
                let reply = super::routes::handle(ctx, req).await;
                usage.in_flight.set(usage.in_flight.get() - 1);
                usage.last.set(Some(Instant::now()));
                reply
            }
        });
        let conn = builder.serve_connection(GlommioIo::new(stream), service).into_owned();
        let watched = graceful.watcher().watch(conn);
        glommio::spawn_local(async move {
            if let Err(e) = watched.await {
                tracing::debug!("connection closed with error: {e}");
            }
            closing.closed.set(true);
            drop(permit);
            stats.shard(shard_id).connections_open.fetch_sub(1, Ordering::Relaxed);
        })
        .detach();
    }
    drop(listener);
    let drained = futures_lite::future::or(
        async {
            graceful.shutdown().await;
            true
        },
        async {
            glommio::timer::sleep(limits::SHUTDOWN_GRACE).await;
            false
        },
    )
    .await;
    if !drained {
        tracing::warn!(shard = store.shard_id(), "connections still open after {:?}; closing anyway", limits::SHUTDOWN_GRACE);
    }
}
