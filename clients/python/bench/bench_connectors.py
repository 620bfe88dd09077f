"""make bench-connectors: each engine connector through its engine's own interface, in one run.

Loads and stores of 16 MiB chunks (Llama-3.1-8B, bf16, 128 tokens: 128 KiB
per token), driven the way each engine drives its storage tier, against a
release ``kvtier serve`` started here (``--block-bytes 16777216``, data dir
under --out, the same disk as the engines' own file tiers):

  local  the connector with ``local: "auto"``: kvtier's same-host socket and
         registered shared memory (docs/LOCAL.md)
  http   the same connector with ``local: "off"``
  file   the engine's own file tier on the same disk

1. vLLM 0.32.0: ``kvtier.vllm.KvtierTier`` and vLLM's ``fs`` tier
   (FileSystemTierManager) as secondary tiers of one TieringOffloadingSpec;
   ``spec.get_manager()`` builds them over one real SharedOffloadRegion
   primary (a MAP_SHARED /dev/shm file). Jobs are TransferJobs as the
   TieringOffloadingManager makes them (one per batch of chunks; stores
   read primary rows 0..N-1, loads are promotions into rows N..2N-1), all of
   a pass submitted at once and polled with get_finished_jobs as the
   scheduler does. (vLLM's manager itself would cascade one store to every
   secondary tier at once, so the tiers are driven one at a time here.)
2. LMCache 0.5.6: ``kvtier.lmcache.KvtierConnector`` through LMCache's
   RemoteBackend, built by CreateStorageBackends, against LMCache's
   LocalDiskBackend; loads are ``batched_get_blocking`` (StorageManager's
   retrieve), stores ``batched_submit_put_task`` until every key's
   completion callback. ``local`` sets ``extra_config.shm_name`` (LMCache's
   CPU buffer in POSIX shared memory, which the connector registers);
   ``local_staged`` leaves it unset (the client stages every chunk).
3. SGLang 0.5.23 (bench_connectors_sglang.py, in target/py-sglang): what
   lands in the host pool, as HiCacheController moves it: the generic
   interface (batch_get into flat dummy pages, then set_from_flat_data_page
   per page; batch_set of get_data_page pages) for ``local_generic``,
   ``http`` and SGLang's HiCacheFile (``file``); ``interface_v1``
   (batch_get_v1/batch_set_v1 on host indices, the host pool allocated by
   ShmHostTensorAllocator) for ``local`` when the connector accepts it,
   else reported as not available.

Warm: kvtier's RAM tier holds the blocks (checked with a lookup of their
tiers); the engine's files were just written and read once (page cache hot;
vLLM's fs tier reads with O_DIRECT, so for it warm is the disk too). Cold:
kvtier restarted on the same data dir with ``--ram-gb 0`` (every GET reads
the log with O_DIRECT), and ``sync; echo 3 > /proc/sys/vm/drop_caches``
before every timed run (root), then one untimed batch of other chunks through
the same contender (the code the drop evicted is back; only the measured
chunks are cold). A warm run loads the working set repeatedly
for ``--seconds``; a cold run loads it once. Stores use fresh keys every run
(vLLM's fs tier, LMCache's disk backend, HiCacheFile and kvtier's SGLang
backend skip keys already stored). Pairs alternate the contenders of a case;
the median of the pairs is reported, with CPU seconds per GB of this process
(the engine and the client) and of the server. Every contender's load is
checked byte for byte once per case, outside the timed runs.

Goals (printed with pass/fail; ``local`` is the zero-copy contender: vLLM
``local``, LMCache ``local`` (shm_name set), SGLang ``local`` (interface_v1),
else SGLang's ``local_generic``): warm loads local ≥ 2× http; local ≥ 1.5× the
engine's file tier warm and cold. Writes summary.json and summary.md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_python as bp

import kvtier
from kvtier.testing import ServerProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MIB = 1 << 20
GIB = 1 << 30
GB = 1e9
#: Llama-3.1-8B, bf16, 128 tokens: 2 (K, V) × 32 layers × 8 KV heads × 128 dims × 2 bytes × 128.
CHUNK_BYTES = 16 * MIB
CHUNK_TOKENS = 128
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: The zero-copy contender of each connector, which the goals measure.
PRIMARY = {"vllm": "local", "lmcache": "local", "sglang": "local"}
#: A fallback when the primary is not available (SGLang without interface_v1).
FALLBACK = {"sglang": "local_generic"}


# ---------------------------------------------------------------- common


_BASE: dict[int, np.ndarray] = {}


def pattern(i: int, nbytes: int = CHUNK_BYTES) -> np.ndarray:
    """The bytes of chunk ``i`` (uint8), different for every chunk and
    every 8-byte word, so a misplaced or stale chunk is caught."""
    base = _BASE.get(nbytes)
    if base is None:
        base = _BASE[nbytes] = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (base ^ np.uint64(((i + 1) * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF)).view(np.uint8)


def check_bytes(got: Any, i: int, what: str) -> None:
    """Raises unless ``got`` (anything numpy can view as bytes) is chunk ``i``."""
    data = np.frombuffer(got, dtype=np.uint8) if not isinstance(got, np.ndarray) else got.view(np.uint8).ravel()
    if data.nbytes != CHUNK_BYTES or not np.array_equal(data, pattern(i)):
        raise RuntimeError(f"{what}: chunk {i} came back with other bytes")


def digest_key(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}-{i}".encode()).digest()


def timed(fn: Callable[[], int], server_pid: int | None) -> dict[str, float]:
    """Runs ``fn`` (returns bytes moved): bytes/s and CPU seconds per GB of
    this process (every thread: the engine's and the client's) and of the server."""
    cpu0, server0 = time.process_time(), bp.proc_cpu_s(server_pid) if server_pid else 0.0
    t0 = time.perf_counter()
    moved = fn()
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    server_cpu = (bp.proc_cpu_s(server_pid) - server0) if server_pid else 0.0
    out = bp.result(moved, elapsed, cpu, server_cpu)
    out.update(bytes=moved, elapsed_s=elapsed)
    return out


def for_seconds(seconds: float, one_pass: Callable[[], int]) -> Callable[[], int]:
    """A run that repeats ``one_pass`` until ``seconds`` have passed (at least once)."""

    def run() -> int:
        moved, started = 0, time.perf_counter()
        while True:
            moved += one_pass()
            if time.perf_counter() - started >= seconds:
                return moved

    return run


def alternate(
    contenders: dict[str, Callable[[], int]],
    pairs: int,
    server_pid: int | None,
    before: Callable[[str], object] | None = None,
) -> dict[str, dict[str, Any]]:
    """``pairs`` rounds, each running every contender once in turn
    (``before(name)`` ahead of each run, untimed); the medians per contender."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for _ in range(pairs):
        for name, fn in contenders.items():
            if before is not None:
                before(name)
            runs[name].append(timed(fn, server_pid))
    return {name: median(rs) for name, rs in runs.items()}


def median(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["bytes_per_s_runs"] = [r["bytes_per_s"] for r in runs]
    return out


def make_row(
    connector: str,
    op: str,
    temperature: str,
    medians: dict[str, dict[str, Any]],
    missing: dict[str, str],
    chunks: int,
    batch: int,
) -> dict[str, Any]:
    """One case: every contender's medians (or why it is not available) and
    the primary local contender's ratios to http and to the file tier."""
    primary = PRIMARY[connector]
    if primary not in medians and FALLBACK.get(connector) in medians:
        primary = FALLBACK[connector]
    contenders: dict[str, Any] = {name: {"available": False, "reason": why} for name, why in missing.items()}
    contenders.update(medians)
    row: dict[str, Any] = {
        "connector": connector,
        "op": op,
        "temperature": temperature,
        "chunks": chunks,
        "batch": batch,
        "primary": primary,
        "contenders": contenders,
    }
    for other in ("http", "file"):
        if primary in medians and other in medians:
            row[f"primary_over_{other}"] = medians[primary]["bytes_per_s"] / medians[other]["bytes_per_s"]
    print_row(row)
    return row


def print_row(row: dict[str, Any]) -> None:
    rates = "  ".join(
        f"{name} {c['bytes_per_s'] / GB:.2f}" if "bytes_per_s" in c else f"{name} n/a"
        for name, c in row["contenders"].items()
    )
    ratios = "  ".join(
        f"{row['primary']}/{o} {row[f'primary_over_{o}']:.2f}" for o in ("http", "file") if f"primary_over_{o}" in row
    )
    print(f"{row['connector']} {row['op']} {row['temperature']}: {rates} GB/s; {ratios}", flush=True)


def client_stats(client: Any) -> dict[str, Any]:
    """What the kvtier client says about its plane: transport, registered
    buffers (and how the server reaches them), staging copies."""
    sync = getattr(client, "sync", client)
    try:
        s = sync.local_stats()
    except Exception as e:  # a client without the local plane
        return {"error": str(e)}
    out = {k: s[k] for k in ("transport", "registrations", "bounce_copies", "bounce_bytes") if k in s}
    out["buffer_access"] = [b.get("access") for b in s.get("buffers", [])]
    return out


def tiers_of(url: str, keys: list[str]) -> dict[str, int]:
    """How many of ``keys`` each kvtier tier holds (``ram``, ``nvme``, ...)."""
    with kvtier.Client(url, connections=1) as c:
        return dict(Counter(c.lookup_tiers(keys)))


def settle(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """Waits until a just-started server has done its start-up work: every
    shard's I/O memory registered (``/v1/stats``), then its RAM tier faulted
    in on a helper thread, which starts only after that: until its CPU time
    grows by under 0.02 s in each of five 0.2 s windows in a row. (One quiet
    window was not enough: the gap before the RAM prefault passed for idle,
    and the first store then paid the RAM tier's page faults.)"""
    deadline = time.monotonic() + timeout_s
    with kvtier.Client(server.url, local="off") as c:
        while time.monotonic() < deadline:
            if all(s.get("io_memory_registered") for s in c.stats()["per_shard"]):
                break
            time.sleep(0.05)
    quiet, last = 0, bp.proc_cpu_s(server.pid)
    while time.monotonic() < deadline and quiet < 5:
        time.sleep(0.2)
        now = bp.proc_cpu_s(server.pid)
        quiet = quiet + 1 if now - last < 0.02 else 0
        last = now


#: More ``kvtier serve`` flags for every server (``--server-args``).
SERVER_ARGS: tuple[str, ...] = ()


@contextlib.contextmanager
def serving(block_bytes: int = CHUNK_BYTES, **kw: Any) -> Iterator[ServerProcess]:
    """A release ``kvtier serve`` (``ServerProcess`` flags and ``--server-args``), started and settled."""
    server = ServerProcess(block_bytes=block_bytes, args=SERVER_ARGS, **kw).start()
    try:
        settle(server)
        yield server
    finally:
        server.stop()


def server_sizes(chunks: int, pairs: int) -> dict[str, float]:
    """RAM for the working set (per shard, with room for an uneven split) and
    disk for every store run plus the load set, in GiB."""
    ws = chunks * CHUNK_BYTES / GIB
    return {"ram_gb": ws * 1.25 + 0.25, "disk_gb": ws * (2 * pairs + 2) * 1.3 + 1}


class Dropper:
    """Drops the page cache before a cold run (``sync; echo 3 >
    /proc/sys/vm/drop_caches``); remembers whether every drop worked."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.ok = enabled

    def __call__(self) -> None:
        if self.enabled:
            self.ok = bp.drop_caches() and self.ok

    def then(self, prime: dict[str, Callable[[], int]]) -> Callable[[str], None]:
        """Before a cold run of contender ``name``: the drop, then
        ``prime[name]`` (one batch of chunks outside the measured set), so
        the code and libraries the drop evicted are back and only the
        measured chunks are cold."""

        def before(name: str) -> None:
            self()
            prime[name]()

        return before


# ------------------------------------------------------------------ vLLM


def section_vllm(args: argparse.Namespace, scratch: Path, drop: Dropper) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    n, b = args.chunks, args.batch
    kv_dir, fs_root = scratch / "vllm-kv", scratch / "vllm-fs"
    job_ids = itertools.count(1)
    load_keys = [make_offload_key(digest_key("vllm-load", i), 0) for i in range(n)]
    src, dst = list(range(n)), list(range(n, 2 * n))

    def store_keys(p: int | str, name: str) -> list[Any]:
        """The fresh keys of store run ``p`` of contender ``name``."""
        return [make_offload_key(digest_key(f"vllm-{p}-{name}", i), 0) for i in src]

    def build(url: str, phase: str) -> tuple[Any, dict[str, Any]]:
        """vLLM's own spec and manager: a 2N-chunk SharedOffloadRegion primary
        and the three secondary tiers over its view, built by vLLM's factory."""
        tiers = [
            {"type": "KvtierTier", "module_path": "kvtier.vllm", "url": url, "local": "auto"},
            {"type": "KvtierTier", "module_path": "kvtier.vllm", "url": url, "local": "off"},
            {"type": "fs", "root_dir": str(fs_root)},
        ]
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "block_size": CHUNK_TOKENS,
            "cpu_bytes_to_use": 2 * n * CHUNK_BYTES,
            "secondary_tiers": tiers,
        }
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=CHUNK_TOKENS, layer_names=("layers",), group_id=0),),
            worker_kv_bytes_per_block=CHUNK_BYTES,
            enable_kv_cache_events=False,
            extra_config=extra,
            engine_id=f"kvtier-bench-{os.getpid()}-{phase}",
            model=OffloadingModelConfig(name=MODEL, dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=CHUNK_TOKENS, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=True,
            ),
        )
        spec = TieringOffloadingSpec(config)
        if spec.kv_bytes_per_chunk != CHUNK_BYTES or spec.num_chunks < 2 * n:
            raise RuntimeError(f"vLLM made {spec.num_chunks} rows of {spec.kv_bytes_per_chunk} bytes")
        manager = spec.get_manager()
        return manager, dict(zip(("local", "http", "file"), manager.secondary_tiers, strict=True))

    def transfer(tier: Any, keys: list[Any], rows: list[int], load: bool) -> int:
        """One job per batch of chunks, all submitted, then polled until done."""
        pending: set[int] = set()
        for a in range(0, len(keys), b):
            job_id = next(job_ids)
            job = TransferJob(
                job_id=job_id,
                keys=keys[a : a + b],
                chunk_ids=np.array(rows[a : a + b], dtype=np.int32 if load else np.int64),
                is_promotion=load,
                req_context=ReqContext(req_id=f"bench-{job_id}"),
            )
            (tier.submit_load if load else tier.submit_store)(job)
            pending.add(job_id)
        failed, deadline = [], time.monotonic() + 300
        while pending:
            for result in tier.get_finished_jobs():
                pending.discard(result.job_id)
                if not result.success:
                    failed.append(result.job_id)
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM {tier.tier_type}: jobs {sorted(pending)} still pending after 300 s")
                time.sleep(0.0002)
        if failed:
            raise RuntimeError(f"vLLM {tier.tier_type}: jobs {failed} failed ({'load' if load else 'store'})")
        return len(keys) * CHUNK_BYTES

    def stats_of(tiers: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("local", "http"):
            t = tiers[name]
            out[name] = {**t.stats, "zero_copy": t.zero_copy, **client_stats(t.client)}
        return out

    def loads(tiers: dict[str, Any], rows: np.ndarray, server: ServerProcess, temperature: str) -> dict[str, Any]:
        for name, tier in tiers.items():  # byte-exact, once per case, untimed
            rows[n : n + b] = 0
            transfer(tier, load_keys[:b], dst[:b], True)
            for i in range(b):
                check_bytes(rows[n + i], i, f"vLLM {name} {temperature} load")
        held = tiers_of(server.url, [tiers["local"].key_of(k) for k in load_keys])
        one = {name: (lambda t=tier: transfer(t, load_keys, dst, True)) for name, tier in tiers.items()}
        if temperature == "warm":
            for fn in one.values():
                fn()
            runs = {name: for_seconds(args.seconds, fn) for name, fn in one.items()}
            medians = alternate(runs, args.pairs, server.pid)
        else:
            prime = {
                name: (lambda t=tier, name=name: transfer(t, store_keys(0, name)[:b], dst, True))
                for name, tier in tiers.items()
            }
            medians = alternate(one, args.pairs, server.pid, before=drop.then(prime))
        row = make_row("vllm", "load", temperature, medians, {}, n, b)
        row["kvtier_tiers"] = held
        return row

    sizes = server_sizes(n, args.pairs)
    rows_out, stats = [], {}
    with serving(data_dir=str(kv_dir), **sizes) as server:
        manager, tiers = build(server.url, "warm")
        view = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        try:
            for i in src:
                view[i] = pattern(i)
            for name, tier in tiers.items():  # connections, registration, first writes: untimed
                transfer(tier, store_keys("warmup", name)[:b], src, False)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in tiers}
            for p in range(args.pairs):
                for name, tier in tiers.items():
                    keys = store_keys(p, name)
                    runs[name].append(timed(lambda t=tier, ks=keys: transfer(t, ks, src, False), server.pid))
            rows_out.append(make_row("vllm", "store", "-", {k: median(v) for k, v in runs.items()}, {}, n, b))
            transfer(tiers["local"], load_keys, src, False)  # the load set, last in kvtier's RAM tier
            transfer(tiers["file"], load_keys, src, False)
            rows_out.append(loads(tiers, view, server, "warm"))
            stats["warm"] = stats_of(tiers)
        finally:
            del view
            manager.shutdown()
    cold = {**sizes, "ram_gb": 0}
    with serving(data_dir=str(kv_dir), **cold) as server:
        manager, tiers = build(server.url, "cold")
        view = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        try:
            rows_out.append(loads(tiers, view, server, "cold"))
            stats["cold"] = stats_of(tiers)
        finally:
            del view
            manager.shutdown()
    shutil.rmtree(kv_dir, ignore_errors=True)
    shutil.rmtree(fs_root, ignore_errors=True)
    return {"rows": rows_out, "stats": stats}


# --------------------------------------------------------------- LMCache


class EventLoop:
    """LMCache runs its connectors on an event loop of its own thread."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def section_lmcache(args: argparse.Namespace, scratch: Path, drop: Dropper) -> dict[str, Any]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    n, b = args.chunks, args.batch
    kv_dir, disk_dir = scratch / "lmcache-kv", scratch / "lmcache-disk"
    loop = EventLoop()
    # LMCache's vLLM layout: (layers, K/V, tokens, KV heads, head dim); a full chunk is 16 MiB.
    meta = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM),
        chunk_size=CHUNK_TOKENS,
    )

    def key(tag: str, i: int) -> Any:
        return CacheEngineKey(MODEL, 1, 0, int.from_bytes(digest_key(tag, i)[:8], "big"), torch.bfloat16)

    load_keys = [key("lmcache-load", i) for i in range(n)]

    def store_keys(p: int | str, name: str) -> list[Any]:
        """The fresh keys of store run ``p`` of contender ``name``."""
        return [key(f"lmcache-{p}-{name}", i) for i in range(n)]

    def build(kind: str, url: str | None, pool_chunks: int) -> tuple[dict[str, Any], Any, Any]:
        """LMCache's own backend factory, as LMCacheEngine calls it: the
        backends, the one under test and the CPU backend whose pool it fills."""
        extra: dict[str, Any] = {"save_chunk_meta": False}
        config: dict[str, Any] = {
            "chunk_size": CHUNK_TOKENS,
            "local_cpu": True,
            "max_local_cpu_size": (pool_chunks + 2) * CHUNK_BYTES / GIB,
            "remote_serde": "naive",
            "extra_config": extra,
        }
        if kind == "file":
            config["local_disk"] = f"file://{disk_dir}/"
            config["max_local_disk_size"] = (args.pairs + 2) * n * CHUNK_BYTES / GIB + 1
        else:
            config["remote_storage_plugins"] = ["kvtier"]
            prefix = "remote_storage_plugin.kvtier."
            extra[prefix + "module_path"] = "kvtier.lmcache"
            extra[prefix + "class_name"] = "KvtierConnector"
            extra[prefix + "url"] = url
            extra[prefix + "local"] = "off" if kind == "http" else "auto"
            if kind == "local":
                extra["shm_name"] = f"kvtier_bench_{os.getpid()}"
        found = CreateStorageBackends(LMCacheEngineConfig.from_dict(config), meta, loop.loop, dst_device="cpu")
        backend = found["LocalDiskBackend" if kind == "file" else "RemoteBackend-kvtier"]
        if kind != "file" and backend.connection is None:
            raise RuntimeError(f"LMCache did not attach kvtier ({kind}); see its log above")
        return found, backend, found["LocalCPUBackend"]

    def close(found: dict[str, Any]) -> None:
        for name in sorted(found, key=lambda k: k == "LocalCPUBackend"):  # the pool last
            try:
                found[name].close()
            except Exception as e:
                print(f"LMCache {name}.close(): {e}", flush=True)

    def sources(cpu: Any) -> list[Any]:
        """The working set in LMCache MemoryObjs of this backend's pool."""
        from lmcache.v1.memory_management import MemoryFormat

        shape = meta.get_shapes()
        objs = [cpu.allocate(shape, meta.get_dtypes(), MemoryFormat.KV_2LTD) for _ in range(n)]
        if any(o is None for o in objs):
            raise RuntimeError("LMCache's CPU pool is too small for the working set")
        for i, o in enumerate(objs):
            o.tensor.view(torch.uint8).view(-1).copy_(torch.from_numpy(pattern(i)))
        return objs

    def store(backend: Any, keys: list[Any], objs: list[Any]) -> int:
        """batched_submit_put_task per batch, then every key's completion callback."""
        done, cond = [0], threading.Condition()

        def completed(_key: Any) -> None:
            with cond:
                done[0] += 1
                cond.notify_all()

        for a in range(0, len(keys), b):
            backend.batched_submit_put_task(keys[a : a + b], objs[a : a + b], on_complete_callback=completed)
        with cond:
            if not cond.wait_for(lambda: done[0] >= len(keys), timeout=300):
                raise RuntimeError(f"LMCache {backend}: {len(keys) - done[0]} puts never completed")
        return len(keys) * CHUNK_BYTES

    def stored(backend: Any, keys: list[Any]) -> bool:
        if hasattr(backend, "batched_contains") and getattr(backend, "connection", None) is not None:
            return backend.batched_contains(keys) == len(keys)
        return all(backend.contains(k) for k in keys)

    def load(backend: Any, keys: list[Any], what: str = "") -> int:
        """batched_get_blocking per batch (StorageManager.batched_get); the
        MemoryObjs go back to the pool as the engine's retrieve frees them."""
        for a in range(0, len(keys), b):
            objs = backend.batched_get_blocking(keys[a : a + b])
            try:
                if any(o is None for o in objs):
                    raise RuntimeError(f"LMCache {backend}: a stored chunk missed")
                if what:
                    for j, o in enumerate(objs):
                        check_bytes(o.tensor.view(torch.uint8).view(-1).numpy(), a + j, what)
            finally:
                for o in objs:
                    if o is not None:
                        o.ref_count_down()
        return len(keys) * CHUNK_BYTES

    def stats_of(sets: dict[str, tuple[dict[str, Any], Any, Any]]) -> dict[str, Any]:
        out = {}
        for name, (_, backend, _) in sets.items():
            if name != "file":
                conn = backend.connection.getWrappedConnector()
                out[name] = {**conn.stats, **client_stats(conn.client)}
        return out

    def loads(sets: dict[str, Any], server: ServerProcess, temperature: str) -> dict[str, Any]:
        for name, (_, backend, _) in sets.items():
            load(backend, load_keys[:b], f"LMCache {name} {temperature} load")
        conn = sets["http"][1].connection.getWrappedConnector()
        held = tiers_of(server.url, [conn.key_of(k) for k in load_keys])
        one = {name: (lambda be=s[1]: load(be, load_keys)) for name, s in sets.items()}
        if temperature == "warm":
            for fn in one.values():
                fn()
            medians = alternate({k: for_seconds(args.seconds, f) for k, f in one.items()}, args.pairs, server.pid)
        else:
            prime = {name: (lambda be=s[1], name=name: load(be, store_keys(0, name)[:b])) for name, s in sets.items()}
            medians = alternate(one, args.pairs, server.pid, before=drop.then(prime))
        row = make_row("lmcache", "load", temperature, medians, {}, n, b)
        row["kvtier_tiers"] = held
        return row

    sizes = server_sizes(n, 3 * args.pairs // 2 + 1)  # three kvtier contenders store
    rows_out, stats = [], {}
    sets: dict[str, Any] = {}
    file_set = None
    try:
        with serving(data_dir=str(kv_dir), **sizes) as server:
            for kind in ("local", "local_staged", "http"):
                sets[kind] = build(kind, server.url, n + 2 * b)
            file_set = sets["file"] = build("file", None, n + 2 * b)
            objs = {name: sources(s[2]) for name, s in sets.items()}
            for name, s in sets.items():  # connections, registration, first writes: untimed
                store(s[1], store_keys("warmup", name)[:b], objs[name][:b])
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in sets}
            for p in range(args.pairs):
                for name, s in sets.items():
                    keys = store_keys(p, name)
                    runs[name].append(timed(lambda be=s[1], ks=keys, name=name: store(be, ks, objs[name]), server.pid))
                    if not stored(s[1], keys):
                        raise RuntimeError(f"LMCache {name}: a put did not store its chunk")
            rows_out.append(make_row("lmcache", "store", "-", {k: median(v) for k, v in runs.items()}, {}, n, b))
            for name in ("local", "file"):  # the load set, last in kvtier's RAM tier
                store(sets[name][1], load_keys, objs[name])
                if not stored(sets[name][1], load_keys):
                    raise RuntimeError(f"LMCache {name}: the load set did not store")
            for held in objs.values():
                for o in held:
                    o.ref_count_down()
            rows_out.append(loads(sets, server, "warm"))
            stats["warm"] = stats_of(sets)
            for name in ("local", "local_staged", "http"):
                close(sets.pop(name)[0])
        with serving(data_dir=str(kv_dir), **{**sizes, "ram_gb": 0}) as server:
            cold = {kind: build(kind, server.url, 2 * b) for kind in ("local", "local_staged", "http")}
            sets = {**cold, "file": file_set}
            rows_out.append(loads(sets, server, "cold"))
            stats["cold"] = stats_of(sets)
    finally:
        for s in sets.values():
            close(s[0])
        if file_set is not None and "file" not in sets:
            close(file_set[0])
        loop.stop()
        shutil.rmtree(kv_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return {"rows": rows_out, "stats": stats}


# ---------------------------------------------------------------- SGLang


def section_sglang(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """bench_connectors_sglang.py in SGLang's virtualenv (another torch),
    with its ninja on PATH as `make test-sglang` has it."""
    python = Path(args.sglang_python)
    if not python.exists():
        raise FileNotFoundError(f"{python}: no SGLang virtualenv (make target/py-sglang/.client makes it)")
    out = scratch / "sglang.json"
    env = dict(os.environ)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "target" / "torch-extensions"))
    argv = [str(python), str(HERE / "bench_connectors_sglang.py"), "--json", str(out), "--scratch", str(scratch)]
    argv += ["--chunks", str(args.chunks), "--batch", str(args.batch), "--pairs", str(args.pairs)]
    argv += ["--seconds", str(args.seconds)] + (["--keep-page-cache"] if args.keep_page_cache else [])
    run = subprocess.run(argv, env=env, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the SGLang section failed (exit {run.returncode}): {' '.join(argv)}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------- report


def goal(name: str, value: float, target: float) -> dict[str, Any]:
    return {"goal": name, "value": value, "op": ">=", "target": target, "unit": "×", "pass": value >= target}


def goals_of(rows: list[dict[str, Any]], dropped: bool) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["op"] != "load":
            continue
        head = f"{r['connector']} {r['temperature']} load: {r['primary']}"
        if r["temperature"] == "warm" and "primary_over_http" in r:
            out.append(goal(f"{head} / http", r["primary_over_http"], 2.0))
        if "primary_over_file" in r:
            note = " (page cache NOT dropped)" if r["temperature"] == "cold" and not dropped else ""
            out.append(goal(f"{head} / {r['temperature']} file tier{note}", r["primary_over_file"], 1.5))
    return out


def _cell(c: dict[str, Any]) -> str:
    return f"{c['bytes_per_s'] / GB:.2f}" if "bytes_per_s" in c else "n/a"


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(summary: dict[str, Any]) -> str:
    names = {"vllm": "vLLM 0.32.0", "lmcache": "LMCache 0.5.6", "sglang": "SGLang 0.5.23"}
    out = [
        f"`make bench-connectors`: {summary['chunks']} chunks of 16 MiB per case, batches of {summary['batch']},"
        f" {summary['pairs']} pair{'s' if summary['pairs'] != 1 else ''} (median); GB/s;"
        " CPU s/GB of the engine process · of kvtier."
        f" Warm runs repeat the working set for {summary['seconds']} s; cold runs read it once"
        + ("" if summary["page_cache_dropped"] else " (page cache NOT dropped: not root?)")
        + ".",
        "",
    ]
    for connector in ("vllm", "lmcache", "sglang"):
        rows = [r for r in summary["rows"] if r["connector"] == connector]
        if not rows:
            continue
        cols = list(rows[0]["contenders"])
        out += [
            f"{names[connector]} (`{rows[0]['primary']}` is the zero-copy contender):",
            "",
            _row("case", *cols, "local/http", "local/file", "CPU s/GB local", "CPU s/GB http"),
            _row("---", *["---:"] * (len(cols) + 4)),
        ]
        for r in rows:
            cpu = []
            for name in (r["primary"], "http"):
                c = r["contenders"].get(name, {})
                cpu.append(
                    f"{c['client_cpu_s_per_gb']:.2f} · {c['server_cpu_s_per_gb']:.2f}" if "bytes_per_s" in c else ""
                )
            ratios = [f"{r[k]:.2f}" if k in r else "" for k in ("primary_over_http", "primary_over_file")]
            case = "store" if r["op"] == "store" else f"{r['temperature']} load"
            out.append(_row(case, *[_cell(r["contenders"].get(c, {})) for c in cols], *ratios, *cpu))
        missing = {c: v["reason"] for r in rows for c, v in r["contenders"].items() if not v.get("available", True)}
        for c, why in missing.items():
            out += ["", f"`{c}`: not available ({why})"]
        stats = summary["stats"].get(connector, {})
        if stats:
            out += ["", "Connector stats at the end of each phase:", ""]
            for phase, per in stats.items():
                for name, s in per.items():
                    keep = ("zero_copy_chunks", "staged_chunks", "zero_copy", "transport", "registrations")
                    keep += ("buffer_access", "bounce_copies", "errors")
                    shown = ", ".join(f"{k} {s[k]}" for k in keep if k in s)
                    out.append(f"- {phase} `{name}`: {shown}")
        out.append("")
    out += ["Goals:", "", _row("goal", "measured", "target", ""), _row("---", "---:", "---:", "---")]
    for g in summary["goals"]:
        out.append(_row(g["goal"], f"{g['value']:.2f}×", f"≥ {g['target']:.2f}×", "pass" if g["pass"] else "**FAIL**"))
    if summary["notes"]:
        out += ["", *[f"- {n}" for n in summary["notes"]]]
    return "\n".join(out) + "\n"


NOTES = {
    "vllm": "vLLM's fs tier opens its files with O_DIRECT when the directory allows it"
    " (vllm/v1/kv_offload/tiering/fs/io.py probe_o_direct), so its warm loads read the disk too;"
    " each job is one task on one of its 16 read threads, reading its chunks one after the other.",
    "lmcache": "LMCache's LocalDiskBackend reads with buffered I/O (use_odirect off by default) in a thread"
    " pool per batch, and its puts end when the file is written (page cache), not on disk;"
    " kvtier's puts are acknowledged after the NVMe write (write-through).",
    "sglang": "SGLang's HiCacheFile reads and writes one page after the other on the calling thread, buffered;"
    " the generic interface adds a fresh flat page per read and a strided copy into the host pool.",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("target/bench/connectors"))
    ap.add_argument("--chunks", type=int, default=48, help="16 MiB chunks per case (the working set)")
    ap.add_argument("--batch", type=int, default=16, help="chunks per engine job / batch call")
    ap.add_argument("--pairs", type=int, default=3, help="alternations of every contender (median reported)")
    ap.add_argument("--seconds", type=float, default=1.0, help="minimum length of a warm load run")
    ap.add_argument("--quick", action="store_true", help="16 chunks, batches of 8, 1 pair, 0.2 s warm runs")
    ap.add_argument("--only", default="vllm,lmcache,sglang", help="sections to run, comma-separated")
    ap.add_argument("--keep-page-cache", action="store_true", help="do not drop the page cache (not root)")
    ap.add_argument(
        "--server-args",
        default="",
        help="more kvtier serve flags for every server, e.g. '--ram-shared on' (leases: the connectors' "
        "reads into memory they cannot register copy once from a lease)",
    )
    ap.add_argument("--sglang-python", default=str(REPO / "target" / "py-sglang" / "bin" / "python"))
    args = ap.parse_args()
    global SERVER_ARGS
    SERVER_ARGS = tuple(args.server_args.split())
    if args.quick:
        args.chunks, args.batch, args.pairs, args.seconds = 16, 8, 1, 0.2
    if args.pairs < 1 or args.batch < 1 or args.chunks < args.batch or args.seconds < 0:
        ap.error("--pairs and --batch must be at least 1, --chunks at least --batch, --seconds not negative")
    only = [s for s in args.only.split(",") if s]
    if not set(only) <= {"vllm", "lmcache", "sglang"}:
        ap.error(f"--only: unknown section in {args.only!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=args.out)).resolve()
    drop = Dropper(not args.keep_page_cache)
    started = time.monotonic()
    summary: dict[str, Any] = {
        "chunks": args.chunks,
        "batch": args.batch,
        "pairs": args.pairs,
        "seconds": args.seconds,
        "chunk_bytes": CHUNK_BYTES,
        "cpus": os.cpu_count(),
        "rows": [],
        "stats": {},
        "sections": {},
        "notes": [NOTES[s] for s in only],
    }
    try:
        for section in only:
            t0 = time.monotonic()
            if section == "vllm":
                result = section_vllm(args, scratch, drop)
            elif section == "lmcache":
                result = section_lmcache(args, scratch, drop)
            else:
                result = section_sglang(args, scratch)
                drop.ok = drop.ok and result.get("page_cache_dropped", True)
                summary["notes"] += result.get("notes", [])
            summary["rows"] += result["rows"]
            summary["stats"][section] = result["stats"]
            summary["sections"][section] = {"elapsed_s": time.monotonic() - t0, **result.get("section", {})}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["page_cache_dropped"] = drop.ok
    summary["goals"] = goals_of(summary["rows"], drop.ok)
    summary["elapsed_s"] = time.monotonic() - started
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(summary))
    print("\ngoals:")
    for g in summary["goals"]:
        print(f"  {'pass' if g['pass'] else 'FAIL'}  {g['goal']}: {g['value']:.2f} (target >= {g['target']:.2f})")
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'summary.md'} in {summary['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    sys.exit(main())
