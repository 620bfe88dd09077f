"""KvtierConnector's copies off the forward path (kvtier.connectors.vllm.mover), against
a real ``kvtier serve`` and the connector's own worker code, no engine: a
background load reported finished with its failed blocks in the same pass, a
store that never reads a block after vLLM may reuse it (finished and
preempted requests), and loads waited for per layer. The same under a real
``vllm serve``: tests/test_vllm_serve.py."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import block
from test_vllm_connector_faults import BB, LAYERS, bare, fill, hashes

from kvtier.connectors.vllm import blocks as blocks_module
from kvtier.connectors.vllm import worker as worker_module
from kvtier.connectors.vllm.blocks import PagedBlocks
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata
from kvtier.connectors.vllm.transfer import Transfer
from kvtier.testing import ServerProcess
from kvtier.vllm_connector import KvtierConnector

pytestmark = pytest.mark.vllm


def pages_of(c: KvtierConnector, block_id: int) -> bytes:
    """vLLM block ``block_id``'s layer pages end to end (a kvtier block)."""
    return b"".join(bytes(c.caches[f"layer.{j}"][block_id].numpy()) for j in range(LAYERS))  # type: ignore[attr-defined]


def resume_after(server: ServerProcess, seconds: float) -> threading.Timer:
    """:meth:`~kvtier.testing.ServerProcess.resume` ``server`` in ``seconds``."""
    timer = threading.Timer(seconds, server.resume)
    timer.start()
    return timer


def test_a_background_load_ends_off_the_forward_path_and_reports_its_failed_blocks_with_it():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, loads="async")
        hr, hq = hashes(4), hashes(2, salt=1)
        c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hr) if i != 2])  # 2 missing
        c._core.client.put_many([(c.key_of(h), block(10 + i, BB)) for i, h in enumerate(hq)])
        loads = [Transfer("r", 0, hr, [0, 1, 2, 3], background=True), Transfer("q", 0, hq, [4, 5], background=True)]
        s.pause()
        began = time.monotonic()
        c.bind_connector_metadata(KvtierConnectorMetadata(loads=loads))
        c.start_load_kv(None)  # type: ignore[arg-type]
        c.wait_for_save()
        c.clear_connector_metadata()
        assert time.monotonic() - began < 1.0, "the step waited for a background load"
        assert c.get_finished(set()) == (None, None) and c.get_block_ids_with_load_errors() == set()
        s.resume()
        finished: dict[str, set[int]] = {}
        deadline = time.monotonic() + 10
        while len(finished) < 2:
            assert time.monotonic() < deadline, f"loads not reported: {finished}"
            _, recving = c.get_finished(set())
            errors = c.get_block_ids_with_load_errors()  # vLLM asks right after, in the same pass
            for req_id in recving or ():
                finished[req_id] = {b for b in errors if b in loads[0 if req_id == "r" else 1].block_ids}
            time.sleep(0.01)
        assert finished == {"r": {2, 3}, "q": set()}
        assert [pages_of(c, b) for b in (0, 1, 4, 5)] == [block(0, BB), block(1, BB), block(10, BB), block(11, BB)]
        assert c.stats["background_loads"] == 2 and c.stats["loaded_blocks"] == 4
        assert c.stats["load_failed_blocks"] == 2
        c.shutdown()


def test_an_idle_step_waits_for_a_background_load_woken_when_it_ends(monkeypatch):
    """A step that computes nothing waits for a background load in flight,
    woken as it ends (else vLLM runs empty steps back to back, taking the
    CPU the copy needs), at most ``IDLE_STEP_WAIT_S``; a step with work, or
    an idle one with nothing in flight, does not wait."""
    monkeypatch.setattr(worker_module, "IDLE_STEP_WAIT_S", 4.0)  # long enough to tell a wake-up from a timeout
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, loads="async")
        hs = hashes(2)
        c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
        s.pause()
        c.bind_connector_metadata(KvtierConnectorMetadata(loads=[Transfer("r", 0, hs, [0, 1], background=True)]))
        c.start_load_kv(None)  # type: ignore[arg-type]
        began = time.monotonic()
        assert c.get_finished(set()) == (None, None)  # a step with work
        assert time.monotonic() - began < 0.5
        c.clear_connector_metadata()
        resume_after(s, 0.3)
        c.bind_connector_metadata(KvtierConnectorMetadata(idle=True))
        began = time.monotonic()
        assert c.get_finished(set()) == (None, {"r"})
        assert 0.2 <= time.monotonic() - began < 3.0  # woken by the load's end, not the timeout
        c.clear_connector_metadata()
        assert [pages_of(c, b) for b in (0, 1)] == [block(0, BB), block(1, BB)]
        c.bind_connector_metadata(KvtierConnectorMetadata(idle=True))
        began = time.monotonic()
        assert c.get_finished(set()) == (None, None)  # nothing in flight
        assert time.monotonic() - began < 0.5
        c.clear_connector_metadata()
        c.shutdown()


def test_a_finished_requests_blocks_are_kept_until_its_stores_end():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url)
        hs = hashes(2)
        data = [fill(c, b, 20 + b) for b in (0, 1)]
        s.pause()
        began = time.monotonic()
        c.bind_connector_metadata(KvtierConnectorMetadata(stores=[Transfer("r", 0, hs, [0, 1])]))
        c.wait_for_save()
        c.clear_connector_metadata()
        assert time.monotonic() - began < 1.0, "the step waited for its stores"
        # The scheduler kept "r" for its stores; "other" had none: vLLM freed it.
        c.bind_connector_metadata(KvtierConnectorMetadata(stores_awaited=["r"]))
        assert c.get_finished({"r", "other"}) == (None, None)
        c.clear_connector_metadata()
        s.resume()
        deadline = time.monotonic() + 10
        while (sending := c.get_finished(set())[0]) is None:
            assert time.monotonic() < deadline, "the finished request's stores were not reported"
            time.sleep(0.01)
        assert sending == {"r"} and c.get_finished(set()) == (None, None)
        assert c._core.client.get_many([c.key_of(h) for h in hs]) == data
        c.shutdown()
        # With stores: sync, vLLM freed the blocks at once: naming the request
        # again would be an error in vLLM's scheduler (an unknown request).
        c = bare(s.url, stores="sync")
        c.bind_connector_metadata(KvtierConnectorMetadata(stores=[Transfer("r", 0, hashes(1, salt=2), [0])]))
        c.wait_for_save()
        c.clear_connector_metadata()
        assert c.stats["stored_blocks"] == 1 and c.get_finished({"r"}) == (None, None)
        c.shutdown()


def preempted_store(server: ServerProcess, *, wait: bool) -> bytes | None:
    """Request ``r``'s block (vLLM block 4) is stored behind another
    request's store that waits on a stopped kvtier; ``r`` is preempted and
    vLLM writes another block's bytes into block 4 once
    ``handle_preemptions`` returns. What kvtier then holds under r's key."""
    c = bare(server.url)
    if not wait:
        c.worker.mover.preempt = lambda preempted: None  # type: ignore[method-assign,union-attr]
    hr, hq = hashes(1), hashes(1, salt=1)
    fill(c, 4, 1)
    fill(c, 6, 2)
    server.pause()
    c.bind_connector_metadata(KvtierConnectorMetadata(stores=[Transfer("q", 0, hq, [6]), Transfer("r", 0, hr, [4])]))
    c.wait_for_save()
    c.clear_connector_metadata()
    timer = resume_after(server, 0.5)
    c.handle_preemptions(KvtierConnectorMetadata(preempted=["r"]))
    fill(c, 4, 3)  # vLLM reuses the preempted request's block
    timer.join()
    c.worker.mover.drain()  # type: ignore[union-attr]
    got = c._core.client.get(c.key_of(hr[0]))
    c.shutdown()
    return got


def test_a_preempted_requests_stores_end_before_its_blocks_are_reused():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        assert preempted_store(s, wait=True) == block(1, BB)
        # Deliberate fault: handle_preemptions that does not wait stores the reused block's bytes.
        assert preempted_store(s, wait=False) == block(3, BB)


def test_layer_loads_let_each_layer_go_as_its_pages_arrive(monkeypatch):
    # The staged path, held before its last layer (leases, the default
    # server's, copy from kvtier's memory instead: tests/test_vllm_serve.py).
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25, args=("--ram-shared", "off")) as s:
        c = bare(s.url, loads="layer")
        hs = hashes(3)
        c._core.client.put_many([(c.key_of(h), block(30 + i, BB)) for i, h in enumerate(hs)])
        release = threading.Event()
        staged = PagedBlocks._staged

        def held_before_the_last_layer(self, keys, block_ids, *, load, tags=None, layer_done=None, lane=0):  # type: ignore[no-untyped-def]
            def done(layer: int) -> None:
                if layer == LAYERS - 1:
                    assert release.wait(10)
                layer_done(layer)  # type: ignore[misc]

            return staged(
                self, keys, block_ids, load=load, tags=tags, layer_done=done if layer_done else None, lane=lane
            )

        monkeypatch.setattr(PagedBlocks, "_staged", held_before_the_last_layer)
        c.bind_connector_metadata(KvtierConnectorMetadata(loads=[Transfer("r", 0, hs, [0, 1, 2])]))
        c.start_load_kv(None)  # type: ignore[arg-type]
        waits = {j: threading.Thread(target=c.wait_for_layer_load, args=(f"layer.{j}",)) for j in range(LAYERS)}
        for t in waits.values():
            t.start()
        waits[0].join(5)
        assert not waits[0].is_alive(), "layer 0 waited for the whole load"
        time.sleep(0.2)
        assert waits[LAYERS - 1].is_alive(), "the last layer went before its pages were in"
        release.set()
        for t in waits.values():
            t.join(5)
            assert not t.is_alive()
        c.wait_for_save()
        c.clear_connector_metadata()
        assert [pages_of(c, b) for b in range(3)] == [block(30 + i, BB) for i in range(3)]
        c.shutdown()


def test_a_bad_mode_is_refused_naming_the_values():
    from kvtier.connectors.vllm.mover import LOAD_MODES, mode_of

    with pytest.raises(ValueError, match="loads is 'fast'; it is one of async, layer, sync"):
        mode_of({"loads": "fast"}, "loads", LOAD_MODES)
    assert mode_of({}, "loads", LOAD_MODES) == "async"


def test_a_hybrid_models_failed_load_fails_the_request_not_blocks():
    """With more than one KV cache group vLLM takes no block failures: the
    request's load is reported failed as a whole (``failed_recving``)."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, loads="async")
        c.worker.mover.register([c.worker.blocks, c.worker.blocks], list(c.caches))  # type: ignore[union-attr,attr-defined]
        hs = hashes(2)
        c._core.client.put(c.key_of(hs[0]), block(0, BB))  # block 1 missing
        loads = [Transfer("r", 0, hs, [0, 1], background=True, group=g) for g in (0, 1)]
        c.bind_connector_metadata(KvtierConnectorMetadata(loads=loads))
        c.start_load_kv(None)  # type: ignore[arg-type]
        c.clear_connector_metadata()
        c.worker.mover.drain()  # type: ignore[union-attr]
        results = c.get_transfer_results(set())
        assert results.finished_recving == {"r"} and results.failed_recving == {"r"}
        assert c.get_block_ids_with_load_errors() == set()
        c.shutdown()


def test_the_forwards_copies_never_wait_behind_a_background_load(monkeypatch):
    """The mover's two lanes: a background load held in its copy (its
    thread stuck) does not hold up a synchronous store or a load on the
    forward path of the next step; the background load is still reported
    once let go. On one FIFO thread both waited for it."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, loads="async", stores="sync")
        hs, hq = hashes(2), hashes(2, salt=1)
        c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
        release = threading.Event()
        move = PagedBlocks.move

        def held(self, keys, block_ids, *, load, **kw):  # type: ignore[no-untyped-def]
            if load and block_ids == [0, 1]:
                assert release.wait(10)
            return move(self, keys, block_ids, load=load, **kw)

        monkeypatch.setattr(PagedBlocks, "move", held)
        c.bind_connector_metadata(KvtierConnectorMetadata(loads=[Transfer("r", 0, hs, [0, 1], background=True)]))
        c.start_load_kv(None)  # type: ignore[arg-type]
        c.wait_for_save()
        c.clear_connector_metadata()
        data = [fill(c, b, 40 + b) for b in (4, 5)]
        began = time.monotonic()
        c.bind_connector_metadata(KvtierConnectorMetadata(stores=[Transfer("q", 0, hq, [4, 5])]))
        c.start_load_kv(None)  # type: ignore[arg-type]
        c.wait_for_save()  # stores: sync, on the forward's lane
        c.clear_connector_metadata()
        took = time.monotonic() - began
        release.set()
        assert took < 5, f"the forward's store waited {took:.1f} s behind the background load"
        assert c._core.client.get_many([c.key_of(h) for h in hq]) == data
        deadline = time.monotonic() + 10
        while (recving := c.get_finished(set())[1]) is None:
            assert time.monotonic() < deadline, "the background load was not reported"
            time.sleep(0.01)
        assert recving == {"r"} and c.get_block_ids_with_load_errors() == set()
        c.shutdown()


def test_a_stopped_kvtier_costs_a_transfer_one_give_up_not_one_per_staged_round(monkeypatch):
    """Against a kvtier stopped with SIGSTOP, a store of 12 blocks staged in
    rounds of 4 waits the client's timeout once (then the rest of it, and
    the step's other transfers, fail at once: kvtier counts as down), not
    once per round."""
    monkeypatch.setattr(blocks_module, "STAGING_BLOCKS", 4)
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, stores="sync", timeout_s=1, retries=0)
        for b in range(12):
            fill(c, b, b)
        assert c.worker.blocks.ready() and not c.worker.blocks.zero_copy  # type: ignore[union-attr]
        s.pause()
        began = time.monotonic()
        stores = [Transfer("r", 0, hashes(12), list(range(12))), Transfer("q", 0, hashes(2, salt=1), [12, 13])]
        c.bind_connector_metadata(KvtierConnectorMetadata(stores=stores))
        c.wait_for_save()
        c.clear_connector_metadata()
        took = time.monotonic() - began
        s.resume()
        assert c.stats["store_failed_blocks"] + c.stats["store_dropped_blocks"] == 14
        assert took < 2.5, f"the stores waited {took:.1f} s: one give-up per staged round"
        c.shutdown()
