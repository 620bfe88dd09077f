"""Start a real ``kvtier serve`` for tests and benchmarks.

    with ServerProcess(block_bytes=65536) as server:
        client = kvtier.Client(server.url)

The binary is ``$KVTIER_BIN``, else ``kvtier`` on ``PATH``. Each server gets
a free loopback port and, unless one is given, a fresh data directory that
is removed when the server is stopped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

#: How long a start may take before it counts as failed (a cold store opens
#: in well under a second; a debug build under load is slower).
START_TIMEOUT_S = 30.0
#: The longest Unix socket path (``sun_path`` less its NUL); the server
#: refuses to start on a longer ``--local-socket``.
SUN_PATH_MAX = 107


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvtier_binary() -> str:
    """Path of the ``kvtier`` binary: ``$KVTIER_BIN`` or ``kvtier`` on ``PATH``.

    Raises:
        FileNotFoundError: neither exists.
    """
    path = os.environ.get("KVTIER_BIN") or shutil.which("kvtier")
    if not path or not os.path.exists(path):
        raise FileNotFoundError("no kvtier binary: set KVTIER_BIN (e.g. target/release/kvtier) or put kvtier on PATH")
    return path


class ServerProcess:
    """One ``kvtier serve`` child process on 127.0.0.1.

    Args:
        block_bytes: the store's block size (``--block-bytes``).
        ram_gb, disk_gb, shards: as the CLI flags.
        data_dir: reuse this directory (kept on stop); default: a new
            temporary one, removed on :meth:`stop`.
        args: further ``kvtier serve`` flags.
        port: listen port; default a free one, kept across restarts.
    """

    def __init__(
        self,
        *,
        block_bytes: int = 65536,
        ram_gb: float = 0.0625,
        disk_gb: float = 0.25,
        shards: int = 2,
        data_dir: str | None = None,
        args: tuple[str, ...] = (),
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvtier-test-")
        # The socket's default, <data_dir>/kvtier.sock, can be too long for a
        # Unix socket path under a deep data directory: then a short one.
        self._socket_dir: str | None = None
        if "--local-socket" not in args and len(os.fsencode(self.data_dir)) + len("/kvtier.sock") > SUN_PATH_MAX:
            self._socket_dir = tempfile.mkdtemp(prefix="kvtier-sock-")
            args = ("--local-socket", os.path.join(self._socket_dir, "kvtier.sock"), *args)
        self.argv = [
            kvtier_binary(),
            "serve",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--data-dir",
            self.data_dir,
            "--block-bytes",
            str(block_bytes),
            "--ram-gb",
            str(ram_gb),
            "--disk-gb",
            str(disk_gb),
            "--shards",
            str(shards),
            "--log-level",
            "warn",
            *args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(self.data_dir) / "server.log" if not self._own_dir else Path(self.data_dir + ".log")

    @property
    def socket_path(self) -> str | None:
        """The same-host socket (docs/LOCAL.md): ``--local-socket`` if given
        (``None`` for ``none``), else ``<data_dir>/kvtier.sock``."""
        if "--local-socket" in self.argv:
            path = self.argv[self.argv.index("--local-socket") + 1]
            return None if path == "none" else path
        return str(Path(self.data_dir) / "kvtier.sock")

    @property
    def unix_url(self) -> str:
        """``unix://`` url of :attr:`socket_path`, for ``kvtier.Client``."""
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        """The running server's process id."""
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        """Starts the server and returns once it prints that it listens.

        Raises:
            RuntimeError: it exited or did not listen within ``START_TIMEOUT_S``;
                the message holds the end of its log.
        """
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log)
        log.close()
        ready = threading.Event()
        assert self.proc.stdout is not None
        stdout = self.proc.stdout

        def watch() -> None:
            for line in stdout:
                if b"kvtier listening on" in line:
                    ready.set()
            stdout.close()

        threading.Thread(target=watch, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.wait(0.02):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log.read_bytes()[-2000:].decode("utf-8", "replace")
                raise RuntimeError(f"kvtier serve did not start ({' '.join(self.argv)}):\n{tail}")
        return self

    def kill(self) -> None:
        """``kill -9`` and wait: what a crash looks like to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (a clean stop: snapshots written) and wait for the exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def stop(self) -> None:
        """Stops the server and removes a data directory it created."""
        self.terminate()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
