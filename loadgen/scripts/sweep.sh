#!/usr/bin/env bash
# `make sweep`: starts a kvtier server (fresh data directory) and a
# redis-server on loopback, sweeps both with the same workload in one run of
# kvtier-loadgen, and writes OUT/results.json and OUT/report.html.
#
# Settings (environment): SWEEP_CONCURRENCY (1,2,4,8,16,32,64),
# SWEEP_WARMUP_S (3), SWEEP_DURATION_S (10), SWEEP_BLOCK_BYTES (server
# default: llama3.1-8b, 16 MiB), SWEEP_WORKING_SET_MIB (1024), SWEEP_ARGS
# (more loadgen flags), SERVE_ARGS (more kvtier flags), OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/loadgen/sweep}
BIN=target/release
KV_PORT=${KV_PORT:-8186}
REDIS_PORT=${REDIS_PORT:-6389}
DATA=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-sweep.XXXXXX")
KV_PID=
REDIS_PID=
cleanup() {
  if [ -n "$KV_PID" ]; then kill "$KV_PID" 2>/dev/null || true; wait "$KV_PID" 2>/dev/null || true; fi
  if [ -n "$REDIS_PID" ]; then kill "$REDIS_PID" 2>/dev/null || true; wait "$REDIS_PID" 2>/dev/null || true; fi
  rm -rf "$DATA"
}
trap cleanup EXIT
mkdir -p "$OUT"

GEOMETRY=()
if [ -n "${SWEEP_BLOCK_BYTES:-}" ]; then GEOMETRY=(--block-bytes "$SWEEP_BLOCK_BYTES"); fi
# shellcheck disable=SC2086
$BIN/kvtier serve --listen 127.0.0.1:$KV_PORT --data-dir "$DATA/kvtier" --disk-gb 8 "${GEOMETRY[@]}" \
  --log-level warn ${SERVE_ARGS:-} >"$OUT/kvtier.log" 2>&1 &
KV_PID=$!
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >"$OUT/redis.log" 2>&1 &
REDIS_PID=$!
for _ in $(seq 100); do
  if curl -sf "http://127.0.0.1:$KV_PORT/healthz" >/dev/null && redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then break; fi
  if ! kill -0 "$KV_PID" 2>/dev/null; then echo "kvtier did not start:" >&2; cat "$OUT/kvtier.log" >&2; exit 1; fi
  sleep 0.2
done

# shellcheck disable=SC2086
$BIN/kvtier-loadgen sweep --target "http://127.0.0.1:$KV_PORT" --target "redis://127.0.0.1:$REDIS_PORT" \
  --concurrency "${SWEEP_CONCURRENCY:-1,2,4,8,16,32,64}" --warmup-s "${SWEEP_WARMUP_S:-3}" \
  --duration-s "${SWEEP_DURATION_S:-10}" --working-set-mib "${SWEEP_WORKING_SET_MIB:-1024}" \
  "${GEOMETRY[@]}" --out "$OUT" ${SWEEP_ARGS:-}
