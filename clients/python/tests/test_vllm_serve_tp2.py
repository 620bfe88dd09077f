"""kvtier under a real ``vllm serve`` with two tensor-parallel workers
(vLLM's mp executor, one core each): each rank keys its own slice of the
heads, loads and stores inside the step, the end-to-end digest on. In
``make test-all``; the one-engine tests and the conventions (like with
like, the byte oracle, lost requests fail a test) are
tests/test_vllm_serve.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from vllm_serve_support import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    MAX_TOKENS,
    SEED,
    external_hit_tokens,
    no_lost_requests,
    oracle_dir,
    oracle_mismatches,
    prompt_blocks,
    serving,
    sharegpt_prompts,
    vllm_tp2,
)

import kvtier
from kvtier.connectors.vllm.verify import read_oracle
from kvtier.testing import ServerProcess, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def half() -> Iterator[ServerProcess]:
    # Under TP 2 each rank holds half the heads: its blocks are 1 MiB.
    with ServerProcess(block_bytes=BLOCK_BYTES // 2, ram_gb=0.125, disk_gb=0.5) as s:
        yield s


@pytest.fixture(scope="module")
def oracle() -> Iterator[str]:
    with oracle_dir("tp2") as d:
        yield d


@pytest.fixture(scope="module")
def tp2(half: ServerProcess, oracle: str) -> Iterator[VllmServer]:
    with serving(vllm_tp2(half.url, oracle)) as e:
        yield e


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return sharegpt_prompts(5, SEED)


@pytest.fixture(autouse=True)
def _no_lost_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from no_lost_requests(request, ("tp2",))


def test_tensor_parallel_ranks_store_and_load_their_own_bytes(tp2, oracle, prompts):
    """TP=2: each rank keys its own slice of the heads; a kvtier hit's tokens
    equal vLLM's own hit's, and each rank's loaded pages are what that rank
    computed (the byte oracle per rank)."""
    for p in prompts:
        tp2.complete(p, MAX_TOKENS)
    own = [tp2.complete(p, MAX_TOKENS) for p in prompts]
    tp2.reset_prefix_cache()
    hits_before = external_hit_tokens(tp2)
    assert [tp2.complete(p, MAX_TOKENS) for p in prompts] == own
    assert external_hit_tokens(tp2) - hits_before >= len(prompts) * BLOCK_TOKENS
    events = read_oracle(oracle)
    assert oracle_mismatches(events) == []
    by_rank: dict[int, dict[str, str]] = {0: {}, 1: {}}
    for e in events:
        if e["event"] == "stored":
            by_rank[e["rank"][0]][e["hash"]] = e["digest"]
    loaded_ranks = {e["rank"][0] for e in events if e["event"] == "loaded"}
    assert loaded_ranks == {0, 1}, loaded_ranks
    # The two ranks hold different heads of each block, under different keys.
    common = set(by_rank[0]) & set(by_rank[1])
    assert common and all(by_rank[0][h] != by_rank[1][h] for h in common)


def test_the_digest_refuses_another_blocks_bytes_and_vllm_recomputes(half, tp2, oracle, prompts):
    """Another block's bytes under a real key (a valid CRC) on an engine with
    the end-to-end digest on: the load is refused and recomputed, and no
    page vLLM was handed differs from the oracle."""
    chain = prompt_blocks(read_oracle(oracle), tp2, prompts[0], rank=0)
    assert len(chain) >= 2, f"rank 0 stored {len(chain)} blocks of the prompt (the previous test stores them)"
    victim, donor = chain[1], chain[0]
    with kvtier.Client(half.url) as c:
        original = c.get(victim)
        assert original is not None and c.put(victim, c.get(donor)) is not None
        try:
            since = time.time()
            tp2.reset_prefix_cache()
            tp2.complete(prompts[0], MAX_TOKENS)  # recomputed from block 1: another shape, other tokens
        finally:
            c.put(victim, original)
            tp2.reset_prefix_cache()
    after = read_oracle(oracle)
    refused = [e for e in after if e["event"] == "digest_refused" and e["t"] >= since]
    assert [e["key"] for e in refused] == [victim], refused
    assert oracle_mismatches(after) == []
