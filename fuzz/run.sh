#!/usr/bin/env bash
# make fuzz: every fuzz target (or those named in FUZZ_TARGETS) under
# libFuzzer for FUZZ_S seconds each, with AddressSanitizer and debug
# assertions, then one table: execs/s, edges covered (libFuzzer's `cov`),
# corpus size, crashes. docs/TESTING.md says how to read it.
#
#   FUZZ_S=300        seconds per target
#   FUZZ_TARGETS="slot key"   a subset (default: all, from kvtier-fuzz-targets)
#   FUZZ_JOBS=1       targets fuzzed at once (each on one core)
#   FUZZ_MERGE=1      afterwards, add the inputs that reached new coverage
#                     to the committed corpus fuzz/corpus/TARGET (minimized)
#   FUZZ_ARGS="-len_control=0"   more libFuzzer flags, for every target
#
# The working corpus grows in target/fuzz/corpus/TARGET (seeded from the
# committed one); a crash is written to fuzz/artifacts/TARGET/, where
# `make test` replays it from then on (commit it with its fix).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_S=${FUZZ_S:-300}
FUZZ_JOBS=${FUZZ_JOBS:-1}
FUZZ_MERGE=${FUZZ_MERGE:-0}
out=target/fuzz
mkdir -p "$out/logs"

# The target list from the debug build `make test` shares (before
# RUSTC_BOOTSTRAP is set: it changes every crate's fingerprint).
targets=$(cargo run --quiet -p kvtier-fuzz --bin kvtier-fuzz-targets)
if [ -n "${FUZZ_TARGETS:-}" ]; then
  targets=$(echo "$targets" | awk -v want=" $FUZZ_TARGETS " 'index(want, " " $1 " ")')
fi
[ -n "$targets" ] || { echo "fuzz: no target matches FUZZ_TARGETS=$FUZZ_TARGETS" >&2; exit 2; }

# The table of the last run of each target, from its log; exit 1 if any crashed.
report() {
  local failed=0
  printf '\n%-15s %10s %8s %12s %9s %8s %s\n' target seconds execs/s executions edges corpus crashes
  while IFS=$'\t' read -r name _ _ _ _; do
    log=$out/logs/$name.log
    [ -f "$log" ] || continue
    runs=$(awk '/stat::number_of_executed_units/ {print $NF}' "$log" | tail -1)
    rate=$(awk '/stat::average_exec_per_sec/ {print $NF}' "$log" | tail -1)
    secs=$(awk '/^Done [0-9]+ runs in [0-9]+ second/ {print $5}' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | awk '{print $2}')
    corp=$(ls "$out/corpus/$name" 2>/dev/null | wc -l)
    # A merge runs every input once more: an input that fails only
    # sometimes is caught there (its artifact is written the same way).
    crash=$(cat "$log" "$out/logs/$name.merge.log" 2>/dev/null | grep -c '^SUMMARY: ' || true)
    [ "$crash" -gt 0 ] && failed=1
    printf '%-15s %10s %8s %12s %9s %8s %s\n' "$name" "${secs:--}" "${rate:--}" "${runs:--}" "${cov:--}" "$corp" "$crash"
  done <<< "$targets"
  echo "fuzz: logs in $out/logs/, crash inputs in fuzz/artifacts/TARGET/"
  return $failed
}
# fuzz/run.sh --report: the table of the last run, without fuzzing.
if [ "${1:-}" = --report ]; then
  report
  exit $?
fi

echo "fuzz: building the targets (release, AddressSanitizer, debug assertions)"
export RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR=$PWD/target/fuzz-build
cargo fuzz build --fuzz-dir fuzz/libfuzzer -O --debug-assertions
bin=$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release

fuzz_one() {
  local name=$1 max_len=$2 malloc_mb=$3 timeout_s=$4 leaks=$5
  mkdir -p "$out/corpus/$name" "fuzz/artifacts/$name"
  local dict=() ; [ -f "fuzz/dict/$name.dict" ] && dict=(-dict="fuzz/dict/$name.dict")
  # detect_leaks in ASAN_OPTIONS too, or the at-exit check still reports.
  ASAN_OPTIONS=detect_leaks=$leaks "$bin/$name" "$out/corpus/$name" "fuzz/corpus/$name" \
    -max_total_time="$FUZZ_S" -max_len="$max_len" -malloc_limit_mb="$malloc_mb" -rss_limit_mb=4096 \
    -timeout="$timeout_s" -detect_leaks="$leaks" -artifact_prefix="fuzz/artifacts/$name/" -print_final_stats=1 -report_slow_units="$timeout_s" "${dict[@]}" ${FUZZ_ARGS:-} \
    > "$out/logs/$name.log" 2>&1 || true
  if [ "$FUZZ_MERGE" = 1 ]; then
    ASAN_OPTIONS=detect_leaks=$leaks "$bin/$name" -merge=1 -max_len="$max_len" -rss_limit_mb=4096 -timeout="$timeout_s" \
      -artifact_prefix="fuzz/artifacts/$name/" \
      "fuzz/corpus/$name" "$out/corpus/$name" > "$out/logs/$name.merge.log" 2>&1 || true
  fi
}

running=0
while IFS=$'\t' read -r name max_len malloc_mb timeout_s leaks; do
  echo "fuzz: $name for ${FUZZ_S}s"
  fuzz_one "$name" "$max_len" "$malloc_mb" "$timeout_s" "$leaks" &
  running=$((running + 1))
  if [ "$running" -ge "$FUZZ_JOBS" ]; then wait -n || true; running=$((running - 1)); fi
done <<< "$targets"
wait

report
