//! An HTTP client for the kvtier block API (HTTP/2 prior knowledge by
//! default, or HTTP/1.1), on hyper's client with tokio.
//!
//! For HTTP/2 it advertises a 1 MiB SETTINGS_MAX_FRAME_SIZE: the server may
//! not send DATA frames larger than the client allows, and at the 16 KiB
//! default a 16 MiB block is 1,024 frames, whose per-frame cost dominated
//! (~5× slower on this machine). Windows are sized for multi-MiB bodies.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::Value;

use crate::retry::OverloadRetry;

/// SETTINGS_MAX_FRAME_SIZE this client advertises: 1 MiB.
pub const H2_FRAME_BYTES_MAX: u32 = 1 << 20;
/// Largest HTTP/1 read buffer: 4 MiB.
pub const H1_READ_BUFFER_BYTES_MAX: usize = 4 << 20;
/// Per-stream receive window: one 16 MiB block.
pub const H2_STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// Per-connection receive window: 128 MiB, so several block reads proceed
/// at once on one connection.
pub const H2_CONNECTION_WINDOW_BYTES: u32 = 128 << 20;

/// A request body of known length made of `Bytes` chunks (sent without
/// copying; the exact size hint makes hyper send Content-Length).
#[derive(Debug, Default)]
pub struct ChunkedBody {
    chunks: VecDeque<Bytes>,
    remaining: u64,
}

impl ChunkedBody {
    /// A body of these chunks.
    pub fn new(chunks: Vec<Bytes>) -> Self {
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        ChunkedBody { chunks: chunks.into_iter().filter(|c| !c.is_empty()).collect(), remaining }
    }
}

impl Body for ChunkedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.chunks.pop_front() {
            Some(chunk) => {
                self.remaining -= chunk.len() as u64;
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

/// A response body as the frames it arrived in. A 16 MiB GET arrives as
/// dozens of frames; joining them into one buffer copied every byte a second
/// time and made the loadgen read slower than a plain Python `http.client`
/// pool (`make bench-python`), so readers check the frames where they are.
#[derive(Debug, Clone, Default)]
pub struct BodyChunks {
    chunks: Vec<Bytes>,
    len: usize,
}

impl BodyChunks {
    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The frames, in order.
    pub fn chunks(&self) -> &[Bytes] {
        &self.chunks
    }

    /// The body as one buffer: free for a one-frame body, a copy otherwise
    /// (for JSON answers and error messages, not block reads).
    pub fn to_bytes(&self) -> Bytes {
        match self.chunks.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => Bytes::from(many.concat()),
        }
    }

    /// This body with `chunk` appended.
    pub fn with(mut self, chunk: Bytes) -> Self {
        self.push(chunk);
        self
    }

    fn push(&mut self, chunk: Bytes) {
        if !chunk.is_empty() {
            self.len += chunk.len();
            self.chunks.push(chunk);
        }
    }
}

impl From<Bytes> for BodyChunks {
    fn from(bytes: Bytes) -> Self {
        let mut body = BodyChunks::default();
        body.push(bytes);
        body
    }
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The target URL is not `http://host:port`.
    #[error("bad target {0:?}: expected http://HOST:PORT")]
    BadTarget(String),
    /// Connecting, sending or receiving failed.
    #[error("request to {target} failed: {message}")]
    Transport {
        /// The target.
        target: String,
        /// The transport error, with its causes.
        message: String,
    },
    /// The server answered with an unexpected status.
    #[error("{method} {path} answered {status}: {body}")]
    Status {
        /// Request method.
        method: Method,
        /// Request path.
        path: String,
        /// Response status.
        status: StatusCode,
        /// Response body (the server's JSON error).
        body: String,
    },
    /// The response did not have the expected shape.
    #[error("unexpected response from {path}: {message}")]
    BadResponse {
        /// Request path.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// The server cut the response off: its body ended before
    /// `Content-Length` (HTTP/1.1: the connection closed), or it reset the
    /// HTTP/2 stream, possibly before the head arrived. kvtier does this
    /// when a block's chunk fails its CRC-32 mid-stream; a GET counts it as
    /// a miss ([`Client::get`]).
    #[error("{path}: the server cut the response off (status {status:?}): {message}")]
    BodyCut {
        /// Request path.
        path: String,
        /// Response status, if the head arrived.
        status: Option<StatusCode>,
        /// The transport error.
        message: String,
    },
}

/// A response: status, the `x-kvtier-tier` header, body.
pub struct Answer {
    /// Status code.
    pub status: StatusCode,
    /// `x-kvtier-tier`, if sent.
    pub tier: Option<String>,
    /// The whole body, as the frames it arrived in.
    pub body: BodyChunks,
    /// `Retry-After` in seconds, if sent (kvtier sends it with a 503 when
    /// overloaded).
    pub retry_after: Option<Duration>,
}

/// A kvtier client over one or more connections.
pub struct Client {
    clients: Vec<HyperClient<HttpConnector, ChunkedBody>>,
    base: String,
    next: AtomicUsize,
    http1: bool,
    /// 503 answers with `Retry-After` received (each was retried after it).
    refusals: AtomicU64,
    body_cuts: AtomicU64,
    /// `Authorization: Bearer` value sent with every request, when set
    /// (the server's `--auth-token-file`, or a tenant's token).
    token: Option<http::HeaderValue>,
}

impl Client {
    /// A client for `target` (`http://host:port`). With HTTP/2, each of
    /// `connections` is one multiplexed connection, used round-robin; with
    /// HTTP/1.1 connections are pooled, one per request in flight.
    ///
    /// # Errors
    /// [`ClientError::BadTarget`] for anything but `http://host:port`.
    pub fn new(target: &str, http1: bool, connections: usize) -> Result<Self, ClientError> {
        let base = target.trim_end_matches('/').to_string();
        let uri: http::Uri = base.parse().map_err(|_| ClientError::BadTarget(target.into()))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() || !matches!(uri.path(), "" | "/") {
            return Err(ClientError::BadTarget(target.into()));
        }
        let clients = (0..connections.max(1))
            .map(|_| {
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                let mut b = HyperClient::builder(TokioExecutor::new());
                b.timer(TokioTimer::new()).pool_timer(TokioTimer::new());
                if !http1 {
                    b.http2_only(true)
                        .http2_max_frame_size(H2_FRAME_BYTES_MAX)
                        .http2_initial_stream_window_size(H2_STREAM_WINDOW_BYTES)
                        .http2_initial_connection_window_size(H2_CONNECTION_WINDOW_BYTES)
                        .http2_adaptive_window(false);
                } else {
                    // hyper's HTTP/1 reads grow to at most this per syscall
                    // (default ~400 KiB): a 16 MiB body in fewer reads.
                    b.http1_max_buf_size(H1_READ_BUFFER_BYTES_MAX);
                }
                b.build(connector)
            })
            .collect();
        Ok(Client {
            clients,
            base,
            next: AtomicUsize::new(0),
            http1,
            refusals: AtomicU64::new(0),
            body_cuts: AtomicU64::new(0),
            token: None,
        })
    }

    /// This client sending `Authorization: Bearer TOKEN` with every request
    /// (a tenant's token names the tenant whose keys it reaches).
    ///
    /// # Errors
    /// [`ClientError::BadTarget`] for a token that cannot be a header value.
    pub fn with_token(mut self, token: &str) -> Result<Self, ClientError> {
        let v = http::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| ClientError::BadTarget("a token with bytes a header cannot carry".into()))?;
        self.token = Some(v);
        Ok(self)
    }

    /// `"h2c"` or `"http/1.1"`.
    pub fn protocol(&self) -> &'static str {
        if self.http1 {
            "http/1.1"
        } else {
            "h2c"
        }
    }

    /// HTTP/2 connections in use; 0 for HTTP/1.1 (pooled, one per request
    /// in flight).
    pub fn connections(&self) -> usize {
        if self.http1 {
            0
        } else {
            self.clients.len()
        }
    }

    /// The target URL.
    pub fn target(&self) -> &str {
        &self.base
    }

    /// Sends one request and reads the whole answer.
    ///
    /// # Errors
    /// [`ClientError::Transport`] when the exchange fails before the
    /// response head; [`ClientError::BodyCut`] when the body is cut off.
    pub async fn send(&self, method: Method, path: &str, body: ChunkedBody, content_type: Option<&str>) -> Result<Answer, ClientError> {
        self.send_with_headers(method, path, body, content_type, &[]).await
    }

    /// [`Client::send`] with `headers` added to the request (a block tag's
    /// `x-kvtier-*` headers, [`crate::tag`]).
    ///
    /// # Errors
    /// As [`Client::send`].
    pub async fn send_with_headers(
        &self,
        method: Method,
        path: &str,
        body: ChunkedBody,
        content_type: Option<&str>,
        headers: &[(HeaderName, HeaderValue)],
    ) -> Result<Answer, ClientError> {
        let transport = |e: &dyn std::error::Error| {
            let mut message = e.to_string();
            let mut source = e.source();
            while let Some(s) = source {
                message.push_str(": ");
                message.push_str(&s.to_string());
                source = s.source();
            }
            ClientError::Transport { target: self.base.clone(), message }
        };
        let mut req = Request::builder().method(method).uri(format!("{}{path}", self.base));
        if let Some(ct) = content_type {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        if let Some(t) = &self.token {
            req = req.header(header::AUTHORIZATION, t.clone());
        }
        for (name, value) in headers {
            req = req.header(name, value);
        }
        let req = req.body(body).map_err(|e| transport(&e))?;
        let client = &self.clients[self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len()];
        let resp = client.request(req).await.map_err(|e| match transport(&e) {
            ClientError::Transport { message, .. } if reset_by_server(&e) => {
                ClientError::BodyCut { path: path.to_string(), status: None, message }
            }
            other => other,
        })?;
        let status = resp.status();
        let tier = resp.headers().get("x-kvtier-tier").and_then(|v| v.to_str().ok()).map(str::to_string);
        let retry_after =
            resp.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok()).map(Duration::from_secs);
        let mut incoming = resp.into_body();
        let mut body = BodyChunks::default();
        while let Some(frame) = incoming.frame().await {
            let frame = frame.map_err(|e| match transport(&e) {
                ClientError::Transport { message, .. } => ClientError::BodyCut { path: path.to_string(), status: Some(status), message },
                other => other,
            })?;
            if let Ok(data) = frame.into_data() {
                body.push(data);
            }
        }
        Ok(Answer { status, tier, body, retry_after })
    }

    /// Sends a request like [`Client::send`]; a 503 with `Retry-After`
    /// (kvtier's backpressure) is counted in [`Client::refusals`] and sent
    /// again after that delay, as [`OverloadRetry`] says (at most
    /// [`RETRY_AFTER_MAX`](crate::retry::RETRY_AFTER_MAX), up to
    /// [`OVERLOAD_RETRIES_MAX`](crate::retry::OVERLOAD_RETRIES_MAX) times);
    /// the last answer is returned.
    ///
    /// # Errors
    /// As [`Client::send`].
    pub async fn send_honouring_retry_after(
        &self,
        method: Method,
        path: &str,
        chunks: Vec<Bytes>,
        content_type: Option<&str>,
    ) -> Result<Answer, ClientError> {
        self.send_retrying(method, path, chunks, content_type, &[]).await
    }

    /// [`Client::send_honouring_retry_after`] with `headers` added.
    async fn send_retrying(
        &self,
        method: Method,
        path: &str,
        chunks: Vec<Bytes>,
        content_type: Option<&str>,
        headers: &[(HeaderName, HeaderValue)],
    ) -> Result<Answer, ClientError> {
        let mut retry = OverloadRetry::new();
        loop {
            let a = self.send_with_headers(method.clone(), path, ChunkedBody::new(chunks.clone()), content_type, headers).await?;
            match a.retry_after {
                Some(delay) if a.status == StatusCode::SERVICE_UNAVAILABLE => {
                    self.refusals.fetch_add(1, Ordering::Relaxed);
                    if !retry.wait(delay).await {
                        return Ok(a);
                    }
                }
                _ => return Ok(a),
            }
        }
    }

    /// 503 answers with `Retry-After` (server overload) this client has
    /// received; each was retried after the delay asked for.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// GETs whose body the server cut off (a chunk failed its CRC-32
    /// mid-stream), each counted as a miss by [`Client::get`].
    pub fn body_cuts(&self) -> u64 {
        self.body_cuts.load(Ordering::Relaxed)
    }

    fn unexpected(method: Method, path: &str, a: Answer) -> ClientError {
        ClientError::Status {
            method,
            path: path.to_string(),
            status: a.status,
            body: String::from_utf8_lossy(&a.body.to_bytes()).into_owned(),
        }
    }

    /// `PUT /v1/blocks/{key}`; returns 201 (created) or 200 (replaced).
    ///
    /// # Errors
    /// [`ClientError::Status`] for any other status; transport errors.
    pub async fn put(&self, key: &str, chunks: Vec<Bytes>) -> Result<StatusCode, ClientError> {
        self.put_with_headers(key, chunks, &[]).await
    }

    /// `PUT /v1/blocks/{key}` with `headers` (a block tag,
    /// [`crate::tag::BlockTag::headers`]); returns 201 or 200.
    ///
    /// # Errors
    /// As [`Client::put`]; a tag the server refuses is 400 `invalid_tag`.
    pub async fn put_with_headers(
        &self,
        key: &str,
        chunks: Vec<Bytes>,
        headers: &[(HeaderName, HeaderValue)],
    ) -> Result<StatusCode, ClientError> {
        let path = format!("/v1/blocks/{key}");
        let a = self.send_retrying(Method::PUT, &path, chunks, Some("application/octet-stream"), headers).await?;
        match a.status {
            StatusCode::CREATED | StatusCode::OK => Ok(a.status),
            _ => Err(Self::unexpected(Method::PUT, &path, a)),
        }
    }

    /// `GET /v1/blocks/{key}`; `None` on 404.
    ///
    /// # Errors
    /// [`ClientError::Status`] for statuses other than 200 and 404.
    pub async fn get(&self, key: &str) -> Result<Option<(BodyChunks, Option<String>)>, ClientError> {
        let path = format!("/v1/blocks/{key}");
        let a = match self.send_honouring_retry_after(Method::GET, &path, Vec::new(), None).await {
            // A block whose chunk failed its check mid-stream: dropped by
            // the server, a miss for us.
            Err(ClientError::BodyCut { status: Some(StatusCode::OK) | None, .. }) => {
                self.body_cuts.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            a => a?,
        };
        match a.status {
            StatusCode::OK => Ok(Some((a.body, a.tier))),
            StatusCode::NOT_FOUND => Ok(None),
            _ => Err(Self::unexpected(Method::GET, &path, a)),
        }
    }

    /// `POST /v1/lookup`: how many leading keys are stored.
    ///
    /// # Errors
    /// [`ClientError::Status`] for a non-200; [`ClientError::BadResponse`]
    /// when `prefix_hits` is missing.
    pub async fn lookup(&self, keys: &[String]) -> Result<usize, ClientError> {
        self.lookup_tiers(keys).await.map(|(hits, _)| hits)
    }

    /// `POST /v1/lookup`: how many leading keys are stored, and the tier
    /// each of them is in (`gpu`, `ram`, `nvme` or `s3`; the fastest that
    /// holds it; empty when the server names none).
    ///
    /// # Errors
    /// As [`Client::lookup`].
    pub async fn lookup_tiers(&self, keys: &[String]) -> Result<(usize, Vec<String>), ClientError> {
        let path = "/v1/lookup";
        let body = serde_json::to_vec(&serde_json::json!({ "keys": keys })).expect("JSON serializes");
        let a = self.send_honouring_retry_after(Method::POST, path, vec![Bytes::from(body)], Some("application/json")).await?;
        if a.status != StatusCode::OK {
            return Err(Self::unexpected(Method::POST, path, a));
        }
        let v: Value = serde_json::from_slice(&a.body.to_bytes())
            .map_err(|e| ClientError::BadResponse { path: path.into(), message: e.to_string() })?;
        let hits = v["prefix_hits"]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| ClientError::BadResponse { path: path.into(), message: format!("no prefix_hits in {v}") })?;
        let tiers = v["tiers"].as_array().map_or_else(Vec::new, |ts| ts.iter().map(|t| t.as_str().unwrap_or("").to_string()).collect());
        Ok((hits, tiers))
    }

    /// `GET /v1/stats` as JSON.
    ///
    /// # Errors
    /// [`ClientError::Status`] for a non-200; [`ClientError::BadResponse`]
    /// for a body that is not JSON.
    pub async fn stats(&self) -> Result<Value, ClientError> {
        let path = "/v1/stats";
        let a = self.send(Method::GET, path, ChunkedBody::default(), None).await?;
        if a.status != StatusCode::OK {
            return Err(Self::unexpected(Method::GET, path, a));
        }
        serde_json::from_slice(&a.body.to_bytes()).map_err(|e| ClientError::BadResponse { path: path.into(), message: e.to_string() })
    }

    /// The server's block geometry: `(block_bytes, block_tokens, model)`.
    ///
    /// # Errors
    /// As [`Client::stats`], or [`ClientError::BadResponse`] without a
    /// geometry.
    pub async fn geometry(&self) -> Result<(u64, u64, String), ClientError> {
        let v = self.stats().await?;
        let g = &v["geometry"];
        match (g["block_bytes"].as_u64(), g["block_tokens"].as_u64()) {
            (Some(b), Some(t)) => Ok((b, t, g["model"].as_str().unwrap_or("").to_string())),
            _ => Err(ClientError::BadResponse { path: "/v1/stats".into(), message: format!("no geometry in {v}") }),
        }
    }
}

/// Whether `e` is the server resetting one HTTP/2 stream (not the
/// connection failing): an `h2::Error` from the peer among its causes.
fn reset_by_server(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(h2) = c.downcast_ref::<h2::Error>() {
            return h2.is_reset() && h2.is_remote();
        }
        cause = c.source();
    }
    false
}
