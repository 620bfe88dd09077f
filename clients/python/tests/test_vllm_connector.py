"""KvtierConnector's parts that need no running engine: the interface vLLM
loads, the shared allocation of the KV cache, the start-up refusals, the
block tags of the store plan, the block mover's leased and staged loads
against a real kvtier. The
connector under a real ``vllm serve`` is tests/test_vllm_serve.py."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import block, start_on_same_port
from test_cuda_pin import fake_cuda  # noqa: F401 - the fixture
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

from kvtier.connectors.core import ConnectorCore
from kvtier.connectors.vllm.blocks import PagedBlocks, block_tags
from kvtier.connectors.vllm.groups import Group, best_hit, groups_of, load_transfers, store_transfers
from kvtier.connectors.vllm.plan import RequestState
from kvtier.connectors.vllm.scheduler import KvtierScheduler
from kvtier.connectors.vllm.shared_cache import SHARED_ALLOCATION_BYTES_MIN, SharedAllocation
from kvtier.shm import backing_fd
from kvtier.testing import ServerProcess
from kvtier.vllm_connector import (
    ConfigurationError,
    KvtierConnector,
    KvtierConnectorMetadata,
    check_hash_algo,
)

pytestmark = pytest.mark.vllm


def test_it_is_a_complete_vllm_kv_connector_that_serves_hybrid_models():
    assert issubclass(KvtierConnector, KVConnectorBase_V1)
    assert not KvtierConnector.__abstractmethods__
    assert supports_hma(KvtierConnector)  # else vLLM turns its hybrid KV cache manager off
    # A cache, not a producer: vLLM 0.33's default (the producer role, kv_both included) would
    # recompute a request preempted with a store pending.
    assert object.__new__(KvtierConnector).requires_kv_delivery is False


def test_the_kv_cache_allocation_lands_in_shared_memory_and_small_ones_do_not():
    buffers = []
    with SharedAllocation(buffers):
        cache = torch.zeros(SHARED_ALLOCATION_BYTES_MIN * 4, dtype=torch.int8, device="cpu")
        small = torch.zeros(16, dtype=torch.int8)
    assert len(buffers) == 1 and buffers[0].nbytes == cache.numel()
    assert cache.data_ptr() == buffers[0].ptr and int(cache.abs().sum()) == 0
    cache[123] = 7  # the same bytes, seen through the memfd
    assert buffers[0].memoryview[123] == 7
    fd, offset = backing_fd(cache.data_ptr(), cache.numel())  # a file kvtier can map
    os.close(fd)
    assert offset == 0
    with pytest.raises(Exception):  # noqa: B017 - anonymous memory has no file to share
        backing_fd(small.data_ptr(), small.numel())


def config(algo: str) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))


def test_a_block_hash_seeded_per_process_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigurationError, match="--prefix-caching-hash-algo sha256"):
        check_hash_algo(config("xxhash"))  # type: ignore[arg-type]
    check_hash_algo(config("sha256"))  # type: ignore[arg-type]
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_hash_algo(config("xxhash"))  # type: ignore[arg-type]


def spec_groups(*specs: tuple[object, int]) -> SimpleNamespace:
    """A KVCacheConfig of groups ``(spec, layers)``."""
    groups, layer = [], 0
    for spec, layers in specs:
        names = [f"model.layers.{layer + i}.self_attn.attn" for i in range(layers)]
        groups.append(SimpleNamespace(kv_cache_spec=spec, layer_names=names))
        layer += layers
    return SimpleNamespace(kv_cache_groups=groups)


def test_kv_cache_groups_are_read_and_those_it_cannot_move_are_refused_saying_why():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=128, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=128, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=1024)
    sliding, whole = groups_of(spec_groups((window, 2), (full, 2)), 128)  # type: ignore[arg-type]
    assert (sliding.window_blocks, sliding.kind, whole.window_blocks, whole.kind) == (8, "sliding1024", None, "full")
    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ConfigurationError, match=r"full-attention and sliding-window .*MambaSpec x2"):
        groups_of(spec_groups((full, 2), (mamba, 2)), 128)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="one block per KV cache group, all of one size"):
        groups_of(spec_groups((full, 1), (window, 2)), 128)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs a full-attention layer"):
        groups_of(spec_groups((window, 2)), 128)  # type: ignore[arg-type]


def test_groups_vllm_gives_blocks_of_their_own_size_are_refused_naming_them():
    """vLLM's own page unification (``unify_kv_cache_spec_page_size``, which
    its KV cache planner applies to a hybrid model): a full attention layer
    of 8 KV heads and a sliding one of 4 have pages of two sizes, so vLLM
    doubles the sliding layer's block (32 tokens beside 16) and sets
    ``cache_config.block_size`` to the smaller. Keyed at 16, the sliding
    group's block i would be named by a shorter prefix's hash."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    try:  # vLLM 0.33 moved KV cache planning out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import unify_kv_cache_spec_page_size
    except ImportError:
        from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size

    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, sliding_window=512)
    unified = unify_kv_cache_spec_page_size({"full": full, "sliding": window})
    assert [unified[name].block_size for name in ("full", "sliding")] == [16, 32]
    config = spec_groups((unified["full"], 1), (unified["sliding"], 1))
    with pytest.raises(ConfigurationError, match=r"block size \(16 tokens\).* blocks of 16, 32 tokens"):
        groups_of(config, 16)  # type: ignore[arg-type]
    uniform = spec_groups((full, 2))
    assert [g.kind for g in groups_of(uniform, 16)] == ["full"]  # type: ignore[arg-type]
    context = SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1)
    with pytest.raises(ConfigurationError, match="context parallelism \\(--decode-context-parallel-size 2\\)"):
        groups_of(uniform, 16, context)  # type: ignore[arg-type]


def test_a_hybrid_hit_is_the_largest_boundary_every_group_can_serve():
    groups = [Group(0, ("a",), 2, 256), Group(1, ("b",))]  # sliding (2 blocks before a boundary), full

    def hit(sliding: set[int], full: int, positions: int = 6, ranks: int = 1) -> int:
        held = [
            int(p in sliding if g == 0 else p < full) for p in range(positions) for g in (0, 1) for _ in range(ranks)
        ]
        return best_hit(held, groups, ranks, positions)

    assert hit({4, 5}, 6) == 6
    assert hit({3, 4}, 6) == 5  # the sliding group cannot serve a boundary at 6
    assert hit({3, 4}, 4) == 0  # nor at 4 or below
    assert hit(set(), 6) == 0 and hit({0, 1, 2, 3, 4, 5}, 0) == 0
    assert hit({0}, 1) == 1  # a boundary at 1 needs block 0 only
    assert hit({4, 5}, 6, ranks=2) == 6


def test_each_group_loads_its_non_null_blocks_and_a_sliding_group_stores_only_its_window():
    groups = [Group(0, ("a",), 2, 256), Group(1, ("b",))]
    hashes = [bytes([i]) * 32 for i in range(1, 7)]
    ids = [[0, 0, 0, 31, 32, 33], [11, 12, 13, 14, 15, 16]]
    sliding, full = load_transfers("r", hashes, ids, 1, 5, background=True)
    assert (sliding.group, sliding.first, sliding.block_ids, sliding.hashes) == (0, 3, [31, 32], hashes[3:5])
    assert (full.group, full.first, full.block_ids, full.background) == (1, 1, [12, 13, 14, 15], True)
    sliding, full = store_transfers("r", hashes, list(range(24)), ids, groups, 4, 1, 6)
    assert (sliding.first, sliding.block_ids, sliding.inline, sliding.tags) == (4, [32, 33], True, None)
    assert (full.first, full.block_ids, full.inline) == (1, [12, 13, 14, 15, 16], False)
    assert full.tags == block_tags(hashes, list(range(24)), 4, 1, 6)


def test_each_stored_block_carries_vllms_hash_its_parent_and_its_tokens():
    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    tokens = list(range(100, 116))
    tags = block_tags(hashes, tokens, 4, 1, 3)
    assert [t.block_hashes for t in tags] == [[hashes[1]], [hashes[2]]]
    assert [t.parent_hash for t in tags] == [hashes[0], hashes[1]]
    assert [t.token_ids for t in tags] == [tokens[4:8], tokens[8:12]]
    assert all(t.block_size == 4 for t in tags)
    first = block_tags(hashes, tokens, 4, 0, 1)[0]
    assert first.parent_hash is None and first.encode()  # a request's first block starts the sequence
    # More tokens per block than a tag takes: the hashes alone.
    big = block_tags([b"\x01" * 32], list(range(1024)), 1024, 0, 1)[0]
    assert big.token_ids == [] and big.block_size == 1024
    # A hash no tag can hold: the block is stored untagged, never refused.
    assert block_tags([b"\x01" * 40], list(range(4)), 4, 0, 1) == [None]


def test_the_store_plan_hands_the_worker_each_blocks_tag():
    scheduler = object.__new__(KvtierScheduler)
    scheduler.block_size, scheduler.groups = 4, [Group(0, ("a",))]
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    request = SimpleNamespace(request_id="r", block_hashes=hashes, all_token_ids=list(range(12)), num_prompt_tokens=12)
    state = RequestState(request, block_ids=[[7, 8, 9]], hit_blocks=1)
    meta = KvtierConnectorMetadata()
    scheduler.plan_stores(meta, state, 12)
    (store,) = meta.stores
    assert store.block_ids == [8, 9] and store.hashes == hashes[1:] and store.first == 1
    assert store.tags == block_tags(hashes, list(range(12)), 4, 1, 3)
    assert store.tags[0].parent_hash == hashes[0] and store.tags[1].token_ids == [8, 9, 10, 11]


def test_loads_come_from_leases_then_from_staging_once_a_restarted_server_offers_none():
    """The block mover on a CPU cache that is not in shared memory: loads are
    leased (one copy into the layers' pages) while kvtier offers leases; a
    kvtier restarted with ``--ram-shared off`` turns them back into staged
    loads, with every byte still right."""
    bb, n, layers = 65536, 8, 4
    keys = [f"lease-load-{i}" for i in range(n)]
    with ServerProcess(block_bytes=bb, ram_gb=0.05, disk_gb=0.5, args=("--ram-shared", "on")) as s:
        core = ConnectorCore(
            {"url": s.url, "timeout_s": 30}, logger=logging.getLogger("t"), stats=("leased_blocks", "staged_blocks")
        )
        core.start(bb)
        core.client.put_many([(k, block(i, bb)) for i, k in enumerate(keys)])
        caches = {f"layer.{j}": torch.zeros((n, bb // layers), dtype=torch.uint8) for j in range(layers)}
        mover = PagedBlocks(core, caches, [], logging.getLogger("t"))

        def loaded() -> bool:
            got = torch.cat([caches[f"layer.{j}"] for j in range(layers)], dim=1)
            ok = all(bytes(got[i].numpy()) == block(i, bb) for i in range(n))
            for t in caches.values():
                t.zero_()
            return ok

        assert mover.ready() and mover.leased_loads and not mover.zero_copy
        assert mover.move(keys, list(range(n)), load=True) == [bb] * n and loaded()
        assert core.stats["leased_blocks"] == n and core.stats["staged_blocks"] == 0

        s.kill()
        s.argv[s.argv.index("--ram-shared") + 1] = "off"
        start_on_same_port(s)
        assert mover.move(keys, list(range(n)), load=True) == [bb] * n and loaded()
        assert not mover.leased_loads
        assert core.stats["leased_blocks"] == n and core.stats["staged_blocks"] == n
        mover.close()
        core.client.close()


def test_per_layer_loads_ask_vllm_for_piecewise_cuda_graphs_and_the_others_do_not():
    """vLLM's config finds the connector class by its factory and asks it
    (``VllmConfig``: full CUDA graphs become piecewise when it answers
    ``True``); a replayed full graph would skip ``wait_for_layer_load``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    def asks(**extra: object) -> bool:
        config = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.vllm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
        return KVConnectorFactory.get_connector_class(config).requires_piecewise_for_cudagraph(extra)

    assert asks(loads="layer") is True
    assert asks() is False and asks(loads="async") is False and asks(loads="sync") is False
    with pytest.raises(ValueError, match="loads is 'fast'"):
        asks(loads="fast")


def test_the_staging_buffer_is_pinned_portable_on_the_kv_caches_device_and_a_refusal_is_logged(
    fake_cuda,  # noqa: F811 - the fixture imported above
    tmp_path,
    monkeypatch,
    caplog,
):
    """On the fake CUDA driver (server/tests/fake-cuda, loaded in this
    process): the staging buffer of a rank whose KV cache is on GPU 1 is
    registered ``PORTABLE`` (flags 1) with GPU 1's context made current on
    the calling thread, and unregistered at close; a driver that cannot be
    loaded (as :func:`kvtier.memory.cuda.driver` answers then) leaves it
    pageable, logged."""
    from kvtier.memory import cuda as _cuda
    from kvtier.memory.shm import SharedBuffer

    trace = tmp_path / "fake-cuda.trace"
    monkeypatch.setenv("FAKE_CUDA_TRACE", str(trace))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    monkeypatch.setattr(_cuda, "_driver", _cuda.Driver(str(fake_cuda / "libcuda.so.1")))
    blocks = object.__new__(PagedBlocks)
    blocks.layers = [SimpleNamespace(device=SimpleNamespace(index=1, type="cuda"))]  # type: ignore[list-item]
    blocks.logger, blocks.owner = logging.getLogger("t"), None
    staging = SharedBuffer(1 << 20)
    pinned = threading_result(lambda: blocks._pin(staging))  # a fresh thread: no context current, as the mover
    assert pinned is True
    calls = trace.read_text().splitlines()
    assert "cuDeviceGet 1" in calls and f"cuMemHostRegister_v2 bytes={1 << 20} flags=1" in calls, calls
    blocks._stagings, blocks.pinned = {0: staging}, {staging.ptr}
    blocks.close()
    assert trace.read_text().splitlines()[-1] == "cuMemHostUnregister"

    def no_driver() -> _cuda.Driver:
        raise _cuda.CudaError("no CUDA driver: cannot load libcuda.so.1", code="no_cuda_driver")

    monkeypatch.setattr(_cuda, "driver", no_driver)
    other = SharedBuffer(1 << 20)
    with caplog.at_level(logging.WARNING, logger="t"):
        assert blocks._pin(other) is False
    assert (
        "page-locking the staging buffer (1048576 bytes) for GPU 1 failed: no_cuda_driver: no CUDA driver"
        in caplog.text
    )
    other.close()


def threading_result(fn: Any) -> Any:
    """``fn()`` run on a thread of its own; its result."""
    import threading

    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_the_connectors_counters_reach_vllms_prometheus_metrics():
    """vLLM's own ``KVConnectorProm`` (what its Prometheus logger builds)
    finds the connector's ``build_prom_metrics`` through its factory, and an
    interval's counters land as ``vllm:kvtier_*_total`` per engine, the
    microsecond ones as seconds."""
    import functools

    import prometheus_client
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = prometheus_client.CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(prometheus_client.Gauge, registry=registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(prometheus_client.Histogram, registry=registry)  # type: ignore[assignment]

    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm_connector", kv_role="kv_both"
        )
    )
    prom = Prom(config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})  # type: ignore[arg-type]
    assert prom.prom_metrics is not None, "vLLM found no Prometheus metrics for the connector"
    prom.observe({"stored_blocks": 7, "loaded_blocks": 0, "scheduler_us": 1_500_000}, engine_idx=1)
    prom.observe({"stored_blocks": 2}, engine_idx=1)
    labels = {"model_name": "m", "engine": "1"}
    assert registry.get_sample_value("vllm:kvtier_stored_blocks_total", labels) == 9
    assert registry.get_sample_value("vllm:kvtier_scheduler_seconds_total", labels) == 1.5
    assert registry.get_sample_value("vllm:kvtier_loaded_blocks_total", labels) is None  # never grew
    assert registry.get_sample_value("vllm:kvtier_stored_blocks_total", {"model_name": "m", "engine": "0"}) is None
