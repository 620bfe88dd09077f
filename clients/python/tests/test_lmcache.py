"""kvtier.lmcache under the real lmcache 0.5.6 on CPU, against a real kvtier.

The connector is loaded the way an engine loads it: LMCache's own
CreateStorageBackends reads `remote_storage_plugins` and `extra_config`,
imports kvtier.lmcache by name and builds a RemoteBackend for `plugin://kvtier`.
Nothing here stands in for an LMCache class.

Both planes: the transfer tests run over HTTP (`local: off`) and over the
same-host socket with LMCache's CPU buffer in shared memory (`shm_name`), where
kvtier copies chunks straight into and out of LMCache's MemoryObjs.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_geometry_error_logged, said_over_http, start_on_same_port

lmcache = pytest.importorskip("lmcache", reason="needs the pinned lmcache (make test installs it)")
import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend import CreateStorageBackends  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

import kvtier  # noqa: E402
from kvtier.lmcache import KvtierConnector  # noqa: E402
from kvtier.testing import ServerProcess  # noqa: E402

pytestmark = pytest.mark.lmcache

MODEL = "test-org/tiny-llama"
CHUNK_TOKENS = 16
# LMCache's vLLM layout (layers, K/V, tokens, kv heads, head dim), bfloat16:
# a full chunk is 2 × 2 × 16 × 2 × 8 × 2 bytes = 2,048 bytes = one kvtier block.
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 8)
CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 2 * 8 * 2


def lmcache_config(url: str, **extra: object) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_dict(
        {
            "chunk_size": CHUNK_TOKENS,
            "local_cpu": False,
            "max_local_cpu_size": 0.01,
            "remote_serde": "naive",
            "remote_storage_plugins": ["kvtier"],
            "extra_config": {
                "remote_storage_plugin.kvtier.module_path": "kvtier.lmcache",
                "remote_storage_plugin.kvtier.class_name": "KvtierConnector",
                "remote_storage_plugin.kvtier.url": url,
                "remote_storage_plugin.kvtier.timeout_s": 5,
                "save_chunk_meta": False,
                **extra,
            },
        }
    )


def metadata(world_size: int = 1, worker_id: int = 0) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK_TOKENS,
    )


def key(chunk_hash: int, worker_id: int = 0, world_size: int = 1) -> CacheEngineKey:
    return CacheEngineKey(MODEL, world_size, worker_id, chunk_hash, torch.bfloat16)


class Loop:
    """LMCache runs its connectors on an event loop of its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def kvserver() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=CHUNK_BYTES) as s:
        yield s


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.stop()


@pytest.fixture(params=["http", "unix"])
def plane(request) -> str:
    """The plane a test's connectors use: HTTP, or the socket with LMCache's
    CPU buffer in shared memory (zero-copy)."""
    return request.param


def plane_settings(plane: str) -> dict[str, object]:
    """The extra_config of ``plane``: ``local`` and, on the socket, a
    ``shm_name`` of this test's own (LMCache unlinks it when freed)."""
    if plane == "http":
        return {"remote_storage_plugin.kvtier.local": "off"}
    return {"remote_storage_plugin.kvtier.local": "on", "shm_name": f"kvtier_test_{uuid.uuid4().hex[:12]}"}


def backends(url: str, loop: Loop, meta: LMCacheMetadata | None = None, plane: str = "http", **extra: object):
    """LMCache's own backend factory, as LMCacheEngine calls it."""
    config = lmcache_config(url, **{**plane_settings(plane), **extra})
    return CreateStorageBackends(config, meta or metadata(), loop.loop, dst_device="cpu")


def assert_plane(conn: KvtierConnector, plane: str, chunks: int) -> None:
    """The chunks moved the plane's way: over HTTP, or straight through
    LMCache's registered CPU buffer (none staged)."""
    assert conn.transport == plane
    if plane == "unix":
        assert conn._host.zero_copy is True
        assert conn.stats["zero_copy_chunks"] >= chunks and conn.stats["staged_chunks"] == 0
        assert conn.client.sync.local_stats()["bounce_copies"] == 0
    else:
        assert conn.stats["zero_copy_chunks"] == conn.stats["staged_chunks"] == 0


def remote_of(found) -> RemoteBackend:
    remote = found["RemoteBackend-kvtier"]
    assert isinstance(remote, RemoteBackend)
    return remote


def chunk(remote: RemoteBackend, cpu, seed: int):
    """A real LMCache MemoryObj from LMCache's CPU pool, filled with `seed`-dependent values."""
    conn = remote.connection.getWrappedConnector()
    obj = cpu.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    values = torch.arange(obj.tensor.numel(), dtype=torch.float32).reshape(obj.tensor.shape) * 0.5 + seed
    obj.tensor.copy_(values.to(torch.bfloat16))
    return obj


def round_trip(remote: RemoteBackend, cpu, seed: int, k: CacheEngineKey) -> None:
    """A chunk put through LMCache's put task and read back byte-exact."""
    obj = chunk(remote, cpu, seed)
    want = obj.tensor.clone()
    remote.submit_put_task(k, obj).result(10)
    got = remote.get_blocking(k)
    assert got is not None and torch.equal(got.tensor, want)
    got.ref_count_down()


def test_lmcache_loads_the_plugin_by_name_and_round_trips_real_chunks(kvserver, loop, plane):
    found = backends(kvserver.url, loop, plane=plane)
    remote, cpu = remote_of(found), found["LocalCPUBackend"]
    conn = remote.connection.getWrappedConnector()
    assert isinstance(conn, KvtierConnector) and conn.full_chunk_size_bytes == CHUNK_BYTES

    objs = [chunk(remote, cpu, seed) for seed in range(3)]
    keys = [key(1000 + i) for i in range(3)]
    expected = [o.tensor.clone() for o in objs]
    for k, o in zip(keys, objs):
        remote.submit_put_task(k, o).result(10)
    assert conn.stats["puts"] == 3

    for k, want in zip(keys, expected):
        assert remote.contains(k)
        got = remote.get_blocking(k)
        assert got is not None and torch.equal(got.tensor, want)
        got.ref_count_down()
    assert not remote.contains(key(999))
    assert remote.get_blocking(key(999)) is None
    assert_plane(conn, plane, 6)

    # The bytes kvtier holds are exactly LMCache's chunk: no header.
    client = kvtier.Client(kvserver.url)
    raw = client.get(conn.key_of(keys[0]))
    assert raw == bytes(expected[0].contiguous().view(torch.uint8).numpy().tobytes())
    assert conn.key_of(keys[0]).startswith(
        kvtier.Namespace(MODEL, "torch.bfloat16", 0, 1, block_tokens=CHUNK_TOKENS).fingerprint + "-"
    )


def test_prefix_counts_through_batched_async_contains_and_batched_transfers(kvserver, loop, plane):
    found = backends(kvserver.url, loop, plane=plane)
    remote, cpu = remote_of(found), found["LocalCPUBackend"]
    conn = remote.connection.getWrappedConnector()
    chain = [key(5000 + i) for i in range(6)]
    objs = [chunk(remote, cpu, 10 + i) for i in range(4)]
    want = [o.tensor.clone() for o in objs]
    loop.run(conn.batched_put(chain[:4], objs))

    assert loop.run(remote.batched_async_contains("lookup-1", chain)) == 4
    assert loop.run(remote.batched_async_contains("lookup-2", chain[4:])) == 0
    assert loop.run(remote.batched_async_contains("lookup-3", [])) == 0
    assert remote.batched_contains(chain) == 4
    got = loop.run(remote.batched_get_non_blocking("lookup-1", chain))
    assert len(got) == 4 and all(torch.equal(g.tensor, w) for g, w in zip(got, want))
    for g in got:
        g.ref_count_down()
    got = loop.run(conn.batched_get(chain[3:5]))
    assert torch.equal(got[0].tensor, want[3]) and got[1] is None
    got[0].ref_count_down()
    assert_plane(conn, plane, 9)
    # A chunk removed from the middle ends the prefix there.
    assert conn.remove_sync(chain[1])
    assert loop.run(remote.batched_async_contains("lookup-4", chain)) == 1
    assert loop.run(conn.ping()) == 0
    assert loop.run(conn.list()) == []


def test_workers_and_models_never_read_each_others_chunks(kvserver, loop, plane):
    found0 = backends(kvserver.url, loop, metadata(world_size=2, worker_id=0), plane=plane)
    remote0, cpu0 = remote_of(found0), found0["LocalCPUBackend"]
    remote0.submit_put_task(key(7, 0, 2), chunk(remote0, cpu0, 1)).result(10)
    assert remote0.contains(key(7, 0, 2))
    assert not remote0.contains(key(7, 1, 2))  # same hash, other TP rank
    assert not remote0.contains(key(7, 0, 1))  # same hash, other world size
    other_model = CacheEngineKey("other/model", 2, 0, 7, torch.bfloat16)
    assert not remote0.contains(other_model)


def test_partial_chunks_are_skipped(kvserver, loop, plane):
    found = backends(kvserver.url, loop, plane=plane)
    remote, cpu = remote_of(found), found["LocalCPUBackend"]
    conn = remote.connection.getWrappedConnector()
    shapes = [torch.Size([2, 2, CHUNK_TOKENS // 2, 16])]
    partial = cpu.allocate(shapes, conn.meta_dtypes, conn.meta_fmt)
    loop.run(conn.put(key(4242), partial))
    assert conn.stats["puts_skipped_partial"] == 1
    assert not remote.contains(key(4242))


def test_a_store_of_another_block_size_is_refused_with_both_numbers(loop, caplog):
    with ServerProcess(block_bytes=CHUNK_BYTES * 2) as wrong:
        with caplog.at_level(logging.ERROR):
            found = backends(wrong.url, loop)
        assert "RemoteBackend-kvtier" not in found or found["RemoteBackend-kvtier"].connection is None
        text = caplog.text
        assert str(CHUNK_BYTES * 2) in text and str(CHUNK_BYTES) in text and "--block-bytes" in text


def test_a_block_size_found_wrong_after_start_gives_misses_and_an_error_not_exceptions(loop, caplog):
    """kvtier down when LMCache starts: the sizes are compared at the first
    call that reaches it, and a mismatch then turns the plugin into misses
    (and failed puts) with an error naming both sizes, never an exception
    where LMCache waits on an answer."""
    server = ServerProcess(block_bytes=CHUNK_BYTES * 2)
    try:
        found = backends(server.url, loop, **{"remote_storage_plugin.kvtier.down_s": 0.2})
        remote, cpu = remote_of(found), found["LocalCPUBackend"]
        conn = remote.connection.getWrappedConnector()
        assert remote.contains(key(1)) is False
        server.start()
        time.sleep(0.3)  # past down_s
        with caplog.at_level(logging.WARNING, logger="kvtier.lmcache"):
            assert remote.contains(key(1)) is False
            assert conn.exists_sync(key(1)) is False
            assert remote.get_blocking(key(1)) is None
            assert loop.run(remote.batched_async_contains("l", [key(1), key(2)])) == 0
            assert remote.batched_contains([key(1)]) == 0
            assert loop.run(conn.batched_get([key(1), key(2)])) == [None, None]
            obj = chunk(remote, cpu, 3)
            with pytest.raises(kvtier.GeometryError):  # into LMCache's put task, which counts it
                loop.run(conn.put(key(3), obj))
            obj.ref_count_down()
        assert_geometry_error_logged(caplog, "kvtier.lmcache", CHUNK_BYTES * 2, CHUNK_BYTES)
        assert conn.stats["puts"] == conn.stats["hits"] == 0
    finally:
        server.stop()


def test_save_chunk_meta_on_is_refused(kvserver, loop, caplog):
    with caplog.at_level(logging.ERROR):
        found = backends(kvserver.url, loop, save_chunk_meta=True)
    assert "RemoteBackend-kvtier" not in found or found["RemoteBackend-kvtier"].connection is None
    assert "save_chunk_meta: false" in caplog.text


def test_a_stopped_server_gives_misses_not_exceptions(loop, caplog, plane):
    server = ServerProcess(block_bytes=CHUNK_BYTES).start()
    try:
        found = backends(server.url, loop, plane=plane, **{"remote_storage_plugin.kvtier.down_s": 0.2})
        remote, cpu = remote_of(found), found["LocalCPUBackend"]
        conn = remote.connection.getWrappedConnector()
        remote.submit_put_task(key(1), chunk(remote, cpu, 1)).result(10)
        assert remote.contains(key(1))
        server.kill()

        with caplog.at_level(logging.WARNING, logger="kvtier.lmcache"):
            assert remote.contains(key(1)) is False
            assert remote.get_blocking(key(1)) is None
            assert loop.run(remote.batched_async_contains("l", [key(1), key(2)])) == 0
            assert remote.batched_contains([key(1)]) == 0
            assert loop.run(conn.ping()) == 1
            # A put fails in LMCache's put task (counted there), not in the caller.
            remote.submit_put_task(key(2), chunk(remote, cpu, 2))
        assert conn.stats["errors"] >= 1
        assert "answered as a miss" in caplog.text
        assert remote.get_blocking_failed_count >= 1

        # Back up (same port and data): hits again once down_s has passed.
        start_on_same_port(server)
        end = time.monotonic() + 10
        while not remote.contains(key(1)) and time.monotonic() < end:
            time.sleep(0.1)
        assert remote.contains(key(1))
        got = remote.get_blocking(key(1))  # on the socket: the buffer registered again on the new connection
        assert got is not None
        got.ref_count_down()
        assert_plane(conn, plane, 2)
    finally:
        server.stop()


DOCS = Path(__file__).resolve().parents[3] / "docs" / "INTEGRATIONS.md"


def documented_block(marker: str) -> str:
    """The fenced block right after `<!-- marker -->` in docs/INTEGRATIONS.md."""
    text = DOCS.read_text()
    after = text[text.index(f"<!-- {marker} -->") :]
    start = after.index("```")
    body = after[after.index("\n", start) + 1 :]
    return body[: body.index("```")]


def check_documented_config(config: LMCacheEngineConfig, server: ServerProcess, loop: Loop) -> None:
    """The documented settings, pointed at the test server and its small chunks."""
    assert config.remote_storage_plugins == ["kvtier"]
    assert config.extra_config["remote_storage_plugin.kvtier.url"] == "http://127.0.0.1:8085"
    assert config.extra_config["save_chunk_meta"] is False
    assert config.chunk_size == 128
    object.__setattr__(config, "chunk_size", CHUNK_TOKENS)
    object.__setattr__(config, "max_local_cpu_size", 0.01)
    config.extra_config["remote_storage_plugin.kvtier.url"] = server.url
    found = CreateStorageBackends(config, metadata(), loop.loop, dst_device="cpu")
    remote, cpu = remote_of(found), found["LocalCPUBackend"]
    round_trip(remote, cpu, 3, key(31337))
    # kvtier on this host: the documented shm_name makes it zero-copy over the socket.
    assert_plane(remote.connection.getWrappedConnector(), "unix", 2)


def test_the_documented_yaml_configures_lmcache(kvserver, loop, tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(documented_block("lmcache-yaml"))
    check_documented_config(LMCacheEngineConfig.from_file(str(path)), kvserver, loop)


def test_the_documented_environment_configures_lmcache(kvserver, loop, monkeypatch):
    for line in documented_block("lmcache-env").splitlines():
        assert line.startswith("export ")
        name, value = line[len("export ") :].split("=", 1)
        monkeypatch.setenv(name, shlex.split(value)[0])
    check_documented_config(LMCacheEngineConfig.from_env(), kvserver, loop)


def test_without_shm_name_the_socket_stages_chunks_and_says_so_once(kvserver, loop, caplog):
    """LMCache's CPU buffer in anonymous memory cannot be registered: chunks
    still round-trip over the socket, stores through the staging area and
    reads by a copy from a lease (the server's RAM tier is shared by
    default), each counted, and one warning names the setting that fixes it."""
    caplog.set_level(logging.INFO, logger="kvtier")
    found = backends(kvserver.url, loop, **{"remote_storage_plugin.kvtier.local": "on"})
    remote, cpu = remote_of(found), found["LocalCPUBackend"]
    conn = remote.connection.getWrappedConnector()
    objs = [chunk(remote, cpu, 40 + i) for i in range(3)]
    want = [o.tensor.clone() for o in objs]
    chain = [key(6100 + i) for i in range(3)]
    loop.run(conn.batched_put(chain, objs))
    got = loop.run(conn.batched_get(chain))
    assert all(g is not None and torch.equal(g.tensor, w) for g, w in zip(got, want))
    for g in got:
        g.ref_count_down()
    assert conn.transport == "unix" and conn._host.zero_copy is False
    assert conn.stats["staged_chunks"] == 6 and conn.stats["zero_copy_chunks"] == 0
    plane = conn.client.sync.local_stats()
    assert (plane["bounce_copies"], plane["lease_copies"]) == (3, 3)
    staged = [r.getMessage() for r in caplog.records if "staged over the same-host socket" in r.getMessage()]
    assert len(staged) == 1 and "shm_name" in staged[0], staged


@pytest.mark.parametrize("socket_state", ["none", "refused"])
def test_a_missing_or_refused_socket_falls_back_to_http_with_one_log_line(loop, caplog, socket_state):
    """local="auto" (the default): a kvtier started with --local-socket none,
    or one whose socket refuses connections (bound, not listening), is used
    over HTTP; the fallback is said once and chunks round-trip."""
    import socket as sockets

    args = ("--local-socket", "none") if socket_state == "none" else ()
    caplog.set_level(logging.INFO, logger="kvtier")
    with ServerProcess(block_bytes=CHUNK_BYTES, args=args) as server:
        dead = None
        if socket_state == "refused":
            path = kvtier.Client(server.url, local="off").stats()["local"]["socket"]
            Path(path).unlink()
            dead = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            dead.bind(path)  # bound, never listening: connect() is refused
        try:
            settings = {
                "remote_storage_plugin.kvtier.local": "auto",
                "shm_name": f"kvtier_test_{uuid.uuid4().hex[:12]}",
            }
            found = backends(server.url, loop, **settings)
            remote, cpu = remote_of(found), found["LocalCPUBackend"]
            conn = remote.connection.getWrappedConnector()
            round_trip(remote, cpu, 5, key(6200))
            assert conn.transport == "http" and conn.stats["zero_copy_chunks"] == 0
        finally:
            if dead is not None:
                dead.close()
    said = said_over_http(caplog)
    if socket_state == "refused":
        assert any("not usable" in m and "refused" in m.lower() for m in said), said


WRITER = """
import asyncio, sys, threading, torch
sys.path.insert(0, {tests!r})
import test_lmcache as t
loop = t.Loop()
found = t.backends({url!r}, loop, plane="unix")
remote, cpu = t.remote_of(found), found["LocalCPUBackend"]
conn = remote.connection.getWrappedConnector()
objs = [t.chunk(remote, cpu, 70 + i) for i in range(4)]
loop.run(conn.batched_put([t.key(7000 + i) for i in range(4)], objs))
print(conn.stats["puts"], conn.stats["zero_copy_chunks"], conn._host.zero_copy, flush=True)
"""


def test_two_engine_processes_share_chunks_through_one_kvtier_on_the_local_plane(kvserver, loop):
    """One LMCache process stores chunks over the socket from its own shared
    CPU buffer; another (this one) loads them into its own buffer: both
    zero-copy, the bytes those of the writer's MemoryObjs."""
    script = WRITER.format(tests=str(Path(__file__).parent), url=kvserver.url)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["4", "4", "True"], out.stdout
    found = backends(kvserver.url, loop, plane="unix")
    remote, cpu = remote_of(found), found["LocalCPUBackend"]
    conn = remote.connection.getWrappedConnector()
    chain = [key(7000 + i) for i in range(4)]
    assert loop.run(remote.batched_async_contains("two", chain)) == 4
    got = loop.run(conn.batched_get(chain))
    for i, g in enumerate(got):
        assert g is not None and torch.equal(g.tensor, chunk(remote, cpu, 70 + i).tensor)
        g.ref_count_down()
    assert_plane(conn, "unix", 4)
