//! `kvtier-http-reference`: a bare HTTP block server, the yardstick
//! `make bench-http` measures kvtier's HTTP path against.
//!
//! It speaks the block routes of docs/API.md that a transfer benchmark
//! uses (`PUT`, `GET`, `HEAD` and `DELETE /v1/blocks/{key}`, and
//! `GET /v1/stats` with the block geometry the loadgen asks for) on the same
//! plumbing as `kvtier serve`: hyper on glommio executors pinned one per
//! CPU, connections spread by `SO_REUSEPORT`, the same connection builder
//! (`kvtier_server::http::builder`: HTTP/2 windows, 1 MiB frames, stream
//! limits) and the same vectored socket writes. Behind the routes there is
//! no store: a PUT's body is gathered into one buffer, and a GET answers
//! with that buffer, no copy. No durability, no tiers, no CRC, no key
//! validation beyond UTF-8, no auth.
//!
//! Each executor holds its own map of every block (the same buffers,
//! shared by reference count, not copied), and a GET is answered from the
//! map of the executor its connection is on: no hop to another executor
//! and no lock another GET takes. (Each map sits behind a lock of its own
//! that only PUTs and DELETEs from other executors ever contend for: a GET
//! takes its executor's read lock, a cache line no other GET touches.) A
//! PUT or DELETE updates every executor's map, one at a time under one
//! writers' mutex, before it answers, so a GET on any connection that
//! starts after the answer finds the block. Until issue 43 the executors
//! shared one `RwLock<HashMap>`, whose lock word every GET on every
//! executor wrote (kvtier beat that by up to 1.48×, so it was no floor);
//! forwarding each key to an owning executor, as kvtier does, would have
//! charged the reference kvtier's own hop. This way the reference's GET does
//! strictly less than kvtier's: it is the floor.
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
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use clap::Parser;
use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvtier_server::http::builder;
use kvtier_server::http::GlommioIo;

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

/// The blocks: one map per executor, each holding every block.
struct Blocks {
    /// Executor `i`'s map; its GETs read only this one.
    maps: Vec<Padded<RwLock<HashMap<String, Bytes>>>>,
    /// Held by a PUT or DELETE while it updates every map, so the maps
    /// change in the same order everywhere; GETs never take it.
    writers: Mutex<Writers>,
}

/// A lock on a cache line of its own, so one executor's GETs and another's
/// do not write the same line.
#[repr(align(128))]
struct Padded<T>(T);

/// The order blocks came in, and the buffers not holding one.
struct Writers {
    order: VecDeque<String>,
    free: Vec<BytesMut>,
}

impl Blocks {
    /// `capacity_blocks` buffers of `block_bytes`, each written once so
    /// its pages are in memory before the first PUT; `executors` empty maps.
    fn new(block_bytes: usize, capacity_blocks: usize, executors: usize) -> Self {
        let free = (0..capacity_blocks)
            .map(|_| {
                let mut b = BytesMut::with_capacity(block_bytes);
                b.resize(block_bytes, 0xA5);
                b.clear();
                b
            })
            .collect();
        Blocks {
            maps: (0..executors).map(|_| Padded(RwLock::new(HashMap::new()))).collect(),
            writers: Mutex::new(Writers { order: VecDeque::new(), free }),
        }
    }

    /// The block under `key` in executor `me`'s map.
    fn get(&self, me: usize, key: &str) -> Option<Bytes> {
        self.maps[me].0.read().expect("blocks lock").get(key).cloned()
    }

    /// Blocks held (every map holds the same ones).
    fn len(&self) -> usize {
        self.maps[0].0.read().expect("blocks lock").len()
    }

    /// Sets (`Some`) or removes (`None`) `key` in every map; returns its old
    /// block, its buffer back in `free` if no reply still holds it.
    fn update(&self, writers: &mut Writers, key: &str, block: Option<Bytes>) -> bool {
        let mut old = None;
        for map in &self.maps {
            let mut map = map.0.write().expect("blocks lock");
            // The same buffer in every map: the last one out is kept.
            old = match &block {
                Some(b) => map.insert(key.to_string(), b.clone()),
                None => map.remove(key),
            };
        }
        match old {
            Some(old) => {
                if let Ok(mut b) = old.try_into_mut() {
                    b.clear();
                    writers.free.push(b);
                }
                true
            }
            None => false,
        }
    }

    /// A buffer for a new block: a free one, else the oldest block's
    /// (dropped from every map), else (every old buffer still being sent) a
    /// new one.
    fn buffer(&self, writers: &mut Writers, block_bytes: usize) -> BytesMut {
        if let Some(b) = writers.free.pop() {
            return b;
        }
        while let Some(oldest) = writers.order.pop_front() {
            if self.update(writers, &oldest, None) {
                if let Some(b) = writers.free.pop() {
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

/// Answers `req` on executor `me`.
async fn handle(blocks: Arc<Blocks>, me: usize, limits: Limits, req: Request<Incoming>) -> Result<Reply, Infallible> {
    if req.uri().path() == "/v1/stats" {
        let stats = serde_json::json!({
            "server": "kvtier-http-reference",
            "shards": limits.shards,
            "geometry": {"block_bytes": limits.block_bytes, "block_tokens": 0, "model": "none"},
            "totals": {"blocks": blocks.len(), "capacity_bytes": limits.capacity_bytes},
        });
        return Ok(Response::new(Full::new(Bytes::from(stats.to_string()))));
    }
    let Some(key) = req.uri().path().strip_prefix("/v1/blocks/").filter(|k| !k.is_empty()).map(str::to_string) else {
        return Ok(status(StatusCode::NOT_FOUND));
    };
    let reply = match *req.method() {
        Method::GET | Method::HEAD => match blocks.get(me, &key) {
            Some(b) if req.method() == Method::HEAD => {
                let mut r = status(StatusCode::OK);
                r.headers_mut().insert(http::header::CONTENT_LENGTH, b.len().into());
                r
            }
            Some(b) => Response::new(Full::new(b)),
            None => status(StatusCode::NOT_FOUND),
        },
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
            // The copy is made outside the writers' mutex, into a buffer
            // taken under it.
            let mut buffer = {
                let mut writers = blocks.writers.lock().expect("writers lock");
                blocks.buffer(&mut writers, limits.block_bytes as usize)
            };
            for f in &frames {
                buffer.extend_from_slice(f);
            }
            let mut writers = blocks.writers.lock().expect("writers lock");
            let replaced = blocks.update(&mut writers, &key, Some(buffer.freeze()));
            // A replaced block is the newest again: it goes to the back of
            // the order, or a PUT of a new key could evict the block just
            // stored (it did, at 16 MiB with the loadgen's working set).
            if replaced {
                writers.order.retain(|k| *k != key);
            }
            writers.order.push_back(key);
            status(if replaced { StatusCode::OK } else { StatusCode::CREATED })
        }
        Method::DELETE => {
            let mut writers = blocks.writers.lock().expect("writers lock");
            if blocks.update(&mut writers, &key, None) {
                writers.order.retain(|k| *k != key);
                status(StatusCode::NO_CONTENT)
            } else {
                status(StatusCode::NOT_FOUND)
            }
        }
        _ => status(StatusCode::METHOD_NOT_ALLOWED),
    };
    Ok(reply)
}

/// Accepts and serves connections on one executor, forever.
async fn serve(listener: TcpListener, blocks: Arc<Blocks>, me: usize, limits: Limits) {
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
        let service = hyper::service::service_fn(move |req| handle(blocks.clone(), me, limits, req));
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
    let blocks = Arc::new(Blocks::new(cli.block_bytes as usize, (limits.capacity_bytes / cli.block_bytes) as usize, cli.shards));
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
                        serve(listener, blocks, shard, limits).await;
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
