#!/usr/bin/env bash
# GET from the GPU tier against GET from the RAM tier over h2c (`make
# gpu-check`), in one run: two servers side by side on the same data size,
# one with only a GPU tier (--gpu-mem-gb, --ram-gb 0), one with only a RAM
# tier, each serving `kvtier-loadgen blocks --op get` (a working set of
# max(4 x concurrency, 16) blocks, read at random, every body checked). Each
# pair measures the GPU server then the RAM server within the same minute;
# the summary gives the median GPU/RAM ratio over the pairs and its range,
# and checks from /v1/stats that the GPU server served from the GPU.
#
# Settings (environment): SIZES, CONCURRENCY, PAIRS, SECONDS_PER, GPU_GB,
# BIN (default target/release), OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES=${SIZES:-"16777216 1228800"}
CONCURRENCY=${CONCURRENCY:-"1 16"}
PAIRS=${PAIRS:-3}
SECONDS_PER=${SECONDS_PER:-5}
GPU_GB=${GPU_GB:-2}
BIN=${BIN:-target/release}
OUT=${OUT:-target/bench/gpu-get}

rm -rf "$OUT" && mkdir -p "$OUT"
PIDS=()
DATAS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for d in "${DATAS[@]}"; do rm -rf "$d"; done
}
trap cleanup EXIT

start() { # name extra-flags...
  local name=$1; shift
  local data; data=$(mktemp -d); DATAS+=("$data")
  $BIN/kvtier serve --listen 127.0.0.1:0 --data-dir "$data" --block-bytes "$size" --disk-gb 8 --segment-mib 512 \
    --log-level warn "$@" >"$OUT/serve-$size-$name.out" 2>"$OUT/serve-$size-$name.err" &
  PIDS+=($!)
  for _ in $(seq 300); do grep -q listening "$OUT/serve-$size-$name.out" && break; sleep 0.1; done
  grep -o 'http://[0-9.:]*' "$OUT/serve-$size-$name.out" || { cat "$OUT/serve-$size-$name.err" >&2; exit 1; }
}

for size in $SIZES; do
  gpu_url=$(start gpu --gpu-mem-gb "$GPU_GB" --ram-gb 0 --shards 1)
  ram_url=$(start ram --ram-gb "$GPU_GB" --shards 1)
  for pair in $(seq "$PAIRS"); do
    for c in $CONCURRENCY; do
      for tier in gpu ram; do
        url=$([ $tier = gpu ] && echo "$gpu_url" || echo "$ram_url")
        $BIN/kvtier-loadgen blocks --target "$url" --op get --concurrency "$c" --duration-s "$SECONDS_PER" \
          --out "$OUT/case-$size-$tier-$c-$pair" | tee -a "$OUT/log.txt"
      done
    done
  done
  curl -s "$gpu_url/v1/stats" >"$OUT/stats-$size-gpu.json"
  curl -s "$ram_url/v1/stats" >"$OUT/stats-$size-ram.json"
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  PIDS=()
done

python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
cases = {}
for f in glob.glob(f"{out}/case-*/results.json"):
    size, tier, c, pair = os.path.basename(os.path.dirname(f))[len("case-"):].split("-")
    r = json.load(open(f))
    assert r["errors"] == 0, f
    cases.setdefault((int(size), int(c), int(pair)), {})[tier] = (r["bytes_per_s"], r["latency"]["p50_us"])
for f in glob.glob(f"{out}/stats-*-gpu.json"):
    tiers = {t["tier"]: t for t in json.load(open(f))["tiers"]}
    assert tiers["gpu"]["hits"] > 0 and "ram" not in tiers, f"{f}: GETs were not served from the GPU tier"
rows = {}
for (size, c, pair), v in cases.items():
    rows.setdefault((size, c), []).append((v["gpu"][0], v["ram"][0], v["gpu"][1], v["ram"][1]))
summary = []
print(f"{'block':>10} {'conc':>4} {'GPU MB/s':>10} {'RAM MB/s':>10} {'ratio':>6}  range      p50 ms gpu/ram")
for (size, c), v in sorted(rows.items()):
    ratios = [g / r for g, r, _, _ in v]
    row = dict(block_bytes=size, concurrency=c, gpu_bytes_per_s=[g for g, *_ in v], ram_bytes_per_s=[r for _, r, *_ in v],
               ratios=ratios, ratio_median=statistics.median(ratios))
    summary.append(row)
    print(f"{size:>10} {c:>4} {statistics.median(row['gpu_bytes_per_s'])/1e6:>10.0f} {statistics.median(row['ram_bytes_per_s'])/1e6:>10.0f} "
          f"{row['ratio_median']:>6.2f}  {min(ratios):.2f}-{max(ratios):.2f}  "
          f"{statistics.median(g for *_, g, _ in v)/1000:.1f}/{statistics.median(r for *_, r in v)/1000:.1f}")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
