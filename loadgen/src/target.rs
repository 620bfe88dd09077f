//! What the loadgen drives: a kvtier server over HTTP (h2c or HTTP/1.1) or
//! over its same-host local socket (docs/LOCAL.md), or a Redis server,
//! behind the three operations every workload is made of.
//!
//! | operation | kvtier (HTTP) | kvtier (`unix://`) | Redis |
//! |---|---|---|---|
//! | lookup (prefix hits of a chain) | `POST /v1/lookup` | `LOOKUP` | `EXISTS` of every key of the chain in one pipeline; hits = leading 1s |
//! | read a block | `GET /v1/blocks/{key}` (404 → miss) | `GET_INTO` a registered slot (`NOT_FOUND`, `CORRUPT` → miss) | `GET key` (nil → miss) |
//! | write a block | `PUT /v1/blocks/{key}` | `PUT_FROM` a registered slot | `SET key value` |
//!
//! | (model, `model://`) | leading keys in its set | a key in its set (no bytes) | adds the key |
//!
//! The model target is an unbounded in-process store that keeps only the
//! keys: a replay against it needs no server and writes the trace of the
//! workload itself (`replay --target model:// --trace-out F`), as a store
//! that never evicts would see it.
//!
//! kvtier tells its block geometry (`/v1/stats`, or the local socket's
//! `HELLO`); Redis stores any size, so the run gives it (`--model` or
//! `--block-bytes`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::{RedisWrite, ToRedisArgs, ToSingleRedisArg};

use crate::client::{BodyChunks, Client, ClientError};
use crate::local::{LocalError, LocalTarget};

/// How long a Redis command may take before it counts as failed: 60 s (a
/// 16 MiB value behind 63 others on one server is slow, not lost). The
/// redis crate's default of 500 ms would fail large values under load.
pub const REDIS_RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why an operation failed, with the target's own words.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// A kvtier request failed.
    #[error(transparent)]
    Kvtier(#[from] ClientError),
    /// A request over kvtier's local socket failed.
    #[error(transparent)]
    Local(#[from] LocalError),
    /// A Redis command failed.
    #[error("redis {target}: {message}")]
    Redis {
        /// The Redis URL.
        target: String,
        /// The redis crate's error.
        message: String,
    },
    /// The target URL is none of `http://HOST:PORT`, `unix://PATH`,
    /// `redis://HOST:PORT`.
    #[error(
        "bad target {0:?}: expected http://HOST:PORT (kvtier), unix:///PATH/kvtier.sock[?http=HOST:PORT] (kvtier's local socket) , redis://HOST:PORT[/DB] (Redis) or model:// (an in-process store of keys, no server)"
    )]
    BadTarget(String),
}

/// A Redis server behind a pool of multiplexed connections, used
/// round-robin (with one connection per worker, as redis-benchmark opens,
/// a command never waits behind another worker's value).
pub struct RedisTarget {
    url: String,
    connections: Vec<MultiplexedConnection>,
    next: AtomicUsize,
}

/// A block value handed to `SET` as chunks: written into the command buffer
/// once, without joining the chunks first.
struct Chunks<'a>(&'a [Bytes]);

impl ToRedisArgs for Chunks<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        for c in self.0 {
            w.write_all(c).expect("writing to a command buffer cannot fail");
        }
    }
}

impl ToSingleRedisArg for Chunks<'_> {}

impl RedisTarget {
    /// Connects `connections` (at least 1) multiplexed connections to `url`.
    ///
    /// # Errors
    /// [`TargetError::Redis`] when the URL is invalid or a connection fails.
    pub async fn connect(url: &str, connections: usize) -> Result<Self, TargetError> {
        let fail = |e: redis::RedisError| TargetError::Redis { target: url.to_string(), message: e.to_string() };
        let client = redis::Client::open(url).map_err(fail)?;
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(REDIS_RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(Duration::from_secs(5)));
        let mut pool = Vec::with_capacity(connections.max(1));
        for _ in 0..connections.max(1) {
            pool.push(client.get_multiplexed_async_connection_with_config(&config).await.map_err(fail)?);
        }
        Ok(RedisTarget { url: url.to_string(), connections: pool, next: AtomicUsize::new(0) })
    }

    fn conn(&self) -> MultiplexedConnection {
        self.connections[self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len()].clone()
    }

    fn fail(&self, e: redis::RedisError) -> TargetError {
        TargetError::Redis { target: self.url.clone(), message: e.to_string() }
    }

    /// `INFO stats` counters `total_net_input_bytes`, `total_net_output_bytes`.
    async fn net_bytes(&self) -> Result<(u64, u64), TargetError> {
        let info: String = redis::cmd("INFO").arg("stats").query_async(&mut self.conn()).await.map_err(|e| self.fail(e))?;
        let field =
            |name: &str| info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<u64>().ok()).unwrap_or(0);
        Ok((field("total_net_input_bytes"), field("total_net_output_bytes")))
    }
}

/// A server under load.
pub enum Target {
    /// kvtier over HTTP.
    Kvtier(Client),
    /// kvtier over its same-host local socket and registered memory.
    Local(LocalTarget),
    /// Redis.
    Redis(RedisTarget),
    /// An unbounded in-process store of keys, no server (`model://`).
    Model(ModelTarget),
}

/// The `model://` target: the block hashes stored so far, never evicted,
/// no bytes kept.
#[derive(Default)]
pub struct ModelTarget {
    keys: std::sync::Mutex<std::collections::HashSet<u128>>,
}

impl ModelTarget {
    fn has(&self, key: &str) -> bool {
        self.keys.lock().expect("model keys").contains(&kvtier_engine::key::BlockHash::of(key.as_bytes()).0)
    }
}

/// The URL scheme of the model target.
pub const MODEL_SCHEME: &str = "model://";

/// A block read: its bytes and the tier that served it (`x-kvtier-tier`,
/// or the `GET_INTO` result's tier in the same words; `"redis"` for Redis).
pub struct ReadBlock {
    /// The block's bytes (over the local socket: a view of the registered
    /// slot the server wrote, held until the body is dropped).
    pub body: BodyChunks,
    /// Where it was served from.
    pub tier: String,
}

impl Target {
    /// Opens a target from its URL: `http://HOST:PORT` is kvtier (HTTP/2
    /// prior knowledge, or HTTP/1.1 with `http1`, over `connections`
    /// connections; 0 means 1 for h2c), `unix://PATH[?http=HOST:PORT]` is
    /// kvtier's local socket (`connections` connections, 0 meaning one per
    /// worker, sharing one registered block slot per worker, `workers`; the
    /// optional HTTP address serves `/v1/stats`), `redis://HOST:PORT[/DB]`
    /// is Redis (`connections` multiplexed connections; 0 means one per
    /// worker).
    ///
    /// # Errors
    /// [`TargetError::BadTarget`] for another scheme; connection failures
    /// for the local socket and Redis (kvtier over HTTP connects on first
    /// use).
    pub async fn open(url: &str, http1: bool, connections: usize, workers: usize) -> Result<Self, TargetError> {
        Target::open_as(url, http1, connections, workers, None).await
    }

    /// [`Target::open`] sending `token` (HTTP's bearer token, the local
    /// socket's HELLO token): a tenant's token makes the run that tenant's
    /// (docs/OPERATIONS.md, "Tenants"). Redis takes no token.
    ///
    /// # Errors
    /// As [`Target::open`].
    pub async fn open_as(url: &str, http1: bool, connections: usize, workers: usize, token: Option<&str>) -> Result<Self, TargetError> {
        if url.starts_with("redis://") {
            let n = if connections == 0 { workers.max(1) } else { connections };
            Ok(Target::Redis(RedisTarget::connect(url, n).await?))
        } else if url.starts_with(crate::local::SCHEME) {
            let n = if connections == 0 { workers.max(1) } else { connections };
            Ok(Target::Local(LocalTarget::connect(url, n, workers.max(1), token).await?))
        } else if url.starts_with("http://") {
            let client = Client::new(url, http1, connections.max(1))?;
            Ok(Target::Kvtier(match token {
                Some(t) => client.with_token(t)?,
                None => client,
            }))
        } else if url.starts_with(MODEL_SCHEME) {
            Ok(Target::Model(ModelTarget::default()))
        } else {
            Err(TargetError::BadTarget(url.to_string()))
        }
    }

    /// `"kvtier"` or `"redis"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Target::Kvtier(_) | Target::Local(_) => "kvtier",
            Target::Redis(_) => "redis",
            Target::Model(_) => "model",
        }
    }

    /// Whether a block read back carries the bytes written (every target
    /// but the model, which keeps keys only).
    pub fn keeps_bytes(&self) -> bool {
        !matches!(self, Target::Model(_))
    }

    /// `"h2c"`, `"http/1.1"`, `"unix"` (kvtier's local protocol) or `"resp"`.
    pub fn protocol(&self) -> &'static str {
        match self {
            Target::Kvtier(c) => c.protocol(),
            Target::Local(_) => "unix",
            Target::Redis(_) => "resp",
            Target::Model(_) => "none",
        }
    }

    /// How blocks travel: `"http"` (kvtier over TCP), `"unix"` (kvtier's
    /// local socket, blocks copied through registered memory) or `"tcp"`
    /// (Redis).
    pub fn transport(&self) -> &'static str {
        match self {
            Target::Kvtier(_) => "http",
            Target::Local(_) => "unix",
            Target::Redis(_) => "tcp",
            Target::Model(_) => "none",
        }
    }

    /// `/v1/stats` of a kvtier target (over HTTP; for the local socket, at
    /// its `?http=` address).
    ///
    /// # Errors
    /// Redis; a local target without `?http=`; the request failing.
    pub async fn stats(&self) -> Result<serde_json::Value, TargetError> {
        match self {
            Target::Kvtier(c) => Ok(c.stats().await?),
            Target::Local(l) => Ok(l.stats().await?),
            Target::Redis(r) => Err(TargetError::Redis { target: r.url.clone(), message: "Redis has no /v1/stats".into() }),
            Target::Model(_) => Err(TargetError::BadTarget("the model target has no /v1/stats".into())),
        }
    }

    /// Requests the server refused with 503 and `Retry-After` (kvtier's
    /// backpressure); each was sent again after the delay. 0 for Redis.
    pub fn refusals(&self) -> u64 {
        match self {
            Target::Kvtier(c) => c.refusals(),
            Target::Local(l) => l.refusals(),
            Target::Redis(_) | Target::Model(_) => 0,
        }
    }

    /// The target URL.
    pub fn url(&self) -> &str {
        match self {
            Target::Kvtier(c) => c.target(),
            Target::Local(l) => l.url(),
            Target::Redis(r) => &r.url,
            Target::Model(_) => MODEL_SCHEME,
        }
    }

    /// Connections the target is driven over (kvtier HTTP/1.1: pooled, one
    /// per request in flight, reported as 0).
    pub fn connections(&self) -> usize {
        match self {
            Target::Kvtier(c) => c.connections(),
            Target::Local(l) => l.connections(),
            Target::Redis(r) => r.connections.len(),
            Target::Model(_) => 0,
        }
    }

    /// The stored block geometry, `(block_bytes, block_tokens, model)`:
    /// kvtier's own; `None` for Redis, which has none.
    ///
    /// # Errors
    /// When kvtier cannot be reached or answers without a geometry.
    pub async fn geometry(&self) -> Result<Option<(u64, u64, String)>, TargetError> {
        match self {
            Target::Kvtier(c) => Ok(Some(c.geometry().await?)),
            Target::Local(l) => {
                let h = l.hello();
                Ok(Some((h.block_bytes, h.block_tokens, h.model.clone())))
            }
            Target::Redis(r) => {
                redis::cmd("PING").query_async::<String>(&mut r.conn()).await.map_err(|e| r.fail(e))?;
                Ok(None)
            }
            Target::Model(_) => Ok(None),
        }
    }

    /// How many leading keys of `keys` are stored.
    ///
    /// # Errors
    /// Transport failures and unexpected answers.
    pub async fn lookup(&self, keys: &[String]) -> Result<usize, TargetError> {
        match self {
            Target::Kvtier(c) => Ok(c.lookup(keys).await?),
            Target::Local(l) => Ok(l.lookup(keys).await?),
            Target::Redis(r) => {
                let mut pipe = redis::pipe();
                for k in keys {
                    pipe.cmd("EXISTS").arg(k);
                }
                let found: Vec<i64> = pipe.query_async(&mut r.conn()).await.map_err(|e| r.fail(e))?;
                Ok(found.iter().take_while(|&&n| n > 0).count())
            }
            Target::Model(m) => Ok(keys.iter().take_while(|k| m.has(k)).count()),
        }
    }

    /// Reads a block; `None` when it is not stored.
    ///
    /// # Errors
    /// Transport failures and unexpected answers.
    pub async fn get(&self, key: &str) -> Result<Option<ReadBlock>, TargetError> {
        match self {
            Target::Kvtier(c) => {
                Ok(c.get(key).await?.map(|(body, tier)| ReadBlock { body, tier: tier.unwrap_or_else(|| "unknown".into()) }))
            }
            Target::Local(l) => Ok(l.get(key).await?.map(|(body, tier)| ReadBlock { body, tier: tier.into() })),
            Target::Redis(r) => {
                let v: Option<Bytes> = redis::cmd("GET").arg(key).query_async(&mut r.conn()).await.map_err(|e| r.fail(e))?;
                Ok(v.map(|body| ReadBlock { body: body.into(), tier: "redis".into() }))
            }
            Target::Model(m) => Ok(m.has(key).then(|| ReadBlock { body: Bytes::new().into(), tier: "model".into() })),
        }
    }

    /// Stores a block given as chunks.
    ///
    /// # Errors
    /// Transport failures and refusals (kvtier: 413/422 for a wrong size,
    /// 507 when full).
    pub async fn put(&self, key: &str, chunks: Vec<Bytes>) -> Result<(), TargetError> {
        match self {
            Target::Kvtier(c) => c.put(key, chunks).await.map(|_| ()).map_err(Into::into),
            Target::Local(l) => l.put(key, &chunks).await.map(|_| ()).map_err(Into::into),
            Target::Redis(r) => {
                redis::cmd("SET").arg(key).arg(Chunks(&chunks)).query_async::<()>(&mut r.conn()).await.map_err(|e| r.fail(e))
            }
            Target::Model(m) => {
                m.keys.lock().expect("model keys").insert(kvtier_engine::key::BlockHash::of(key.as_bytes()).0);
                Ok(())
            }
        }
    }

    /// Stores a block given as chunks with `headers` added (a block tag's,
    /// [`crate::tag::BlockTag::headers`]): [`Target::put`] when there are
    /// none.
    ///
    /// # Errors
    /// As [`Target::put`]; headers for a target other than kvtier over HTTP
    /// ([`TargetError::BadTarget`]: the loadgen tags blocks over HTTP only).
    pub async fn put_tagged(
        &self,
        key: &str,
        chunks: Vec<Bytes>,
        headers: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<(), TargetError> {
        match self {
            _ if headers.is_empty() => self.put(key, chunks).await,
            Target::Kvtier(c) => c.put_with_headers(key, chunks, headers).await.map(|_| ()).map_err(Into::into),
            _ => Err(TargetError::BadTarget(format!("{}: block tags are sent over HTTP only", self.url()))),
        }
    }

    /// Bytes the server has received and sent so far, `(in, out)`: kvtier's
    /// request and response body bytes summed over shards (`/v1/stats`; for
    /// the local socket its own counters, `local.per_shard`, which need
    /// `?http=`),
    /// Redis's `total_net_input_bytes` / `total_net_output_bytes`. The
    /// difference of two readings is the server's bandwidth.
    ///
    /// # Errors
    /// When the counters cannot be read.
    pub async fn server_bytes(&self) -> Result<(u64, u64), TargetError> {
        match self {
            Target::Kvtier(c) => {
                let v = c.stats().await?;
                let shards = v["http"]["per_shard"].as_array().cloned().unwrap_or_default();
                let sum = |f: &str| shards.iter().map(|s| s[f].as_u64().unwrap_or(0)).sum::<u64>();
                Ok((sum("bytes_in"), sum("bytes_out")))
            }
            Target::Local(l) => Ok(l.server_bytes().await?),
            Target::Redis(r) => r.net_bytes().await,
            Target::Model(_) => Ok((0, 0)),
        }
    }
}

/// The block geometry of a run, `(block_bytes, block_tokens, model)`:
/// `block_bytes` or `model` if given (checked against every kvtier target),
/// else the first kvtier target's, else llama3.1-8b (16 MiB for 128 tokens).
///
/// # Errors
/// A target that cannot be reached; a kvtier target storing another block
/// size than asked for, or than another kvtier target ("wrong block size");
/// an unknown model or a block size the engine refuses.
pub async fn resolve_geometry(
    targets: &[std::sync::Arc<Target>],
    model: Option<&str>,
    block_bytes: Option<u64>,
    block_tokens: u64,
) -> Result<(u64, u64, String), String> {
    let tokens = u32::try_from(block_tokens).map_err(|_| format!("--block-tokens {block_tokens} is too large"))?;
    let asked = match (model, block_bytes) {
        (_, Some(bytes)) => {
            let geo = kvtier_engine::Geometry::from_block_bytes(bytes, tokens).map_err(|e| e.to_string())?;
            Some((geo.block_bytes, block_tokens, geo.model))
        }
        (Some(m), None) => {
            let geo = kvtier_engine::Geometry::from_model(m, tokens).map_err(|e| e.to_string())?;
            Some((geo.block_bytes, block_tokens, geo.model))
        }
        (None, None) => None,
    };
    let mut chosen = asked.clone();
    for t in targets {
        let Some((bytes, tokens, model)) = t.geometry().await.map_err(|e| format!("cannot reach {}: {e}", t.url()))? else { continue };
        match &chosen {
            Some((want, _, _)) if *want != bytes => {
                let what = if asked.is_some() { "the run asks for" } else { "another target stores" };
                return Err(format!(
                    "wrong block size: {what} {want}-byte blocks, but the kvtier server at {} stores {bytes} (model {model})",
                    t.url()
                ));
            }
            Some(_) => {}
            None => chosen = Some((bytes, tokens, model)),
        }
    }
    match chosen {
        Some(c) => Ok(c),
        None => {
            let geo = kvtier_engine::Geometry::from_model(kvtier_engine::geometry::MODEL_DEFAULT, tokens).map_err(|e| e.to_string())?;
            Ok((geo.block_bytes, block_tokens, geo.model))
        }
    }
}
