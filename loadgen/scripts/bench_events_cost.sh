#!/usr/bin/env bash
# What KV events cost (`make bench-events`): the sweep (tagged blocks,
# `kvtier-loadgen sweep --kv-tags`, so every block publishes its moves)
# against two release servers side by side with the same flags, one with
# --kv-events and a subscriber reading its whole stream into a router's
# index (`kvtier-loadgen subscribe`, attached for the whole run), one
# without events. The sweeps alternate between them in one run, PAIRS
# pairs, which goes first alternating too; per pair the PUT and GET
# throughput of the one with events over the one without, then the
# medians and the verdict against the issue's goal (>= 0.97).
#
# The RAM tier holds a quarter of the working set, so reads keep
# promoting blocks from the log into RAM and evicting others: the
# published stream carries a steady flow of BlockStored and BlockRemoved
# (counted per sweep from /v1/stats), not only the preload's.
#
# Settings (environment): PAIRS (5), SWEEP_S (8), CONCURRENCY (16),
# WORKING_SET_MIB (256), RAM_GB (0.0625), BLOCK_BYTES (262144), SHARDS (2),
# OUT (target/bench/events), BIN (target/release).
set -euo pipefail
cd "$(dirname "$0")/../.."
PAIRS=${PAIRS:-5}
SWEEP_S=${SWEEP_S:-8}
CONCURRENCY=${CONCURRENCY:-16}
WORKING_SET_MIB=${WORKING_SET_MIB:-256}
RAM_GB=${RAM_GB:-0.0625}
BLOCK_BYTES=${BLOCK_BYTES:-262144}
SHARDS=${SHARDS:-2}
OUT=${OUT:-target/bench/events}
BIN=${BIN:-target/release}

rm -rf "$OUT" && mkdir -p "$OUT"
# SCRATCH, PIDS, start and stop (loadgen/scripts/nodes.sh).
source loadgen/scripts/nodes.sh
json() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

# start_node NAME [flags...]: a server of this bench's geometry.
start_node() {
  local name=$1; shift
  start "$name" --shards "$SHARDS" --block-bytes "$BLOCK_BYTES" --disk-gb 2 --ram-gb "$RAM_GB" "$@"
}

start_node plain
start_node events --kv-events tcp://127.0.0.1:0
$BIN/kvtier-loadgen subscribe --node "$URL_events" --stop-file "$SCRATCH/stop" --out "$OUT/subscriber" \
  >"$OUT/subscriber.log" 2>&1 &
SUBSCRIBER=$!
for _ in $(seq 100); do
  [ "$(curl -sf "$URL_events/v1/stats" | json /dev/stdin "r['kv_events']['subscribers']")" -ge 1 ] && break
  sleep 0.1
done
echo "subscriber attached to $URL_events: $(curl -sf "$URL_events/v1/stats" | json /dev/stdin "r['kv_events']['subscribers']")"

published() { curl -sf "$URL_events/v1/stats" | json /dev/stdin "r['kv_events']['events_published']"; }
: >"$OUT/put.txt"; : >"$OUT/get.txt"; : >"$OUT/tokens.txt"
for i in $(seq "$PAIRS"); do
  order="plain events"
  if [ $((i % 2)) = 0 ]; then order="events plain"; fi
  for mode in $order; do
    eval "url=\$URL_$mode"
    before=$(published)
    $BIN/kvtier-loadgen sweep --target "$url" --kv-tags --concurrency "$CONCURRENCY" --warmup-s 2 --duration-s "$SWEEP_S" \
      --working-set-mib "$WORKING_SET_MIB" --link-gbps 100 --out "$OUT/sweep-$mode-$i" >"$OUT/sweep-$mode-$i.log" 2>&1
    after=$(published)
    r=$OUT/sweep-$mode-$i/results.json
    echo "$mode $(json "$r" "r['targets'][0]['levels'][0]['blocks_written'] / r['targets'][0]['levels'][0]['elapsed_s']")" >>"$OUT/put.txt"
    echo "$mode $(json "$r" "r['targets'][0]['levels'][0]['blocks_read'] / r['targets'][0]['levels'][0]['elapsed_s']")" >>"$OUT/get.txt"
    echo "$mode $(json "$r" "r['targets'][0]['levels'][0]['tokens_per_s']")" >>"$OUT/tokens.txt"
    echo "pair $i $mode: $(grep -o 'c=.*tokens/s' "$OUT/sweep-$mode-$i.log" | head -1); events published during it: $((after - before))"
  done
done
touch "$SCRATCH/stop"
wait "$SUBSCRIBER" || true
cat "$OUT/subscriber.log"
curl -sf "$URL_events/v1/stats" | python3 -c "import json,sys; k=json.load(sys.stdin)['kv_events']; print('server: published', k['events_published'], 'events in', k['batches_published'], 'batches; dropped', k['events_dropped'], '; unsent batches', k['batches_unsent'])"
echo "(odd pairs ran the server without events first)"
echo "PUT blocks/s:"; loadgen/scripts/paired_median.py "$OUT/put.txt" plain events "events off" "events + subscriber" | tee "$OUT/put-ratio.txt"
echo "GET blocks/s:"; loadgen/scripts/paired_median.py "$OUT/get.txt" plain events "events off" "events + subscriber" | tee "$OUT/get-ratio.txt"
echo "tokens/s:"; loadgen/scripts/paired_median.py "$OUT/tokens.txt" plain events "events off" "events + subscriber" | tee "$OUT/tokens-ratio.txt"
python3 - "$OUT" <<'PY'
import sys
out = sys.argv[1]
ratio = lambda f: float(open(f"{out}/{f}-ratio.txt").read().split()[-1])
put, get = ratio("put"), ratio("get")
ok = min(put, get) >= 0.97
print(f"verdict: PUT {put:.3f}x, GET {get:.3f}x of events off: {'MET' if ok else 'NOT MET'} (goal >= 0.97x)")
open(f"{out}/verdict.txt", "w").write(f"put {put:.3f} get {get:.3f} met {ok}\n")
PY
