"""The same-host data plane (docs/LOCAL.md) against a real `kvtier serve`:
the Unix socket, registered memory, Mooncake's calls, and failures."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import BLOCK_BYTES, block, server_fds, start_on_same_port, wait_for

import kvtier
from kvtier import codes
from kvtier.testing import ServerProcess

BB = BLOCK_BYTES


@pytest.fixture
def uclient(server: ServerProcess) -> Iterator[kvtier.Client]:
    with kvtier.Client(server.unix_url, timeout_s=10) as c:
        yield c


@pytest.fixture
def sb() -> Iterator[kvtier.SharedBuffer]:
    with kvtier.SharedBuffer(8 * BB) as buf:
        yield buf


@pytest.fixture
def shm_file() -> Iterator[tuple[str, mmap.mmap, int]]:
    """A /dev/shm file of 8 blocks mapped MAP_SHARED: (path, map, address)."""
    path = f"/dev/shm/kvtier-test-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 8 * BB)
    mm = mmap.mmap(fd, 8 * BB)
    os.close(fd)
    anchor = ctypes.c_char.from_buffer(mm)
    ptr = ctypes.addressof(anchor)
    del anchor
    yield path, mm, ptr
    mm.close()
    os.unlink(path)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def fill(view: np.ndarray, seed: int) -> None:
    view[:] = np.frombuffer(block(seed), dtype=np.uint8)


# ------------------------------------------------------------- transports


def test_transport_choice_and_hello(server):
    with kvtier.Client(server.unix_url) as c:
        assert c.transport == "unix"
        assert c.block_bytes == BB
        info = c.server_info
        assert info["version"] == 3 and info["block_bytes"] == BB and info["max_items"] == 4096
        assert isinstance(info["epoch"], int)
        assert c.ping()
        # The hello gives the HTTP address, so stats work from a bare socket url.
        assert info["http"] == server.url.removeprefix("http://")
        assert c.stats()["local"]["epoch"] == info["epoch"]
    with kvtier.Client(server.url, local="auto") as c:
        assert c.stats()["local"]["socket"] == server.socket_path
        assert c.transport == "unix"
        assert c.server_info["epoch"] == c.stats()["local"]["epoch"]
    with kvtier.Client(server.url) as c:
        assert c.transport == "http" and c.server_info == {}
    with kvtier.Client(f"{server.unix_url}?http={server.url.removeprefix('http://')}") as c:
        assert c.transport == "unix" and c.ping()
        assert c.stats()["local"]["socket"] == server.socket_path  # over HTTP
    for bad in ("unix://", "unix:///x.sock?port=1", "ftp://host"):
        with pytest.raises(ValueError, match=r"url must be|takes"):
            kvtier.Client(bad)


def test_auto_stays_on_http_without_a_socket():
    with ServerProcess(block_bytes=BB, args=("--local-socket", "none")) as s:
        assert s.socket_path is None
        with kvtier.Client(s.url, local="auto") as c:
            assert c.stats()["local"]["socket"] is None
            assert c.transport == "http"
            with kvtier.SharedBuffer(BB) as buf:
                assert c.register_buffer(buf) == 0
                fill(buf.numpy(), 1)
                assert c.batch_put_from(["auto-1"], [buf.ptr], [BB]) == [0]
                assert c.get("auto-1") == block(1)
        with kvtier.Client(s.url, local="on") as c, pytest.raises(kvtier.KvtierError, match="no local socket"):
            _ = c.transport


def test_geometry_mismatch_names_both_sides(server):
    with kvtier.Client(server.unix_url, expect_block_bytes=2 * BB) as c:
        with pytest.raises(kvtier.GeometryMismatchError) as e:
            _ = c.block_bytes
        assert str(BB) in str(e.value) and str(2 * BB) in str(e.value)
    with kvtier.Client(server.url, local="auto", expect_model="some-other-model") as c:
        with pytest.raises(kvtier.GeometryMismatchError, match="some-other-model"):
            _ = c.transport


# ------------------------------------------------------- round trips


def test_every_operation_through_a_shared_buffer(uclient, sb):
    keys = [f"sb-{i}" for i in range(4)]
    arr = sb.numpy()
    for i in range(4):
        fill(arr[i * BB : (i + 1) * BB], 10 + i)
    assert uclient.register_buffer(sb.ptr, sb.nbytes) == 0
    assert uclient.register_buffer(sb.ptr, sb.nbytes) == 0  # again: a no-op
    stats = uclient.local_stats()
    assert stats["transport"] == "unix" and stats["registrations"] == 1
    assert stats["buffers"] == [{"ptr": sb.ptr, "size": sb.nbytes, "access": 1}]  # mapped
    ptrs = [sb.ptr + i * BB for i in range(4)]
    assert uclient.batch_put_from(keys, ptrs, [BB] * 4) == [0] * 4
    assert uclient.batch_is_exist([*keys, "sb-missing"]) == [1, 1, 1, 1, 0]
    arr[: 4 * BB] = 0
    targets = [sb.ptr + (4 + i) * BB for i in range(4)]
    assert uclient.batch_get_into(keys, targets, [BB] * 4) == [BB] * 4
    for i in range(4):
        assert arr[(4 + i) * BB : (5 + i) * BB].tobytes() == block(10 + i)
    assert uclient.lookup([*keys, "sb-missing", keys[0]]) == 4
    assert uclient.lookup_tiers(keys[:2]) == ["ram", "ram"]
    assert uclient.prefetch([*keys, "sb-missing"]) == 4
    assert uclient.delete(keys[0]) is True and uclient.delete(keys[0]) is False
    assert uclient.batch_get_into(keys[:2], targets[:2], [BB, BB]) == [codes.NOT_FOUND, BB]
    assert uclient.unregister_buffer(sb.ptr) == 0
    assert uclient.unregister_buffer(sb.ptr) == codes.NOT_REGISTERED
    assert uclient.batch_get_into(keys[1:2], targets[:1], [BB]) == [codes.NOT_REGISTERED]
    assert uclient.local_stats()["bounce_copies"] == 0


def test_memoryview_of_a_shared_buffer_is_the_memory_a_put_stores(server, uclient, sb):
    view = memoryview(sb)  # the buffer protocol itself, not the .memoryview property
    assert (view.nbytes, view.readonly, view.format, view.ndim, view.c_contiguous) == (sb.nbytes, False, "B", 1, True)
    assert kvtier.shm.buffer_address(view, writable=True) == (sb.ptr, sb.nbytes)  # the mapping, not a copy
    view[BB : 2 * BB] = block(90)
    view[3 * BB : 4 * BB] = block(91)
    assert os.pread(sb.fd, BB, BB) == block(90)  # written into the memfd the server is handed
    assert uclient.register_buffer(sb) == 0
    # One PUT_FROM by pointer, one by a slice of the view: the server copies both
    # out of the registered memory (no bounce through the client's staging).
    assert uclient.batch_put_from(["mv-ptr"], [sb.ptr + BB], [BB]) == [0]
    assert uclient.batch_put_from(["mv-slice"], [view[3 * BB : 4 * BB]]) == [0]
    assert uclient.local_stats()["bounce_copies"] == 0
    with kvtier.Client(server.url) as http:
        assert http.get("mv-ptr") == block(90) and http.get("mv-slice") == block(91)
    # And back: a GET_INTO into the registered memory shows through the view.
    view[:BB] = bytes(BB)
    assert uclient.batch_get_into(["mv-slice"], [view[:BB]]) == [BB]
    assert bytes(view[:BB]) == block(91) and uclient.local_stats()["bounce_copies"] == 0
    assert uclient.unregister_buffer(sb) == 0
    view.release()


def test_a_shared_buffer_is_an_mmap_of_fixed_size_and_says_when_closed():
    buf = kvtier.SharedBuffer(2 * BB, name="kvtier-test-mv")
    assert isinstance(buf, mmap.mmap) and len(buf) == 2 * BB and not buf.closed
    buf[:4] = b"abcd"
    assert bytes(memoryview(buf)[:4]) == b"abcd" == bytes(buf.memoryview[:4]) == buf.numpy()[:4].tobytes()
    with pytest.raises(ValueError, match="cannot be resized"):
        buf.resize(4 * BB)
    with pytest.raises(ValueError, match="positive"):
        kvtier.SharedBuffer(0)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        kvtier.SharedBuffer(4096.0)  # type: ignore[arg-type]
    kept = memoryview(buf)
    buf.close()
    assert buf.closed and buf.fd == -1
    assert bytes(kept[:4]) == b"abcd"  # a view made before close keeps the mapping
    with pytest.raises(ValueError, match="closed"):
        buf.memoryview  # noqa: B018
    with pytest.raises(ValueError, match="closed"):
        buf.numpy()
    kept.release()
    buf.close()  # again, with no view left: now unmapped
    with pytest.raises(ValueError, match="closed"):
        memoryview(buf)
    buf.close()


def test_every_operation_through_a_dev_shm_file(uclient, shm_file):
    _, mm, ptr = shm_file
    arr = np.frombuffer(mm, dtype=np.uint8)
    for i in range(3):
        fill(arr[i * BB : (i + 1) * BB], 20 + i)
    assert uclient.register_buffer(ptr, 8 * BB) == 0
    assert uclient.local_stats()["buffers"][0]["access"] == 3  # mapped under the SIGBUS guard
    keys = [f"shm-{i}" for i in range(3)]
    assert uclient.batch_put_from(keys, [ptr + i * BB for i in range(3)], [BB] * 3) == [0] * 3
    assert uclient.batch_is_exist(keys) == [1, 1, 1]
    assert uclient.batch_get_into(keys, [ptr + (5 + i) * BB for i in range(3)], [BB] * 3) == [BB] * 3
    for i in range(3):
        assert arr[(5 + i) * BB : (6 + i) * BB].tobytes() == block(20 + i)
    assert uclient.lookup(keys) == 3 and uclient.prefetch(keys) == 3
    assert uclient.delete(keys[2])
    assert uclient.batch_is_exist(keys) == [1, 1, 0]
    del arr
    assert uclient.unregister_buffer(ptr) == 0
    assert uclient.local_stats()["registrations"] == 0


def test_buffer_objects_inside_and_outside_registrations(server, sb):
    """Buffer objects in a registration are copied into by the server; ones
    outside every registration through the staging area (one bounce copy,
    counted): ``lease_reads=False``, as the server's default RAM tier is
    shared and reads would otherwise take a lease copy (test_leases.py)."""
    torch = pytest.importorskip("torch")
    with kvtier.Client(server.unix_url, timeout_s=10, lease_reads=False) as uclient:
        _buffer_objects(uclient, sb, torch)


def _buffer_objects(uclient: kvtier.Client, sb: kvtier.SharedBuffer, torch: Any) -> None:
    assert uclient.register_buffer(sb) == 0
    view = sb.memoryview
    inside = [view[0:BB], sb.numpy()[BB : 2 * BB], sb.torch()[2 * BB : 3 * BB]]
    for i in range(3):
        fill(sb.numpy()[i * BB : (i + 1) * BB], 30 + i)
    keys = [f"obj-{i}" for i in range(3)]
    assert uclient.batch_put_from(keys, inside) == [0] * 3
    sb.numpy()[: 3 * BB] = 0
    assert uclient.batch_get_into(keys, inside) == [BB] * 3
    assert [bytes(v) if isinstance(v, memoryview) else v.numpy().tobytes() for v in inside[:1]] == [block(30)]
    assert inside[1].tobytes() == block(31) and inside[2].numpy().tobytes() == block(32)
    assert uclient.local_stats()["bounce_copies"] == 0
    # Outside every registration: one bounce copy per item, counted.
    outside = [bytearray(BB), np.zeros(BB // 4, dtype=np.float32), torch.zeros(BB, dtype=torch.uint8)]
    assert uclient.batch_get_into(keys, outside) == [BB] * 3
    assert bytes(outside[0]) == block(30) and outside[1].tobytes() == block(31)
    assert outside[2].numpy().tobytes() == block(32)
    stats = uclient.local_stats()
    assert stats["bounce_copies"] == 3 and stats["bounce_bytes"] == 3 * BB
    tensor = torch.frombuffer(bytearray(block(42)), dtype=torch.uint8)
    sources = [block(40), np.frombuffer(block(41), dtype=np.uint8), tensor]
    assert uclient.batch_put_from(["out-0", "out-1", "out-2"], sources) == [0] * 3
    assert uclient.get_many(["out-0", "out-1", "out-2"]) == [block(40), block(41), block(42)]
    assert uclient.local_stats()["bounce_copies"] == 3 + 3 + 3  # 3 puts, then get_many's 3
    del view, inside
    assert uclient.unregister_buffer(sb) == 0


def test_codes_for_bad_items(uclient, sb, caplog):
    assert uclient.register_buffer(sb) == 0
    fill(sb.numpy()[:BB], 50)
    stray = bytearray(BB)
    stray_ptr = ctypes.addressof(ctypes.c_char.from_buffer(stray))
    assert uclient.batch_put_from(["bad-0"], [stray_ptr], [BB]) == [codes.NOT_REGISTERED]
    assert uclient.batch_get_into(["bad-0"], [stray_ptr], [BB]) == [codes.NOT_REGISTERED]
    # Short lengths: -4, nothing stored (the server's check: the memory is registered).
    assert uclient.batch_put_from(["bad-1"], [sb.ptr], [BB - 1]) == [codes.WRONG_SIZE]
    assert uclient.batch_is_exist(["bad-1"]) == [0]
    assert uclient.batch_put_from(["bad-1b"], [sb.ptr], [BB + 1]) == [codes.WRONG_SIZE]
    assert uclient.batch_put_from(["bad-2"], [sb.ptr], [BB]) == [0]
    assert uclient.batch_get_into(["bad-2"], [sb.ptr + BB], [BB - 1]) == [codes.WRONG_SIZE]
    assert uclient.batch_get_into(["bad-2"], [sb.numpy()[BB : 2 * BB - 1]]) == [codes.WRONG_SIZE]
    # Past the end of the registered buffer: the server's OUT_OF_BOUNDS.
    assert uclient.batch_get_into(["bad-2"], [sb.ptr + 8 * BB - BB // 2], [BB]) == [codes.OUT_OF_BOUNDS]
    # Bad keys: -3 per item, the rest go on; -1 from batch_is_exist.
    assert uclient.batch_put_from(["no/slash", "bad-3"], [sb.ptr, sb.ptr], [BB, BB]) == [codes.INVALID_KEY, 0]
    assert uclient.batch_get_into(["", "bad-3"], [sb.ptr + BB, sb.ptr + 2 * BB], [BB, BB]) == [codes.INVALID_KEY, BB]
    assert uclient.batch_is_exist(["x" * 257, "bad-3"]) == [-1, 1]
    # Anonymous memory cannot be registered: -18 and a warning saying why.
    with caplog.at_level(logging.WARNING, logger="kvtier.local"):
        assert uclient.register_buffer(np.zeros(BB, dtype=np.uint8)) == codes.BAD_BUFFER
    assert any("anonymous memory" in r.getMessage() for r in caplog.records)
    assert uclient.register_buffer(sb.ptr + BB, BB) == codes.BAD_BUFFER  # overlaps
    # A shared mapping of a file on a disk: the server refuses it (only memory).
    with tempfile.NamedTemporaryFile(prefix="kvtier-disk-") as f:
        fs = subprocess.run(["stat", "-f", "-c", "%T", f.name], capture_output=True, text=True).stdout.strip()
        f.truncate(BB)
        with mmap.mmap(f.fileno(), BB) as mm:
            on_disk = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            if fs not in ("tmpfs", "hugetlbfs"):
                assert uclient.register_buffer(on_disk, BB) == codes.BAD_BUFFER
                assert uclient.local_stats()["registrations"] == 1  # sb only
    assert uclient.batch_get_into(["bad-2"], [object()], [BB]) == [codes.BAD_BUFFER]
    # The block API raises as over HTTP.
    with pytest.raises(kvtier.BlockSizeError):
        uclient.put("bad-4", bytes(BB - 1))
    with pytest.raises(kvtier.BlockSizeError, match="too small"):
        uclient.get_into("bad-2", bytearray(BB - 1))
    with pytest.raises(kvtier.InvalidKeyError):
        uclient.get("no/slash")
    uclient.unregister_buffer(sb)


def test_block_api_over_the_socket(server):
    with kvtier.Client(server.unix_url) as c:
        assert c.put("api-1", block(60)) is True
        assert c.put("api-1", block(60)) is False
        assert c.get("api-1") == block(60) and c.exists("api-1")
        assert c.tier_of("api-1") == "ram" and c.tier_of("api-none") is None
        buf = bytearray(BB + 10)
        assert c.get_into("api-1", buf) and buf[:BB] == block(60)
        assert c.put_many([("api-2", block(61)), ("api-3", memoryview(block(62)))]) == [True, True]
        assert c.get_many(["api-2", "api-none", "api-3"]) == [block(61), None, block(62)]
        bufs = [bytearray(BB), np.zeros(BB, dtype=np.uint8)]
        assert c.get_many_into(["api-3", "api-none"], bufs) == [True, False]
        assert bytes(bufs[0]) == block(62)
        assert c.lookup(["api-1", "api-2", "api-none", "api-3"]) == 2
        assert c.prefetch(["api-1", "api-none"]) == 1
        assert c.delete("api-1") and not c.delete("api-1") and c.get("api-1") is None
        assert not c.exists("api-1") and not c.get_into("api-1", buf)
        long_chain = [f"api-chain-{i}" for i in range(5000)]
        assert c.lookup(long_chain) == 0 and c.prefetch(long_chain) == 0
    with kvtier.Client(server.url, local="auto") as c:
        assert c.transport == "unix" and c.get("api-2") == block(61)
        assert c.ping() and c.stats()["geometry"]["block_bytes"] == BB


def test_mooncake_calls_give_the_same_results_over_http(server):
    def scenario(c: kvtier.Client, tag: str) -> list:
        out = []
        with kvtier.SharedBuffer(4 * BB) as buf:
            arr = buf.numpy()
            fill(arr[:BB], 70)
            fill(arr[BB : 2 * BB], 71)
            out.append(c.register_buffer(buf.ptr, buf.nbytes))
            stray = bytearray(BB)
            stray_ptr = ctypes.addressof(ctypes.c_char.from_buffer(stray))
            keys = [f"{tag}-0", f"{tag}-1", "bad/key", f"{tag}-short", f"{tag}-stray"]
            ptrs = [buf.ptr, buf.ptr + BB, buf.ptr, buf.ptr, stray_ptr]
            out.append(c.batch_put_from(keys, ptrs, [BB, BB, BB, BB - 8, BB]))
            out.append(c.batch_is_exist([*keys, f"{tag}-none"]))
            arr[: 2 * BB] = 0
            gets = [f"{tag}-1", f"{tag}-0", f"{tag}-none", "bad/key", f"{tag}-0"]
            targets = [buf.ptr + 2 * BB, buf.ptr + 3 * BB, buf.ptr, buf.ptr, buf.ptr]
            out.append(c.batch_get_into(gets, targets, [BB, BB, BB, BB, BB - 1]))
            out.append(arr[2 * BB :].tobytes() == block(71) + block(70))
            out.append(c.batch_get_into([f"{tag}-0"], [bytearray(BB)]))
            del arr
            out.append(c.unregister_buffer(buf.ptr))
            out.append(c.unregister_buffer(buf.ptr))
        return out

    with kvtier.Client(server.url) as h, kvtier.Client(server.unix_url) as u:
        over_http = scenario(h, "mh")
        over_unix = scenario(u, "mu")
    assert over_http == over_unix
    assert over_unix[1] == [0, 0, codes.INVALID_KEY, codes.WRONG_SIZE, codes.NOT_REGISTERED]
    assert over_unix[3] == [BB, BB, codes.NOT_FOUND, codes.INVALID_KEY, codes.WRONG_SIZE]


def test_multi_buffer_calls_scatter_and_gather_the_same_over_http_and_the_socket(server):
    """Mooncake's batch_*_multi_buffers: a block gathered from spans apart
    (SGLang's K and V halves) and scattered into others, byte-exact on both
    transports, with the same codes for bad items."""

    def scenario(c: kvtier.Client, tag: str) -> list:
        out = []
        with kvtier.SharedBuffer(6 * BB) as buf:
            arr = buf.numpy()
            fill(arr[:BB], 80)
            want = arr[:BB].tobytes()
            out.append(c.register_buffer(buf))
            k, v = buf.ptr, buf.ptr + 3 * BB  # the halves, apart
            arr[3 * BB : 3 * BB + BB // 2] = arr[BB // 2 : BB]
            half = BB // 2
            keys = [f"{tag}-kv", f"{tag}-short", f"{tag}-over", f"{tag}-stray", f"{tag}-past"]
            ptrs = [[k, v], [k, v], [k, v], [k, 12345], [k, buf.ptr + 6 * BB - half + 1]]
            sizes = [[half, half], [half, half - 1], [half, half + 1], [half, half], [half, half]]
            out.append(c.batch_put_from_multi_buffers(keys, ptrs, sizes))
            out.append(c.batch_get_into([f"{tag}-kv"], [buf.ptr + BB], [BB]))
            out.append(arr[BB : 2 * BB].tobytes() == want)
            # Scattered into three spans in another order, with room to spare.
            arr[:] = 0
            spans = [[buf.ptr + 5 * BB, buf.ptr + 2 * BB, buf.ptr]]
            out.append(c.batch_get_into_multi_buffers([f"{tag}-kv"], spans, [[BB // 4, BB // 4, BB]]))
            got = arr[5 * BB : 5 * BB + BB // 4].tobytes() + arr[2 * BB : 2 * BB + BB // 4].tobytes()
            got += arr[: BB // 2].tobytes()
            out.append(got == want and not arr[BB // 2 : BB].any())
            out.append(c.batch_get_into_multi_buffers([f"{tag}-none", f"{tag}-kv"], [[k], [k]], [[BB], [BB - 1]]))
            del arr
            c.unregister_buffer(buf)
        return out

    with kvtier.Client(server.url) as h, kvtier.Client(server.unix_url) as u:
        over_http = scenario(h, "vh")
        over_unix = scenario(u, "vu")
    assert over_http == over_unix
    bad = [codes.WRONG_SIZE, codes.WRONG_SIZE, codes.NOT_REGISTERED, codes.OUT_OF_BOUNDS]
    assert over_unix[1] == [0, *bad], over_unix
    assert over_unix[2:] == [[BB], True, [BB], True, [codes.NOT_FOUND, codes.WRONG_SIZE]], over_unix


def test_many_threads_share_one_connection(uclient, sb):
    assert uclient.register_buffer(sb) == 0
    arr = sb.numpy()
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            mine = arr[t * BB : (t + 1) * BB]
            for round_ in range(20):
                fill(mine, 1000 + t * 100 + round_)
                key = f"thr-{t}-{round_}"
                assert uclient.batch_put_from([key], [mine]) == [0]
                mine[:] = 0
                assert uclient.batch_get_into([key], [mine]) == [BB]
                assert mine.tobytes() == block(1000 + t * 100 + round_)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    uclient.unregister_buffer(sb)


# ------------------------------------------------------------- failures


KILLED_CLIENT = """
import sys, kvtier, numpy as np
c = kvtier.Client(sys.argv[1], timeout_s=10)
bb = c.block_bytes
buf = kvtier.SharedBuffer(16 * bb)
assert c.register_buffer(buf) == 0
arr = buf.numpy()
keys = [f"kill-{j}" for j in range(8)]
i = 0
while True:
    for j in range(8):
        arr[j * bb : (j + 1) * bb] = (i * 8 + j) % 251 + 1
    assert c.batch_put_from(keys, [buf.ptr + j * bb for j in range(8)], [bb] * 8) == [0] * 8
    c.batch_get_into(keys, [buf.ptr + (8 + j) * bb for j in range(8)], [bb] * 8)
    if i == 3:
        print("running", flush=True)
    i += 1
"""


def run_and_kill(server: ServerProcess) -> None:
    """Starts KILLED_CLIENT against ``server``, lets it run PUT and GET
    batches, then kills it with SIGKILL mid-batch."""
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, server.unix_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == b"running\n", child.stderr.read() if child.stderr else line
        time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


def test_client_killed_mid_batch_leaves_whole_blocks_and_no_fds(server):
    with kvtier.Client(server.url) as c:
        c.ping()
    run_and_kill(server)  # warm-up: the server's allocators and copy buffers
    assert wait_for(lambda: registrations_open(server) == 0)
    baseline, rss0 = server_fds(server.pid), settled_rss_kib(server)
    run_and_kill(server)
    assert wait_for(lambda: server_fds(server.pid) <= baseline), sorted(
        os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")
    )
    assert wait_for(lambda: rss_kib(server.pid) - rss0 < 8192), (rss0, rss_kib(server.pid))  # KiB
    with kvtier.Client(server.unix_url) as c:
        got = c.get_many([f"kill-{j}" for j in range(8)])
        assert all(data is not None for data in got)
        for data in got:
            assert data == bytes([data[0]]) * BB  # one whole pattern, never a mix
    assert wait_for(lambda: registrations_open(server) == 0)  # this client's staging area went with it


def settled_fds(pid: int) -> int:
    """``server_fds`` once it holds still (two readings 0.2 s apart agree):
    the server closes an unregistered buffer's descriptor off its shard's
    thread, a moment after answering."""
    last = server_fds(pid)
    for _ in range(25):
        time.sleep(0.2)
        now = server_fds(pid)
        if now == last:
            return now
        last = now
    return last


def settled_rss_kib(server: ServerProcess) -> int:
    """The server's RSS once start-up's background fault-in of its I/O
    memory and RAM tier is over (two readings 0.3 s apart within 1 MiB)."""
    with kvtier.Client(server.url) as c:
        assert wait_for(lambda: all(s["io_memory_registered"] for s in c.stats()["per_shard"]))
    last = rss_kib(server.pid)
    for _ in range(50):
        time.sleep(0.3)
        now = rss_kib(server.pid)
        if abs(now - last) < 1024:
            return now
        last = now
    return last


def registrations_open(server: ServerProcess) -> int:
    with kvtier.Client(server.url) as c:
        n: int = c.stats()["local"]["registrations_open"]
        return n


def test_a_file_shrunk_under_a_registration(uclient, shm_file):
    path, mm, ptr = shm_file
    arr = np.frombuffer(mm, dtype=np.uint8)
    for i in range(8):
        fill(arr[i * BB : (i + 1) * BB], 90 + i)
    del arr
    assert uclient.register_buffer(ptr, 8 * BB) == 0
    keys = [f"shrink-{i}" for i in range(8)]
    assert uclient.batch_put_from(keys, [ptr + i * BB for i in range(8)], [BB] * 8) == [0] * 8
    results: list[list[int]] = []
    stop = threading.Event()

    def batches() -> None:  # the server's copies only: this process never touches the lost pages
        while not stop.is_set():
            results.append(uclient.batch_get_into(keys[4:], [ptr + i * BB for i in range(4, 8)], [BB] * 4))

    t = threading.Thread(target=batches)
    t.start()
    time.sleep(0.1)
    os.truncate(path, 4 * BB)  # mid-batch
    time.sleep(0.1)
    stop.set()
    t.join(10)
    assert results and all(r in (BB, codes.BUFFER_SHRUNK) for batch in results for r in batch), results
    assert results[-1] == [codes.BUFFER_SHRUNK] * 4
    # The server mapped the file under its SIGBUS guard (access 3): a file
    # that shrank, whether a copy faulted on it or a check saw it first, is
    # lost whole, even the part that is left, until registered again.
    assert uclient.local_stats()["buffers"][0]["access"] == 3
    assert uclient.batch_put_from(["shrink-x", "shrink-y"], [ptr + 5 * BB, ptr + BB], [BB] * 2) == [
        codes.BUFFER_SHRUNK,
        codes.BUFFER_SHRUNK,
    ]
    assert uclient.batch_get_into(keys[:1], [ptr + 2 * BB], [BB]) == [codes.BUFFER_SHRUNK]
    assert uclient.ping()
    assert uclient.unregister_buffer(ptr) == 0
    assert uclient.register_buffer(ptr, 4 * BB) == 0  # what is left, again
    assert uclient.batch_get_into(keys[:2], [ptr + 2 * BB, ptr + 3 * BB], [BB] * 2) == [BB, BB]
    arr = np.frombuffer(mm, dtype=np.uint8)
    assert arr[3 * BB : 4 * BB].tobytes() == block(91)
    del arr
    assert uclient.unregister_buffer(ptr) == 0
    os.truncate(path, 8 * BB)  # for the fixture's unmap


def test_register_unregister_cycles_leak_nothing(server, sb):
    with kvtier.Client(server.unix_url) as c:
        for _ in range(300):  # warm-up: allocators, tables
            assert c.register_buffer(sb) == 0 and c.unregister_buffer(sb) == 0
        # An unregistered buffer's descriptor is closed on the server's
        # blocking pool, after the answer: counted once those closes are done.
        rss0 = settled_rss_kib(server)
        fd0 = settled_fds(server.pid)
        for _ in range(10_000):
            assert c.register_buffer(sb) == 0
            assert c.unregister_buffer(sb) == 0
        fd1, rss1 = settled_fds(server.pid), rss_kib(server.pid)
    assert fd1 == fd0
    assert rss1 - rss0 < 4096, (rss0, rss1)  # KiB


def test_server_restart_under_a_connected_client():
    data_dir = tempfile.mkdtemp(prefix="kvtier-restart-")
    s = ServerProcess(block_bytes=BB, data_dir=data_dir)
    try:
        s.start()
        with kvtier.Client(s.unix_url, timeout_s=15) as c, kvtier.SharedBuffer(4 * BB) as buf:
            assert c.register_buffer(buf) == 0
            fill(buf.numpy()[:BB], 100)
            assert c.batch_put_from(["rs-0"], [buf.ptr], [BB]) == [0]
            epoch = c.local_stats()["epoch"]
            s.kill()
            start_on_same_port(s)
            fill(buf.numpy()[BB : 2 * BB], 101)
            assert c.batch_put_from(["rs-1"], [buf.ptr + BB], [BB]) == [0]
            assert c.batch_get_into(["rs-1"], [buf.ptr + 2 * BB], [BB]) == [BB]
            assert buf.numpy()[2 * BB : 3 * BB].tobytes() == block(101)
            stats = c.local_stats()
            assert stats["epoch"] != epoch and stats["reconnects"] == 1 and stats["registrations_renewed"] == 1
        # Not back within the timeout: CONNECTION_LOST per item, no exception.
        with kvtier.Client(s.unix_url, timeout_s=1) as c, kvtier.SharedBuffer(2 * BB) as buf:
            assert c.register_buffer(buf) == 0
            s.kill()
            t0 = time.monotonic()
            assert c.batch_get_into(["rs-1", "rs-0"], [buf.ptr, buf.ptr + BB], [BB, BB]) == [codes.CONNECTION_LOST] * 2
            assert c.batch_put_from(["rs-2"], [buf.ptr], [BB]) == [codes.CONNECTION_LOST]
            assert c.batch_is_exist(["rs-1"]) == [-1]
            assert time.monotonic() - t0 < 6
            start_on_same_port(s)
            assert c.batch_is_exist(["rs-1", "rs-2"]) == [1, 0]
            assert c.local_stats()["registrations_renewed"] == 1
    finally:
        s.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_block_written_in_place_is_stored_as_acknowledged_whatever_the_memory_holds_later():
    """Writes in place (docs/LOCAL.md): the client writes blocks into its
    registered memory and commits them with PUT_FROM; kvtier copies each once,
    into a RAM-tier slot, computes its CRCs from that copy, and writes the log
    straight from the slot. Overwriting the client's memory after the
    acknowledgment changes nothing stored: neither the RAM copies nor the log
    (read back after kill -9 and a restart)."""
    data_dir = tempfile.mkdtemp(prefix="kvtier-inplace-")
    # Room for 16 blocks in RAM: the 24 PUTs also evict (clean) blocks.
    s = ServerProcess(block_bytes=BB, data_dir=data_dir, ram_gb=16 * BB / (1 << 30), args=("--write-policy", "through"))
    keys = [f"in-place-{i}" for i in range(24)]
    try:
        s.start()
        with kvtier.Client(s.unix_url, timeout_s=15) as c, kvtier.SharedBuffer(len(keys) * BB) as buf:
            assert c.register_buffer(buf) == 0
            for i in range(len(keys)):
                fill(buf.numpy()[i * BB : (i + 1) * BB], 300 + i)
            # Batches of 4: a shard's 8 slots are never all taken by writes
            # in flight (a PUT that finds no slot is copied, not in place).
            for at in range(0, len(keys), 4):
                ptrs = [buf.ptr + i * BB for i in range(at, at + 4)]
                assert c.batch_put_from(keys[at : at + 4], ptrs, [BB] * 4) == [0] * 4
            buf.numpy()[:] = 0xEE  # the client reuses its memory once acknowledged
            with kvtier.Client(s.url) as http:
                totals = http.stats()["totals"]
                assert totals["writes_from_ram"] == len(keys), totals
                assert http.batch_is_exist(keys) == [1] * len(keys)
                ram = next(t for t in http.stats()["tiers"] if t["tier"] == "ram")
                assert ram["used_blocks"] == 16 and ram["hits"] == 0, ram
                # Newest first: the 16 in RAM are read from RAM, then the
                # 8 evicted ones from the log.
                for i in reversed(range(len(keys))):
                    assert http.get(keys[i]) == block(300 + i), keys[i]
                ram = next(t for t in http.stats()["tiers"] if t["tier"] == "ram")
                assert ram["hits"] == 16, ram
        s.kill()
        start_on_same_port(s)
        with kvtier.Client(s.url) as http:
            for i, k in enumerate(keys):
                assert http.get(k) == block(300 + i), f"{k} after kill -9"
    finally:
        s.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_dev_shm_file_is_written_in_place_too(server, uclient, shm_file):
    """A /dev/shm file (what the engines register: mapped under the SIGBUS
    guard) is read once by the owning shard as a sealed memfd is; the bytes
    stored are those of the PUT, whatever the file holds afterwards."""
    _, mm, ptr = shm_file
    arr = np.frombuffer(mm, dtype=np.uint8)
    for i in range(4):
        fill(arr[i * BB : (i + 1) * BB], 400 + i)
    assert uclient.register_buffer(ptr, 8 * BB) == 0
    assert uclient.local_stats()["buffers"][0]["access"] == 3  # guarded
    with kvtier.Client(server.url) as http:
        before = http.stats()["totals"]["writes_from_ram"]
        keys = [f"shm-in-place-{i}" for i in range(4)]
        assert uclient.batch_put_from(keys, [ptr + i * BB for i in range(4)], [BB] * 4) == [0] * 4
        assert http.stats()["totals"]["writes_from_ram"] == before + 4
        arr[: 4 * BB] = 0x5A
        for i, k in enumerate(keys):
            assert http.get(k) == block(400 + i), k
    del arr
    assert uclient.unregister_buffer(ptr) == 0


def test_blocks_of_partial_pages_are_copied_then_stored_in_ram_and_the_log():
    """A block that is not a whole number of 4 KiB pages cannot be written
    to the log from a RAM slot (O_DIRECT): the shard copies the client's
    memory into its own first, and the block still lands in RAM."""
    bb = 65536 + 100
    with ServerProcess(block_bytes=bb, args=("--write-policy", "through")) as s:
        with kvtier.Client(s.unix_url, timeout_s=15) as c, kvtier.SharedBuffer(4 * bb) as buf:
            assert c.register_buffer(buf) == 0
            data = [os.urandom(bb) for _ in range(4)]
            for i, d in enumerate(data):
                buf.numpy()[i * bb : (i + 1) * bb] = np.frombuffer(d, dtype=np.uint8)
            keys = [f"odd-{i}" for i in range(4)]
            assert c.batch_put_from(keys, [buf.ptr + i * bb for i in range(4)], [bb] * 4) == [0] * 4
            buf.numpy()[:] = 0xEE
            with kvtier.Client(s.url) as http:
                stats = http.stats()
                ram = next(t for t in stats["tiers"] if t["tier"] == "ram")
                assert ram["used_blocks"] == 4 and stats["totals"]["writes_from_ram"] == 0, stats
                assert [http.get(k) for k in keys] == data


def test_a_restarted_server_with_another_geometry_raises():
    root = tempfile.mkdtemp(prefix="kvtier-geo-")
    sock = os.path.join(root, "kv.sock")
    a = ServerProcess(block_bytes=BB, data_dir=os.path.join(root, "a"), args=("--local-socket", sock))
    b = ServerProcess(block_bytes=2 * BB, data_dir=os.path.join(root, "b"), args=("--local-socket", sock))
    try:
        a.start()
        with kvtier.Client(f"unix://{sock}", timeout_s=10) as c:
            assert c.block_bytes == BB and c.ping()
            a.kill()
            b.start()
            with pytest.raises(kvtier.GeometryMismatchError) as e:
                c.batch_is_exist(["geo"])
            assert str(BB) in str(e.value) and str(2 * BB) in str(e.value)
    finally:
        a.stop()
        b.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_async_client_over_the_socket(server):
    import asyncio

    async def main() -> None:
        async with kvtier.AsyncClient(server.unix_url) as c:
            assert c.sync.transport == "unix"
            assert await c.put("async-1", block(110)) is True
            assert await c.get("async-1") == block(110)
            assert await c.get_many(["async-1", "async-none"]) == [block(110), None]

    asyncio.run(main())


def test_a_batch_past_its_in_flight_bound_answers_every_item_in_order():
    """A batch keeps at most 128 MiB of blocks in flight (docs/LOCAL.md): 10
    blocks of 32 MiB run four at a time, and each item's answer and bytes
    are still its own, a missing key (answered first) included."""
    bb = 32 << 20
    n = 10
    missing = 1  # its answer comes before its neighbours'
    with ServerProcess(block_bytes=bb, ram_gb=0.0625, disk_gb=1) as s, kvtier.Client(s.unix_url) as c:
        sb = kvtier.SharedBuffer(2 * n * bb)
        arr = sb.numpy()
        for i in range(n):
            arr[i * bb : (i + 1) * bb] = np.frombuffer(block(40 + i, bb), dtype=np.uint8)
        assert c.register_buffer(sb.ptr, sb.nbytes) == 0
        keys = [f"fl-{i}" for i in range(n)]
        stored = [k for i, k in enumerate(keys) if i != missing]
        sources = [sb.ptr + i * bb for i in range(n) if i != missing]
        assert c.batch_put_from(stored, sources, [bb] * (n - 1)) == [0] * (n - 1)
        targets = [sb.ptr + (n + i) * bb for i in range(n)]
        got = c.batch_get_into(keys, targets, [bb] * n)
        assert got == [codes.NOT_FOUND if i == missing else bb for i in range(n)]
        for i in range(n):
            if i != missing:
                assert arr[(n + i) * bb : (n + i + 1) * bb].tobytes() == block(40 + i, bb), f"block {i}"
        assert c.unregister_buffer(sb.ptr) == 0
        sb.close()
