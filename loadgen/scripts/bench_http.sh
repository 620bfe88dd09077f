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
# NVMe-tier GETs over h2c are also measured with h2load (nghttp2's load
# client, 1 MiB frames, one connection with `concurrency` streams, like the
# loadgen) over the same keys the loadgen stored: a second, independent h2
# client, whose mean request time is reported (h2load gives no p50).
#
# KVTIER_BEFORE=path/to/kvtier (optional): an older build, serving beside
# this one on the NVMe-only cases and measured in the same pairs (GETs
# only), for a before/after table.
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
PIDS=()
DIRS=()
cleanup() {
  kill $IPERF_PID 2>/dev/null || true
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for d in "${DIRS[@]}"; do rm -rf "$d"; done
}
trap cleanup EXIT
sleep 0.5

# The loadgen's GET working set at concurrency $1: max(4 x concurrency, 16)
# blocks, keys blocks-SIZE-0..N-1 (loadgen/src/blocks.rs).
working_set_blocks() { echo $(( 4 * $1 > 16 ? 4 * $1 : 16 )); }
# fio's file for block size $1 at concurrency $2: the working set, at most 1 GiB.
working_set_bytes() {
  local n max
  n=$(working_set_blocks "$2"); max=$(( (1 << 30) / $1 )); [ "$max" -ge 1 ] || max=1
  [ "$n" -le "$max" ] || n=$max
  echo $(( n * $1 ))
}

# Starts `kvtier serve` ($1: binary, $2: block bytes, $3: RAM GiB, $4: log
# name) on a fresh data directory; sets $url.
start_server() {
  local dir; dir=$(mktemp -d); DIRS+=("$dir")
  "$1" serve --listen 127.0.0.1:0 --data-dir "$dir" --block-bytes "$2" --disk-gb 8 --segment-mib 512 --ram-gb "$3" \
    --log-level warn >"$OUT/serve-$4.out" 2>"$OUT/serve-$4.err" &
  PIDS+=($!)
  for _ in $(seq 100); do grep -q listening "$OUT/serve-$4.out" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$OUT/serve-$4.out")
}

# GETs with h2load ($1: URL, $2: block bytes, $3: concurrency, $4: case
# directory) over the loadgen's GET working set (blocks-SIZE-0..N-1, stored
# by the loadgen GET run just before); writes results.json like the loadgen's.
h2load_get() {
  local n uris=() log
  n=$(working_set_blocks "$3")
  for i in $(seq 0 $((n - 1))); do uris+=("$1/v1/blocks/blocks-$2-$i"); done
  mkdir -p "$4"; log="$4/h2load.txt"
  h2load -c 1 -m "$3" -f 1M -w 24 -W 26 -D "$SECONDS_PER" "${uris[@]}" >"$log" 2>&1
  python3 - "$log" "$2" "$4/results.json" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
secs = float(re.search(r"finished in ([\d.]+)s", text).group(1))
done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", text)
mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", text)
mean_us = float(mean.group(1)) * {"us": 1, "ms": 1e3, "s": 1e6}[mean.group(2)]
ok, failed, errored = int(done.group(2)), int(done.group(3)), int(done.group(4))
# A request cut by the end of the run may count as 2xx and not done.
status = re.search(r"status codes: \d+ 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text)
if status is None or any(int(x) for x in status.groups()):
    sys.exit(f"h2load: a request was answered other than 2xx:\n{text}")
bytes_per_s = ok * int(sys.argv[2]) / secs
json.dump({"bytes_per_s": bytes_per_s, "errors": failed + errored,
           "latency": {"p50_us": None, "p99_us": None, "mean_us": mean_us}}, open(sys.argv[3], "w"))
print(f"h2load get: {ok} requests ({failed + errored} errors), {bytes_per_s / 1e6:.0f} MB/s, mean {mean_us:.0f} µs")
PY
}

for size in $SIZES; do
for ram in $RAM_GB_LIST; do
  tier=$([ "$ram" = 0 ] && echo nvme || echo ram)
  # Every build under test serves at once, so each pair measures them (and
  # fio) within the same minute.
  declare -A urls=()
  start_server "$BIN/kvtier" "$size" "$ram" "$size-$tier-kvtier"; urls[kvtier]=$url
  variants=kvtier
  if [ "$tier" = nvme ] && [ -n "$KVTIER_BEFORE" ]; then
    start_server "$KVTIER_BEFORE" "$size" "$ram" "$size-$tier-before"; urls[before]=$url
    variants="kvtier before"
  fi
  for pair in $(seq "$PAIRS"); do
    iperf3 -c 127.0.0.1 -p $IPERF_PORT -t "$SECONDS_PER" -J >"$OUT/iperf3-$size-$tier-$pair.json"
    for c in $CONCURRENCY; do
      if [ "$tier" = nvme ]; then
        fio --name=ref --filename="${DIRS[0]}/fio.dat" --size="$(working_set_bytes "$size" "$c")" --bs="$size" --rw=randread \
          --direct=1 --ioengine=io_uring --iodepth="$c" --runtime="$SECONDS_PER" --time_based --output-format=json \
          >"$OUT/fio-$size-$c-$pair.json"
        rm -f "${DIRS[0]}/fio.dat"
      fi
      for proto in h2c http1; do
        flag=""; [ $proto = http1 ] && flag="--http1"
        for variant in $variants; do
          ops="put get"; [ "$variant" = before ] && ops=get
          for op in $ops; do
            $BIN/kvtier-loadgen blocks --target "${urls[$variant]}" --op $op --concurrency "$c" --duration-s "$SECONDS_PER" $flag \
              --out "$OUT/case-$size-$tier-$proto-$c-$op-$pair-$variant" | tee -a "$OUT/log.txt"
            if [ "$tier" = nvme ] && [ "$proto" = h2c ] && [ "$op" = get ]; then
              h2load_get "${urls[$variant]}" "$size" "$c" "$OUT/case-$size-$tier-h2load-$c-$op-$pair-$variant"
            fi
          done
        done
      done
    done
  done
  for pid in "${PIDS[@]}"; do kill -TERM "$pid"; wait "$pid" || true; done
  for d in "${DIRS[@]}"; do rm -rf "$d"; done
  PIDS=(); DIRS=()
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
        p50_us=r["latency"]["p50_us"], p99_us=r["latency"]["p99_us"], mean_us=r["latency"].get("mean_us"), errors=r["errors"]))
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
               errors=sum(x["errors"] for x in v))
    if v[0]["p50_us"] is None:  # h2load: mean request time only
        row.update(mean_us_median=med(x["mean_us"] for x in v), p50_us_median=None, p99_us_median=None)
        lat = f"{'mean':>7} {row['mean_us_median']/1000:>7.1f}"
    else:
        row.update(p50_us_median=med(x["p50_us"] for x in v), p99_us_median=med(x["p99_us"] for x in v))
        lat = f"{row['p50_us_median']/1000:>7.1f} {row['p99_us_median']/1000:>7.1f}"
    rows.append(row)
    fio_cols = f"{row['fio_ratio_median']:>6.2f}  {min(vs_fio):.2f}-{max(vs_fio):.2f}" if vs_fio else f"{'':>6}  {'':>9}"
    print(f"{size:>10} {tier:>5} {proto:>6} {c:>4} {op:>4} {variant:>6} {med(row['kvtier_bytes_per_s'])/1e6:>7.0f} "
          f"{row['ratio_median']:>8.2f} {fio_cols}  {lat}")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
