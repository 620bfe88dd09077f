"""kvtier.vllm under the real vllm 0.32.0 on CPU, against a real kvtier.

The tier is loaded the way vLLM loads it: vLLM's own TieringOffloadingSpec
reads `secondary_tiers` from the documented kv_connector_extra_config, and its
SecondaryTierFactory imports kvtier.vllm by name. The primary view is either
vLLM's own CPU primary tier (spec.get_manager(), the scheduler-side manager
vLLM runs) or, in the pattern of vLLM's tests/v1/kv_offload/tiering/
test_fs_tier.py, a memoryview over a CPU tensor. Nothing here stands in for a
vLLM class.

Both planes: the `tier` fixture and the transfer tests run with local="off"
(HTTP) and local="auto" (the same-host socket). vLLM's own primary region is
a MAP_SHARED /dev/shm file, so through spec.get_manager() the socket path is
zero-copy (kvtier copies into and out of the rows); a tensor_view() primary is
torch memory no file backs, so there it is staged through the client.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import assert_geometry_error_logged, said_over_http, start_on_same_port

vllm = pytest.importorskip("vllm", reason="needs the pinned vllm (make test-vllm installs it)")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

import kvtier  # noqa: E402
from kvtier.testing import ServerProcess  # noqa: E402
from kvtier.vllm import KvtierTier  # noqa: E402

MODEL = "test-org/tiny-llama"
BLOCK_TOKENS = 16
# One worker's KV bytes per 16-token block (2 layers × K/V × 16 tokens × 2 heads
# × 32 dims × bf16 = 8,192): with one block per chunk and TP=1 a chunk row of
# vLLM's CPU tier is 8,192 bytes (a multiple of the 4 KiB page: no padding).
WORKER_KV_BYTES_PER_BLOCK = 2 * 2 * BLOCK_TOKENS * 2 * 32 * 2
ROW_BYTES = WORKER_KV_BYTES_PER_BLOCK
NUM_CHUNKS = 8

# The documented flag (docs/INTEGRATIONS.md), with the test server's URL.
KV_TRANSFER_CONFIG = json.loads(
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
    '{"spec_name":"TieringOffloadingSpec","block_size":16,"cpu_bytes_to_use":65536,'
    '"secondary_tiers":[{"type":"KvtierTier","module_path":"kvtier.vllm","url":"http://127.0.0.1:8085"}]}}'
)


def extra_config(url: str, **tier: object) -> dict:
    extra = copy.deepcopy(KV_TRANSFER_CONFIG["kv_connector_extra_config"])
    extra["secondary_tiers"][0].update({"url": url, "timeout_s": 5, **tier})
    return extra


def offloading_config(
    url: str, *, model: str = MODEL, dtype: str = "bfloat16", tp_size: int = 1, agnostic: bool = True, **tier: object
) -> OffloadingConfig:
    """vLLM's normalized offloading configuration, as the connector builds it
    from a VllmConfig and the kv_connector_extra_config."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=WORKER_KV_BYTES_PER_BLOCK // tp_size,
        enable_kv_cache_events=False,
        extra_config=extra_config(url, **tier),
        engine_id="test-engine",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
    )


def spec_for(url: str, **kw: object) -> TieringOffloadingSpec:
    return TieringOffloadingSpec(offloading_config(url, **kw))


def key(n: int, group: int = 0) -> OffloadKey:
    return make_offload_key(n.to_bytes(32, "big"), group)


CTX = ReqContext(req_id="test")


def job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int], load: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids, dtype=np.int64),
        is_promotion=load,
        req_context=CTX,
    )


def finished(tier: SecondaryTierManager, timeout_s: float = 20.0) -> list:
    """Polls get_finished_jobs, as vLLM's scheduler does each step, until the
    tier has no pending work (bounded, so a hang fails the test instead of
    stalling it); returns every result collected."""
    results: list = []
    deadline = time.monotonic() + timeout_s
    while True:
        results += tier.get_finished_jobs()
        if not tier.has_pending_work():
            return results
        assert time.monotonic() < deadline, f"jobs still pending after {timeout_s} s"
        time.sleep(0.005)


def step_until_resolved(lookup, keys: list[OffloadKey], on_schedule_end, timeout_s: float = 10.0) -> list:
    """Scheduler steps (lookups, then on_schedule_end) until no lookup answers
    RETRY: what vLLM's scheduler does for a waiting request."""
    deadline = time.monotonic() + timeout_s
    while True:
        results = [lookup(k, CTX) for k in keys]
        if LookupResult.RETRY not in results and LookupResult.HIT_PENDING not in results:
            return results
        assert time.monotonic() < deadline, f"lookups still {results} after {timeout_s} s"
        on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.005)


def tensor_view() -> tuple[torch.Tensor, memoryview]:
    """The fs-tier test's primary: a CPU tensor of NUM_CHUNKS rows and a memoryview over it."""
    tensor = torch.zeros(NUM_CHUNKS, ROW_BYTES // 4, dtype=torch.float32)
    return tensor, memoryview(tensor.numpy())


@pytest.fixture(scope="module")
def kvserver() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=ROW_BYTES) as s:
        yield s


@pytest.fixture(params=["off", "auto"])
def tier(kvserver, request) -> Iterator[tuple[KvtierTier, torch.Tensor]]:
    """A tier over a tensor_view() primary, over HTTP ("off") or the socket ("auto", staged)."""
    tensor, view = tensor_view()
    t = SecondaryTierFactory.create_secondary_tier(
        extra_config(kvserver.url, local=request.param)["secondary_tiers"][0], view, spec_for(kvserver.url)
    )
    assert isinstance(t, KvtierTier)
    assert t.transport == ("http" if request.param == "off" else "unix")
    assert t.zero_copy is False  # torch memory: no shared file to register
    yield t, tensor
    t.shutdown()


def test_vllm_builds_the_tier_from_the_documented_config(kvserver):
    spec = spec_for(kvserver.url)
    assert spec.kv_bytes_per_chunk == ROW_BYTES
    manager = spec.get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager)
        (t,) = manager.secondary_tiers
        assert isinstance(t, KvtierTier) and isinstance(t, SecondaryTierManager)
        assert t.tier_type == "KvtierTier" and t.url == kvserver.url
        assert t.block_size_bytes == ROW_BYTES == kvtier.Client(kvserver.url).block_bytes
        assert t.namespace.model == MODEL and t.namespace.block_tokens == BLOCK_TOKENS
    finally:
        manager.shutdown()  # also unmaps the primary: the tier must have let go of it


def test_vllm_hands_the_tier_its_backpressure_detector(kvserver):
    """`backpressure` in the tier's entry is vLLM's: it builds the detector and
    drops stores while kvtier is slower than the configured water marks."""
    entry = extra_config(kvserver.url, backpressure={"backpressure_cls": "EMABackpressureDetector"})
    t = SecondaryTierFactory.create_secondary_tier(
        entry["secondary_tiers"][0], tensor_view()[1], spec_for(kvserver.url)
    )
    try:
        assert isinstance(t, KvtierTier) and t.bp_detector is not None
    finally:
        t.shutdown()


def test_store_then_load_into_other_chunks_round_trips_the_bytes(tier, kvserver):
    t, tensor = tier
    tensor[:] = torch.rand(NUM_CHUNKS, ROW_BYTES // 4)
    keys = [key(i) for i in range(3)]
    expected = tensor[:3].clone()

    t.submit_store(job(1, keys, [0, 1, 2]))
    (stored,) = finished(t)
    assert stored.job_id == 1 and stored.success and stored.transfer_bytes == 3 * ROW_BYTES

    # kvtier holds exactly the row's bytes under the namespaced key.
    client = kvtier.Client(kvserver.url)
    assert client.get(t.key_of(keys[0])) == expected[0].numpy().tobytes()

    tensor[:] = 0.0
    t.submit_load(job(2, keys, [5, 6, 7], load=True))
    (loaded,) = finished(t)
    assert loaded.job_id == 2 and loaded.success
    for i, cid in enumerate([5, 6, 7]):
        assert torch.equal(tensor[cid], expected[i])
    assert not tensor[:5].any()
    staged = 6 if t.transport == "unix" else 0
    assert t.stats["staged_chunks"] == staged and t.stats["zero_copy_chunks"] == 0
    # Over the socket the stores go through the staging area and the loads
    # copy from leases (the server's RAM tier is shared by default).
    plane = t.client.local_stats()
    assert (plane["bounce_copies"], plane["lease_copies"]) == ((3, 3) if staged else (0, 0))


def test_lookups_answer_retry_then_the_stored_prefix(tier):
    t, tensor = tier
    tensor[:] = 1.0
    keys = [key(100 + i) for i in range(4)]
    t.submit_store(job(1, keys[:2], [0, 1]))
    assert all(r.success for r in finished(t))

    # Never blocks: the first answer is RETRY, the batch goes out at the step's end.
    assert t.lookup(keys[0], CTX) is LookupResult.RETRY
    results = step_until_resolved(t.lookup, keys, t.on_schedule_end)
    assert results == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS, LookupResult.MISS]
    assert t.stats["lookup_hits"] == 2
    t.on_request_finished(CTX)


def test_a_load_with_a_missing_chunk_fails_keeps_the_rest_and_marks_it_missing(tier):
    t, tensor = tier
    tensor[0] = 7.0
    t.submit_store(job(1, [key(200)], [0]))
    assert all(r.success for r in finished(t))
    tensor[:] = 0.0

    assert step_until_resolved(t.lookup, [key(201)], t.on_schedule_end) == [LookupResult.MISS]
    t.submit_load(job(2, [key(200), key(201)], [3, 4], load=True))
    (result,) = finished(t)
    assert not result.success and tuple(result.successful_keys) == (key(200),)
    assert torch.equal(tensor[3], torch.full((ROW_BYTES // 4,), 7.0))
    # vLLM will not try to promote the missing chunk again.
    assert t.lookup(key(201), CTX) is LookupResult.MISS
    t.on_request_finished(CTX)


def test_groups_and_namespaces_never_read_each_others_chunks(kvserver):
    client = kvtier.Client(kvserver.url)
    base = KvtierTier(spec_for(kvserver.url), tensor_view()[1], "KvtierTier", url=kvserver.url)
    others = [
        KvtierTier(spec_for(kvserver.url, model="other/model"), tensor_view()[1], "KvtierTier", url=kvserver.url),
        KvtierTier(spec_for(kvserver.url, dtype="float16"), tensor_view()[1], "KvtierTier", url=kvserver.url),
        KvtierTier(spec_for(kvserver.url, tp_size=2, agnostic=False), tensor_view()[1], "KvtierTier", url=kvserver.url),
    ]
    try:
        keys = {base.key_of(key(700)), base.key_of(key(700, group=1))}
        keys |= {o.key_of(key(700)) for o in others}
        assert len(keys) == 5
        # A layout vLLM calls parallelism-agnostic shares chunks across TP sizes.
        agnostic = KvtierTier(spec_for(kvserver.url, tp_size=2), tensor_view()[1], "KvtierTier", url=kvserver.url)
        assert agnostic.key_of(key(700)) == base.key_of(key(700))
        agnostic.shutdown()
        assert all(len(k) < 120 for k in keys) and client.lookup(sorted(keys)) == 0
    finally:
        for t in [base, *others]:
            t.shutdown()


def test_a_store_of_another_block_size_is_refused_with_both_numbers():
    with ServerProcess(block_bytes=ROW_BYTES * 2) as other:
        with pytest.raises(
            kvtier.GeometryError, match=rf"{ROW_BYTES * 2} bytes.*{ROW_BYTES} bytes.*--block-bytes {ROW_BYTES}"
        ) as refused:
            spec_for(other.url).get_manager()
        assert isinstance(refused.value, ValueError)


def test_a_block_size_found_wrong_after_start_fails_jobs_and_misses_not_raises(caplog):
    """kvtier down when vLLM starts: the sizes are compared at the first
    transfer or lookup that reaches it, and a mismatch then fails every job
    and misses every lookup with an error naming both sizes."""
    server = ServerProcess(block_bytes=ROW_BYTES * 2)
    tensor, view = tensor_view()
    t = KvtierTier(spec_for(server.url), view, "KvtierTier", url=server.url, timeout_s=2, down_s=0.2)
    try:
        server.start()
        time.sleep(0.3)  # past down_s
        caplog.set_level(logging.WARNING, logger="kvtier.vllm")
        tensor[:] = 5.0
        assert step_until_resolved(t.lookup, [key(800)], t.on_schedule_end) == [LookupResult.MISS]
        t.submit_store(job(1, [key(800)], [0]))
        t.submit_load(job(2, [key(800)], [1], load=True))
        assert {r.job_id: r.success for r in finished(t)} == {1: False, 2: False}
        assert_geometry_error_logged(caplog, "kvtier.vllm", ROW_BYTES * 2, ROW_BYTES)
        assert t.stats["failed_jobs"] == 2 and t.stats["stored_chunks"] == 0
        assert torch.equal(tensor[1], torch.full((ROW_BYTES // 4,), 5.0))  # nothing was read into it
        t.on_request_finished(CTX)
    finally:
        t.shutdown()
        server.stop()


def assert_plane(t: KvtierTier, local: str, chunks: int) -> None:
    """`t` (over vLLM's own primary region) moved `chunks` chunks zero-copy
    over the socket (local="auto"), or over HTTP (local="off")."""
    if local == "auto":
        assert t.transport == "unix" and t.zero_copy is True
        assert t.stats["zero_copy_chunks"] == chunks and t.stats["staged_chunks"] == 0
        stats = t.client.local_stats()
        assert stats["bounce_copies"] == 0 and stats["registrations"] == 1
    else:
        assert t.transport == "http" and t.zero_copy is False
        assert t.stats["zero_copy_chunks"] == t.stats["staged_chunks"] == 0


@pytest.mark.parametrize("local", ["off", "auto"])
def test_the_tiering_manager_cascades_stores_and_promotes_misses(kvserver, local):
    """vLLM's scheduler-side TieringOffloadingManager: a chunk stored in one
    engine's CPU tier cascades to kvtier; a second engine (an empty CPU tier)
    finds it there, promotes it and reads the same bytes into its own primary
    rows. On the socket both ways are kvtier copying straight out of and into
    vLLM's shared region: no copy in this process."""
    keys = [key(300 + i) for i in range(3)]
    writer = spec_for(kvserver.url, local=local).get_manager()
    try:
        ctx = ReqContext(req_id="w")
        writer.on_new_request(ctx)
        out = writer.prepare_store(keys, ctx)
        rows = np.asarray(writer.primary_tier.get_kv_memoryview())
        chunk_ids = [int(c) for c in out.store_spec.chunk_ids]
        for i, cid in enumerate(chunk_ids):
            rows[cid] = np.arange(ROW_BYTES, dtype=np.int64).astype(np.int8) + i  # what the GPU worker copies
        expected = [rows[cid].copy() for cid in chunk_ids]
        writer.complete_store(keys, ctx)  # cascades to the secondary tiers
        (t,) = writer.secondary_tiers
        deadline = time.monotonic() + 20
        while t.stats["stored_chunks"] < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert t.stats["stored_chunks"] == 3
        assert_plane(t, local, 3)
        writer.on_request_finished(ctx)
        writer.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    finally:
        writer.shutdown()

    reader = spec_for(kvserver.url, local=local).get_manager()
    try:
        ctx = ReqContext(req_id="r")
        reader.on_new_request(ctx)

        def lookup(k: OffloadKey, _ctx: ReqContext) -> LookupResult:
            return reader.lookup(k, ctx)

        assert step_until_resolved(lookup, [*keys, key(399)], reader.on_schedule_end) == [LookupResult.HIT] * 3 + [
            LookupResult.MISS
        ]
        assert reader.secondary_tiers[0].stats["loaded_chunks"] == 3  # promoted from kvtier
        load = reader.prepare_load(keys, ctx)
        rows = np.asarray(reader.primary_tier.get_kv_memoryview())
        for want, cid in zip(expected, load.chunk_ids):
            assert np.array_equal(rows[int(cid)], want)
        assert_plane(reader.secondary_tiers[0], local, 3)
        reader.complete_load(keys, ctx)
        reader.on_request_finished(ctx)
    finally:
        reader.shutdown()


@pytest.mark.parametrize("local", ["off", "auto"])
def test_a_stopped_server_gives_failed_jobs_and_misses_not_a_hang(caplog, local):
    server = ServerProcess(block_bytes=ROW_BYTES).start()
    tensor, view = tensor_view()
    t = KvtierTier(spec_for(server.url), view, "KvtierTier", url=server.url, local=local, timeout_s=2, down_s=0.5)
    try:
        tensor[:] = 3.0
        t.submit_store(job(1, [key(400)], [0]))
        assert all(r.success for r in finished(t))

        server.kill()
        caplog.set_level(logging.WARNING, logger="kvtier.vllm")
        started = time.monotonic()
        t.submit_store(job(2, [key(401), key(402)], [1, 2]))
        t.submit_load(job(3, [key(400)], [3], load=True))
        assert time.monotonic() - started < 0.1  # submitting never waits on kvtier
        results = {r.job_id: r for r in finished(t, timeout_s=10)}
        assert set(results) == {2, 3} and not results[2].success and not results[3].success
        assert step_until_resolved(t.lookup, [key(400)], t.on_schedule_end) == [LookupResult.MISS]
        assert time.monotonic() - started < 10
        assert any("kvtier" in r.getMessage() for r in caplog.records)
        t.on_request_finished(CTX)

        # Back up: after down_s the tier tries again and finds the chunk.
        start_on_same_port(server)
        time.sleep(0.6)
        tensor[3] = 0.0
        t.submit_load(job(4, [key(400)], [3], load=True))
        (again,) = finished(t)
        assert again.success and torch.equal(tensor[3], torch.full((ROW_BYTES // 4,), 3.0))
    finally:
        t.shutdown()
        server.stop()


def test_a_server_down_at_start_is_tried_later():
    server = ServerProcess(block_bytes=ROW_BYTES)
    _, view = tensor_view()
    t = KvtierTier(spec_for(server.url), view, "KvtierTier", url=server.url, timeout_s=2, down_s=0.2)
    try:
        t.submit_store(job(1, [key(500)], [0]))
        assert [r.success for r in finished(t)] == [False]
        server.start()
        time.sleep(0.3)
        t.submit_store(job(2, [key(500)], [0]))
        assert [r.success for r in finished(t)] == [True]
    finally:
        t.shutdown()
        server.stop()


def test_drain_jobs_waits_for_every_transfer(tier):
    t, tensor = tier
    tensor[:] = 2.0
    for i in range(NUM_CHUNKS):
        t.submit_store(job(i, [key(600 + i)], [i]))
    t.drain_jobs()
    assert len(list(t.get_finished_jobs())) == NUM_CHUNKS
    assert not t.has_pending_work()


@contextmanager
def stored_over_the_socket(k: int, **settings: object) -> Iterator[tuple[ServerProcess, KvtierTier, np.ndarray]]:
    """A kvtier and the tier over vLLM's own primary region (a shared file:
    zero-copy over the socket; ``settings`` as :func:`spec_for` takes them),
    row 0 (every byte 3) stored under ``key(k)``; yields the server, the
    tier and the rows."""
    server = ServerProcess(block_bytes=ROW_BYTES).start()
    manager = spec_for(server.url, **settings).get_manager()
    try:
        (t,) = manager.secondary_tiers
        assert isinstance(t, KvtierTier) and t.transport == "unix" and t.zero_copy is True
        rows = np.asarray(manager.primary_tier.get_kv_memoryview())
        rows[0] = 3
        t.submit_store(job(1, [key(k)], [0]))
        assert all(r.success for r in finished(t))
        yield server, t, rows
    finally:
        manager.shutdown()
        server.stop()


def test_a_kvtier_restart_on_the_local_plane_fails_jobs_then_recovers_zero_copy(caplog):
    """vLLM's own primary region registered over the socket; kvtier killed
    mid-run: jobs fail and lookups miss (bounded by timeout_s, nothing
    raised), then the restarted server gets the region registered again and
    a load lands in the primary row, still zero-copy."""
    with stored_over_the_socket(450, timeout_s=2, down_s=0.5) as (server, t, rows):
        server.kill()
        caplog.set_level(logging.WARNING, logger="kvtier.vllm")
        started = time.monotonic()
        t.submit_store(job(2, [key(451)], [1]))
        t.submit_load(job(3, [key(450)], [2], load=True))
        assert time.monotonic() - started < 0.1  # submitting never waits on kvtier
        results = {r.job_id: r for r in finished(t, timeout_s=10)}
        assert set(results) == {2, 3} and not results[2].success and not results[3].success
        assert step_until_resolved(t.lookup, [key(450)], t.on_schedule_end) == [LookupResult.MISS]
        assert any("kvtier" in r.getMessage() for r in caplog.records)
        assert t.stats["failed_jobs"] == 2 and t.stats["errors"] >= 2
        t.on_request_finished(CTX)

        start_on_same_port(server)
        time.sleep(0.6)  # past down_s
        rows[2] = 0
        t.submit_load(job(4, [key(450)], [2], load=True))
        (again,) = finished(t)
        assert again.success and (rows[2] == 3).all()
        assert t.stats["zero_copy_chunks"] == 2 and t.stats["staged_chunks"] == 0
        stats = t.client.local_stats()
        assert stats["bounce_copies"] == 0 and stats["registrations_renewed"] >= 1


def test_a_load_given_up_on_is_reported_once_kvtier_closed_the_connection():
    """A zero-copy load into vLLM's own primary region that kvtier, held
    still (SIGSTOP), does not answer: kvtier run again may finish a piece of
    its copy into the row, so the job's end (after which vLLM reuses the
    row) is reported only once kvtier has closed the connection given up
    on."""
    with stored_over_the_socket(470, timeout_s=1, down_s=0.2) as (server, t, _rows):
        with server.paused():
            t.submit_load(job(2, [key(470)], [1], load=True))
            deadline = time.monotonic() + 3.0  # past the give-up (1 s) and the client's wait for the close
            while time.monotonic() < deadline:
                early = [r.job_id for r in t.get_finished_jobs()]
                assert early == [], "the load ended while kvtier, held still, had not closed the connection"
                assert t.has_pending_work()
                time.sleep(0.05)
            assert t.stats["load_reports_held"] == 1
        results = {r.job_id: r for r in finished(t, timeout_s=10)}
        assert set(results) == {2} and not results[2].success


def test_no_local_socket_falls_back_to_http_with_one_log_line(caplog):
    """local="auto" (the default) against a kvtier started with
    --local-socket none: HTTP, said once, and transfers work."""
    caplog.set_level(logging.INFO, logger="kvtier.vllm")
    with ServerProcess(block_bytes=ROW_BYTES, args=("--local-socket", "none")) as server:
        tensor, view = tensor_view()
        t = KvtierTier(spec_for(server.url), view, "KvtierTier", url=server.url)
        try:
            assert t.transport == "http" and t.zero_copy is False
            tensor[0] = 4.0
            t.submit_store(job(1, [key(900)], [0]))
            assert all(r.success for r in finished(t))
            t.submit_load(job(2, [key(900)], [1], load=True))
            assert all(r.success for r in finished(t))
            assert torch.equal(tensor[1], tensor[0])
            assert t.stats["zero_copy_chunks"] == t.stats["staged_chunks"] == 0
        finally:
            t.shutdown()
    said = said_over_http(caplog, "kvtier.vllm")
    assert len(said) == 1, said
