"""KvtierConnector's answers to the faults of issue 53, against a real
``kvtier serve`` and the connector's own scheduler and worker code, no
engine: keys per TP rank, no store over a failed load, the digest that
refuses another block's bytes, a kvtier that is stopped or gone costing
the lookup deadline, never the client's timeout, and the misconfigurations
that stop an engine at start (``register_kv_caches``: a kvtier of another
block size, a socket that refuses the engine's uid). The same under a real
``vllm serve``: tests/test_vllm_serve*.py (one real misconfigured start:
tests/test_vllm_serve_misconfigured.py)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time

import pytest
import torch
from conftest import block, start_on_same_port

from kvtier.connectors.core import ConnectorCore, GeometryError
from kvtier.connectors.vllm.groups import Group
from kvtier.connectors.vllm.lookup import Lookups
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata, RequestState
from kvtier.connectors.vllm.scheduler import KvtierScheduler
from kvtier.connectors.vllm.transfer import STATS, Transfer, block_key
from kvtier.connectors.vllm.verify import Digests, digest_of
from kvtier.connectors.vllm.worker import KvtierWorker
from kvtier.errors import ConfigurationError
from kvtier.keys import Namespace
from kvtier.testing import ServerProcess
from kvtier.vllm_connector import KvtierConnector

pytestmark = pytest.mark.vllm

BB, LAYERS, SLOTS = 65536, 4, 16
log = logging.getLogger("t")


def bare(
    url: str,
    *,
    digest: bool = False,
    ranks: int = 1,
    rank: int = 0,
    replicas: int = 1,
    registered: bool = True,
    **settings: object,
) -> KvtierConnector:
    """A KvtierConnector with its scheduler and worker sides but no engine
    (rank ``rank`` of ``ranks``, in replica sets of ``replicas`` ranks that
    share their keys, as an MLA model's do): a CPU paged cache of
    :data:`SLOTS` blocks of :data:`LAYERS` layer pages, registered as
    ``register_kv_caches`` does unless ``registered`` is false (then the
    test calls it)."""
    c = object.__new__(KvtierConnector)
    namespaces = [
        Namespace(model="m", dtype="bfloat16", tp_rank=r // replicas, tp_size=ranks) for r in range(0, ranks, replicas)
    ]
    core = ConnectorCore(
        {"url": url, "timeout_s": 5, "down_s": 0.3, **settings},
        logger=log,
        stats=STATS,
        background_probe=True,
    )
    c.block_size, c.namespace, c.replicas = 4, namespaces[rank // replicas], replicas
    c._core, c.stats = core, core.stats
    c._reported, c._lock = dict.fromkeys(STATS, 0), threading.Lock()
    c.loads, c.stores = str(settings.get("loads", "sync")), str(settings.get("stores", "async"))
    caches = {f"layer.{j}": torch.zeros((SLOTS, BB // LAYERS), dtype=torch.uint8) for j in range(LAYERS)}
    c.groups = [Group(0, tuple(caches))]
    c.scheduler = KvtierScheduler(
        core,
        Lookups(core, settings.get("lookup_timeout_ms", 50), settings.get("lookup_give_up_ms", 300)),
        groups=c.groups,
        block_size=c.block_size,
        loads=c.loads,
        stores=c.stores,
        lookup_fingerprints=[[ns.fingerprint for ns in namespaces]],
    )
    c.worker = KvtierWorker(
        core,
        groups=c.groups,
        block_size=c.block_size,
        group_fingerprints=[namespaces[rank // replicas].fingerprint],
        loads=c.loads,
        stores=c.stores,
        digests=Digests() if digest else None,
        oracle=None,
        local=str(settings.get("local", "auto")),
        logger=log,
        replicas=replicas,
        replica_rank=rank % replicas,
    )
    c.caches = caches  # type: ignore[attr-defined]
    if registered:
        c.worker.register_kv_caches(caches)
    return c


def fill(c: KvtierConnector, block_id: int, seed: int) -> bytes:
    """Writes block ``seed``'s bytes into vLLM block ``block_id``'s pages."""
    data = block(seed, BB)
    for j in range(LAYERS):
        part = data[j * BB // LAYERS : (j + 1) * BB // LAYERS]
        c.caches[f"layer.{j}"][block_id].copy_(torch.frombuffer(bytearray(part), dtype=torch.uint8))  # type: ignore[attr-defined]
    return data


def step(c: KvtierConnector, loads: list[Transfer], stores: list[Transfer], store: bool = True) -> None:
    """One worker step: the loads, then the stores, as vLLM runs them; then
    waits for the copies it started (as vLLM's later steps would)."""
    c.bind_connector_metadata(KvtierConnectorMetadata(loads=loads, stores=stores, store=store))
    c.start_load_kv(None)  # type: ignore[arg-type]
    c.wait_for_save()
    c.clear_connector_metadata()
    c.worker.mover.drain()  # type: ignore[union-attr]


def ask(c: KvtierConnector, hs: list[bytes]) -> int:
    """A new request's lookup answered as vLLM asks for it: again, each
    step, while the connector answers ``None``."""
    state = RequestState(None)  # type: ignore[arg-type]
    while (hit := c.scheduler.ask(hs, state)) is None:
        pass
    return hit


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def test_each_rank_keys_its_own_slice_and_a_lookup_counts_blocks_every_rank_holds():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, ranks=2)
        hs = hashes(4)
        r0, r1 = c.scheduler.lookup_fingerprints[0]
        assert r0 != r1 and block_key(r0, hs[0]) != block_key(r1, hs[0])
        c._core.client.put_many([(block_key(r0, h), block(i, BB)) for i, h in enumerate(hs)])
        c._core.client.put_many([(block_key(r1, h), block(i, BB)) for i, h in enumerate(hs[:2])])
        assert ask(c, hs) == 2  # rank 1 holds two
        c._core.close()


def test_no_block_computed_over_a_failed_load_is_stored_in_that_step():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url)
        hs = hashes(6)
        keys = [c.key_of(h) for h in hs]
        c._core.client.put_many([(k, block(i, BB)) for i, k in enumerate(keys[:4]) if i != 2])  # block 2 missing
        for b in (4, 5):
            fill(c, b, 40 + b)
        load = Transfer("r", 0, hs[:4], [0, 1, 2, 3])
        store = Transfer("r", 4, hs[4:], [4, 5])
        # Another request of the step may have taken r's loaded blocks as a
        # prefix hit of vLLM's own: its store waits for a step without failures.
        other = Transfer("q", 0, hashes(1, salt=9), [5])
        step(c, [load], [store, other])
        assert c.get_block_ids_with_load_errors() == {2, 3}
        assert c._core.client.batch_is_exist(keys[4:]) == [0, 0]
        assert c._core.client.batch_is_exist([c.key_of(hashes(1, salt=9)[0])]) == [0]
        assert c.stats["stores_skipped_after_failed_load"] == 3 and c.stats["loaded_blocks"] == 2
        # The next step (vLLM recomputed the blocks) stores them.
        step(c, [], [Transfer("r", 2, hs[2:], [2, 3, 4, 5])])
        assert c._core.client.batch_is_exist(keys[2:]) == [1, 1, 1, 1]
        # Deliberate fault: the failure not counted, the failed step's stores are made.
        c._core.client.delete(keys[2])
        c._core.client.delete(keys[4])
        c.worker.mover._any_rank = lambda failed: False  # type: ignore[union-attr]
        step(c, [load], [store])
        assert c.get_block_ids_with_load_errors() == {2, 3}
        assert c._core.client.batch_is_exist(keys[4:5]) == [1]
        c._core.close()


def test_the_digest_refuses_another_blocks_bytes_under_a_real_key():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, digest=True)
        hs = hashes(3)
        keys = [c.key_of(h) for h in hs]
        for b in range(3):
            fill(c, b, b)
        step(c, [], [Transfer("r", 0, hs, [0, 1, 2])])
        assert c.stats["stored_blocks"] == 3
        c._core.client.put(keys[1], block(7, BB))  # a valid CRC, the wrong bytes
        for t in c.caches.values():  # type: ignore[attr-defined]
            t.zero_()
        step(c, [Transfer("r", 0, hs, [0, 1, 2])], [])
        assert c.get_block_ids_with_load_errors() == {1, 2}
        assert c.stats["digest_mismatch_blocks"] == 1 and c.stats["digest_checked_blocks"] == 1
        pages = c.worker.blocks.pages(0)  # type: ignore[union-attr]
        assert digest_of(pages) == digest_of([block(0, BB)])  # a block is its pages end to end
        c._core.close()


def test_a_stopped_kvtier_costs_the_lookup_give_up_then_nothing_until_it_answers():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, local="on")
        hs = hashes(2)
        c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
        assert ask(c, hs) == 2
        s.pause()
        try:
            started = time.monotonic()
            assert ask(c, hs) == 0
            assert c.scheduler.lookups.give_up_s <= time.monotonic() - started < c.scheduler.lookups.give_up_s + 0.5
            assert c.stats["lookup_timeouts"] == 1 and c.stats["lookup_retries"] >= 1
            for _ in range(3):  # down: answered at once, nothing asked
                started = time.monotonic()
                assert ask(c, hs) == 0
                assert time.monotonic() - started < 0.01
            step(c, [], [Transfer("r", 0, hs, [0, 1])], store=False)
            assert c.stats["store_dropped_blocks"] == 2
        finally:
            s.resume()
        deadline = time.monotonic() + 15
        while ask(c, hs) != 2:  # the probe finds it again
            assert time.monotonic() < deadline, "kvtier not found again within 15 s of SIGCONT"
            time.sleep(0.1)
        c._core.close()


def test_a_lookup_slower_than_its_deadline_is_asked_again_and_keeps_its_hit():
    """kvtier held still past ``lookup_timeout_ms`` but inside
    ``lookup_give_up_ms`` (a cold or busy kvtier): vLLM is told to ask
    again, the request keeps its hit, and kvtier is not taken for down (the
    step's stores are made)."""
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url, local="on", lookup_give_up_ms=5000)
        hs = hashes(2)
        c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
        assert ask(c, hs) == 2
        state = RequestState(None)  # type: ignore[arg-type]
        s.pause()
        try:
            assert c.scheduler.ask(hs, state) is None  # past lookup_timeout_ms: ask again
            assert c.scheduler.ask(hs, state) is None
        finally:
            s.resume()
        while (hit := c.scheduler.ask(hs, state)) is None:
            pass
        assert hit == 2
        assert c.stats["lookup_timeouts"] == 0 and c.stats["lookup_retries"] >= 2
        assert c._core.ready()  # the scheduler plans the step's stores
        more = hashes(2, salt=1)
        step(c, [], [Transfer("r", 0, more, [2, 3])], store=c._core.ready())
        assert c.stats["store_dropped_blocks"] == 0 and ask(c, more) == 2
        c._core.close()


def test_lookup_deadlines_must_be_numbers_a_wait_per_ask_may_be_zero():
    with pytest.raises(ValueError, match="lookup_timeout_ms must be zero or more, got -1"):
        Lookups(None, -1, 500)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lookup_give_up_ms must be positive, got 0"):
        Lookups(None, 0, 0)  # type: ignore[arg-type]
    assert Lookups(None, 0, 500).timeout_s == 0  # type: ignore[arg-type]  # the default: never waits
    with pytest.raises(ValueError, match="lookup_give_up_ms must be a number of milliseconds, got 'soon'"):
        Lookups(None, 10, "soon")  # type: ignore[arg-type]
    assert Lookups(None, 50, 10).give_up_s == 0.05  # type: ignore[arg-type]  # never below the per-ask wait


def test_a_kvtier_that_is_gone_is_a_miss_at_once_and_found_again():
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        c = bare(s.url)
        hs = hashes(2)
        c._core.client.put_many([(c.key_of(h), block(i, BB)) for i, h in enumerate(hs)])
        s.kill()
        waits = []
        for _ in range(5):
            started = time.monotonic()
            ask(c, hs)
            step(c, [Transfer("r", 0, hs, [0, 1])], [])
            waits.append(time.monotonic() - started)
            time.sleep(0.1)
        assert max(waits) < 1.0, waits  # never the client's 5 s timeout
        assert c.get_block_ids_with_load_errors() == {0, 1}
        start_on_same_port(s)
        deadline = time.monotonic() + 15
        while ask(c, hs) != 2:
            assert time.monotonic() < deadline, "kvtier not found again within 15 s of its restart"
            time.sleep(0.1)
        c._core.close()


def test_a_kvtier_of_another_block_size_stops_the_engine_at_start_naming_both_and_the_flag():
    with ServerProcess(block_bytes=2 * BB) as server:
        c = bare(server.url, registered=False)
        with pytest.raises(GeometryError) as e:
            c.register_kv_caches(c.caches)  # type: ignore[attr-defined]
        message = str(e.value)
        assert f"stores blocks of {2 * BB} bytes" in message and f"is {BB} bytes" in message, message
        assert f"--block-bytes {BB}" in message, message


def test_a_socket_that_refuses_the_engines_uid_stops_it_at_start_naming_the_uid_and_the_flag(tmp_path):
    """kvtier runs as uid 65534, so its socket admits that uid only; the
    engine (this test, as root) asked for the socket (``local: on``)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("this test runs kvtier as uid 65534 with setpriv: run it as root on a machine with util-linux")
    data = tempfile.mkdtemp(prefix="kvtier-uid-65534-")  # in /tmp: a directory uid 65534 can reach
    os.chown(data, 65534, 65534)
    strict = ServerProcess(block_bytes=BB, data_dir=data)
    strict.argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *strict.argv]
    try:
        with strict:
            c = bare(strict.url, registered=False, local="on")
            with pytest.raises(ConfigurationError) as e:
                c.register_kv_caches(c.caches)  # type: ignore[attr-defined]
            message = str(e.value)
            assert "refused this engine on its same-host socket" in message, message
            assert "peer uid 0" in message and "--local-allow-uid 0" in message, message
    finally:
        shutil.rmtree(data, ignore_errors=True)
