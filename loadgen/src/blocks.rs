//! `kvtier-loadgen blocks`: whole-block PUT or GET throughput at a fixed
//! concurrency, the raw transfer path with no workload logic, for comparing
//! the server against a link's bandwidth (iperf3) or the disk (fio).
//!
//! PUTs write distinct keys. GETs first store a working set of
//! `max(4 × concurrency, 16)` blocks, then read random keys of it; every
//! body is checked against the key it was asked for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::client::{Client, ClientError};
use crate::payload::Payloads;
use crate::stats::{LatencySummary, OpLatency};

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
    /// `"h2c"` or `"http/1.1"`.
    pub protocol: String,
    /// Concurrent requests.
    pub concurrency: usize,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Measured seconds.
    pub elapsed_s: f64,
    /// Requests completed.
    pub requests: u64,
    /// Failed requests (must be 0).
    pub errors: u64,
    /// Block payload bytes per second.
    pub bytes_per_s: f64,
    /// Request latency.
    pub latency: LatencySummary,
}

/// Runs `op` with `concurrency` requests in flight for `duration`.
///
/// # Errors
/// The first failed request of the set-up (storing the GET working set).
pub async fn run(
    client: Arc<Client>,
    op: BlockOp,
    concurrency: usize,
    duration: Duration,
    block_bytes: u64,
) -> Result<BlocksResults, ClientError> {
    let payloads = Payloads::new(block_bytes as usize, 1);
    let working_set = (4 * concurrency).max(16);
    if op == BlockOp::Get {
        for i in 0..working_set {
            let key = format!("blocks-{block_bytes}-{i}");
            client.put(&key, payloads.chunks(&key)).await?;
        }
    }
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let latency = Arc::new(Mutex::new(OpLatency::default()));
    let started = Instant::now();
    let deadline = started + duration;
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|w| {
            let (client, payloads, next, errors, latency) =
                (client.clone(), payloads.clone(), next.clone(), errors.clone(), latency.clone());
            tokio::spawn(async move {
                let mut mine = OpLatency::default();
                let mut rng = 0x2545_F491_4F6C_DD1Du64.wrapping_mul(w as u64 + 1);
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let ok = match op {
                        BlockOp::Put => {
                            let key = format!("put-{block_bytes}-{n}");
                            client.put(&key, payloads.chunks(&key)).await.is_ok()
                        }
                        BlockOp::Get => {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let key = format!("blocks-{block_bytes}-{}", rng % working_set as u64);
                            matches!(client.get(&key).await, Ok(Some((body, _))) if payloads.verify_body(&key, &body, false))
                        }
                    };
                    if ok {
                        mine.record(t.elapsed().as_micros() as u64);
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
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
        protocol: client.protocol().into(),
        concurrency,
        block_bytes,
        elapsed_s,
        requests: latency.count(),
        errors: errors.load(Ordering::Relaxed),
        bytes_per_s: (latency.count() * block_bytes) as f64 / elapsed_s,
        latency: latency.summary(),
    })
}
