//! `kvtier-http-reference`: a bare HTTP block server, the yardstick
//! `make bench-http` measures kvtier's HTTP path against.
//!
//! It speaks the block routes of docs/API.md that a transfer benchmark
//! uses (`PUT`, `GET`, `HEAD` and `DELETE /v1/blocks/{key}`, and
//! `GET /v1/stats` with the block geometry the loadgen asks for) on the same
//! plumbing as `kvtier serve`: hyper on glommio executors pinned one per
//! CPU, connections spread by `SO_REUSEPORT`, the same connection builder
//! (`kvtier_server::server::builder`: HTTP/2 windows, 1 MiB frames, stream
//! limits) and the same vectored socket writes. Behind the routes there is
//! no store: a PUT's body is gathered into one buffer in a map shared by
//! every executor, and a GET answers with that buffer, no copy. No
//! durability, no tiers, no CRC, no key validation beyond UTF-8, no auth.
//!
//! So kvtier's RAM-tier GET (also one buffer, no copy) against this
//! server's GET, on the same client and in the same minute, is the cost of
//! everything kvtier does per request beyond HTTP: routing to the owning
//! shard, the index and tier lookups, metrics, limits.
//!
//! A PUT answers 201 (new key) or 200 (replaced), as kvtier's does; one
//! of other than `--block-bytes` is refused with 400, as kvtier refuses one. It holds at most `--capacity-mib` of blocks, in buffers
//! allocated and faulted in at start (as kvtier's RAM tier is), so a PUT
//! costs HTTP and one copy, not page faults: a PUT past the capacity
//! reuses the oldest block's buffer (first in, first out), as a cache
//! would. Stop it with SIGTERM or SIGINT.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{mpsc, Arc, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use clap::Parser;
use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvtier_server::http::GlommioIo;
use kvtier_server::server::builder;

kvtier_engine::jemalloc_with_huge_pages!();

/// A bare HTTP block server (blocks in a map in memory; no durability, no
/// tiers), the yardstick `make bench-http` measures kvtier's HTTP path
/// against. Routes: PUT, GET, HEAD and DELETE /v1/blocks/{key}.
#[derive(Parser, Debug)]
#[command(name = "kvtier-http-reference", version)]
struct Cli {
    /// Address to listen on (port 0 picks a free one; the address taken is
    /// printed as `listening on http://ADDR`).
    #[arg(long, default_value = "127.0.0.1:8086")]
    listen: SocketAddr,
    /// Executors (threads), each pinned to CPU `i mod cpus` and accepting
    /// on the same port, as kvtier's shards do.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Block size in bytes: a PUT of another length gets 400.
    #[arg(long, default_value_t = 16 << 20)]
    block_bytes: u64,
    /// Most block bytes held, in MiB (2^20 bytes); a PUT past it drops the
    /// oldest blocks.
    #[arg(long, default_value_t = 2048)]
    capacity_mib: u64,
}

/// The blocks, shared by every executor.
struct Blocks {
    map: RwLock<Held>,
}

/// Blocks by key, the order they came in, and the buffers not holding one.
struct Held {
    blocks: HashMap<String, Bytes>,
    order: VecDeque<String>,
    free: Vec<BytesMut>,
}

impl Blocks {
    /// `capacity_blocks` buffers of `block_bytes`, each written once so
    /// its pages are in memory before the first PUT.
    fn new(block_bytes: usize, capacity_blocks: usize) -> Self {
        let free = (0..capacity_blocks)
            .map(|_| {
                let mut b = BytesMut::with_capacity(block_bytes);
                b.resize(block_bytes, 0xA5);
                b.clear();
                b
            })
            .collect();
        Blocks { map: RwLock::new(Held { blocks: HashMap::new(), order: VecDeque::new(), free }) }
    }

    /// A buffer for a new block: a free one, else the oldest block's
    /// (dropped from the map), else (every old buffer still being sent) a
    /// new one.
    fn buffer(&self, block_bytes: usize) -> BytesMut {
        let mut held = self.map.write().expect("blocks lock");
        if let Some(b) = held.free.pop() {
            return b;
        }
        while let Some(oldest) = held.order.pop_front() {
            if let Some(b) = held.blocks.remove(&oldest) {
                if let Ok(mut b) = b.try_into_mut() {
                    b.clear();
                    return b;
                }
                break;
            }
        }
        BytesMut::with_capacity(block_bytes)
    }
}

type Reply = Response<Full<Bytes>>;

fn status(code: StatusCode) -> Reply {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = code;
    r
}

/// Limits of a [`Blocks`] map.
#[derive(Clone, Copy)]
struct Limits {
    block_bytes: u64,
    capacity_bytes: u64,
    shards: usize,
}

async fn handle(blocks: Arc<Blocks>, limits: Limits, req: Request<Incoming>) -> Result<Reply, Infallible> {
    if req.uri().path() == "/v1/stats" {
        let held = blocks.map.read().expect("blocks lock");
        let stats = serde_json::json!({
            "server": "kvtier-http-reference",
            "shards": limits.shards,
            "geometry": {"block_bytes": limits.block_bytes, "block_tokens": 0, "model": "none"},
            "totals": {"blocks": held.blocks.len(), "capacity_bytes": limits.capacity_bytes},
        });
        return Ok(Response::new(Full::new(Bytes::from(stats.to_string()))));
    }
    let Some(key) = req.uri().path().strip_prefix("/v1/blocks/").filter(|k| !k.is_empty()).map(str::to_string) else {
        return Ok(status(StatusCode::NOT_FOUND));
    };
    let reply = match *req.method() {
        Method::GET | Method::HEAD => {
            let found = blocks.map.read().expect("blocks lock").blocks.get(&key).cloned();
            match found {
                Some(b) if req.method() == Method::HEAD => {
                    let mut r = status(StatusCode::OK);
                    r.headers_mut().insert(http::header::CONTENT_LENGTH, b.len().into());
                    r
                }
                Some(b) => Response::new(Full::new(b)),
                None => status(StatusCode::NOT_FOUND),
            }
        }
        Method::PUT => {
            let mut frames = Vec::new();
            let mut body = req.into_body();
            while let Some(frame) = body.frame().await {
                match frame.map(|f| f.into_data()) {
                    Ok(Ok(data)) => frames.push(data),
                    Ok(Err(_)) => {}
                    Err(_) => return Ok(status(StatusCode::BAD_REQUEST)),
                }
            }
            if frames.iter().map(|f| f.len() as u64).sum::<u64>() != limits.block_bytes {
                return Ok(status(StatusCode::BAD_REQUEST));
            }
            let mut buffer = blocks.buffer(limits.block_bytes as usize);
            for f in &frames {
                buffer.extend_from_slice(f);
            }
            let mut held = blocks.map.write().expect("blocks lock");
            match held.blocks.insert(key.clone(), buffer.freeze()) {
                Some(old) => {
                    if let Ok(mut b) = old.try_into_mut() {
                        b.clear();
                        held.free.push(b);
                    }
                    status(StatusCode::OK)
                }
                None => {
                    held.order.push_back(key);
                    status(StatusCode::CREATED)
                }
            }
        }
        Method::DELETE => {
            let mut held = blocks.map.write().expect("blocks lock");
            match held.blocks.remove(&key) {
                Some(old) => {
                    held.order.retain(|k| *k != key);
                    if let Ok(mut b) = old.try_into_mut() {
                        b.clear();
                        held.free.push(b);
                    }
                    status(StatusCode::NO_CONTENT)
                }
                None => status(StatusCode::NOT_FOUND),
            }
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED),
    };
    Ok(reply)
}

/// Accepts and serves connections on one executor, forever.
async fn serve(listener: TcpListener, blocks: Arc<Blocks>, limits: Limits) {
    let builder = builder(Duration::from_secs(10));
    loop {
        let stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvtier-http-reference: accept failed: {e}");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let blocks = blocks.clone();
        let service = hyper::service::service_fn(move |req| handle(blocks.clone(), limits, req));
        let conn = builder.serve_connection(GlommioIo::new(stream), service).into_owned();
        glommio::spawn_local(async move {
            let _ = conn.await;
        })
        .detach();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.shards == 0 {
        eprintln!("kvtier-http-reference: --shards must be at least 1");
        return ExitCode::from(2);
    }
    let limits = Limits { block_bytes: cli.block_bytes, capacity_bytes: cli.capacity_mib << 20, shards: cli.shards };
    if cli.block_bytes == 0 || limits.capacity_bytes < cli.block_bytes {
        eprintln!("kvtier-http-reference: --capacity-mib must hold at least one block of --block-bytes (> 0)");
        return ExitCode::from(2);
    }
    let blocks = Arc::new(Blocks::new(cli.block_bytes as usize, (limits.capacity_bytes / cli.block_bytes) as usize));
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let (bound_tx, bound_rx) = mpsc::channel::<Result<SocketAddr, String>>();
    let mut addr = cli.listen;
    let mut executors = Vec::new();
    for shard in 0..cli.shards {
        let (blocks, bound_tx) = (blocks.clone(), bound_tx.clone());
        let spawned =
            LocalExecutorBuilder::new(Placement::Fixed(shard % cpus)).name(&format!("reference-{shard}")).spawn(move || async move {
                match TcpListener::bind(addr).and_then(|l| l.local_addr().map(|a| (l, a))) {
                    Ok((listener, bound)) => {
                        let _ = bound_tx.send(Ok(bound));
                        serve(listener, blocks, limits).await;
                    }
                    Err(e) => {
                        let _ = bound_tx.send(Err(format!("cannot listen on {addr}: {e}")));
                    }
                }
            });
        match spawned.map_err(|e| e.to_string()).and_then(|h| bound_rx.recv().map(|b| (h, b)).map_err(|e| e.to_string())) {
            // Every later executor binds the port the first one got.
            Ok((h, Ok(bound))) => {
                addr = bound;
                executors.push(h);
            }
            Ok((_, Err(e))) | Err(e) => {
                eprintln!("kvtier-http-reference: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "kvtier-http-reference listening on http://{addr} (h2c and HTTP/1.1; {} executors; block_bytes {}; capacity {} MiB)",
        cli.shards, cli.block_bytes, cli.capacity_mib
    );
    for h in executors {
        let _ = h.join();
    }
    ExitCode::SUCCESS
}
