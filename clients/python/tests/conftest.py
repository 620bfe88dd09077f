"""Fixtures: a real `kvtier serve` on loopback ($KVTIER_BIN, see kvtier.testing)."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvtier
from kvtier.testing import ServerProcess, free_port

# Every test server with the least I/O memory (64 MiB a shard, faulted in
# and pinned at each start): the tests start servers by the hundred, and the
# default 512 MiB each kept the machine reclaiming memory under them.
ServerProcess.common_args = ("--io-memory-mib", "128")

#: Small blocks keep the tests quick on a debug build; the client's code path
#: is the same at 16 MiB (make bench-python runs that size).
BLOCK_BYTES = 65536
#: The bucket the ``moto`` fixture makes.
MOTO_BUCKET = "kvtier-walk"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=BLOCK_BYTES) as s:
        yield s


@pytest.fixture
def client(server: ServerProcess) -> Iterator[kvtier.Client]:
    with kvtier.Client(server.url, connections=4, timeout_s=10) as c:
        yield c


@pytest.fixture
def router_python() -> str:
    """Dynamo's virtualenv's python ($KVTIER_ROUTER_PYTHON, set by make)."""
    python = os.environ.get("KVTIER_ROUTER_PYTHON", "")
    if not python or not os.path.exists(python):
        pytest.fail(
            f"KVTIER_ROUTER_PYTHON={python!r} is not Dynamo's virtualenv's python; "
            "run `make target/py-router/.installed` (pip install ai-dynamo-runtime==1.6.1) and the tests through make"
        )
    return python


def block(seed: int, nbytes: int = BLOCK_BYTES) -> bytes:
    """A block whose bytes depend on `seed` (so a wrong block is caught)."""
    pattern = seed.to_bytes(4, "little") + bytes(range(7, 7 + 60))
    return (pattern * (nbytes // len(pattern) + 1))[:nbytes]


def start_on_same_port(server: ServerProcess, attempts: int = 10) -> None:
    """Restarts `server` on its port; a just-killed server's socket can
    linger for about a second (io_uring), which older servers refuse."""
    for i in range(attempts):
        try:
            server.start()
            return
        except RuntimeError:
            if i == attempts - 1:
                raise
            time.sleep(0.3)


def assert_geometry_error_logged(
    caplog: pytest.LogCaptureFixture, logger: str, store_bytes: int, chunk_bytes: int
) -> None:
    """Asserts that connector `logger` logged, at error level, the block-size
    mismatch found after start: both sizes, the `--block-bytes` that fixes
    it, and that the connector stays off until the engine restarts."""
    errors = [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == logging.ERROR]
    assert any(
        f"{store_bytes} bytes" in m and f"--block-bytes {chunk_bytes}" in m and "until the engine restarts" in m
        for m in errors
    ), errors


def said_over_http(caplog, logger: str = "kvtier") -> list[str]:
    """The messages of ``logger`` (and its children) that mention HTTP,
    after asserting that the fallback to HTTP was said exactly once."""
    said = [r.getMessage() for r in caplog.records if r.name.startswith(logger) and "HTTP" in r.getMessage()]
    assert sum("blocks move over HTTP" in m for m in said) == 1, said
    return said


def server_fds(pid: int) -> int:
    """The server's descriptors of sockets and client memory (its log's
    segment files come and go with the data, not with clients)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(("socket:", "/memfd:", "/dev/shm/"))
    return n


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """Polls ``cond`` every 50 ms until it holds or ``timeout_s`` passes (a
    server's counters settle after the answers a client saw); its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto_server on loopback (target/py-s3) with the bucket
    :data:`MOTO_BUCKET`; its endpoint. The S3 credentials it takes are set
    for this process and the servers it starts."""
    binary = Path(os.environ.get("KVTIER_BIN", "")).resolve().parents[1] / "py-s3/bin/moto_server"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run `make target/py-s3/.installed` and the tests through make")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "kvtier-test",
        "AWS_SECRET_ACCESS_KEY": "kvtier-test",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{MOTO_BUCKET}", method="PUT"), timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not answer within 30 s"
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()
