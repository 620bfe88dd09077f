"""kvtier.sglang under the real sglang 0.5.23 on CPU, against a real kvtier.

The backend is built the way SGLang builds it: StorageBackendFactory's
`dynamic` backend reads the documented extra config, imports kvtier.sglang by
name and constructs the class. Pages come from SGLang's own host KV pool
(MHATokenToKVPoolHost over an MHATokenToKVPool on the CPU) and are moved the
way HiCacheController's generic page path moves them; page keys are SGLang's
own chained page hashes. Nothing here stands in for an SGLang class.

Both planes: the page tests run over HTTP (`local: off`) and over the
same-host socket (`local: on`); interface_v1 runs with the host pool in
shared memory (SGLang's `shm` allocator: kvtier copies into and out of the
pool's K and V spans), and with SGLang's default allocator (staged).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_geometry_error_logged, said_over_http, start_on_same_port

with warnings.catch_warnings():  # sglang's imports warn about every missing GPU kernel
    warnings.simplefilter("ignore")
    sglang = pytest.importorskip("sglang", reason="needs the pinned sglang (make test-sglang installs it)")
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

import kvtier
from kvtier.sglang import KvtierHiCacheStorage
from kvtier.testing import ServerProcess

# SGLang builds its page hash (a C++ extension) on first use with the ninja
# its virtualenv installs: put that on PATH as activating the virtualenv would.
if shutil.which("ninja") is None:
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

MODEL = "test-org/tiny-llama"
PAGE_TOKENS = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 32
# A flat HiCache page: K and V × 2 layers × 16 tokens × 2 heads × 32 dims × bf16.
PAGE_BYTES = 2 * LAYERS * PAGE_TOKENS * HEADS * HEAD_DIM * 2

# The documented flag (docs/INTEGRATIONS.md), with the test server's URL.
EXTRA_CONFIG = json.loads(
    '{"backend_name":"kvtier","module_path":"kvtier.sglang","class_name":"KvtierHiCacheStorage",'
    '"url":"http://127.0.0.1:8085","interface_v1":1,"allocator":"shm"}'
)


def storage_config(url: str, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **extra: object):
    """What HiCacheController._generate_storage_config hands the factory."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=extra.pop("model", MODEL),
        extra_config={**EXTRA_CONFIG, "url": url, "timeout_s": 5, **extra},
    )


def backend(url: str, plane: str = "http", **kw: object) -> KvtierHiCacheStorage:
    kw.setdefault("local", "off" if plane == "http" else "on")
    kw.setdefault("model", MODEL if plane == "http" else f"{MODEL}-over-unix")  # one server: keys of their own
    b = StorageBackendFactory.create_backend("dynamic", storage_config(url, **kw), None)
    assert isinstance(b, KvtierHiCacheStorage)
    return b


def host_pool(layout: str = "layer_first", allocator: str = "default") -> MHATokenToKVPoolHost:
    """SGLang's host KV pool over a device pool, both on the CPU."""
    device = MHATokenToKVPool(
        256, PAGE_TOKENS, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False, v_head_dim=HEAD_DIM
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE_TOKENS,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
        allocator_type=allocator,
    )


def page_hashes(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of every full page of `tokens` (a sha256 chain)."""
    return get_storage_hash_str(tokens, None, page_size=PAGE_TOKENS)


def page(seed: int) -> torch.Tensor:
    """A flat page (bf16) whose values depend on `seed`."""
    return (torch.arange(PAGE_BYTES // 2, dtype=torch.float32) * 0.25 + seed).to(torch.bfloat16)


@pytest.fixture(scope="module")
def kvserver() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=PAGE_BYTES) as s:
        yield s


@pytest.fixture(params=["http", "unix"])
def plane(request) -> str:
    return request.param


@pytest.fixture
def store(kvserver, plane) -> Iterator[KvtierHiCacheStorage]:
    b = backend(kvserver.url, plane, page_size=PAGE_TOKENS, dtype="torch.bfloat16")
    yield b
    b.close()


def test_sglang_builds_the_backend_from_the_documented_config(kvserver):
    b = backend(kvserver.url)
    try:
        assert isinstance(b, HiCacheStorage) and b.url == kvserver.url
        host = host_pool()
        b.register_mem_pool_host(host)  # what HiCacheController does next
        assert b.page_bytes == PAGE_BYTES == host.get_dummy_flat_data_page().nbytes
        assert b.page_bytes == kvtier.Client(kvserver.url).block_bytes
        ns = b.namespace
        assert (ns.model, ns.dtype, ns.block_tokens, ns.tp_size) == (MODEL, "torch.bfloat16", PAGE_TOKENS, 1)
    finally:
        b.close()


def test_set_then_batch_exists_counts_the_stored_prefix_and_batch_get_reads_into_targets(store):
    keys = page_hashes(list(range(5 * PAGE_TOKENS)))
    assert len(keys) == 5 and all(len(k) == 64 for k in keys)
    pages = [page(i) for i in range(5)]
    assert store.batch_exists(keys) == 0
    assert store.batch_set(keys[:3], pages[:3])
    assert store.set(keys[4], pages[4])  # a gap at keys[3]

    assert store.batch_exists(keys) == 3
    assert store.batch_exists(keys[:2]) == 2
    assert store.batch_exists(keys[3:]) == 0
    assert store.batch_exists(keys[4:]) == 1
    assert store.batch_exists([]) == 0
    assert store.exists(keys[4]) and not store.exists(keys[3])

    targets = [torch.zeros(PAGE_BYTES // 2, dtype=torch.bfloat16) for _ in keys]
    got = store.batch_get(keys, targets)
    for i in (0, 1, 2, 4):
        assert got[i] is targets[i] and torch.equal(targets[i], pages[i])  # read in place, no copy
    assert got[3] is None and not targets[3].any()

    plain = store.get(keys[1])  # no target: a new uint8 tensor
    assert plain.dtype == torch.uint8 and bytes(plain.numpy()) == bytes(pages[1].view(torch.uint8).numpy())
    assert store.stats["hits"] == 5 and store.stats["misses"] == 1


def test_batch_set_skips_the_leading_pages_already_stored(store):
    keys = page_hashes(list(range(1000, 1000 + 4 * PAGE_TOKENS)))
    pages = [page(10 + i) for i in range(4)]
    assert store.batch_set(keys[:2], pages[:2])
    sets = store.stats["sets"]
    assert store.batch_set(keys, pages)
    assert store.stats["sets"] - sets == 2 and store.stats["sets_skipped"] == 2
    assert store.batch_exists(keys) == 4


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pool_pages_round_trip_the_way_the_cache_controller_moves_them(kvserver, layout, plane):
    b = backend(kvserver.url, plane)
    host = host_pool(layout)
    b.register_mem_pool_host(host)
    try:
        tokens = list(range(5000, 5000 + 3 * PAGE_TOKENS))
        keys = page_hashes(tokens)
        written = host.alloc(len(keys) * PAGE_TOKENS)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
        want = [host.get_data_page(written[i * PAGE_TOKENS]).clone() for i in range(len(keys))]
        # HiCacheController._generic_page_set
        assert b.batch_set(keys, [host.get_data_page(written[i * PAGE_TOKENS]) for i in range(len(keys))])

        # HiCacheController._storage_hit_query, then _generic_page_get into other host pages
        assert b.batch_exists(keys) == 3
        read = host.alloc(len(keys) * PAGE_TOKENS)
        dummy = [host.get_dummy_flat_data_page() for _ in keys]
        got = b.batch_get(keys, dummy)
        for i in range(len(keys)):
            assert got[i] is dummy[i]
            host.set_from_flat_data_page(read[i * PAGE_TOKENS], got[i])
            assert torch.equal(host.get_data_page(read[i * PAGE_TOKENS]), want[i])
    finally:
        b.close()


def test_ranks_models_and_layouts_never_read_each_others_pages(kvserver):
    key = page_hashes(list(range(PAGE_TOKENS)))[0]

    def kvkey(layout: str = "layer_first", **kw: object) -> str:
        b = backend(kvserver.url, **kw)
        b.register_mem_pool_host(host_pool(layout))
        b.close()
        return b.key_of(key)

    base = kvkey()
    others = {kvkey(tp_rank=1, tp_size=2), kvkey(tp_rank=0, tp_size=2), kvkey(model="other/model"), kvkey("page_first")}
    assert len(others | {base}) == 5
    # MLA: every TP rank holds the whole latent KV, so ranks share pages.
    assert kvkey(mla=True, tp_rank=1, tp_size=2) == kvkey(mla=True, tp_rank=0, tp_size=2)


def test_a_store_of_another_page_size_is_refused_with_both_numbers(caplog):
    with ServerProcess(block_bytes=PAGE_BYTES * 2) as other:
        b = backend(other.url)
        try:
            with pytest.raises(
                kvtier.GeometryError, match=rf"{PAGE_BYTES * 2} bytes.*{PAGE_BYTES} bytes.*--block-bytes {PAGE_BYTES}"
            ) as refused:
                b.register_mem_pool_host(host_pool())
            assert isinstance(refused.value, ValueError)
        finally:
            b.close()
        # Without a host pool the sizes meet at the first set: refused, not raised.
        b = backend(other.url, page_size=PAGE_TOKENS)
        caplog.set_level(logging.WARNING, logger="kvtier.sglang")
        assert not b.set(page_hashes(list(range(PAGE_TOKENS)))[0], page(1))
        assert any(str(PAGE_BYTES * 2) in r.getMessage() and str(PAGE_BYTES) in r.getMessage() for r in caplog.records)
        b.close()


def test_a_page_size_found_wrong_after_start_gives_misses_not_exceptions(caplog):
    """kvtier down when SGLang registers its host pool: the sizes are
    compared at the first call that reaches it, and a mismatch then makes
    every call a miss with an error naming both sizes."""
    server = ServerProcess(block_bytes=PAGE_BYTES * 2)
    b = backend(server.url, down_s=0.2, timeout_s=2)
    try:
        b.register_mem_pool_host(host_pool())  # not compared yet: nothing raised
        server.start()
        time.sleep(0.3)  # past down_s
        caplog.set_level(logging.WARNING, logger="kvtier.sglang")
        keys = page_hashes(list(range(7000, 7000 + 2 * PAGE_TOKENS)))
        assert b.batch_exists(keys) == 0
        targets = [torch.zeros(PAGE_BYTES // 2, dtype=torch.bfloat16) for _ in keys]
        assert b.batch_get(keys, targets) == [None, None]
        assert not b.batch_set(keys, [page(1), page(2)])
        assert not b.set(keys[0], page(1))
        assert not b.exists(keys[0]) and b.get(keys[0]) is None
        assert_geometry_error_logged(caplog, "kvtier.sglang", PAGE_BYTES * 2, PAGE_BYTES)
        assert b.stats["sets"] == b.stats["hits"] == 0
    finally:
        b.close()
        server.stop()


def fill_pool(host: MHATokenToKVPoolHost, pages: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocates ``pages`` pages of host slots and fills them: (slots, each page's flat bytes)."""
    slots = host.alloc(pages * PAGE_TOKENS)
    torch.manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
    return slots, [host.get_data_page(slots[i * PAGE_TOKENS]).clone() for i in range(pages)]


def shm_pool_with_pages(b: KvtierHiCacheStorage, first_token: int, seed: int):
    """A page_first host pool in SGLang's shm allocator registered with
    ``b``, two pages of it filled: (pool, page keys, their slots, their flat bytes)."""
    host = host_pool("page_first", allocator="shm")
    b.register_mem_pool_host(host)
    keys = page_hashes(list(range(first_token, first_token + 2 * PAGE_TOKENS)))
    written, want = fill_pool(host, 2, seed=seed)
    return host, keys, written, want


def without_map_files(monkeypatch) -> None:
    """What a process without CAP_SYS_ADMIN/CAP_CHECKPOINT_RESTORE (an engine
    not run as root) meets: /proc/self/map_files cannot be opened, so memory
    is shareable only through a descriptor the process holds."""
    real_open = os.open

    def open_(path, *args, **kw):
        if str(path).startswith("/proc/self/map_files/"):
            raise PermissionError(1, "Operation not permitted", path)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", open_)


def test_pages_carry_sglangs_page_hash_and_its_parent_as_a_block_tag(kvserver, plane, monkeypatch):
    """Each stored page names itself in SGLang's hash space for kvtier's KV
    events: its page hash, the previous page's as parent (from the batch,
    or SGLang's prefix_keys before it), the page size; a page whose parent
    SGLang does not say is stored untagged, never claimed to start a sequence."""
    b = backend(kvserver.url, plane)
    host = host_pool("page_first", allocator="shm" if plane == "unix" else "default")
    b.register_mem_pool_host(host)
    try:
        keys = page_hashes(list(range(31000, 31000 + 3 * PAGE_TOKENS)))
        tags = b.page_tags(keys[1:], keys[:1])
        assert [t.block_hashes for t in tags] == [[bytes.fromhex(k)] for k in keys[1:]]
        assert [t.parent_hash for t in tags] == [bytes.fromhex(k) for k in keys[:2]]
        assert all(t.block_size == PAGE_TOKENS and t.token_ids == [] for t in tags)
        assert b.page_tags(keys[:1], [])[0].parent_hash is None  # the sequence's first page
        unknown = b.page_tags(keys, None)
        assert unknown[0] is None and unknown[1].parent_hash == bytes.fromhex(keys[0])
        assert b.page_tags(["not-a-hash", keys[0]], []) == [None, None]  # the chain is broken after it too
        sent: list = []
        put, put_v = b.client.put, b.client.batch_put_from_multi_buffers
        monkeypatch.setattr(b.client, "put", lambda key, data, tag=None: sent.append(tag) or put(key, data, tag=tag))
        monkeypatch.setattr(
            b.client,
            "batch_put_from_multi_buffers",
            lambda k, p, s, tags=None: sent.extend(tags) or put_v(k, p, s, tags),
        )
        written, _ = fill_pool(host, 3, seed=5)
        assert b.batch_set_v1(keys, written, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 3
        assert sent == b.page_tags(keys, []) and all(t is not None for t in sent)
    finally:
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("path", ["http", "unix-shm", "unix-staged"])
def test_interface_v1_moves_pages_between_the_host_pool_and_kvtier(kvserver, layout, path, monkeypatch):
    """HiCacheController's zero-copy page path (batch_set_v1/batch_get_v1 by
    host slots): with the pool in shared memory over the socket kvtier
    gathers and scatters each page's K and V spans itself; with SGLang's
    default allocator (anonymous memory, no descriptor) the pages are
    staged; over HTTP one request a page. The engine runs unprivileged (see
    without_map_files). A page stored either way reads back the same
    through the generic interface (same bytes, same key)."""
    plane, _, how = path.partition("-")
    without_map_files(monkeypatch)
    b = backend(kvserver.url, plane)
    host = host_pool(layout, allocator="shm" if how == "shm" else "default")
    b.register_mem_pool_host(host)
    try:
        keys = page_hashes(
            list(range(11000 + 100 * len(path) + len(layout), 11000 + 100 * len(path) + len(layout) + 3 * PAGE_TOKENS))
        )
        written, want = fill_pool(host, len(keys), seed=len(path))
        assert b.batch_set_v1(keys, written) == [True] * 3
        assert b.batch_set_v1(keys, written) == [True] * 3 and b.stats["sets_skipped"] == 3  # all stored already
        read = host.alloc(len(keys) * PAGE_TOKENS)
        missing = page_hashes(list(range(99000, 99000 + PAGE_TOKENS)))
        assert b.batch_get_v1(keys[:2] + missing, read) == [True, True, False]
        for i in range(2):
            assert torch.equal(host.get_data_page(read[i * PAGE_TOKENS]), want[i])
        flat = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        assert all(torch.equal(f, w) for f, w in zip(flat, want))
        assert b.transport == ("unix" if plane == "unix" else "http")
        moved = {"zero_copy_chunks": b.stats["zero_copy_chunks"], "staged_chunks": b.stats["staged_chunks"]}
        if how == "shm":
            assert b._host.zero_copy is True and moved == {"zero_copy_chunks": 5, "staged_chunks": 3}  # +3 generic gets
        elif how == "staged":
            assert b._host.zero_copy is False and moved == {"zero_copy_chunks": 0, "staged_chunks": 8}
        else:
            assert moved == {"zero_copy_chunks": 0, "staged_chunks": 0}
    finally:
        b.close()


def test_a_stopped_server_gives_misses_not_exceptions(caplog, plane):
    """kvtier killed under SGLang: misses and failed sets (bounded by
    timeout_s, nothing raised), on both interfaces; restarted, pages are
    found again, and on the socket the host pool is registered again on the
    new connection, still zero-copy."""
    server = ServerProcess(block_bytes=PAGE_BYTES).start()
    b = backend(server.url, plane, down_s=0.5, timeout_s=2)
    host, keys, written, want = shm_pool_with_pages(b, 9000, seed=9)
    try:
        assert b.batch_set_v1(keys, written) == [True, True]
        server.kill()
        caplog.set_level(logging.WARNING, logger="kvtier.sglang")
        started = time.monotonic()
        assert b.batch_exists(keys) == 0
        assert b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
        read = host.alloc(2 * PAGE_TOKENS)
        assert b.batch_get_v1(keys, read) == [False, False]
        assert not b.batch_set(keys, [page(1), page(2)])
        assert b.batch_set_v1(keys, written) == [False, False]
        assert not b.exists(keys[0]) and b.get(keys[0]) is None
        assert time.monotonic() - started < 5
        assert any("kvtier" in r.getMessage() for r in caplog.records)

        start_on_same_port(server)
        time.sleep(0.6)
        assert b.batch_exists(keys) == 2
        assert b.batch_get_v1(keys, read) == [True, True]
        assert all(torch.equal(host.get_data_page(read[i * PAGE_TOKENS]), want[i]) for i in range(2))
        if plane == "unix":
            assert b._host.zero_copy is True and b.stats["zero_copy_chunks"] == 4
            assert b.client.local_stats()["registrations_renewed"] >= 1
    finally:
        b.close()
        server.stop()


def test_no_local_socket_falls_back_to_http_with_one_log_line(caplog):
    """local="auto" (the default) against a kvtier started with
    --local-socket none: HTTP, said once, and pages move."""
    caplog.set_level(logging.INFO, logger="kvtier")
    with ServerProcess(block_bytes=PAGE_BYTES, args=("--local-socket", "none")) as server:
        b = backend(server.url, local="auto")
        host, keys, written, want = shm_pool_with_pages(b, 8000, seed=8)
        try:
            assert b.batch_set_v1(keys, written) == [True, True]
            read = host.alloc(2 * PAGE_TOKENS)
            assert b.batch_get_v1(keys, read) == [True, True]
            assert all(torch.equal(host.get_data_page(read[i * PAGE_TOKENS]), want[i]) for i in range(2))
            assert b.transport == "http" and b.stats["zero_copy_chunks"] == b.stats["staged_chunks"] == 0
        finally:
            b.close()
    said_over_http(caplog)
