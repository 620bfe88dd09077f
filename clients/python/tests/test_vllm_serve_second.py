"""Two vLLMs on one kvtier: the second loads the blocks the first computed
and stored, byte for byte, from leases (its KV cache is not in shared
memory, so its loads copy once from kvtier's RAM tier, read in place), its
loads waited for per layer. The engines run one after the other (two at
once would share this machine's two cores). In ``make test-all``; the
conventions are tests/test_vllm_serve.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_serve_support import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    MAX_TOKENS,
    connector,
    external_hit_tokens,
    lost_requests,
    oracle_dir,
    serving,
    settled_puts,
    vllm,
)

import kvtier
from kvtier.connectors.vllm.verify import read_oracle
from kvtier.testing import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def leases_granted(server: ServerProcess) -> int:
    with kvtier.Client(server.url) as c:
        granted: int = c.stats()["local"]["leases"]["granted_total"]
        return granted


@pytest.fixture(scope="module")
def store() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=BLOCK_BYTES, ram_gb=0.25, disk_gb=1, shards=2) as s:
        yield s


def test_a_second_vllm_loads_the_first_ones_blocks_byte_for_byte(store):
    prompt = " ".join(Path(__file__).read_text().split()[:500])
    with oracle_dir("first") as first_oracle, oracle_dir("second") as second_oracle:
        first = vllm(kv_transfer_config=connector(store.url, oracle_dir=first_oracle), args=("--enforce-eager",))
        with serving(first):
            first.complete(prompt, MAX_TOKENS)
            settled_puts(store)  # the stores end after vLLM answers (stores: async)
        assert lost_requests(first) == []
        second = vllm(
            kv_transfer_config=connector(
                store.url, kv_cache_shared=False, oracle_dir=second_oracle, loads="layer", stores="sync"
            ),
            args=("--enforce-eager",),
        )
        with serving(second):
            leases_before = leases_granted(store)
            from_kvtier = second.complete(prompt, MAX_TOKENS)
            assert external_hit_tokens(second) >= BLOCK_TOKENS
            assert second.complete(prompt, MAX_TOKENS) == from_kvtier  # vLLM's own hit, same graph
            # Its loads came from leases (kvtier's RAM tier read in place,
            # one copy into vLLM's pages), and they hold what `first` computed.
            assert leases_granted(store) - leases_before >= external_hit_tokens(second) // BLOCK_TOKENS
            assert lost_requests(second) == []
        computed = {e["key"]: e["digest"] for e in read_oracle(first_oracle) if e["event"] == "stored"}
        loaded = [e for e in read_oracle(second_oracle) if e["event"] == "loaded"]
        assert loaded and all(computed.get(e["key"]) == e["digest"] for e in loaded)
