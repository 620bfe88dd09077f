"""KvtierConnector's parts that need no running engine: the interface vLLM
loads, the shared allocation of the KV cache, the start-up refusals. The
connector under a real ``vllm serve`` is tests/test_vllm_serve.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvtier._vllm_blocks import SHARED_ALLOCATION_BYTES_MIN, SharedAllocation
from kvtier.shm import backing_fd
from kvtier.vllm_connector import ConfigurationError, KvtierConnector, check_hash_algo, namespace_of

pytestmark = pytest.mark.vllm


def test_it_is_a_complete_vllm_kv_connector():
    assert issubclass(KvtierConnector, KVConnectorBase_V1)
    assert not KvtierConnector.__abstractmethods__


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


def test_a_hybrid_model_is_refused_at_start_saying_why():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=128, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=128, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=1024)
    groups = [
        SimpleNamespace(kv_cache_spec=full, layer_names=["model.layers.0.self_attn.attn"]),
        SimpleNamespace(kv_cache_spec=window, layer_names=["model.layers.1.self_attn.attn"]),
    ]
    with pytest.raises(ConfigurationError, match=r"2 KV cache groups .*SupportsHMA"):
        namespace_of(SimpleNamespace(), SimpleNamespace(kv_cache_groups=groups), None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="full-attention KV caches"):
        namespace_of(SimpleNamespace(), SimpleNamespace(kv_cache_groups=groups[1:]), None)  # type: ignore[arg-type]
