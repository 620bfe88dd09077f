#!/usr/bin/env bash
# make bench-devices: kvtier over one and over N data directories (one per
# device), beside fio with one direct-I/O job per directory, in one run.
#
# What it measures, in DEVICES_PAIRS rounds (medians and ratios at the end):
# - fio: one O_DIRECT io_uring job per device directory at kvtier's slot
#   size (the block plus its 4 KiB header page), DEVICES_CONCURRENCY
#   requests in flight in all (split over the jobs): sequential writes (a
#   log's), then random reads over as many blocks as the loadgen's GETs
#   read (its working set: max(4 x concurrency, 16) blocks);
# - kvtier with DEVICES_SHARDS shards over the first directory alone, then
#   over all N (shard s on device s mod N; with fewer shards than
#   devices, each shard's segments rotate over its devices): `kvtier-loadgen blocks` PUTs
#   then GETs at the same concurrency, no RAM tier (GETs read the log),
#   over each transport of DEVICES_TRANSPORTS: `http` (h2c, the block API's
#   door: each block's bytes cross a TCP socket) and `socket` (the same-host
#   socket engines use: each block copied from or into memory the loadgen
#   registered, as a vLLM or LMCache worker's are);
# - with loop images, once at the end: PUTs over all N, then with the last
#   device failed (its filesystem shut down), then a restart with that
#   device absent, timed until /readyz answers.
#
# The devices are loop-mounted ext4 images (root; made here, removed at the
# end, with direct I/O to their backing files) under DEVICES_DIR, or the
# directories DEVICES_MOUNTS names (one per
# real device, space-separated): on a host with several NVMe drives, point
# DEVICES_MOUNTS at a directory on each. Loop images on one disk share that
# disk: they show the method and kvtier's overhead against fio over the
# same directories, not a gain from more drives.
#
# Settings: DEVICES_N (2), DEVICES_SHARDS (2), DEVICES_CONCURRENCY (8),
# DEVICES_TRANSPORTS ("http socket"),
# DEVICES_SECONDS (6), DEVICES_PAIRS (3), DEVICES_BLOCK_BYTES (1 MiB),
# DEVICES_IMAGE_MIB (1536), OUT (target/bench/devices), BIN (target/release).
set -euo pipefail

N=${DEVICES_N:-2}
SHARDS=${DEVICES_SHARDS:-2}
C=${DEVICES_CONCURRENCY:-8}
SECONDS_PER=${DEVICES_SECONDS:-6}
PAIRS=${DEVICES_PAIRS:-3}
BLOCK=${DEVICES_BLOCK_BYTES:-1048576}
SLOT=$((BLOCK + 4096))
IMAGE_MIB=${DEVICES_IMAGE_MIB:-1536}
BIN=${BIN:-target/release}
OUT=${OUT:-target/bench/devices}
PORT=${DEVICES_PORT:-18555}
WORK=${DEVICES_DIR:-$(mktemp -d /tmp/kvtier-bench-devices.XXXXXX)}
read -r -a TRANSPORTS <<<"${DEVICES_TRANSPORTS:-http socket}"
for t in "${TRANSPORTS[@]}"; do
  case "$t" in http | socket) ;; *) echo "bench-devices: DEVICES_TRANSPORTS: '$t' is neither http nor socket" >&2; exit 2 ;; esac
done

mkdir -p "$OUT"
rm -rf "$OUT"/*.json "$OUT/log.txt" "$OUT"/failed-* "$OUT/server-failed.log"

MOUNTS=()
LOOPS=()
LOOPDEVS=()
SERVER=""
cleanup() {
  if [ -n "$SERVER" ]; then kill -TERM "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  for m in "${LOOPS[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
  for d in "${LOOPDEVS[@]}"; do losetup -d "$d" 2>/dev/null || true; done
  [ -z "${DEVICES_DIR:-}" ] && rm -rf "$WORK"
}
trap cleanup EXIT

if [ -n "${DEVICES_MOUNTS:-}" ]; then
  read -r -a MOUNTS <<<"$DEVICES_MOUNTS"
  N=${#MOUNTS[@]}
else
  if [ "$(id -u)" != 0 ]; then
    echo "bench-devices: loop-mounted images need root (or set DEVICES_MOUNTS to a directory on each device)" >&2
    exit 2
  fi
  for i in $(seq 0 $((N - 1))); do
    truncate -s "${IMAGE_MIB}M" "$WORK/dev$i.img"
    mkfs.ext4 -q -F "$WORK/dev$i.img"
    mkdir -p "$WORK/mnt$i"
    # Direct I/O on the backing file too: else the loop device reads and
    # writes through the page cache, and fio measures memory.
    dev=$(losetup -f --show --direct-io=on "$WORK/dev$i.img")
    LOOPDEVS+=("$dev")
    mount "$dev" "$WORK/mnt$i"
    LOOPS+=("$WORK/mnt$i")
    MOUNTS+=("$WORK/mnt$i")
  done
fi

# fio: one job per device directory, DEVICES_CONCURRENCY in flight in all.
fio_run() { # rw pair
  local rw=$1 pair=$2 depth=$(( (C + N - 1) / N )) size=512M
  # The reads cover what the loadgen's GETs read: max(4 x concurrency, 16)
  # blocks in all, split over the directories.
  if [ "$rw" = randread ]; then
    local blocks=$(( 4 * C > 16 ? 4 * C : 16 ))
    size=$(( (blocks + N - 1) / N * SLOT ))
  fi
  local args=(--direct=1 --ioengine=io_uring --bs="$SLOT" --iodepth="$depth" --size="$size" --rw="$rw"
    --runtime="$SECONDS_PER" --time_based --group_reporting --output-format=json)
  for i in $(seq 0 $((N - 1))); do args+=(--name="dev$i" --directory="${MOUNTS[$i]}"); done
  fio "${args[@]}" >"$OUT/fio-$rw-$pair.json"
}

# kvtier over the first `count` device directories, driven over `transport`
# (its same-host socket is made in the first directory).
kvtier_run() { # count pair transport
  local count=$1 pair=$2 transport=$3 dirs=() target="http://127.0.0.1:$PORT"
  [ "$transport" = socket ] && target="unix://${MOUNTS[0]}/kvtier/kvtier.sock"
  for i in $(seq 0 $((count - 1))); do dirs+=(--data-dir "${MOUNTS[$i]}/kvtier"); done
  "$BIN/kvtier" serve --listen "127.0.0.1:$PORT" "${dirs[@]}" --shards "$SHARDS" --block-bytes "$BLOCK" \
    --disk-gb 1 --ram-gb 0 --log-level warn >"$OUT/server-$transport-$count-$pair.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  for op in put get; do
    "$BIN/kvtier-loadgen" blocks --target "$target" --op $op --concurrency "$C" \
      --duration-s "$SECONDS_PER" --out "$OUT/kvtier-$transport-$count-$op-$pair" >>"$OUT/log.txt"
  done
  kill -TERM "$SERVER"; wait "$SERVER" || true
  SERVER=""
  for i in $(seq 0 $((count - 1))); do rm -rf "${MOUNTS[$i]}/kvtier"; done
}

for pair in $(seq "$PAIRS"); do
  fio_run write "$pair"
  fio_run randread "$pair"
  for i in $(seq 0 $((N - 1))); do rm -f "${MOUNTS[$i]}"/dev*.*; done
  for t in "${TRANSPORTS[@]}"; do
    kvtier_run 1 "$pair" "$t"
    kvtier_run "$N" "$pair" "$t"
  done
done

# One of N devices failed under load (loop images only: it shuts the last
# image's filesystem down, as a drive that died): PUTs over all N, then the
# same PUTs once every I/O on device N-1 fails (its shards answer 503
# device_down, counted as the loadgen's errors; MB/s counts stored blocks),
# then a restart with that device's directory absent, timed to /readyz.
if [ -z "${DEVICES_MOUNTS:-}" ] && [ "$N" -gt 1 ]; then
  dirs=()
  for i in $(seq 0 $((N - 1))); do dirs+=(--data-dir "${MOUNTS[$i]}/kvtier"); done
  serve() {
    "$BIN/kvtier" serve --listen "127.0.0.1:$PORT" "${dirs[@]}" --shards "$SHARDS" --block-bytes "$BLOCK" \
      --disk-gb 1 --ram-gb 0 --log-level warn >>"$OUT/server-failed.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
      curl -fsS "http://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
      sleep 0.01
    done
  }
  serve
  "$BIN/kvtier-loadgen" blocks --target "http://127.0.0.1:$PORT" --op put --concurrency "$C" \
    --duration-s "$SECONDS_PER" --out "$OUT/failed-before" >>"$OUT/log.txt"
  python3 -c 'import fcntl, os, struct, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))' \
    "${MOUNTS[$((N - 1))]}"
  "$BIN/kvtier-loadgen" blocks --target "http://127.0.0.1:$PORT" --op put --concurrency "$C" \
    --duration-s "$SECONDS_PER" --out "$OUT/failed-after" >>"$OUT/log.txt" || true
  kill -9 "$SERVER"; wait "$SERVER" 2>/dev/null || true
  SERVER=""
  umount "${MOUNTS[$((N - 1))]}" 2>/dev/null || umount -l "${MOUNTS[$((N - 1))]}"
  LOOPS=("${LOOPS[@]:0:$((N - 1))}")
  started=$(date +%s.%N)
  serve
  echo "$started $(date +%s.%N)" >"$OUT/failed-restart.txt"
  kill -TERM "$SERVER"; wait "$SERVER" 2>/dev/null || true
  SERVER=""
fi

python3 - "$OUT" "$N" "$SHARDS" "$C" "$BLOCK" "${TRANSPORTS[*]}" <<'PY'
import glob, json, statistics, sys
out, n, shards, c, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
transports = sys.argv[6].split()

def fio(rw):
    side = "write" if rw == "write" else "read"
    return [json.load(open(p))["jobs"][0][side]["bw_bytes"] for p in sorted(glob.glob(f"{out}/fio-{rw}-*.json"))]

def kvtier(transport, count, op):
    return [json.load(open(p))["bytes_per_s"]
            for p in sorted(glob.glob(f"{out}/kvtier-{transport}-{count}-{op}-*/results.json"))]

rows = {"fio_write": fio("write"), "fio_read": fio("randread")}
for t in transports:
    for count in sorted({1, n}):
        for op in ("put", "get"):
            rows[f"kvtier_{t}_{count}_{op}"] = kvtier(t, count, op)
med = {k: statistics.median(v) if v else None for k, v in rows.items()}
print(f"bench-devices: {n} device directories, {shards} shards, {c} in flight, {block} B blocks (fio at the slot size), "
      f"{len(rows['fio_write'])} pairs; medians in MB/s")
print(f"{'':24}{'write/PUT':>12}{'read/GET':>12}")
print(f"{'fio, one job per dir':24}{med['fio_write'] / 1e6:>12.0f}{med['fio_read'] / 1e6:>12.0f}")
for t in transports:
    for count in sorted({1, n}):
        put, get = med[f"kvtier_{t}_{count}_put"], med[f"kvtier_{t}_{count}_get"]
        print(f"{f'kvtier {t}, {count} dir(s)':24}{put / 1e6:>12.0f}{get / 1e6:>12.0f}"
              f"   vs fio: PUT {put / med['fio_write']:.2f}, GET {get / med['fio_read']:.2f}")
failed = {}
try:
    before, after = (json.load(open(f"{out}/failed-{w}/results.json")) for w in ("before", "after"))
    t0, t1 = (float(x) for x in open(f"{out}/failed-restart.txt").read().split())
    failed = {"put_before": before["bytes_per_s"], "put_after": after["bytes_per_s"], "refused": after["errors"],
              "stored_after": after["requests"], "restart_s": t1 - t0}
    print(f"device {n - 1} of {n} failed under load: PUT {before['bytes_per_s'] / 1e6:.0f} -> {after['bytes_per_s'] / 1e6:.0f} MB/s "
          f"({after['bytes_per_s'] / before['bytes_per_s']:.2f}; {(n - 1) / n:.2f} expected), {after['errors']} PUTs refused, "
          f"{after['requests']} stored; restart with it absent ready in {t1 - t0:.2f} s")
except FileNotFoundError:
    pass
json.dump({"devices": n, "shards": shards, "transports": transports, "concurrency": c, "block_bytes": block, "runs": rows, "medians": med, "failed": failed},
          open(f"{out}/results.json", "w"), indent=1)
PY
