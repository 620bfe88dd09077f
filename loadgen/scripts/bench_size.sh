#!/usr/bin/env bash
# `make bench-size`: tier sizing from traces, measured.
#  1. A ShareGPT trace of at least 10 million records, written by the replay
#     against the in-process model store (no server): the exact curve, and
#     SHARDS at 1 % and 0.1 %, each alone (time, peak RSS) and beside the
#     exact one (mean absolute error).
#  2. Predicted against measured: a real `kvtier serve` with the recorder on
#     replays the same conversations at a small RAM tier; the curve from its
#     trace predicts the RAM hit ratio, measured at the knee and at 4x it.
#  3. Recorder cost: the sweep at C=16 against one server (64 KiB blocks),
#     the recorder off and on in turn (toggled by the admin route: no restart
#     between the two), PAIRS pairs; the median of on/off.
# Settings (environment): PARTS ("1 2 3": which of the above), PASSES (2),
# USERS (32), CONVERSATIONS (400, part 2), PAIRS (7), SWEEP_S (10), OUT
# (target/bench-size).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-target/bench-size}
BIN=target/release
PORT=${PORT:-8187}
DATA=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-bench-size.XXXXXX")
PID=
cleanup() {
  if [ -n "$PID" ]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi
  rm -rf "$DATA"
}
trap cleanup EXIT
mkdir -p "$OUT"
json() { python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

part() { [[ " ${PARTS:-1 2 3} " == *" $1 "* ]]; }
if part 1; then
echo "== 1. exact against SHARDS on a ShareGPT trace"
TRACE=$OUT/sharegpt.kvtrace
$BIN/kvtier-loadgen replay --target model:// --users "${USERS:-32}" --passes "${PASSES:-2}" --duration-s 3600 \
  --block-tokens 16 --trace-out "$TRACE" --out "$OUT/replay-model" >/dev/null 2>"$OUT/replay-model.log"
run_size() { # name, args...
  local name=$1; shift
  /usr/bin/time -f "%e %M" -o "$OUT/$name.time" $BIN/kvtier-loadgen size "$TRACE" --policy-sizes 0 --out "$OUT/$name" "$@" >"$OUT/$name.txt"
}
run_size exact
run_size shards-1 --sample-rate 0.01 --skip-exact
run_size shards-0.1 --sample-rate 0.001 --skip-exact
run_size mae-1 --sample-rate 0.01
run_size mae-0.1 --sample-rate 0.001
records=$(json "$OUT/exact/results.json" "r['records']")
echo "trace: $records records, $(json "$OUT/exact/results.json" "r['distinct_blocks']") distinct blocks"
printf "%-12s %12s %12s %14s %10s\n" method curve_s whole_s peak_rss_mib mae
exact_s=$(json "$OUT/exact/results.json" "r['memory']['seconds']")
printf "%-12s %12.3f %12s %14d %10s\n" exact "$exact_s" "$(cut -d' ' -f1 "$OUT/exact.time")" $(( $(cut -d' ' -f2 "$OUT/exact.time") / 1024 )) -
for r in 1 0.1; do
  s=$(json "$OUT/shards-$r/results.json" "r['memory_shards']['seconds']")
  mae=$(json "$OUT/mae-$r/results.json" "round(r['memory_shards_mae'], 5)")
  printf "%-12s %12.3f %12s %14d %10s\n" "shards-$r%" "$s" "$(cut -d' ' -f1 "$OUT/shards-$r.time")" $(( $(cut -d' ' -f2 "$OUT/shards-$r.time") / 1024 )) "$mae"
  echo "  SHARDS $r% curve is $(python3 -c "print(round($exact_s / max($s, 1e-9), 1))")x faster than the exact one"
done
echo "exact pass: $(json "$OUT/exact/results.json" "round(r['exact_records_per_s'] / 1e6, 2)") M records/s, $(json "$OUT/exact/results.json" "round(r['exact_references_per_s'] / 1e6, 2)") M references/s (one core)"

fi

serve() { # ram_gb, trace_dir_or_empty
  local extra=()
  if [ -n "$2" ]; then extra=(--trace-dir "$2"); fi
  rm -rf "$DATA/kv"
  $BIN/kvtier serve --listen 127.0.0.1:$PORT --data-dir "$DATA/kv" --shards 2 --block-bytes 65536 --block-tokens 16 \
    --disk-gb 4 --ram-gb "$1" --log-level warn "${extra[@]}" >"$OUT/kvtier.log" 2>&1 &
  PID=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && return 0
    kill -0 "$PID" 2>/dev/null || { cat "$OUT/kvtier.log" >&2; exit 1; }
    sleep 0.2
  done
}
stop() { kill "$PID"; wait "$PID" 2>/dev/null || true; PID=; }
if part 2; then
echo "== 2. predicted against measured (real kvtier, recorder on)"
replay() { # name
  $BIN/kvtier-loadgen replay --target "http://127.0.0.1:$PORT" --users 16 --passes 2 --conversations "${CONVERSATIONS:-400}" \
    --duration-s 3600 --out "$OUT/$1" >/dev/null 2>"$OUT/$1.log"
  json "$OUT/$1/results.json" "r['get_latency_by_tier'].get('ram', {'count': 0})['count'] / r['gets']"
}
gb() { python3 -c "print($1 * 2 * 65536 / 2**30)"; }
SMALL=256
rm -rf "$OUT/traces-small"
serve "$(gb $SMALL)" "$OUT/traces-small"
measured_small=$(replay replay-small)
stop
$BIN/kvtier-loadgen size "$OUT/traces-small" --policy-sizes 0 --out "$OUT/size-small" >"$OUT/size-small.txt"
KNEE=$(json "$OUT/size-small/results.json" "r['memory']['knee']['blocks_per_shard']")
LARGE=$(( KNEE * 4 ))
predict() { $BIN/kvtier-loadgen size "$OUT/traces-small" --policy-sizes 0 --ram-gb "$(gb "$1")" --out "$OUT/predict-$1" >/dev/null; json "$OUT/predict-$1/results.json" "[t for t in r['tiers'] if t['tier']=='ram'][0]['configured']['hit_ratio']"; }
printf "%-8s %14s %12s %12s %10s\n" size slots/shard predicted measured diff_pp
for pair in "small:$SMALL:$measured_small" "knee:$KNEE:" "large:$LARGE:"; do
  IFS=: read -r name slots measured <<<"$pair"
  if [ -z "$measured" ]; then serve "$(gb "$slots")" ""; measured=$(replay "replay-$name"); stop; fi
  p=$(predict "$slots")
  printf "%-8s %14s %12.4f %12.4f %10.2f\n" "$name" "$slots" "$p" "$measured" "$(python3 -c "print(100 * ($p - $measured))")"
done

fi

if part 3; then
echo "== 3. recorder cost: sweep at C=16, off and on alternating on one server (the admin route toggles it)"
serve 1 "$DATA/traces-cost"
admin() { curl -sf -X POST "http://127.0.0.1:$PORT/v1/admin/trace/$1" >"$OUT/trace-state.json"; }
admin stop
for i in $(seq "${PAIRS:-7}"); do
  for mode in off on; do
    if [ $mode = on ]; then admin start; fi
    $BIN/kvtier-loadgen sweep --target "http://127.0.0.1:$PORT" --concurrency 16 --warmup-s 2 --duration-s "${SWEEP_S:-10}" \
      --working-set-mib 512 --out "$OUT/sweep-$mode-$i" >/dev/null 2>&1
    if [ $mode = on ]; then
      admin stop
      echo "  pair $i: $(json "$OUT/trace-state.json" "r['records']") records so far, $(json "$OUT/trace-state.json" "r['dropped_records']") dropped"
    fi
    echo "$mode $(json "$OUT/sweep-$mode-$i/results.json" "r['targets'][0]['levels'][0]['tokens_per_s']")" >>"$OUT/recorder.txt.$$"
  done
done
stop
loadgen/scripts/paired_median.py "$OUT/recorder.txt.$$" off on "recorder off tokens/s" "recorder on tokens/s"
rm -f "$OUT/recorder.txt.$$"
fi
