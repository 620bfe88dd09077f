#!/usr/bin/env bash
# HTTP transfer bench (`make bench-http`): kvtier whole-block PUT and GET over
# h2c and HTTP/1.1 at each concurrency, beside iperf3 loopback bandwidth, in
# one run. Each pair measures iperf3 once and then every kvtier case, so a
# ratio compares figures taken within the same minute; the summary gives the
# median ratio over the pairs and its range.
#
# Each size runs twice: with a 2 GiB RAM tier (GETs served from RAM, PUTs
# written through to NVMe) and with none (GETs read from NVMe). Without a
# RAM tier each pair also runs fio: O_DIRECT random reads (io_uring) of the
# same block size at the same depth as the GET concurrency, over a file of
# the size of the GETs' working set, on the data directory's filesystem: the
# device's own speed, which an NVMe-tier GET is compared with.
#
# KVTIER_BEFORE=path/to/kvtier (optional): an older build, run beside this
# one on the same NVMe-only cases (GETs only), for a before/after table.
#
# Settings (environment): SIZES, RAM_GB_LIST, CONCURRENCY, PAIRS,
# SECONDS_PER, OUT, KVTIER_BEFORE.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES=${SIZES:-"1228800 16777216"}
RAM_GB_LIST=${RAM_GB_LIST:-"2 0"}
CONCURRENCY=${CONCURRENCY:-"1 16"}
PAIRS=${PAIRS:-3}
SECONDS_PER=${SECONDS_PER:-5}
OUT=${OUT:-target/bench/http}
KVTIER_BEFORE=${KVTIER_BEFORE:-}
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

# The loadgen's GET working set: max(4 x concurrency, 16) blocks, at most 1 GiB.
working_set_bytes() { python3 -c "import sys; s,c=int(sys.argv[1]),int(sys.argv[2]); print(min(max(4*c,16), max(1,(1<<30)//s))*s)" "$1" "$2"; }

for size in $SIZES; do
for ram in $RAM_GB_LIST; do
  tier=$([ "$ram" = 0 ] && echo nvme || echo ram)
  variants=kvtier
  if [ "$ram" = 0 ] && [ -n "$KVTIER_BEFORE" ]; then variants="kvtier before"; fi
  for variant in $variants; do
  bin=$BIN/kvtier; ops="put get"
  if [ "$variant" = before ]; then bin=$KVTIER_BEFORE; ops=get; fi
  DATA=$(mktemp -d)
  $bin serve --listen 127.0.0.1:0 --data-dir "$DATA" --block-bytes "$size" --disk-gb 8 --segment-mib 512 --ram-gb "$ram" \
    --log-level warn >"$OUT/serve-$size-$tier-$variant.out" 2>"$OUT/serve-$size-$tier-$variant.err" &
  SERVER_PID=$!
  for _ in $(seq 100); do grep -q listening "$OUT/serve-$size-$tier-$variant.out" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$OUT/serve-$size-$tier-$variant.out")
  for pair in $(seq "$PAIRS"); do
    if [ "$variant" = kvtier ]; then
      iperf3 -c 127.0.0.1 -p $IPERF_PORT -t "$SECONDS_PER" -J >"$OUT/iperf3-$size-$tier-$pair.json"
      if [ "$tier" = nvme ]; then
        for c in $CONCURRENCY; do
          fio --name=ref --filename="$DATA/fio.dat" --size="$(working_set_bytes "$size" "$c")" --bs="$size" --rw=randread \
            --direct=1 --ioengine=io_uring --iodepth="$c" --runtime="$SECONDS_PER" --time_based --output-format=json \
            >"$OUT/fio-$size-$c-$pair.json"
          rm -f "$DATA/fio.dat"
        done
      fi
    fi
    for proto in h2c http1; do
      flag=""; [ $proto = http1 ] && flag="--http1"
      for c in $CONCURRENCY; do
        for op in $ops; do
          $BIN/kvtier-loadgen blocks --target "$url" --op $op --concurrency "$c" --duration-s "$SECONDS_PER" $flag \
            --out "$OUT/case-$size-$tier-$proto-$c-$op-$pair-$variant" | tee -a "$OUT/log.txt"
        done
      done
    done
  done
  kill -TERM $SERVER_PID; wait $SERVER_PID || true; SERVER_PID=
  rm -rf "$DATA"; DATA=
  done
done
done

python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
iperf = {}
for f in glob.glob(f"{out}/iperf3-*-*.json"):
    size, tier, pair = os.path.basename(f)[len("iperf3-"):-len(".json")].split("-")
    iperf[(size, tier, pair)] = json.load(open(f))["end"]["sum_received"]["bits_per_second"] / 8
fio = {}
for f in glob.glob(f"{out}/fio-*-*-*.json"):
    size, c, pair = os.path.basename(f)[len("fio-"):-len(".json")].split("-")
    fio[(size, c, pair)] = json.load(open(f))["jobs"][0]["read"]["bw_bytes"]
cases = {}
for f in glob.glob(f"{out}/case-*/results.json"):
    size, tier, proto, c, op, pair, variant = os.path.basename(os.path.dirname(f))[len("case-"):].split("-")
    r = json.load(open(f))
    cases.setdefault((int(size), tier, proto, int(c), op, variant), []).append(dict(
        kvtier=r["bytes_per_s"], iperf3=iperf[(size, tier, pair)], fio=fio.get((size, c, pair)),
        p50_us=r["latency"]["p50_us"], p99_us=r["latency"]["p99_us"], errors=r["errors"]))
med = statistics.median
rows = []
print(f"{'block':>10} {'tier':>5} {'proto':>6} {'conc':>4} {'op':>4} {'build':>6} {'MB/s':>7} {'/iperf3':>8} {'/fio':>6}  /fio range  {'p50 ms':>7} {'p99 ms':>7}")
for (size, tier, proto, c, op, variant), v in sorted(cases.items()):
    vs_iperf = [x["kvtier"] / x["iperf3"] for x in v]
    vs_fio = [x["kvtier"] / x["fio"] for x in v if x["fio"]]
    row = dict(block_bytes=size, tier=tier, protocol=proto, concurrency=c, op=op, build=variant,
               kvtier_bytes_per_s=[x["kvtier"] for x in v], iperf3_bytes_per_s=[x["iperf3"] for x in v],
               fio_bytes_per_s=[x["fio"] for x in v if x["fio"]],
               ratios=vs_iperf, ratio_median=med(vs_iperf), fio_ratios=vs_fio, fio_ratio_median=med(vs_fio) if vs_fio else None,
               errors=sum(x["errors"] for x in v), p50_us_median=med(x["p50_us"] for x in v), p99_us_median=med(x["p99_us"] for x in v))
    rows.append(row)
    fio_cols = f"{row['fio_ratio_median']:>6.2f}  {min(vs_fio):.2f}-{max(vs_fio):.2f}" if vs_fio else f"{'':>6}  {'':>9}"
    print(f"{size:>10} {tier:>5} {proto:>6} {c:>4} {op:>4} {variant:>6} {med(row['kvtier_bytes_per_s'])/1e6:>7.0f} "
          f"{row['ratio_median']:>8.2f} {fio_cols}  {row['p50_us_median']/1000:>7.1f} {row['p99_us_median']/1000:>7.1f}")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
