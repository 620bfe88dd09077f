#!/usr/bin/env bash
# HTTP transfer bench (`make bench-http`): kvtier whole-block PUT and GET over
# h2c and HTTP/1.1 at each concurrency, beside iperf3 loopback bandwidth, in
# one run. Each pair measures iperf3 once and then every case, so a ratio
# compares figures taken within the same minute; the summary gives the
# median ratio over the pairs and its range.
#
# Each size runs twice: with a 2 GiB RAM tier (GETs served from RAM, PUTs
# written through to NVMe) and with none (GETs read from NVMe).
#
# Two clients, two access patterns:
# - the loadgen (`kvtier-loadgen blocks`): its working set of
#   max(4 x concurrency, 16) blocks; h2c is one connection with
#   `concurrency` streams, HTTP/1.1 one connection per request in flight.
# - h2load (nghttp2's load client, 1 MiB frames), as a remote client or a
#   user with standard tools would: `concurrency` connections of one
#   request each (`-c C -m 1`), over h2c and HTTP/1.1 (`--h1`), GETs of
#   random keys over 2 GiB of blocks (the NVMe tier) or 1 GiB (the RAM
#   tier, which holds it), stored with curl before the pairs. Cases
#   `h2conns` and `h1conns`. (Also, on the NVMe tier, h2load with one
#   connection of `concurrency` streams over the loadgen's working set:
#   case `h2load`.)
#
# References, in the same pairs:
# - NVMe tier: fio O_DIRECT random reads (io_uring) of the same block size
#   at depth = concurrency, over a 2 GiB file on the data directory's
#   filesystem, laid out once per size and read in every pair. (Earlier
#   versions laid out a file of the working set's size, at most 1 GiB,
#   right before each fio run and deleted it after: at 16 MiB and depth 16
#   that read 0.74-1.05x what the settled 2 GiB file did in the same
#   pairs; docs/BENCHMARKS.md.)
# - RAM tier: `kvtier-http-reference`, a bare hyper-on-glommio block server
#   (blocks in a map, same executors and HTTP settings as kvtier; see its
#   --help), serving beside kvtier: the same cases against it give kvtier's
#   cost per request beyond HTTP as a ratio (column /ref). Since issue 43
#   each of its executors answers GETs from a map of its own (no lock
#   another executor's GETs take); before, one RwLock'd map was shared.
#
# REFERENCE_BEFORE=path/to/old/kvtier-http-reference (optional): an older
# reference, serving beside the new one on the RAM tier and measured in the
# same pairs (GETs only), as column /refold (the new reference's own row
# gives new/old).
#
# KVTIER_BEFORE=path/to/kvtier (optional): an older build, serving beside
# this one and measured in the same pairs (GETs only), for a before/after
# table.
#
# Settings (environment): SIZES, RAM_GB_LIST, CONCURRENCY, PAIRS,
# SECONDS_PER, OUT, KVTIER_BEFORE, REFERENCE_BEFORE, SHARDS.
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES=${SIZES:-"1228800 16777216"}
RAM_GB_LIST=${RAM_GB_LIST:-"2 0"}
CONCURRENCY=${CONCURRENCY:-"1 16"}
PAIRS=${PAIRS:-3}
SECONDS_PER=${SECONDS_PER:-5}
OUT=${OUT:-target/bench/http}
KVTIER_BEFORE=${KVTIER_BEFORE:-}
REFERENCE_BEFORE=${REFERENCE_BEFORE:-}
SHARDS=${SHARDS:-2}
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

# Waits for "listening on http://..." in $1 (a server's stdout); sets $url.
await_url() {
  for _ in $(seq 600); do grep -q listening "$1" && break; sleep 0.1; done
  url=$(grep -o 'http://[0-9.:]*' "$1")
}

# Starts `kvtier serve` ($1: binary, $2: block bytes, $3: RAM GiB, $4: log
# name) on a fresh data directory; sets $url.
start_server() {
  local dir; dir=$(mktemp -d); DIRS+=("$dir")
  "$1" serve --listen 127.0.0.1:0 --data-dir "$dir" --block-bytes "$2" --disk-gb 8 --segment-mib 512 --ram-gb "$3" \
    --shards "$SHARDS" --log-level warn >"$OUT/serve-$4.out" 2>"$OUT/serve-$4.err" &
  PIDS+=($!)
  await_url "$OUT/serve-$4.out"
}

# Starts the reference server ($1: block bytes, $2: log name, $3: binary,
# $BIN/kvtier-http-reference if none); sets $url.
start_reference() {
  "${3:-$BIN/kvtier-http-reference}" --listen 127.0.0.1:0 --block-bytes "$1" --shards "$SHARDS" --capacity-mib 2048 \
    >"$OUT/serve-$2.out" 2>"$OUT/serve-$2.err" &
  PIDS+=($!)
  await_url "$OUT/serve-$2.out"
}

# Stores $2 blocks of $3 bytes under keys remote-0..N-1 at URL $1 with curl.
store_blocks() {
  head -c "$3" /dev/urandom >"$OUT/block.bin"
  seq 0 $(($2 - 1)) | xargs -P 4 -I{} curl -sf -o /dev/null -X PUT --data-binary @"$OUT/block.bin" "$1/v1/blocks/remote-{}"
  rm -f "$OUT/block.bin"
}

# Writes h2load's figures ($1: its output, $2: block bytes) as results.json
# in directory $3, like the loadgen's.
h2load_results() {
  python3 - "$1" "$2" "$3/results.json" <<'PY'
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

# h2load GETs, one connection of $3 streams ($1: URL, $2: block bytes, $4:
# case directory), over the loadgen's GET working set (blocks-SIZE-0..N-1,
# stored by the loadgen GET run just before).
h2load_streams() {
  local n uris=()
  n=$(working_set_blocks "$3")
  for i in $(seq 0 $((n - 1))); do uris+=("$1/v1/blocks/blocks-$2-$i"); done
  mkdir -p "$4"
  h2load -c 1 -m "$3" -f 1M -w 24 -W 26 -D "$SECONDS_PER" "${uris[@]}" >"$4/h2load.txt" 2>&1
  h2load_results "$4/h2load.txt" "$2" "$4"
}

# h2load GETs over $3 connections of one request each ($1: URL, $2: block
# bytes, $4: blocks stored by store_blocks, $5: case directory, $6: extra
# h2load flag, --h1 for HTTP/1.1), keys in a random order.
h2load_conns() {
  mkdir -p "$5"
  seq 0 $(($4 - 1)) | shuf | sed "s|^|$1/v1/blocks/remote-|" >"$5/uris.txt"
  # shellcheck disable=SC2086
  h2load -c "$3" -m 1 -f 1M $6 -D "$SECONDS_PER" -i "$5/uris.txt" >"$5/h2load.txt" 2>&1
  h2load_results "$5/h2load.txt" "$2" "$5"
}

for size in $SIZES; do
for ram in $RAM_GB_LIST; do
  tier=$([ "$ram" = 0 ] && echo nvme || echo ram)
  # Every server under test serves at once, so each pair measures them (and
  # fio) within the same minute.
  declare -A urls=()
  start_server "$BIN/kvtier" "$size" "$ram" "$size-$tier-kvtier"; urls[kvtier]=$url
  variants=kvtier
  if [ -n "$KVTIER_BEFORE" ]; then
    start_server "$KVTIER_BEFORE" "$size" "$ram" "$size-$tier-before"; urls[before]=$url
    variants="$variants before"
  fi
  if [ "$tier" = ram ]; then
    start_reference "$size" "$size-reference"; urls[reference]=$url
    variants="$variants reference"
    if [ -n "$REFERENCE_BEFORE" ]; then
      start_reference "$size" "$size-refbefore" "$REFERENCE_BEFORE"; urls[refbefore]=$url
      variants="$variants refbefore"
    fi
    remote_blocks=$(( (1 << 30) / size ))
  else
    remote_blocks=$(( (2 << 30) / size ))
    fio_file="${DIRS[0]}/fio.dat"
    fio --name=layout --filename="$fio_file" --size=2G --rw=write --bs=1M --direct=1 --ioengine=io_uring --iodepth=4 \
      --output="$OUT/fio-layout-$size.txt"
  fi
  for pair in $(seq "$PAIRS"); do
    iperf3 -c 127.0.0.1 -p $IPERF_PORT -t "$SECONDS_PER" -J >"$OUT/iperf3-$size-$tier-$pair.json"
    # The random-key GETs first, on blocks stored afresh in each pair (the
    # loadgen's PUTs of the pair before have evicted them from RAM, or
    # reclaimed them from the log); the writes settle before the reads.
    for variant in $variants; do store_blocks "${urls[$variant]}" "$remote_blocks" "$size"; done
    sync; sleep 3
    for c in $CONCURRENCY; do
      if [ "$tier" = nvme ]; then
        fio --name=ref --filename="$fio_file" --size=2G --bs="$size" --rw=randread \
          --direct=1 --ioengine=io_uring --iodepth="$c" --runtime="$SECONDS_PER" --time_based --output-format=json \
          >"$OUT/fio-$size-$c-$pair.json"
      fi
      for variant in $variants; do
        h2load_conns "${urls[$variant]}" "$size" "$c" "$remote_blocks" "$OUT/case-$size-$tier-h2conns-$c-get-$pair-$variant" ""
        h2load_conns "${urls[$variant]}" "$size" "$c" "$remote_blocks" "$OUT/case-$size-$tier-h1conns-$c-get-$pair-$variant" --h1
      done
    done
    for c in $CONCURRENCY; do
      for proto in h2c http1; do
        flag=""; [ $proto = http1 ] && flag="--http1"
        for variant in $variants; do
          ops="put get"; { [ "$variant" = before ] || [ "$variant" = refbefore ]; } && ops=get
          for op in $ops; do
            $BIN/kvtier-loadgen blocks --target "${urls[$variant]}" --op $op --concurrency "$c" --duration-s "$SECONDS_PER" $flag \
              --out "$OUT/case-$size-$tier-$proto-$c-$op-$pair-$variant" | tee -a "$OUT/log.txt"
            if [ "$tier" = nvme ] && [ "$proto" = h2c ] && [ "$op" = get ]; then
              h2load_streams "${urls[$variant]}" "$size" "$c" "$OUT/case-$size-$tier-h2load-$c-$op-$pair-$variant"
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
runs = {}
for f in glob.glob(f"{out}/case-*/results.json"):
    size, tier, proto, c, op, pair, variant = os.path.basename(os.path.dirname(f))[len("case-"):].split("-")
    runs[(size, tier, proto, c, op, pair, variant)] = json.load(open(f))
cases = {}
for (size, tier, proto, c, op, pair, variant), r in runs.items():
    ref = runs.get((size, tier, proto, c, op, pair, "reference"))
    refold = runs.get((size, tier, proto, c, op, pair, "refbefore"))
    cases.setdefault((int(size), tier, proto, int(c), op, variant), []).append(dict(
        kvtier=r["bytes_per_s"], iperf3=iperf[(size, tier, pair)], fio=fio.get((size, c, pair)) if tier == "nvme" else None,
        ref=ref["bytes_per_s"] if ref and variant not in ("reference", "refbefore") else None,
        refold=refold["bytes_per_s"] if refold and variant != "refbefore" else None,
        p50_us=r["latency"]["p50_us"], p99_us=r["latency"]["p99_us"], mean_us=r["latency"].get("mean_us"), errors=r["errors"]))
med = statistics.median
rows = []
print("client: h2c/http1 = loadgen; h2load = one h2c connection of `conc` streams; "
      "h2conns/h1conns = h2load, `conc` connections of one request (h2c / HTTP/1.1) over random keys")
print("/fio: NVMe tier against fio randread over a 2 GiB file; /ref: RAM tier against kvtier-http-reference"
      " (per-executor maps); /refold: against REFERENCE_BEFORE (one shared RwLock'd map), when given")
print(f"{'block':>10} {'tier':>5} {'client':>7} {'conc':>4} {'op':>4} {'server':>9} {'MB/s':>7} {'/iperf3':>8} {'/fio':>6} {'/ref':>6} {'/refold':>7}  range       {'p50 ms':>7} {'p99 ms':>7}")
for (size, tier, proto, c, op, variant), v in sorted(cases.items()):
    vs_iperf = [x["kvtier"] / x["iperf3"] for x in v]
    vs_fio = [x["kvtier"] / x["fio"] for x in v if x["fio"]]
    vs_ref = [x["kvtier"] / x["ref"] for x in v if x["ref"]]
    vs_refold = [x["kvtier"] / x["refold"] for x in v if x["refold"]]
    row = dict(block_bytes=size, tier=tier, client=proto, concurrency=c, op=op, build=variant,
               bytes_per_s=[x["kvtier"] for x in v], iperf3_bytes_per_s=[x["iperf3"] for x in v],
               fio_bytes_per_s=[x["fio"] for x in v if x["fio"]], reference_bytes_per_s=[x["ref"] for x in v if x["ref"]],
               ratios=vs_iperf, ratio_median=med(vs_iperf), fio_ratios=vs_fio, fio_ratio_median=med(vs_fio) if vs_fio else None,
               reference_ratios=vs_ref, reference_ratio_median=med(vs_ref) if vs_ref else None,
               reference_before_ratios=vs_refold, reference_before_ratio_median=med(vs_refold) if vs_refold else None,
               errors=sum(x["errors"] for x in v))
    if v[0]["p50_us"] is None:  # h2load: mean request time only
        row.update(mean_us_median=med(x["mean_us"] for x in v), p50_us_median=None, p99_us_median=None)
        lat = f"{'mean':>7} {row['mean_us_median']/1000:>7.1f}"
    else:
        row.update(p50_us_median=med(x["p50_us"] for x in v), p99_us_median=med(x["p99_us"] for x in v))
        lat = f"{row['p50_us_median']/1000:>7.1f} {row['p99_us_median']/1000:>7.1f}"
    rows.append(row)
    spread = vs_fio or vs_ref or vs_refold
    fio_col = f"{row['fio_ratio_median']:>6.2f}" if vs_fio else f"{'':>6}"
    ref_col = f"{row['reference_ratio_median']:>6.2f}" if vs_ref else f"{'':>6}"
    ref_col += f" {row['reference_before_ratio_median']:>7.2f}" if vs_refold else f" {'':>7}"
    rng = f"{min(spread):.2f}-{max(spread):.2f}" if spread else ""
    print(f"{size:>10} {tier:>5} {proto:>7} {c:>4} {op:>4} {variant:>9} {med(row['bytes_per_s'])/1e6:>7.0f} "
          f"{row['ratio_median']:>8.2f} {fio_col} {ref_col}  {rng:<11} {lat}")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
