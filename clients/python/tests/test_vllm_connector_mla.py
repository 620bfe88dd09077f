"""An MLA model's KV stored once across tensor-parallel ranks (issue 64):
the ranks of a replica set share one namespace, one of them writes each
block (a stripe by block hash) and the others count it stored, every rank
loads the shared key, and the scheduler asks one key per block. Against a
real ``kvtier serve`` with the connector's own scheduler and worker code;
the model end to end under ``vllm serve`` is tests/test_vllm_serve_mla.py."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch
from test_vllm_connector import spec_groups
from test_vllm_connector_faults import BB, bare, fill, hashes, step

import kvtier
from kvtier.connectors.vllm.groups import namespace_of, rank_namespaces, replicas_of
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata
from kvtier.connectors.vllm.transfer import Transfer, writer_of
from kvtier.testing import ServerProcess

pytestmark = pytest.mark.vllm


def engine(tp: int, *, mla: bool, replicas: int | None, dcp: int = 1) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A vLLM config and KV cache config of a two-layer model at TP ``tp``:
    MLA (one 576-value latent per token and layer, vLLM's
    ``MLAAttentionSpec``) or 8 KV heads of 64; ``replicas``: vLLM's
    ``kv_tp_replicas`` (``None``: a vLLM without it)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if mla:
        spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=16, num_kv_heads=8 // tp, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = spec_groups((spec, 2))
    if replicas is not None:
        kv_cache_config.kv_tp_replicas = replicas
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="tiny-mla", use_mla=mla),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            pipeline_parallel_size=1,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=1,
        ),
        cache_config=SimpleNamespace(
            block_size=16, prefix_caching_hash_algo="sha256", get_resolved_kv_cache_layout=lambda: "NHD"
        ),
    )
    return vllm_config, kv_cache_config


def test_an_mla_models_ranks_share_one_namespace_and_a_lookup_asks_one_key_per_block():
    for replicas in (4, None):  # vLLM's kv_tp_replicas, or read from use_mla and the specs
        vllm_config, kv = engine(4, mla=True, replicas=replicas)
        assert replicas_of(vllm_config, kv) == 4  # type: ignore[arg-type]
        spaces = {namespace_of(vllm_config, kv, None, rank=(r, 0)).fingerprint for r in range(4)}  # type: ignore[arg-type]
        assert len(spaces) == 1
        assert len(rank_namespaces(vllm_config, kv, None)) == 1  # type: ignore[arg-type]
        assert namespace_of(vllm_config, kv, None, rank=(3, 0)).tp_size == 4  # type: ignore[arg-type]
    # Two replica sets of two (vLLM's kv_tp_replicas 2): two namespaces, two keys per block.
    vllm_config, kv = engine(4, mla=True, replicas=2)
    ranks = [namespace_of(vllm_config, kv, None, rank=(r, 0)).fingerprint for r in range(4)]  # type: ignore[arg-type]
    assert ranks[0] == ranks[1] != ranks[2] == ranks[3]
    assert [ns.fingerprint for ns in rank_namespaces(vllm_config, kv, None)] == [ranks[0], ranks[2]]  # type: ignore[arg-type]
    # Heads split across ranks, or MLA under decode context parallelism: keys per rank as before.
    for vllm_config, kv in (engine(4, mla=False, replicas=1), engine(4, mla=True, replicas=None, dcp=2)):
        assert replicas_of(vllm_config, kv) == 1  # type: ignore[arg-type]
        assert len({namespace_of(vllm_config, kv, None, rank=(r, 0)).fingerprint for r in range(4)}) == 4  # type: ignore[arg-type]
        assert len(rank_namespaces(vllm_config, kv, None)) == 4  # type: ignore[arg-type]


def test_write_stripes_are_disjoint_cover_every_block_and_spread_evenly():
    blocks = [hashlib.sha256(str(i).encode()).digest() for i in range(4000)]
    for replicas in (2, 4, 8):
        writers = [[rank for rank in range(replicas) if writer_of(h, replicas) == rank] for h in blocks]
        assert all(len(w) == 1 for w in writers)  # one writer each: disjoint, and every block covered
        counts = [sum(1 for w in writers if w == [rank]) for rank in range(replicas)]
        mean = len(blocks) / replicas
        assert all(abs(n - mean) < 0.15 * mean for n in counts), counts
    assert all(writer_of(h, 1) == 0 for h in blocks[:10])


def test_a_replica_set_stores_each_block_once_acknowledges_on_every_rank_and_every_rank_loads_it():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        ranks = [bare(s.url, ranks=2, rank=r, replicas=2, digest=True) for r in range(2)]
        hs = hashes(12)
        assert len({writer_of(h, 2) for h in hs}) == 2  # both ranks write some
        for c in ranks:
            for b in range(12):
                fill(c, b, b)  # identical KV on both ranks, as MLA's latent is
        for c in ranks:
            step(c, [], [Transfer("r", 0, hs, list(range(12)))])
        keys = [ranks[0].key_of(h) for h in hs]
        assert keys == [ranks[1].key_of(h) for h in hs]  # one shared key per block
        assert ranks[0].scheduler.lookup_fingerprints == [[ranks[0].namespace.fingerprint]]
        with kvtier.Client(s.url) as client:
            totals = client.stats()["totals"]
        assert (totals["blocks"], totals["puts"]) == (12, 12)  # once, not once per rank
        stored = [c.stats["stored_blocks"] for c in ranks]
        assert stored == [sum(1 for h in hs if writer_of(h, 2) == r) for r in range(2)]
        assert [c.stats["store_replica_blocks"] for c in ranks] == [12 - n for n in stored]
        # Both ranks name the finished request once its stores have ended (a
        # non-writer at once): vLLM frees its blocks when every rank has.
        for c in ranks:
            c.bind_connector_metadata(KvtierConnectorMetadata(stores_awaited=["r"]))
            assert c.get_finished({"r"}) == ({"r"}, None)
            c.clear_connector_metadata()
        # Every rank loads every block, the ones the other rank wrote too, and
        # its digest check knows them all (recorded from its own pages).
        for c in ranks:
            for t in c.caches.values():  # type: ignore[attr-defined]
                t.zero_()
            step(c, [Transfer("r", 0, hs, list(range(12)))], [])
            assert c.get_block_ids_with_load_errors() == set()
            assert c.stats["digest_checked_blocks"] == 12 and c.stats["digest_unknown_blocks"] == 0
            assert fill(ranks[0], 0, 0) == bytes(torch.cat([t[0] for t in c.caches.values()]).numpy())  # type: ignore[attr-defined]
        # Deliberate fault: a rank that writes nothing of its stripe. Its blocks
        # are missing, so the lookup stops at the first of them.
        fresh = hashes(6, salt=3)
        ranks[1].worker.mover.writes = lambda h: False  # type: ignore[union-attr]
        for c in ranks:
            step(c, [], [Transfer("q", 0, fresh, list(range(6)))])
        held = ranks[0]._core.client.batch_is_exist([ranks[0].key_of(h) for h in fresh])
        assert held == [int(writer_of(h, 2) == 0) for h in fresh]
        for c in ranks:
            c._core.close()
