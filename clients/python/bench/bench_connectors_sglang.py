"""The SGLang section of `make bench-connectors` (bench_connectors.py runs it
in target/py-sglang, whose torch differs from vLLM's).

HiCache storage backends built as HiCacheController attaches them
(StorageBackendFactory.create_backend, register_mem_pool_host,
on_host_pools_registered) over one SGLang host pool: MHATokenToKVPoolHost,
page_first, 128-token pages of Llama-3.1-8B's shapes (32 layers × 8 KV heads ×
128 dims × bf16, K and V: 16 MiB a page), allocated by SGLang's
ShmHostTensorAllocator (``"allocator": "shm"``). Pages 0..N-1 of the pool
hold the working set; loads land in the next ``--batch`` pages.

  local          kvtier, ``interface_v1``: batch_get_v1/batch_set_v1 on host
                 indices (HiCacheController._page_get_zero_copy and
                 _page_set_zero_copy); "not available" while the connector
                 refuses ``interface_v1`` at construction (ValueError)
  local_generic  kvtier over the socket, the generic interface
  http           kvtier over HTTP, the generic interface
  file           SGLang's HiCacheFile, the generic interface

Generic interface, as HiCacheController._generic_page_get/_generic_page_set:
batch_get into fresh flat dummy pages, then set_from_flat_data_page per page;
batch_set of get_data_page pages. Writes its rows (bench_connectors.make_row)
and stats as JSON to --json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_connectors as bc

from kvtier.testing import ServerProcess

EXTRA = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage"}
KINDS = {
    "local": {"local": "auto", "interface_v1": 1, "allocator": "shm"},
    "local_generic": {"local": "auto"},
    "http": {"local": "off"},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--scratch", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--keep-page-cache", action="store_true")
    args = ap.parse_args()
    with warnings.catch_warnings():  # sglang's imports warn about every missing GPU kernel
        warnings.simplefilter("ignore")
        result = run(args)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    n, b, page = args.chunks, args.batch, bc.CHUNK_TOKENS
    drop = bc.Dropper(not args.keep_page_cache)
    file_dir = args.scratch / "sglang-file"
    load_keys = [hashlib.sha256(f"sglang-load-{i}".encode()).hexdigest() for i in range(n)]

    def store_keys(p: int | str, kind: str) -> list[str]:
        """The fresh page hashes of store run ``p`` of contender ``kind``."""
        return [hashlib.sha256(f"sglang-{p}-{kind}-{i}".encode()).hexdigest() for i in range(n)]

    # SGLang's host pool over a (CPU) device pool, as the scheduler builds it
    # for `--hicache-mem-layout page_first` with `"allocator": "shm"`.
    device = MHATokenToKVPool(
        2 * page, page, torch.bfloat16, bc.KV_HEADS, bc.HEAD_DIM, bc.LAYERS, "cpu", False, v_head_dim=bc.HEAD_DIM
    )
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page,
        "page_first",
        pin_memory=False,
        allocator_type="shm",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
        host_token_capacity=(n + b) * page,
    )
    if host.get_size_per_token() * page != bc.CHUNK_BYTES:
        raise RuntimeError(f"the host pool's page is {host.get_size_per_token() * page} bytes, not 16 MiB")
    src, dst = host.alloc(n * page), host.alloc(b * page)
    for i in range(n):
        host.set_from_flat_data_page(src[i * page], torch.from_numpy(bc.pattern(i)).view(torch.bfloat16))

    def config(extra: dict[str, Any]) -> Any:
        """What HiCacheController._generate_storage_config hands the factory."""
        return HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=bc.MODEL,
            extra_config=extra,
        )

    def attach(kind: str, url: str | None) -> Any:
        """HiCacheController.attach_storage_backend's three calls."""
        if kind == "file":
            name, extra = "file", {"file_storage_path": str(file_dir)}
        else:
            name, extra = "dynamic", {**EXTRA, "url": url, **KINDS[kind]}
        backend = StorageBackendFactory.create_backend(name, config(extra), host)
        try:
            backend.register_mem_pool_host(host)
            backend.on_host_pools_registered()
        except BaseException:
            if hasattr(backend, "close"):
                backend.close()
            raise
        return backend

    def get_generic(backend: Any, keys: list[str], what: str = "") -> int:
        for a in range(0, len(keys), b):
            batch = keys[a : a + b]
            dummy = [host.get_dummy_flat_data_page() for _ in batch]
            pages = backend.batch_get(batch, dummy)
            for j, data in enumerate(pages or [None] * len(batch)):
                if data is None:
                    raise RuntimeError(f"SGLang {backend}: stored page {a + j} missed")
                host.set_from_flat_data_page(dst[j * page], data)
            verify(a, len(batch), what)
        return len(keys) * bc.CHUNK_BYTES

    def get_v1(backend: Any, keys: list[str], what: str = "") -> int:
        for a in range(0, len(keys), b):
            batch = keys[a : a + b]
            ok = backend.batch_get_v1(batch, dst[: len(batch) * page], HiCacheStorageExtraInfo())
            if not all(ok):
                raise RuntimeError(f"SGLang {backend}: batch_get_v1 answered {ok}")
            verify(a, len(batch), what)
        return len(keys) * bc.CHUNK_BYTES

    def verify(first: int, count: int, what: str) -> None:
        if what:
            for j in range(count):
                data = host.get_data_page(dst[j * page]).view(torch.uint8).numpy()
                bc.check_bytes(data, first + j, what)

    def set_generic(backend: Any, keys: list[str]) -> int:
        for a in range(0, len(keys), b):
            batch = keys[a : a + b]
            if not backend.batch_set(batch, [host.get_data_page(src[(a + j) * page]) for j in range(len(batch))]):
                raise RuntimeError(f"SGLang {backend}: batch_set failed")
        return len(keys) * bc.CHUNK_BYTES

    def set_v1(backend: Any, keys: list[str]) -> int:
        for a in range(0, len(keys), b):
            batch = keys[a : a + b]
            ok = backend.batch_set_v1(batch, src[a * page : (a + len(batch)) * page], HiCacheStorageExtraInfo())
            if not all(ok):
                raise RuntimeError(f"SGLang {backend}: batch_set_v1 answered {ok}")
        return len(keys) * bc.CHUNK_BYTES

    def get(kind: str) -> Any:
        return get_v1 if kind == "local" else get_generic

    def put(kind: str) -> Any:
        return set_v1 if kind == "local" else set_generic

    missing: dict[str, str] = {}
    notes: list[str] = []
    v1_checked: list[str] = []  # the round trip's verdict, once
    sizes = bc.server_sizes(2 * n, 3 * args.pairs // 4 + 1)  # RAM for two load sets
    data_dirs: dict[int, Path] = {bc.CHUNK_BYTES: args.scratch / "sglang-kv"}

    def servers(ram_gb: float | None) -> dict[int, ServerProcess]:
        """The kvtier on its data dir; ``ram_gb`` 0 for the cold phase."""
        out = {}
        for block, path in data_dirs.items():
            kw = {**sizes, **({} if ram_gb is None else {"ram_gb": ram_gb})}
            out[block] = ServerProcess(block_bytes=block, data_dir=str(path), **kw).start()
            bc.settle(out[block])
        return out

    def attach_all(running: dict[int, ServerProcess]) -> dict[str, Any]:
        backends: dict[str, Any] = {}
        for kind in KINDS:
            if kind in missing:
                continue
            try:
                backends[kind] = attach(kind, running[bc.CHUNK_BYTES].url)
            except ValueError as e:
                if kind != "local":
                    raise
                missing[kind] = f"the connector refuses interface_v1: {e}"
                print(f"sglang: interface_v1 not available ({e})", flush=True)
                continue
            if kind == "local" and not v1_checked:
                why = round_trip(backends[kind])
                v1_checked.append(why)
                if why:
                    missing[kind] = why
                    backends.pop(kind).close()
                    print(f"sglang: interface_v1 not available ({why})", flush=True)
        backends["file"] = attach("file", None)
        return backends

    def round_trip(backend: Any) -> str:
        """Why interface_v1 is not usable ("" when it is): a batch stored
        with batch_set_v1 and read back byte-exact with batch_get_v1."""
        keys = [hashlib.sha256(f"sglang-v1-probe-{i}".encode()).hexdigest() for i in range(b)]
        try:
            set_v1(backend, keys)
            host.kv_buffer[:, dst] = 0
            get_v1(backend, keys, "SGLang interface_v1 round trip")
        except Exception as e:
            return f"the connector accepts interface_v1 but a round trip failed: {e}"
        return ""

    def stats_of(backends: dict[str, Any]) -> dict[str, Any]:
        return {
            kind: {**be.stats, **bc.client_stats(be.client)} for kind, be in backends.items() if hasattr(be, "stats")
        }

    def loads(backends: dict[str, Any], running: dict[int, ServerProcess], temperature: str) -> dict[str, Any]:
        for kind, be in backends.items():
            host.kv_buffer[:, dst] = 0
            get(kind)(be, load_keys[:b], f"SGLang {kind} {temperature} load")
        key_of = backends["http"].key_of
        held = bc.tiers_of(running[bc.CHUNK_BYTES].url, [key_of(k) for k in load_keys])
        one = {kind: (lambda be=be, kind=kind: get(kind)(be, load_keys)) for kind, be in backends.items()}
        pid = running[bc.CHUNK_BYTES].pid
        if temperature == "warm":
            for fn in one.values():
                fn()
            medians = bc.alternate({k: bc.for_seconds(args.seconds, f) for k, f in one.items()}, args.pairs, pid)
        else:
            prime = {
                kind: (lambda be=be, kind=kind: get(kind)(be, store_keys(0, kind)[:b])) for kind, be in backends.items()
            }
            medians = bc.alternate(one, args.pairs, pid, before=drop.then(prime))
        row = bc.make_row("sglang", "load", temperature, medians, missing, n, b)
        row["kvtier_tiers"] = held
        return row

    rows: list[dict[str, Any]] = []
    stats: dict[str, Any] = {}
    backends: dict[str, Any] = {}
    running = servers(None)
    try:
        backends = attach_all(running)
        for kind, be in backends.items():  # connections, registration, first writes: untimed
            put(kind)(be, store_keys("warmup", kind)[:b])
        runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in backends}
        for p in range(args.pairs):
            for kind, be in backends.items():
                keys = store_keys(p, kind)
                pid = running[bc.CHUNK_BYTES].pid
                runs[kind].append(bc.timed(lambda be=be, ks=keys, kind=kind: put(kind)(be, ks), pid))
        rows.append(bc.make_row("sglang", "store", "-", {k: bc.median(v) for k, v in runs.items()}, missing, n, b))
        for kind in ("local", "local_generic", "file"):  # the load set, last in kvtier's RAM tier
            if kind in backends:
                put(kind)(backends[kind], load_keys)
        rows.append(loads(backends, running, "warm"))
        stats["warm"] = stats_of(backends)
        close(backends, running)
        running = servers(0)
        backends = attach_all(running)
        rows.append(loads(backends, running, "cold"))
        stats["cold"] = stats_of(backends)
    finally:
        close(backends, running)
        shutil.rmtree(file_dir, ignore_errors=True)
        for path in data_dirs.values():
            shutil.rmtree(path, ignore_errors=True)
    v1 = "available" if "local" not in missing else missing["local"]
    return {
        "rows": rows,
        "stats": stats,
        "notes": notes,
        "page_cache_dropped": drop.ok,
        "section": {"interface_v1": v1, "host_pool": "page_first, ShmHostTensorAllocator"},
    }


def close(backends: dict[str, Any], running: dict[int, ServerProcess]) -> None:
    for be in backends.values():
        if hasattr(be, "close"):
            be.close()
    backends.clear()
    for server in running.values():
        server.stop()
    running.clear()


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"sglang section: {time.monotonic() - started:.0f} s", flush=True)
    sys.exit(code)
