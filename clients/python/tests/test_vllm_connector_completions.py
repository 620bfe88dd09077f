"""KvtierConnector's completions as vLLM 0.32's scheduler takes them
(issue 62), against a real ``kvtier serve`` and the connector's own
scheduler and worker code, no engine: a request aborted while its
background load is in flight is freed by that load's end, never by its
stores (vLLM frees a request's blocks at the first of ``finished_sending``
and ``finished_recving`` and asserts on a second naming); a fault at any
stage of a copy (staging, the copy, the digest) is a failed load or a failed
store, never a lost completion or an exception in the forward; and a byte
oracle that cannot write its events is counted and logged while the copies
go on."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from conftest import block
from test_vllm_connector_faults import BB, bare, fill, hashes

from kvtier.connectors.vllm import mover as mover_module
from kvtier.connectors.vllm.blocks import PagedBlocks
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata, RequestState
from kvtier.connectors.vllm.transfer import Transfer
from kvtier.testing import ServerProcess
from kvtier.vllm_connector import KvtierConnector

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server():
    """One kvtier for the module (each test keys its own blocks)."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        yield s


class Frees:
    """vLLM 0.32's scheduler's rule for a finished request's blocks
    (``_update_from_kv_xfer_finished``): freed at the first of
    ``finished_sending`` and ``finished_recving`` that names it; a later
    naming is its ``assert req_id in self.requests``."""

    def __init__(self, c: KvtierConnector) -> None:
        self.c = c
        self.freed: dict[str, str] = {}  # request -> what freed it
        self.errors: list[str] = []
        self.loading_when_freed: list[str] = []
        self.load_errors: set[int] = set()

    def take(self, sending: set[str] | None, recving: set[str] | None, load_errors: set[int]) -> None:
        self.load_errors |= load_errors
        for kind, ids in (("finished_recving", recving), ("finished_sending", sending)):
            for req_id in ids or ():
                if req_id in self.freed:
                    self.errors.append(f"{req_id} named in {kind} after {self.freed[req_id]} freed it")
                    continue
                self.freed[req_id] = kind
                if self.c.worker.mover._pending.loading:  # type: ignore[union-attr]
                    self.loading_when_freed.append(f"{req_id} freed by {kind} while its load was in flight")


def schedule(c: KvtierConnector, preempted: set[str] | None = None) -> KvtierConnectorMetadata:
    """The scheduler's metadata of a step that schedules nothing new (and
    preempts ``preempted``)."""
    output = SimpleNamespace(
        total_num_scheduled_tokens=0,
        preempted_req_ids=preempted or set(),
        num_scheduled_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
    )
    meta = c.build_connector_meta(output)  # type: ignore[arg-type]
    assert isinstance(meta, KvtierConnectorMetadata)
    return meta


def worker_step(c: KvtierConnector, meta: KvtierConnectorMetadata, finished: set[str], frees: Frees) -> None:
    """One worker step as vLLM's model runner makes it, its transfer results
    handed to ``frees``."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)  # type: ignore[arg-type]
    c.wait_for_save()
    sending, recving = c.get_finished(finished)
    errors = c.get_block_ids_with_load_errors()  # vLLM asks right after, in the same pass
    c.clear_connector_metadata()
    frees.take(sending, recving, errors)


def aborted_mid_load(server: ServerProcess) -> Frees:
    """Request ``r`` stored blocks before it was preempted; resumed, it
    loads its 2 blocks in the background from a stopped kvtier and is
    aborted before the load ends. kvtier resumes and the steps go on."""
    c = bare(server.url, loads="async")
    hs = hashes(2, salt=10)
    c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
    request = SimpleNamespace(request_id="r", block_hashes=hs, num_prompt_tokens=9)
    state = RequestState(request)  # type: ignore[arg-type]
    state.has_stores, state.stored_blocks, state.hit_blocks = True, 2, 2  # its stores before the preemption
    c.scheduler.requests["r"] = state
    c.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0, 1],)), 8)  # type: ignore[arg-type]
    frees = Frees(c)
    server.pause()
    try:
        worker_step(c, schedule(c), set(), frees)
        delay, _ = c.request_finished(request, [0, 1])  # type: ignore[arg-type]
        assert delay is False, "request_finished kept the blocks of a request whose load is in flight for its stores"
        worker_step(c, schedule(c), {"r"}, frees)
    finally:
        server.resume()
    deadline = time.monotonic() + 10
    while "r" not in frees.freed and time.monotonic() < deadline:
        worker_step(c, schedule(c), set(), frees)
        time.sleep(0.01)
    for _ in range(3):  # later steps name it no more
        worker_step(c, schedule(c), set(), frees)
    c.shutdown()
    return frees


def test_a_request_aborted_during_its_load_is_freed_by_the_load_not_by_its_stores(server):
    frees = aborted_mid_load(server)
    assert frees.freed == {"r": "finished_recving"}
    assert frees.errors == [] and frees.loading_when_freed == []


def test_a_finished_request_is_named_once_its_stores_end_and_only_if_the_scheduler_kept_it(server):
    c = bare(server.url)
    fill(c, 0, 1)
    hs = hashes(1, salt=11)
    request = SimpleNamespace(request_id="r", block_hashes=hs, num_prompt_tokens=4)
    state = RequestState(request)  # type: ignore[arg-type]
    state.has_stores = True
    c.scheduler.requests["r"] = state
    frees = Frees(c)
    server.pause()
    try:
        worker_step(c, KvtierConnectorMetadata(stores=[Transfer("r", 0, hs, [0])]), set(), frees)
        assert c.request_finished(request, [0]) == (True, None)  # type: ignore[arg-type]
        meta = schedule(c)
        assert meta.stores_awaited == ["r"]
        worker_step(c, meta, {"r", "q"}, frees)  # "q" finished without stores: vLLM freed it already
        assert frees.freed == {}, "named before its stores ended"
    finally:
        server.resume()
    deadline = time.monotonic() + 10
    while not frees.freed and time.monotonic() < deadline:
        worker_step(c, schedule(c), set(), frees)
        time.sleep(0.01)
    worker_step(c, schedule(c), set(), frees)
    assert frees.freed == {"r": "finished_sending"} and frees.errors == []
    c.shutdown()


class BrokenOracle:
    """An oracle whose file I/O fails."""

    step = 0

    def event(self, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")


def break_stage(c: KvtierConnector, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``stage`` of every copy raise."""

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"injected at {stage}")

    if stage == "staging":
        monkeypatch.setattr(PagedBlocks, "ready", fail)
    elif stage == "copy":
        monkeypatch.setattr(PagedBlocks, "move", fail)
    elif stage == "digest":
        monkeypatch.setattr(mover_module, "digest_of", fail)
    else:
        c.worker.mover.oracle = BrokenOracle()  # type: ignore[union-attr,assignment]


STAGES = ("staging", "copy", "digest", "oracle")


def failed_blocks(stage: str, n: int) -> int:
    """Blocks a fault at ``stage`` fails out of ``n``: all of them, but for
    the oracle's (an observer: its fault is counted in ``errors``)."""
    return 0 if stage == "oracle" else n


def loading_with_a_fault(
    url: str, loads: str, stage: str, salt: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[KvtierConnector, list[bytes]]:
    """A connector whose copies fault at ``stage``, and two blocks kvtier holds."""
    c = bare(url, loads=loads, digest=stage == "digest")
    hs = hashes(2, salt=salt)
    c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
    break_stage(c, stage, monkeypatch)
    return c, hs


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_in_a_background_load_fails_its_blocks_and_is_reported(server, stage, monkeypatch):
    c, hs = loading_with_a_fault(server.url, "async", stage, 12, monkeypatch)
    frees = Frees(c)
    worker_step(c, KvtierConnectorMetadata(loads=[Transfer("r", 0, hs, [0, 1], background=True)]), set(), frees)
    deadline = time.monotonic() + 5
    while "r" not in frees.freed:
        assert time.monotonic() < deadline, f"a fault at {stage} lost the load's completion"
        worker_step(c, KvtierConnectorMetadata(), set(), frees)
    assert len(frees.load_errors) == c.stats["load_failed_blocks"] == failed_blocks(stage, 2)
    assert c.stats["errors"] >= 1
    c.shutdown()


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_in_a_load_on_the_forward_path_is_a_failed_load_not_an_exception(server, stage, monkeypatch):
    c, hs = loading_with_a_fault(server.url, "sync", stage, 13, monkeypatch)
    stores = [Transfer("r", 2, hashes(1, salt=14), [2])]
    frees = Frees(c)
    worker_step(c, KvtierConnectorMetadata(loads=[Transfer("r", 0, hs, [0, 1])], stores=stores), set(), frees)
    assert len(frees.load_errors) == failed_blocks(stage, 2) and c.stats["errors"] >= 1
    # Block 2, computed over a failed load, is not stored.
    assert c.stats["stores_skipped_after_failed_load"] == failed_blocks(stage, 1)
    c.shutdown()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("stores", ["async", "sync"])
def test_a_fault_in_a_store_is_a_failed_store_and_its_request_is_still_reported(server, stage, stores, monkeypatch):
    c = bare(server.url, stores=stores, digest=stage == "digest")
    fill(c, 0, 1)
    break_stage(c, stage, monkeypatch)
    frees = Frees(c)
    worker_step(c, KvtierConnectorMetadata(stores=[Transfer("r", 0, hashes(1, salt=15), [0])]), set(), frees)
    if stores == "async":
        deadline = time.monotonic() + 5
        awaited = ["r"]
        while "r" not in frees.freed:
            assert time.monotonic() < deadline, f"a fault at {stage} lost the store's completion"
            worker_step(c, KvtierConnectorMetadata(stores_awaited=awaited), {"r"}, frees)
            awaited = []
    c.worker.mover.drain()  # type: ignore[union-attr]
    assert c.stats["store_failed_blocks"] == failed_blocks(stage, 1) and c.stats["errors"] >= 1
    c.shutdown()
