#!/usr/bin/env bash
# HTTP transfer bench (`make bench-http`): kvtier whole-block PUT and GET over
# h2c and HTTP/1.1 at each concurrency, beside iperf3 loopback bandwidth, in
# one run. Each pair measures iperf3 once and then every kvtier case, so a
# ratio compares figures taken within the same minute; the summary gives the
# median ratio over the pairs and its range.
#
# Each size runs twice: with a 2 GiB RAM tier (GETs served from RAM, PUTs
# written through to NVMe) and with none (GETs read from NVMe).
#
# Settings (environment): SIZES, RAM_GB_LIST, CONCURRENCY, PAIRS,
# SECONDS_PER, OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES=${SIZES:-"1228800 16777216"}
RAM_GB_LIST=${RAM_GB_LIST:-"2 0"}
CONCURRENCY=${CONCURRENCY:-"1 16"}
PAIRS=${PAIRS:-3}
SECONDS_PER=${SECONDS_PER:-5}
OUT=${OUT:-target/bench/http}
BIN=target/release
IPERF_PORT=5299
# iperf3 takes whole seconds (and runs forever on -t 0).
if ! [[ "$SECONDS_PER" =~ ^[1-9][0-9]*$ ]]; then
  echo "SECONDS_PER must be a whole number of seconds >= 1, got '$SECONDS_PER'" >&2
  exit 2
fi

rm -rf "$OUT" && mkdir -p "$OUT"
iperf3 -s -p $IPERF_PORT >"$OUT/iperf3-server.log" 2>&1 &
IPERF_PID=$!
SERVER_PID=
DATA=
cleanup() {
  kill $IPERF_PID 2>/dev/null || true
  if [ -n "$SERVER_PID" ]; then kill $SERVER_PID 2>/dev/null || true; fi
  if [ -n "$DATA" ]; then rm -rf "$DATA"; fi
}
trap cleanup EXIT
sleep 0.5

for size in $SIZES; do
for ram in $RAM_GB_LIST; do
  tier=$([ "$ram" = 0 ] && echo nvme || echo ram)
  DATA=$(mktemp -d)
  $BIN/kvtier serve --listen 127.0.0.1:0 --data-dir "$DATA" --block-bytes "$size" --disk-gb 8 --segment-mib 512 --ram-gb "$ram" \
    --log-level warn >"$OUT/serve-$size-$tier.out" 2>"$OUT/serve-$size-$tier.err" &
  SERVER_PID=$!
  for _ in $(seq 100); do grep -q listening "$OUT/serve-$size-$tier.out" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$OUT/serve-$size-$tier.out")
  for pair in $(seq "$PAIRS"); do
    iperf3 -c 127.0.0.1 -p $IPERF_PORT -t "$SECONDS_PER" -J >"$OUT/iperf3-$size-$tier-$pair.json"
    for proto in h2c http1; do
      flag=""; [ $proto = http1 ] && flag="--http1"
      for c in $CONCURRENCY; do
        for op in put get; do
          $BIN/kvtier-loadgen blocks --target "$url" --op $op --concurrency "$c" --duration-s "$SECONDS_PER" $flag \
            --out "$OUT/case-$size-$tier-$proto-$c-$op-$pair" | tee -a "$OUT/log.txt"
        done
      done
    done
  done
  kill -TERM $SERVER_PID; wait $SERVER_PID || true; SERVER_PID=
  rm -rf "$DATA"; DATA=
done
done

python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
iperf = {}
for f in glob.glob(f"{out}/iperf3-*-*.json"):
    size, tier, pair = os.path.basename(f)[len("iperf3-"):-len(".json")].split("-")
    iperf[(size, tier, pair)] = json.load(open(f))["end"]["sum_received"]["bits_per_second"] / 8
cases = {}
for f in glob.glob(f"{out}/case-*/results.json"):
    size, tier, proto, c, op, pair = os.path.basename(os.path.dirname(f))[len("case-"):].split("-")
    r = json.load(open(f))
    cases.setdefault((int(size), tier, proto, int(c), op), []).append((r["bytes_per_s"], iperf[(size, tier, pair)], r["latency"]["p50_us"], r["errors"]))
rows = []
print(f"{'block':>10} {'tier':>5} {'proto':>6} {'conc':>4} {'op':>4} {'kvtier MB/s':>12} {'iperf3 MB/s':>12} {'ratio':>6}  range        p50 ms")
for (size, tier, proto, c, op), v in sorted(cases.items()):
    ratios = [b / i for b, i, _, _ in v]
    row = dict(block_bytes=size, tier=tier, protocol=proto, concurrency=c, op=op,
               kvtier_bytes_per_s=[b for b, *_ in v], iperf3_bytes_per_s=[i for _, i, *_ in v],
               ratios=ratios, ratio_median=statistics.median(ratios), errors=sum(e for *_, e in v),
               p50_us_median=statistics.median(p for _, _, p, _ in v))
    rows.append(row)
    print(f"{size:>10} {tier:>5} {proto:>6} {c:>4} {op:>4} {statistics.median(row['kvtier_bytes_per_s'])/1e6:>12.0f} "
          f"{statistics.median(row['iperf3_bytes_per_s'])/1e6:>12.0f} {row['ratio_median']:>6.2f}  "
          f"{min(ratios):.2f}-{max(ratios):.2f}  {row['p50_us_median']/1000:>8.1f}")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
