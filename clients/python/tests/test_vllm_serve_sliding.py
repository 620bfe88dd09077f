"""A sliding-window model under a real ``vllm serve``: Gemma-3's layout
(sliding-window and global layers, vLLM's hybrid KV cache manager on),
keyed per KV cache group. In ``make test-all``; the conventions are
tests/test_vllm_serve.py's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_serve_support import (
    BLOCK_TOKENS,
    GROUP_BLOCK_BYTES,
    MAX_TOKENS,
    SEED,
    SW_GROUPS,
    SW_LAYERS,
    SW_WINDOW_BLOCKS,
    connector,
    external_hit_tokens,
    no_lost_requests,
    oracle_dir,
    oracle_mismatches,
    server_totals,
    serving,
    settled_puts,
    sharegpt_prompts,
    vllm,
)

from kvtier.connectors.vllm.verify import read_oracle
from kvtier.testing import ServerProcess, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def windowed() -> Iterator[ServerProcess]:
    # The sliding-window model keys a block per KV cache group: 256 KiB.
    with ServerProcess(block_bytes=GROUP_BLOCK_BYTES, ram_gb=0.0625, disk_gb=0.25) as s:
        yield s


@pytest.fixture(scope="module")
def oracle() -> Iterator[str]:
    with oracle_dir("sliding") as d:
        yield d


@pytest.fixture(scope="module")
def sliding(windowed: ServerProcess, oracle: str) -> Iterator[VllmServer]:
    engine = vllm(
        "KVTIER_VLLM_SW_MODEL", kv_transfer_config=connector(windowed.url, oracle_dir=oracle), args=("--enforce-eager",)
    )
    with serving(engine) as e:
        yield e


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return sharegpt_prompts(6, SEED)


@pytest.fixture(autouse=True)
def _no_lost_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from no_lost_requests(request, ("sliding",))


def test_a_sliding_window_model_loads_vllms_own_hit_from_kvtier_and_stores_less(windowed, sliding, oracle, prompts):
    """Gemma-3's layout (sliding-window and global layers, vLLM's hybrid KV
    cache manager on): a kvtier hit's tokens equal vLLM's own hit's, every
    loaded block holds what was stored, and the sliding groups store only
    the blocks a later hit needs, fewer bytes than the full-attention
    equivalent."""
    assert "Turning off hybrid kv cache manager" not in sliding.tail(200_000)
    before = server_totals(windowed)["puts"]
    for p in prompts:
        sliding.complete(p, MAX_TOKENS)
    puts = settled_puts(windowed) - before
    own = [sliding.complete(p, MAX_TOKENS) for p in prompts]
    sliding.reset_prefix_cache()
    hits_before = external_hit_tokens(sliding)
    assert [sliding.complete(p, MAX_TOKENS) for p in prompts] == own
    assert external_hit_tokens(sliding) - hits_before >= len(prompts) * 2 * BLOCK_TOKENS
    events = read_oracle(oracle)
    assert [e for e in events if e["event"] == "loaded"] and oracle_mismatches(events) == []
    # Bytes: a block position of the full-attention group is tagged with its
    # tokens; the full-attention equivalent stores every layer of each.
    positions = len({e["key"] for e in events if e["event"] == "stored" and e["tokens"]})
    full_equivalent = positions * SW_LAYERS * GROUP_BLOCK_BYTES // 2
    stored = puts * GROUP_BLOCK_BYTES
    assert positions <= puts <= positions + (SW_GROUPS - 1) * SW_WINDOW_BLOCKS * len(prompts) * 2, (puts, positions)
    assert stored < full_equivalent, (stored, full_equivalent)
    print(f"sliding-window model: {stored} bytes stored for {positions} block positions ({full_equivalent} at full)")
