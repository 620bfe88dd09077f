# Sourced by the benches that run kvtier servers of their own
# (bench_s3.sh, bench_router.sh, bench_events_cost.sh), after they set OUT
# and BIN: a scratch directory ($SCRATCH, removed at exit), the processes
# to kill at exit ($PIDS; a bench adds its own), and
#   start NAME [flags...]  `kvtier serve` on a free loopback port with its
#                          data in $SCRATCH/NAME and its output in
#                          $OUT/serve-NAME.{out,err}, plus the flags; waits
#                          until it listens (exits 1 with its stderr if it
#                          never does); sets URL_<NAME> and PID_<NAME>
#   stop NAME              SIGTERM, wait for the exit, remove its data
SCRATCH=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$SCRATCH"
}
trap cleanup EXIT

start() {
  local name=$1; shift
  mkdir -p "$SCRATCH/$name"
  $BIN/kvtier serve --listen 127.0.0.1:0 --data-dir "$SCRATCH/$name" --pin-cpus false --log-level warn "$@" \
    >"$OUT/serve-$name.out" 2>"$OUT/serve-$name.err" &
  local pid=$!
  PIDS+=($pid)
  for _ in $(seq 200); do grep -q listening "$OUT/serve-$name.out" && break; sleep 0.05; done
  grep -q listening "$OUT/serve-$name.out" || { cat "$OUT/serve-$name.err" >&2; exit 1; }
  eval "URL_$name=$(grep -o 'http://[0-9.:]*' "$OUT/serve-$name.out" | head -1)"
  eval "PID_$name=$pid"
}

stop() {
  local pid
  eval "pid=\$PID_$1"
  kill -TERM "$pid"; wait "$pid" || true
  rm -rf "${SCRATCH:?}/$1"
}
