#!/usr/bin/env bash
# `make bench-tenants`: tenants (docs/OPERATIONS.md, "Tenants"), measured.
#  1. Noisy neighbour: a quiet tenant's ShareGPT replay (a small working set,
#     inside its RAM and NVMe reservations) alone; then beside a noisy
#     replay writing many times the RAM tier, with a tenants file (two
#     tokens) and without one (one key space, one LRU). For the quiet replay
#     each time: the share of its GETs served from RAM, its prefix hit rate
#     (tokens), and what the noisy one wrote against the RAM tier's size.
#  2. Cost: the sweep at C=16 against two servers side by side (1 GiB RAM
#     tier each), one with a tenants file (the sweep runs as its one tenant)
#     and one without, alternating (which goes first alternates too), PAIRS
#     pairs; the median of with/without.
# Settings (environment): PARTS ("1 2"), DURATION_S (40), QUIET_CONVERSATIONS
# (6), NOISY_GENERATION (none: full speed; fast: 2 ms a generated token, as
# the quiet one), PAIRS (7), SWEEP_S (10), OUT (target/bench-tenants).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-tenants}
BIN=target/release
PORT=${PORT:-8191}
DATA=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-bench-tenants.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$DATA"
}
trap cleanup EXIT
mkdir -p "$OUT"
json() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
part() { [[ " ${PARTS:-1 2} " == *" $1 "* ]]; }

# 64 KiB blocks of 64 tokens. RAM 16 MiB (256 blocks, 128 a shard); the log
# 1 GiB, so the noisy replay also wraps it.
RAM_GB=0.015625
echo -n quiet-token >"$DATA/quiet.token"
echo -n noisy-token >"$DATA/noisy.token"
cat >"$DATA/tenants.toml" <<EOF
[[tenant]]
name = "quiet"
token = "quiet-token"
ram_reserved_gb = 0.01171875    # 12 MiB: 192 of the RAM tier's 256 blocks
nvme_reserved_gb = 0.125

[[tenant]]
name = "noisy"
token = "noisy-token"
EOF

serve() { # port, data dir name, extra args...
  local port=$1 name=$2; shift 2
  rm -rf "$DATA/$name"
  $BIN/kvtier serve --listen 127.0.0.1:"$port" --data-dir "$DATA/$name" --shards 2 --block-bytes 65536 --block-tokens 64 \
    --disk-gb 1 --ram-gb "$RAM_GB" --log-level warn "$@" >"$OUT/kvtier-$name.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  for _ in $(seq 100); do
    # Any HTTP answer (401 with tenants) is a live server.
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/healthz")" != 000 ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$OUT/kvtier-$name.log" >&2; exit 1; }
    sleep 0.2
  done
  echo "kvtier on port $port did not answer" >&2
  exit 1
}
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  PIDS=()
}

if part 1; then
echo "== 1. noisy neighbour: the quiet replay alone, then beside a noisy one, with and without tenants"
quiet() { # name, token args...
  local name=$1; shift
  $BIN/kvtier-loadgen replay --target "http://127.0.0.1:$PORT" "$@" --users 2 --conversations "${QUIET_CONVERSATIONS:-6}" \
    --max-context-tokens 2048 --generation-mode fast --duration-s "${DURATION_S:-40}" --seed 1 --out "$OUT/$name" >/dev/null 2>"$OUT/$name.log"
}
noisy() { # name, token args...
  local name=$1; shift
  $BIN/kvtier-loadgen replay --target "http://127.0.0.1:$PORT" "$@" --users 8 --generation-mode "${NOISY_GENERATION:-none}" --duration-s "${DURATION_S:-40}" --seed 2 \
    --out "$OUT/$name" >/dev/null 2>"$OUT/$name.log"
}
report() { # case, quiet run, noisy run or -
  local q=$OUT/$2/results.json
  local ram share hit noisy_x
  ram=$(json "$q" "r['get_latency_by_tier'].get('ram', {'count': 0})['count']")
  share=$(json "$q" "round(100 * r['get_latency_by_tier'].get('ram', {'count': 0})['count'] / max(r['gets'], 1), 1)")
  hit=$(json "$q" "round(100 * r['prefix_hit_rate'], 1)")
  noisy_x=-
  if [ "$3" != - ]; then noisy_x=$(json "$OUT/$3/results.json" "round(r['blocks_written'] / 256, 1)"); fi
  printf "%-26s %8s %12s %14s %16s\n" "$1" "$(json "$q" "r['gets']")" "$share" "$hit" "$noisy_x"
  echo "$1 $share $hit" >>"$OUT/noisy.txt"
}
rm -f "$OUT/noisy.txt"
serve "$PORT" alone --tenants "$DATA/tenants.toml"
quiet quiet-alone --token-file "$DATA/quiet.token"
stop_all
serve "$PORT" tenants --tenants "$DATA/tenants.toml"
noisy noisy-tenants --token-file "$DATA/noisy.token" &
NOISY=$!
quiet quiet-tenants --token-file "$DATA/quiet.token"
wait "$NOISY"
curl -s -H "Authorization: Bearer quiet-token" "http://127.0.0.1:$PORT/v1/stats" >"$OUT/stats-tenants.json"
stop_all
serve "$PORT" shared
noisy noisy-shared &
NOISY=$!
quiet quiet-shared
wait "$NOISY"
stop_all
printf "%-26s %8s %12s %14s %16s\n" case quiet_gets ram_share_% prefix_hit_% noisy_writes/RAM
report "quiet alone (tenants)" quiet-alone -
report "quiet + noisy, tenants" quiet-tenants noisy-tenants
report "quiet + noisy, no tenants" quiet-shared noisy-shared
python3 - "$OUT/noisy.txt" <<'PY'
import sys
rows = {l.rsplit(None, 2)[0]: (float(l.split()[-2]), float(l.split()[-1])) for l in open(sys.argv[1])}
alone, ten, shared = rows["quiet alone (tenants)"], rows["quiet + noisy, tenants"], rows["quiet + noisy, no tenants"]
print(f"RAM share, tenants vs alone: {ten[0] - alone[0]:+.1f} points; no tenants vs alone: {shared[0] - alone[0]:+.1f} points")
print(f"prefix hit rate, tenants vs alone: {ten[1] - alone[1]:+.1f} points; no tenants vs alone: {shared[1] - alone[1]:+.1f} points")
PY
python3 - "$OUT/stats-tenants.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
for t in s["tenants"]:
    r, n = t["tiers"]["ram"], t["tiers"]["nvme"]
    print(f"  {t['name']:8} ram {r['blocks']:4} blocks (reserved {r['reserved_bytes'] >> 16}), evicted own {r['evicted_own']}, by other {r['evicted_by_other']};"
          f" nvme {n['blocks']} blocks, evicted own {n['evicted_own']}, by other {n['evicted_by_other']}")
PY
fi

if part 2; then
echo "== 2. cost: sweep at C=16, one tenant configured against no tenants file, alternating"
# RAM-served reads (1 GiB tier), so the request path's own cost shows.
RAM_GB=1
cat >"$DATA/one.toml" <<EOF
[[tenant]]
name = "only"
token = "quiet-token"
EOF
serve "$PORT" cost-plain
serve $((PORT + 1)) cost-tenant --tenants "$DATA/one.toml"
rm -f "$OUT/cost.txt"
for i in $(seq "${PAIRS:-7}"); do
  # Which goes first alternates from pair to pair.
  order="plain tenant"
  if [ $((i % 2)) = 0 ]; then order="tenant plain"; fi
  for mode in $order; do
    if [ $mode = plain ]; then port=$PORT; auth=(); else port=$((PORT + 1)); auth=(--token-file "$DATA/quiet.token"); fi
    $BIN/kvtier-loadgen sweep --target "http://127.0.0.1:$port" "${auth[@]}" --concurrency 16 --warmup-s 2 --duration-s "${SWEEP_S:-10}" \
      --working-set-mib 512 --out "$OUT/sweep-$mode-$i" >/dev/null 2>"$OUT/sweep-$mode-$i.log"
    echo "$mode $(json "$OUT/sweep-$mode-$i/results.json" "r['targets'][0]['levels'][0]['tokens_per_s']")" >>"$OUT/cost.txt"
  done
done
stop_all
echo "(odd pairs ran the server without tenants first)"
loadgen/scripts/paired_median.py "$OUT/cost.txt" plain tenant "no tenants tokens/s" "one tenant tokens/s"
fi
