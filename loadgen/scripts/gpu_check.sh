#!/usr/bin/env bash
# `make gpu-check` from prebuilt executables, for a GPU machine with no Rust
# toolchain: `make gpu-pack` builds them here into target/gpu-pack/ (about
# 60 MB, stripped); copy that folder to the GPU machine's checkout of the
# same commit and run this script from the checkout's root. It runs what
# `make gpu-check` runs:
#   1. the GPU tier tests (server/tests/gpu.rs) against the machine's driver;
#   2. the tier's H2D/D2H copy path against a plain pinned memcpy (gpu.json);
#   3. GET from the GPU tier against the RAM tier over h2c (gpu-get/);
#   4. loads into GPU memory from leases in kvtier's page-locked arenas
#      (clients/python/bench/bench_gpu_lease.py; gpu-lease/), with PYTHON
#      (default python3), which needs torch with CUDA, numpy and xxhash;
#   5. the vLLM connector's worker data path on the GPU with torch alone
#      (clients/python/tools/gpu_connector_check.py; gpu-connector/).
# Results go to GPU_CHECK_OUT (default target/bench). Every step runs; the exit status
# is the first failing step's.
#
# The test executable looks for `kvtier` and the repository where it was
# built (Cargo compiles in CARGO_BIN_EXE_kvtier and CARGO_MANIFEST_DIR):
# target/gpu-pack/root names that checkout, and where that path does not
# exist this script links it to the current one.
set -uo pipefail
cd "$(dirname "$0")/../.."
PACK=${PACK:-target/gpu-pack}
RESULTS=${GPU_CHECK_OUT:-target/bench}
DEVICE=${GPU_CHECK_DEVICE:-0}
for f in kvtier kvtier-loadgen gpu-tests gpu-bench root; do
  [ -e "$PACK/$f" ] || { echo "gpu_check.sh: $PACK/$f is missing: run \`make gpu-pack\` on a machine with the Rust toolchain and copy $PACK here" >&2; exit 2; }
done
nvidia-smi -L || { echo "gpu_check.sh needs an NVIDIA GPU and driver (nvidia-smi found none)" >&2; exit 1; }
root=$(cat "$PACK/root")
if [ "$root" != "$PWD" ] && [ ! -e "$root" ]; then
  mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"
fi
mkdir -p target/release "$RESULTS"
cp "$PACK/kvtier" "$PACK/kvtier-loadgen" target/release/
status=0
step() { # name command...
  local name=$1; shift
  echo "== gpu-check: $name"
  "$@" || { local rc=$?; echo "== gpu-check: $name FAILED (exit $rc)"; [ $status -ne 0 ] || status=$rc; }
}
step "GPU tier tests against the real driver" "$PACK/gpu-tests" --nocapture --test-threads 1
step "tier copy path against pinned memcpy" "$PACK/gpu-bench" --device "$DEVICE"
step "GET from the GPU tier against the RAM tier" env BIN=target/release OUT="$RESULTS/gpu-get" loadgen/scripts/bench_gpu_get.sh
step "loads into the GPU from leases" env KVTIER_BIN="$PWD/target/release/kvtier" PYTHONPATH="$PWD/clients/python/src" \
  "${PYTHON:-python3}" clients/python/bench/bench_gpu_lease.py --device "$DEVICE" --out "$RESULTS/gpu-lease"
step "the vLLM connector's data path on the GPU" env KVTIER_BIN="$PWD/target/release/kvtier" PYTHONPATH="$PWD/clients/python/src" \
  "${PYTHON:-python3}" clients/python/tools/gpu_connector_check.py --device "$DEVICE" --out "$RESULTS/gpu-connector"
exit $status
