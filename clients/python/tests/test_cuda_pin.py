"""``Client.pin_arenas``: kvtier's RAM-tier arenas page-locked for the GPU
(``cuMemHostRegister``, read-only), so a host-to-device copy from a lease is
one DMA from kvtier's pages. Against a real `kvtier serve` and the fake
CUDA driver of server/tests/fake-cuda (built here with ``cc``), which checks
what the real driver checks of a registration (a current context, every
page mapped, ``READ_ONLY`` for memory mapped without write permission) and
traces whether each copy's host side was page-locked. The client runs in a
child process whose ``LD_LIBRARY_PATH`` holds the fake. On a GPU, ``make
gpu-check``'s lease step runs the same calls against the real driver
(clients/python/bench/bench_gpu_lease.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BLOCK_BYTES, block, start_on_same_port

import kvtier
from kvtier.testing import ServerProcess

BB = BLOCK_BYTES
ROOT = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent(
    """
    import ctypes, hashlib, json, sys
    import kvtier
    from kvtier.memory import cuda as _cuda

    url, bb, keys = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    lib = ctypes.CDLL("libcuda.so.1")
    out = {}

    def copies(c):
        # Each leased block to the device and back: its digest and whether the lease held.
        dev = ctypes.c_ulonglong()
        assert lib.cuMemAlloc_v2(ctypes.byref(dev), ctypes.c_size_t(bb)) == 0
        back = (ctypes.c_char * bb)()
        got = []
        with c.lease(keys) as leases:
            for i in range(len(keys)):
                src = ctypes.c_void_p(leases.numpy(i).ctypes.data)
                rc = lib.cuMemcpyHtoD_v2(dev, src, ctypes.c_size_t(bb))
                rc += lib.cuMemcpyDtoH_v2(back, dev, ctypes.c_size_t(bb))
                got.append([rc, hashlib.sha256(bytes(back)).hexdigest(), leases.valid(i)])
        lib.cuMemFree_v2(dev)
        return got

    with kvtier.Client(url, timeout_s=30) as c:
        out["pinned_bytes"] = c.pin_arenas(0)
        arenas = c._link.current().arenas
        out["arena_bytes"] = [a.file_bytes for a in arenas._arenas.values()]
        out["before"] = copies(c)
        # The mapping is read-only: registering it for writing is refused.
        a = next(iter(arenas._arenas.values()))
        cuda = _cuda.driver()
        cuda.unregister(a.address)
        try:
            cuda.register(a.address, a.file_bytes, read_only=False)
            out["writable_registration"] = "accepted"
        except kvtier.CudaError as e:
            out["writable_registration"] = e.code
        cuda.register(a.address, a.file_bytes, read_only=True)
        out["pinned_arenas"] = c.local_stats()["arenas_pinned"]
        print("pinned", flush=True)
        sys.stdin.readline()  # the server restarts
        out["after_restart"] = copies(c)
        out["pinned_arenas_after_restart"] = c.local_stats()["arenas_pinned"]
    print(json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fake driver as libcuda.so.1."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.fail(f"building the fake CUDA driver needs a C compiler: {cc!r} is not on PATH (apt install gcc)")
    out = tmp_path_factory.mktemp("fake-cuda")
    subprocess.run(
        [cc, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"),
         str(ROOT / "server/tests/fake-cuda/fake_cuda.c"), "-lpthread"],
        check=True,
    )  # fmt: skip
    return out


@pytest.fixture
def pserver(tmp_path: Path) -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=BB, ram_gb=0.01, disk_gb=0.5, args=("--ram-shared", "on")) as s:
        yield s


def test_pinned_arenas_are_registered_read_only_and_copies_dma_from_them(fake_cuda, pserver, tmp_path):
    keys = [f"pin-{i}" for i in range(6)]
    with kvtier.Client(pserver.unix_url, timeout_s=30) as c:
        c.put_many([(k, block(i)) for i, k in enumerate(keys)])
    want = [hashlib.sha256(block(i)).hexdigest() for i in range(len(keys))]
    trace = tmp_path / "fake-cuda.trace"
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_cuda), "FAKE_CUDA_TRACE": str(trace)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, pserver.unix_url, str(BB), ",".join(keys)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    line = child.stdout.readline()
    if line.strip() != "pinned":
        child.kill()
        pytest.fail(f"the child did not pin: {line!r}\n{child.communicate()[1]}")
    calls_before_restart = trace.read_text()
    pserver.kill()
    start_on_same_port(pserver)  # a new server process: new arenas, a new epoch
    stdout, stderr = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])

    # Every arena (one per shard) page-locked whole, PORTABLE|READ_ONLY (0x9).
    assert len(out["arena_bytes"]) == 2  # ServerProcess's two shards: HELLO named both arenas
    assert out["pinned_bytes"] == sum(out["arena_bytes"])
    registered = [ln for ln in calls_before_restart.splitlines() if ln.startswith("cuMemHostRegister_v2")]
    assert [ln for ln in registered if ln.endswith("flags=9")][: len(out["arena_bytes"])] == [
        f"cuMemHostRegister_v2 bytes={n} flags=9" for n in out["arena_bytes"]
    ], calls_before_restart
    # The leased bytes went to the device and back intact, each DMA from pinned memory.
    assert out["before"] == [[0, h, True] for h in want]
    htod = [ln for ln in calls_before_restart.splitlines() if ln.startswith("cuMemcpyHtoDAsync_v2")]
    assert len(htod) == len(keys) and all(ln == f"cuMemcpyHtoDAsync_v2 bytes={BB} host=pinned" for ln in htod), htod
    # The arena is mapped read-only: a registration for writing is refused.
    assert out["writable_registration"] == "CUDA_ERROR_INVALID_VALUE"
    assert "INVALID_VALUE (read-only memory without READ_ONLY)" in calls_before_restart
    assert out["pinned_arenas"] == len(out["arena_bytes"])

    # After the restart the next lease mapped the new server's arenas and
    # pinned them; the old ones were unpinned; the copies are pinned again.
    assert out["after_restart"] == [[0, h, True] for h in want]
    assert out["pinned_arenas_after_restart"] == len(out["arena_bytes"])
    calls = trace.read_text()
    after = calls[len(calls_before_restart) :].splitlines()
    assert sum(1 for ln in after if ln == "cuMemHostUnregister") >= len(out["arena_bytes"]), after
    assert sum(1 for ln in after if ln.startswith("cuMemHostRegister_v2") and ln.endswith("flags=9")) == len(
        out["arena_bytes"]
    ), after
    assert all(ln.endswith("host=pinned") for ln in after if ln.startswith("cuMemcpyHtoDAsync_v2")), after
    # The client's close unpinned every arena it held.
    registers = sum(1 for ln in calls.splitlines() if ln.startswith("cuMemHostRegister_v2") and ln.endswith("flags=9"))
    assert sum(1 for ln in calls.splitlines() if ln == "cuMemHostUnregister") == registers, calls


PIN = textwrap.dedent(
    """
    import sys, kvtier
    with kvtier.Client(sys.argv[1], timeout_s=30) as c:
        try:
            c.pin_arenas(0)
            print("pinned")
        except kvtier.KvtierError as e:
            print(type(e).__name__, e.code)
    """
)


def pin_in_child(url: str, library_dir: Path) -> str:
    """``pin_arenas`` in a child whose ``LD_LIBRARY_PATH`` is ``library_dir``:
    ``"pinned"`` or the error's class and code."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(library_dir)}
    out = subprocess.run([sys.executable, "-c", PIN, url], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_server_without_leases_and_an_http_client_refuse_pinning_with_the_reason(fake_cuda):
    with ServerProcess(block_bytes=BB, ram_gb=0.01, disk_gb=0.5, args=("--ram-shared", "off")) as s:
        assert pin_in_child(s.unix_url, fake_cuda) == "LeasesOffError leases_off"
        assert pin_in_child(s.url, fake_cuda) == "LeasesOffError leases_need_socket"


def test_without_a_driver_pinning_raises_no_cuda_driver(tmp_path):
    if "libcuda.so.1 " in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout:
        pytest.skip("this machine's loader cache lists a CUDA driver: no library path hides it")
    with ServerProcess(block_bytes=BB, ram_gb=0.01, disk_gb=0.5, args=("--ram-shared", "on")) as s:
        assert pin_in_child(s.unix_url, tmp_path) == "CudaError no_cuda_driver"
