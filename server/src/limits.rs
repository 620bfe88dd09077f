//! Every limit the server enforces, in one place. Each is checked before
//! memory is committed for the request it limits.

use std::time::Duration;

/// Largest `POST /v1/lookup` body: 1 MiB holds 4,096 keys of 256 bytes with
/// JSON quoting.
pub const LOOKUP_BODY_BYTES_MAX: u64 = 1 << 20;

/// Most keys in one lookup: 4,096 blocks of 128 tokens is a 512k-token
/// prompt, past any context window served today.
pub const LOOKUP_KEYS_MAX: usize = 4096;

/// Concurrent HTTP/2 streams per connection. The loadgen's 64 users fit on
/// one connection; a client wanting more opens another.
pub const H2_STREAMS_MAX: u32 = 256;

/// HTTP/2 per-stream receive window: 16 MiB, one llama3.1-8b block, so a
/// PUT arrives without waiting for a WINDOW_UPDATE.
pub const H2_STREAM_WINDOW_BYTES: u32 = 16 << 20;

/// HTTP/2 per-connection receive window: 64 MiB bounds the body bytes one
/// connection can have in flight towards us.
pub const H2_CONNECTION_WINDOW_BYTES: u32 = 64 << 20;

/// Largest HTTP/2 frame we accept: 1 MiB. Frames of the 16 KiB default cost
/// one header and one poll each; 1 MiB frames measured ~5× the throughput
/// on this machine. (Frames we *send* are sized by the client's setting.)
pub const H2_FRAME_BYTES_MAX: u32 = 1 << 20;

/// Response bytes h2 buffers per stream before applying back-pressure.
pub const H2_SEND_BUFFER_BYTES: usize = 4 << 20;

/// Largest request header block, counted as HTTP/2 does (name + value +
/// 32 bytes per field): HTTP/2's header-list limit, and checked per request
/// for HTTP/1 (431).
pub const HEADER_BYTES_MAX: u32 = 16 << 10;

/// Time an HTTP/1 client has to send its request headers
/// (`--header-timeout-s`); a client trickling them (slowloris) is cut off.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Time a request body has to arrive in full once its handler starts
/// reading it (`--body-timeout-s`): a 16 MiB block needs ~2.2 Mbit/s to
/// make it. Past it the request answers 408 and nothing is stored.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Interval of HTTP/2 keep-alive pings; a peer that does not answer within
/// [`H2_KEEP_ALIVE_TIMEOUT`] is dropped.
pub const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);

/// See [`H2_KEEP_ALIVE_INTERVAL`].
pub const H2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// A connection with no request in flight for this long is closed
/// (`--idle-timeout-s`). HTTP/2 keep-alive pings do not count as use.
pub const IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);

/// Open connections per shard, on each front door (HTTP: past it, new
/// connections wait in the kernel's accept queue; the same-host socket:
/// past it, a new connection is closed with a warning).
pub const CONNECTIONS_PER_SHARD_MAX: u64 = 1024;

/// How long shutdown waits for in-flight requests before closing anyway.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// PUT body bytes a shard admits at once by default (`--put-inflight-mib`):
/// 1 GiB is 64 llama3.1-8b blocks of 16 MiB, twice the default I/O depth.
/// Past it a PUT answers 503 with [`RETRY_AFTER_S`].
pub const PUT_INFLIGHT_BYTES_DEFAULT: u64 = 1 << 30;

/// `Retry-After` of a 503 refusal for overload, in seconds (the smallest
/// nonzero value the header can say).
pub const RETRY_AFTER_S: u64 = 1;
