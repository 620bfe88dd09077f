"""KvtierConnector when a load is given up on (issue 62), against a real
``kvtier serve`` held still with SIGSTOP and the connector's own worker
code, no engine. kvtier stops a given-up connection's copies, but one held
still mid-copy finishes the piece it was in when it runs again
(docs/LOCAL.md, "When a client gives up"), so:

- a background load into vLLM's registered cache (zero-copy) is reported
  failed only once kvtier has closed that connection: told earlier, vLLM
  recomputes into those pages, or hands an aborted request's pages to
  another, while a late piece can still land there;
- loads on the forward path go through the forward lane's staging buffer,
  never straight into vLLM's pages (the forward cannot wait for a stopped
  kvtier), and a staging buffer a load was given up in is replaced, so no
  later load or store is staged where a late piece can land."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from conftest import block
from test_vllm_connector_faults import BB, LAYERS, SLOTS, bare, hashes

from kvtier.connectors.vllm.blocks import FORWARD
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata
from kvtier.connectors.vllm.shared_cache import SharedAllocation
from kvtier.connectors.vllm.transfer import Transfer
from kvtier.testing import ServerProcess
from kvtier.vllm_connector import KvtierConnector

pytestmark = pytest.mark.vllm

#: The client's answer timeout, seconds: kvtier is held still past it.
TIMEOUT_S = 1.0


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    """A kvtier of its own per test (each holds it still); no RAM tier
    shared, so loads are copied by kvtier, not leased."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25, args=("--ram-shared", "off")) as s:
        yield s


def zero_copy(url: str, loads: str) -> KvtierConnector:
    """A connector whose KV cache is one shared allocation, as vLLM's is
    under the connector (one ``torch.zeros`` of int8, each layer a view of
    it), registered with kvtier: the zero-copy path."""
    c = bare(url, loads=loads, registered=False, timeout_s=TIMEOUT_S)
    with SharedAllocation(c.worker.shared):
        whole = torch.zeros(LAYERS * SLOTS * (BB // LAYERS), dtype=torch.int8)
    layer_bytes = SLOTS * (BB // LAYERS)
    caches = {
        f"layer.{j}": whole[j * layer_bytes : (j + 1) * layer_bytes].view(torch.uint8).view(SLOTS, BB // LAYERS)
        for j in range(LAYERS)
    }
    c.caches = caches  # type: ignore[attr-defined]
    c.worker.register_kv_caches(caches)
    assert c.worker.blocks.ready() and c.worker.blocks.zero_copy, "the KV cache was not registered"  # type: ignore[union-attr]
    return c


def pages(c: KvtierConnector, block_id: int) -> bytes:
    return b"".join(bytes(c.caches[f"layer.{j}"][block_id].numpy()) for j in range(LAYERS))  # type: ignore[attr-defined]


def stored(c: KvtierConnector, n: int, salt: int) -> list[bytes]:
    """``n`` blocks kvtier holds under this connector's keys."""
    hs = hashes(n, salt=salt)
    c._core.client.put_many([(c.key_of(h), block(salt * 100 + i, BB)) for i, h in enumerate(hs)])
    return hs


def start(c: KvtierConnector, loads: list[Transfer]) -> None:
    c.bind_connector_metadata(KvtierConnectorMetadata(loads=loads))
    c.start_load_kv(None)  # type: ignore[arg-type]
    c.wait_for_save()
    c.clear_connector_metadata()


def reported(c: KvtierConnector) -> tuple[set[str], set[int]]:
    """One step's ``finished_recving`` and load errors, as vLLM takes them."""
    _, recving = c.get_finished(set())
    return recving or set(), c.get_block_ids_with_load_errors()


def test_a_background_load_given_up_on_is_reported_once_kvtier_closed_the_connection(server):
    c = zero_copy(server.url, "async")
    hs = stored(c, 2, salt=21)
    server.pause()
    try:
        start(c, [Transfer("r", 0, hs, [3, 4], background=True)])
        # Well past the give-up (TIMEOUT_S) and the client's 0.25 s wait for the close.
        deadline = time.monotonic() + TIMEOUT_S + 2.0
        while time.monotonic() < deadline:
            recving, errors = reported(c)
            assert "r" not in recving, (
                "the failed load was reported while kvtier, given up on and held still, had not closed the "
                "connection: vLLM recomputes into (or hands on) pages a late piece can still land in"
            )
            time.sleep(0.05)
        assert c.stats["load_reports_held"] == 1 and not c._core.client.local_settled()
    finally:
        server.resume()
    recving: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + 10
    while "r" not in recving and time.monotonic() < deadline:
        got, failed = reported(c)
        recving |= got
        errors |= failed
        time.sleep(0.02)
    assert "r" in recving, "not reported once kvtier ran again and closed the connection"
    assert errors == {3, 4} and c._core.client.local_settled()
    # kvtier answers again (once the connector's down window ends): the same load fills the pages.
    deadline = time.monotonic() + 10
    for attempt in range(1000):
        req_id = f"again-{attempt}"
        start(c, [Transfer(req_id, 0, hs, [3, 4], background=True)])
        while req_id not in (got := reported(c))[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        if not got[1] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not got[1], "kvtier, running again, did not serve the load"
    assert [pages(c, 3), pages(c, 4)] == [block(2100, BB), block(2101, BB)]
    c.shutdown()


def test_a_forward_path_load_is_staged_and_a_staging_buffer_given_up_in_is_replaced(server):
    c = zero_copy(server.url, "sync")
    blocks = c.worker.blocks
    assert blocks is not None
    hs = stored(c, 2, salt=22)
    start(c, [Transfer("a", 0, hs, [1, 2])])
    assert c.stats["zero_copy_blocks"] == 0, "a load on the forward path went straight into vLLM's pages"
    assert c.stats["staged_blocks"] == 2 and [pages(c, 1), pages(c, 2)] == [block(2200, BB), block(2201, BB)]
    old = blocks._stagings[FORWARD]
    server.pause()
    try:
        start(c, [Transfer("b", 0, hs, [5, 6])])
        assert c.get_block_ids_with_load_errors() == {5, 6}
        assert FORWARD not in blocks._stagings and c.stats["staging_retired_buffers"] == 1, (
            "the staging buffer a load was given up in is still the lane's: a late piece can land under a later copy"
        )
    finally:
        server.resume()
    assert c._core.client.local_settled(wait_s=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        start(c, [Transfer("c", 0, hs, [7, 8])])
        if not c.get_block_ids_with_load_errors():
            break
        time.sleep(0.2)
    assert [pages(c, 7), pages(c, 8)] == [block(2200, BB), block(2201, BB)]
    assert blocks._stagings[FORWARD] is not old
    c.shutdown()


def test_with_kvtiers_ram_tier_shared_a_forward_path_load_is_leased_one_copy():
    """Where kvtier offers leases (its default), the forward lane's loads
    from its RAM tier are one copy by the worker from kvtier's arena into
    vLLM's pages, not two through staging; kvtier writes nothing there."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = zero_copy(s.url, "sync")
        hs = stored(c, 2, salt=23)
        start(c, [Transfer("a", 0, hs, [1, 2])])
        assert (c.stats["leased_blocks"], c.stats["zero_copy_blocks"], c.stats["staged_blocks"]) == (2, 0, 0)
        assert [pages(c, 1), pages(c, 2)] == [block(2300, BB), block(2301, BB)]
        c.shutdown()


def test_the_answered_blocks_of_a_staged_load_given_up_on_are_copied_before_its_buffer_is_retired(monkeypatch):
    """A staged load whose first block kvtier answered and whose second it
    did not (the connection given up on, its close not seen): the first
    block is loaded, its bytes copied out of its staging slot (that copy is
    done); only then is the buffer retired, for the unanswered slot."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25, args=("--ram-shared", "off")) as s:
        c = zero_copy(s.url, "sync")
        hs = stored(c, 2, salt=24)
        client = c._core.client
        real = client.batch_get_into

        def second_unanswered(keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
            results = real(keys, ptrs, sizes)
            return results[:1] + [-21] * (len(results) - 1)  # CONNECTION_LOST

        monkeypatch.setattr(client, "batch_get_into", second_unanswered)
        monkeypatch.setattr(c._core, "settled", lambda: False)
        start(c, [Transfer("a", 0, hs, [1, 2])])
        assert c.get_block_ids_with_load_errors() == {2}
        assert pages(c, 1) == block(2400, BB), "a block reported loaded whose bytes never left the staging buffer"
        assert c.stats["staging_retired_buffers"] == 1
        c.shutdown()
