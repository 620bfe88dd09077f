//! `kvtier-loadgen blocks`: whole-block PUT or GET throughput at a fixed
//! concurrency, the raw transfer path with no workload logic, for comparing
//! the server against a link's bandwidth (iperf3) or the disk (fio).
//!
//! PUTs write distinct keys. GETs first store a working set of
//! `max(4 × concurrency, 16)` blocks, then read random keys of it; every
//! body is checked against the key it was asked for.
//!
//! Over HTTP a block is a `PUT`/`GET` body; over kvtier's local socket
//! (`--target unix://PATH`) it is a `PUT_FROM`/`GET_INTO` of a slot of
//! registered memory, one slot per request in flight, the body checked
//! where the server wrote it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::payload::Payloads;
use crate::stats::{FirstError, LatencySummary, OpLatency};
use crate::target::{Target, TargetError};

/// PUT or GET.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BlockOp {
    /// Store blocks.
    Put,
    /// Read blocks.
    Get,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct BlocksResults {
    /// `"blocks"`.
    pub mode: String,
    /// `"put"` or `"get"`.
    pub op: String,
    /// `"h2c"`, `"http/1.1"` or `"unix"`.
    pub protocol: String,
    /// `"http"` or `"unix"` (kvtier's local socket).
    #[serde(default)]
    pub transport: String,
    /// Connections the requests went over.
    #[serde(default)]
    pub connections: usize,
    /// Concurrent requests.
    pub concurrency: usize,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// Requests completed.
    pub requests: u64,
    /// Failed requests (must be 0): errors, misses and wrong bytes.
    pub errors: u64,
    /// The first failure, if any.
    #[serde(default)]
    pub first_error: Option<String>,
    /// Block payload bytes per second.
    pub bytes_per_s: f64,
    /// Request latency.
    pub latency: LatencySummary,
}

/// Runs `op` with `concurrency` requests in flight for `duration` against
/// a kvtier `target` (HTTP or local socket) storing `block_bytes` blocks.
/// A GET checks the length and key stamp of every block, and with
/// `verify_full` every byte.
///
/// # Errors
/// The first failed request of the set-up (storing the GET working set).
pub async fn run(
    target: Arc<Target>,
    op: BlockOp,
    concurrency: usize,
    duration: Duration,
    block_bytes: u64,
    verify_full: bool,
) -> Result<BlocksResults, TargetError> {
    let payloads = Payloads::new(block_bytes as usize, 1);
    let working_set = (4 * concurrency).max(16);
    if op == BlockOp::Get {
        for i in 0..working_set {
            let key = format!("blocks-{block_bytes}-{i}");
            target.put(&key, payloads.chunks(&key)).await?;
        }
    }
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(FirstError::default());
    let latency = Arc::new(Mutex::new(OpLatency::default()));
    let started = Instant::now();
    let deadline = started + duration;
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|w| {
            let (target, payloads, next, errors, latency, first_error) =
                (target.clone(), payloads.clone(), next.clone(), errors.clone(), latency.clone(), first_error.clone());
            tokio::spawn(async move {
                let mut mine = OpLatency::default();
                let mut rng = 0x2545_F491_4F6C_DD1Du64.wrapping_mul(w as u64 + 1);
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let outcome = match op {
                        BlockOp::Put => {
                            let key = format!("put-{block_bytes}-{n}");
                            target.put(&key, payloads.chunks(&key)).await.map_err(|e| e.to_string())
                        }
                        BlockOp::Get => {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let key = format!("blocks-{block_bytes}-{}", rng % working_set as u64);
                            match target.get(&key).await {
                                Ok(Some(b)) if payloads.verify_body(&key, &b.body, verify_full) => Ok(()),
                                Ok(Some(b)) => Err(format!("{key} read back with wrong bytes ({} bytes from {})", b.body.len(), b.tier)),
                                Ok(None) => Err(format!("{key} missed, though stored")),
                                Err(e) => Err(e.to_string()),
                            }
                        }
                    };
                    match outcome {
                        Ok(()) => mine.record(t.elapsed().as_micros() as u64),
                        Err(e) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            first_error.note(e);
                        }
                    }
                }
                latency.lock().expect("lock").merge(&mine);
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    let latency = latency.lock().expect("lock").clone();
    Ok(BlocksResults {
        mode: "blocks".into(),
        op: match op {
            BlockOp::Put => "put",
            BlockOp::Get => "get",
        }
        .into(),
        protocol: target.protocol().into(),
        transport: target.transport().into(),
        connections: target.connections(),
        concurrency,
        block_bytes,
        elapsed_s,
        requests: latency.count(),
        errors: errors.load(Ordering::Relaxed),
        first_error: first_error.get(),
        bytes_per_s: (latency.count() * block_bytes) as f64 / elapsed_s,
        latency: latency.summary(),
    })
}
