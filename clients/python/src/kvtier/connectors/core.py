"""The core every engine connector (lmcache, vllm, sglang) shares.

A connector is :class:`ConnectorCore` plus the engine's translation (keys,
buffers, the engine's interface). The core owns the client and what the
design rule asks of every connector — *a kvtier that is down or slow costs
the engine misses, never an exception or a stalled scheduler*:

- settings: :func:`client_options` and ``down_s``, the same keys and
  defaults for every engine;
- transport: ``local`` (``"auto"``) picks the same-host socket of
  docs/LOCAL.md when the server serves one, else HTTP; the transport used is
  logged once, at info, when first known, and kept in
  :attr:`ConnectorCore.transport`;
- readiness: :meth:`ConnectorCore.start` asks the server once when the engine
  attaches the connector; a server that cannot be reached then is asked again
  at the first call that needs it (:meth:`~ConnectorCore.ready`);
- geometry: the store's ``block_bytes`` must be the engine's chunk size in
  bytes (one chunk is one block, header-free). One behaviour for every
  connector: a mismatch found by :meth:`~ConnectorCore.start` raises
  :class:`GeometryError` naming both sizes, so the engine refuses the
  connector; a mismatch found later (the server was down at start) turns the
  connector off instead: every call is a miss (a failed transfer), an error
  naming both sizes is logged at most once per ``WARN_INTERVAL_S``, and
  nothing is raised into the engine until it is restarted;
- failures: a miss for the engine, a warning for the operator — at most one
  per kind per ``WARN_INTERVAL_S``, with how many were held back — and, after
  a connection failure, ``down_s`` seconds in which calls answer at once
  without trying (:class:`Failures`);
- off the engine's path (``background_probe``, the vLLM connector): whether
  kvtier answers is known, never asked on the calling thread: after a
  failure, and before the first answer, :meth:`~ConnectorCore.ready` answers
  ``False`` at once while one probe thread asks the server (waiting out the
  down window first), so a kvtier that is down, or stopped and accepting
  connections it never answers, costs the engine misses, never a wait;
- the engine's host buffer: :class:`kvtier.connectors.shared_host.SharedHost`
  registers it over the socket, so kvtier copies chunks straight into and
  out of it; when it cannot be registered, chunks are staged (one more
  copy, logged once);
- stats: counters behind one lock (:meth:`~ConnectorCore.count`);
- fan-out: a batch's calls run in parallel over the client's connection pool,
  blocking (:meth:`~ConnectorCore.map`), completing through callbacks
  (:meth:`~ConnectorCore.submit_each`) or awaited (:meth:`~ConnectorCore.gather`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

from ..client import Client
from ..errors import BlockSizeError, KvtierConnectionError, KvtierError

T = TypeVar("T")

#: At most one warning of each kind per this many seconds.
WARN_INTERVAL_S = 10.0

#: Errors of one call that cost the engine a miss rather than an exception:
#: kvtier failed or refused (``KvtierError``), or a buffer kvtier cannot read
#: or fill (``TypeError``, ``ValueError`` from :func:`kvtier.byte_view`).
CALL_ERRORS: tuple[type[Exception], ...] = (KvtierError, TypeError, ValueError)


def client_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~kvtier.Client` arguments of a connector's settings, with
    the defaults every connector documents: ``url``
    (``http://127.0.0.1:8085``), ``token_file`` (read and stripped; none),
    ``connections`` (8), ``timeout_s`` (10), ``retries`` (1), ``local``
    (``"auto"``: the same-host socket when the server serves one and its
    hello succeeds, else HTTP; ``"off"``: HTTP only; ``"on"``: the socket,
    or every call fails).

    Raises:
        OSError: ``token_file`` cannot be read.
        ValueError: a number that does not parse, or ``local`` not
            ``"off"``, ``"auto"`` or ``"on"``.
    """
    local = str(settings.get("local") or "auto")
    if local not in ("off", "auto", "on"):
        raise ValueError(f"local must be 'off', 'auto' or 'on', got {local!r}")
    token_file = settings.get("token_file")
    return {
        "url": str(settings.get("url") or "http://127.0.0.1:8085"),
        "token": Path(str(token_file)).read_text().strip() if token_file else None,
        "connections": int(settings.get("connections", 8)),
        "timeout_s": float(settings.get("timeout_s", 10.0)),
        "retries": int(settings.get("retries", 1)),
        "local": local,
    }


class GeometryError(BlockSizeError):
    """The store's ``block_bytes`` is not the engine's chunk size in bytes: a
    configuration error no retry fixes. The message names both sizes and the
    ``--block-bytes`` to start kvtier with.

    Attributes:
        block_bytes: the store's block size in bytes.
        chunk_bytes: the engine's chunk size in bytes.
    """

    def __init__(self, message: str, *, block_bytes: int, chunk_bytes: int) -> None:
        super().__init__(message, code="geometry_mismatch")
        self.block_bytes = block_bytes
        self.chunk_bytes = chunk_bytes

    def __str__(self) -> str:
        return self.message


class Failures:
    """Rate-limited warnings and the down window of one connector.

    Args:
        logger: where warnings go (the connector's own logger).
        down_s: seconds after a connection failure in which :meth:`down`
            answers ``True``.
    """

    def __init__(self, logger: logging.Logger, down_s: float) -> None:
        self.logger = logger
        self.down_s = down_s
        self._down_until = 0.0
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def down(self) -> bool:
        """Whether a connection failure happened less than ``down_s`` ago."""
        return time.monotonic() < self._down_until

    def open_window(self) -> None:
        """Opens the down window now (``down_s`` seconds of untried misses):
        a connection failure, or kvtier too slow to answer within a deadline."""
        self._down_until = time.monotonic() + self.down_s

    def record(self, kind: str, message: str, error: BaseException) -> None:
        """Warns (rate-limited); a connection failure (other than the
        connector's own "marked down" refusal) opens the down window."""
        if isinstance(error, KvtierConnectionError) and error.code != "server_down":
            self.open_window()
        self.warn(kind, message)

    def warn(self, kind: str, message: str, level: int = logging.WARNING) -> None:
        """Logs ``message`` at ``level`` unless one of ``kind`` was logged less
        than ``WARN_INTERVAL_S`` ago (then it is counted and told with the next)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -WARN_INTERVAL_S) < WARN_INTERVAL_S:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        suffix = f" ({held} more like it since the last one)" if held else ""
        self.logger.log(level, "kvtier %s: %s%s", kind, message, suffix)


class ConnectorCore:
    """The client, readiness, geometry check, failure handling, stats and
    fan-out of one engine connector (module docstring).

    Args:
        settings: the connector's settings: :func:`client_options`'s keys and
            ``down_s`` (seconds, default 1).
        logger: the connector's logger (``kvtier.<engine>``).
        stats: names of the connector's counters; ``errors`` (failed calls)
            is always added.
        outcome: what a failure costs the engine, ending each warning
            (``"answered as a miss"``).
        background_probe: whether :meth:`ready` never waits on the server:
            it answers from what is known and leaves asking to one probe
            thread (module docstring). Off: :meth:`ready` asks the server
            itself when it must (at most one request, ``timeout_s``).

    Raises:
        OSError, ValueError: as :func:`client_options` and
            :class:`~kvtier.Client` (a bad URL or number).

    Attributes:
        client: the blocking client; its pool and threads run every call.
        url: the server's URL.
        down_s: the down window after a connection failure, in seconds.
        failures: the rate-limited warnings and the down window.
        stats: the counters (read them; change them with :meth:`count`).
        chunk_bytes: the engine's chunk size in bytes, once known.
        transport: ``"unix"`` (the same-host socket) or ``"http"``: how the
            client moves blocks, once known (the first time the server
            answers); ``None`` before. Logged once, at info, when known.
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        *,
        logger: logging.Logger,
        stats: Iterable[str],
        outcome: str = "answered as a miss",
        background_probe: bool = False,
    ) -> None:
        options = client_options(settings)
        self.down_s = float(settings.get("down_s", 1.0))
        self.url: str = options["url"]
        # In background mode a call connects once: a socket that is gone
        # fails the call at once and the probe thread asks again.
        self.client = Client(**options, connect_timeout_s=0.0 if background_probe else None)
        self.logger = logger
        self.failures = Failures(logger, self.down_s)
        self.stats: dict[str, int] = dict.fromkeys((*stats, "errors"), 0)
        self.chunk_bytes: int | None = None
        self.transport: str | None = None
        self._outcome = outcome
        self._chunk = ""
        self._remedy = ""
        self._matched = False
        self._mismatch: GeometryError | None = None
        self._lock = threading.Lock()
        self._background = background_probe
        self._up = False  # background mode: the last probe or call reached kvtier
        self._probing: Future[bool] | None = None
        self._probe_pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------ readiness, geometry

    def start(self, chunk_bytes: int | None, chunk: str = "", remedy: str = "") -> None:
        """Sets the engine's chunk size and compares it with the store's
        ``block_bytes`` now, if the server answers (else at the first call
        that needs kvtier, see :meth:`ready`). Called again (SGLang
        re-registering its host pool), it starts over.

        Args:
            chunk_bytes: bytes of one engine chunk, or ``None`` when not known
                (nothing is compared).
            chunk: the chunk in the engine's words, for the error message
                (``"an LMCache chunk here"``).
            remedy: the engine setting that fixes it from the engine's side
                (``"change chunk_size"``).

        Raises:
            GeometryError: the server answers and its ``block_bytes`` is not
                ``chunk_bytes`` (both named). The client is closed first.
        """
        self.chunk_bytes = chunk_bytes
        self._chunk, self._remedy = chunk, remedy
        self._matched, self._mismatch = False, None
        try:
            matched = self._check_geometry(at_start=True)
        except GeometryError:
            self.client.close()
            raise
        if matched:
            self._up = self._check_transport()

    def _check_geometry(self, at_start: bool = False) -> bool:
        """Whether the geometry is known to match (``True`` when there is
        nothing to compare). Asks the server once it answers; a mismatch
        raises at start and turns the connector off later."""
        if self._mismatch is not None:
            self._log_mismatch()
            return False
        if self._matched or self.chunk_bytes is None:
            return True
        if self.failures.down():
            return False
        try:
            block_bytes = self.client.block_bytes
        except KvtierError as e:
            self.failed("start" if at_start else "geometry", e)
            return False
        if block_bytes != self.chunk_bytes:
            error = GeometryError(
                f"kvtier at {self.url} stores blocks of {block_bytes} bytes but {self._chunk} is "
                f"{self.chunk_bytes} bytes: start kvtier with --block-bytes {self.chunk_bytes} on a new data "
                f"directory, or {self._remedy}",
                block_bytes=block_bytes,
                chunk_bytes=self.chunk_bytes,
            )
            if at_start:
                raise error
            self._mismatch = error
            self._log_mismatch()
            return False
        self._matched = True
        return True

    def _log_mismatch(self) -> None:
        """The error log of a mismatch found after start (rate-limited)."""
        message = f"{self._mismatch}; every call is {self._outcome} until the engine restarts"
        self.failures.warn("geometry", message, logging.ERROR)

    def settled(self) -> bool:
        """Whether no copy by kvtier can still land in this process's memory
        for a call given up on (:meth:`kvtier.Client.local_settled`: kvtier
        held still mid-copy finishes that piece when it runs again). Never
        raises: a client that cannot tell (closed) answers ``True``, since
        its connections, and their copies, are gone."""
        try:
            return bool(self.client.local_settled())
        except Exception:  # a closed client: nothing of it is kept open
            return True

    def ready(self) -> bool:
        """Whether to try kvtier now: not in a down window, and the geometry
        matches (checked with one ``GET /v1/stats`` the first time the server
        answers). Never raises; blocks at most one request (``timeout_s``),
        and with ``background_probe`` never blocks: it answers what is known
        and, while kvtier is not known to answer, starts one probe."""
        if not self._background:
            return not self.failures.down() and self._check_geometry() and self._check_transport()
        if self.failures.down():
            return False
        if self._up and self._mismatch is None:
            return True
        self._probe()
        return False

    def mark_down(self, kind: str, message: str) -> None:
        """kvtier did not answer in time (a deadline of the engine's, not a
        connection failure): counted as a failure, the down window opens
        and, with ``background_probe``, only a probe asks it again."""
        self._up = False
        self.count(errors=1)
        self.failures.open_window()
        self.failures.warn(kind, f"{self.url}: {message}; {self._outcome}")

    def _probe(self) -> None:
        """Starts the probe (background mode) unless one is running: the
        blocking readiness check, plus a round trip when the geometry is
        already known, on a thread of its own."""
        with self._lock:
            if self._probing is not None and not self._probing.done():
                return
            if self._probe_pool is None:
                self._probe_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-probe")
            try:
                self._probing = self._probe_pool.submit(self._probe_once)
            except RuntimeError:  # closed
                self._probing = None

    def _probe_once(self) -> bool:
        """One probe: kvtier is up when the geometry and transport checks pass
        and it answers a ping. Never raises (a failure is recorded)."""
        try:
            up = self._check_geometry() and self._check_transport() and self.client.ping()
        except KvtierError as e:
            self.failed("probe", e)
            up = False
        except Exception as e:  # never into the engine
            self.count(errors=1)
            self.logger.warning("kvtier %s: probe failed: %r", self.url, e)
            up = False
        if not up and not self.failures.down():
            self.failures.open_window()  # not asked again before down_s
        self._up = up
        if up:
            self.logger.info("kvtier %s answers; blocks move again", self.url)
        return up

    def _check_transport(self) -> bool:
        """Learns the client's transport (the choice ``local`` asks for is
        made at the client's first call that reaches the server) and logs it
        once. ``False`` (a recorded failure) when ``local="on"`` and the
        socket cannot be used; ``True`` otherwise, even while unknown."""
        if self.transport is not None:
            return True
        try:
            self.client.transport  # noqa: B018 - makes the client choose
        except KvtierError as e:
            self.failed("transport", e)
            return False
        known = self.client._transport  # None: /v1/stats did not answer yet
        if known is None:
            return True
        with self._lock:
            if self.transport is not None:
                return True
            self.transport = known
        if known == "unix":
            socket = self.client.local_stats().get("socket")
            self.logger.info("kvtier %s: blocks move over the same-host socket %s", self.url, socket)
        else:
            self.logger.info("kvtier %s: blocks move over HTTP", self.url)
        return True

    async def ready_async(self) -> bool:
        """:meth:`ready` for an event loop: answers at once once the geometry
        is known, else asks the server on the client's pool."""
        if self.failures.down():
            return False
        known = self._matched or self._mismatch is not None or self.chunk_bytes is None
        if known and self.transport is not None:
            return self._check_geometry()
        return await asyncio.get_running_loop().run_in_executor(self.client.executor(), self.ready)

    def require_ready(self) -> None:
        """Returns if :meth:`ready`, else raises :meth:`not_ready`'s error."""
        if not self.ready():
            raise self.not_ready()

    def not_ready(self) -> KvtierError:
        """Why :meth:`ready` answered ``False`` (asks nothing): the
        :class:`GeometryError` of a mismatch, else a
        :class:`~kvtier.KvtierConnectionError` with ``code`` ``server_down``
        (in a down window, or the server could not be reached; it opens no
        new window)."""
        if self._mismatch is not None:
            return self._mismatch
        return KvtierConnectionError(f"{self.url} is marked down after a failure; not tried", code="server_down")

    # ------------------------------------------------------- failures, stats

    def failed(self, kind: str, error: BaseException) -> None:
        """Counts a failed call (``errors``) and warns, rate-limited per
        ``kind``; a connection failure also opens the down window. A
        :class:`GeometryError` is only counted (it has its own error log)."""
        self.count(errors=1)
        if isinstance(error, KvtierConnectionError) and error.code != "server_down":
            self._up = False
        if not isinstance(error, GeometryError):
            self.failures.record(kind, f"{self.url}: {error}; {self._outcome}", error)

    def count(self, **deltas: int) -> None:
        """Adds ``deltas`` to :attr:`stats` under the lock."""
        with self._lock:
            for name, delta in deltas.items():
                self.stats[name] += delta

    # -------------------------------------------------------------- fan-out

    def call(self, kind: str, fn: Callable[..., T], *args: Any, failed: T) -> T:
        """``fn(*args)`` if :meth:`ready`, else ``failed`` untried; a
        :data:`CALL_ERRORS` error is recorded (:meth:`failed`) and answers
        ``failed``. Never raises those."""
        if not self.ready():
            return failed
        try:
            return fn(*args)
        except CALL_ERRORS as e:
            self.failed(kind, e)
            return failed

    async def call_async(self, kind: str, fn: Callable[..., T], *args: Any, failed: T) -> T:
        """:meth:`call` on the client's pool, awaited (the event loop never
        blocks on kvtier); in a down window ``failed`` at once."""
        if self.failures.down():
            return failed
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.client.executor(), functools.partial(self.call, kind, fn, *args, failed=failed)
        )

    def map(self, kind: str, fn: Callable[..., T], items: Sequence[tuple[Any, ...]], failed: T) -> list[T]:
        """:meth:`call` of ``fn(*item)`` for every item, in parallel over the
        client's pool (one item runs on the calling thread); results in order.
        Not :meth:`ready` (asked once, before any item starts): every item
        answers ``failed`` untried; so do the items after a connection failure."""
        if not items:
            return []
        if not self.ready():
            return [failed] * len(items)
        if len(items) == 1:
            return [self.call(kind, fn, *items[0], failed=failed)]
        pool = self.client.executor()
        futures = [pool.submit(self.call, kind, fn, *item, failed=failed) for item in items]
        return [f.result() for f in futures]

    def submit_each(
        self,
        kind: str,
        fn: Callable[..., T],
        items: Sequence[tuple[Any, ...]],
        done: Callable[[int, T | None, BaseException | None], None],
    ) -> None:
        """Starts ``fn(*items[i])`` for every item on the client's pool and
        returns at once; ``done(i, result, error)`` runs as each finishes (on
        a pool thread; at once with a ``RuntimeError`` when the pool is shut
        down). ``fn`` should call :meth:`require_ready` first. An error is
        recorded before ``done``: a ``KvtierError`` by :meth:`failed`,
        anything else logged with its traceback."""

        def finished(i: int, future: Future[T]) -> None:
            error: BaseException | None = RuntimeError("cancelled") if future.cancelled() else future.exception()
            self._done(kind, i, None if error is not None else future.result(), error, done)

        pool = self.client.executor()
        for i, item in enumerate(items):
            try:
                future = pool.submit(fn, *item)
            except RuntimeError as e:  # the pool is shut down
                self._done(kind, i, None, e, done)
                continue
            future.add_done_callback(lambda f, i=i: finished(i, f))

    def _done(
        self,
        kind: str,
        i: int,
        result: T | None,
        error: BaseException | None,
        done: Callable[[int, T | None, BaseException | None], None],
    ) -> None:
        if isinstance(error, KvtierError):
            self.failed(kind, error)
        elif error is not None:
            self.count(errors=1)
            self.logger.error("kvtier %s: item %d failed", kind, i, exc_info=error)
        done(i, result, error)

    async def gather(self, calls: Iterable[Awaitable[T]]) -> list[T]:
        """Awaits every call concurrently (each runs on the client's pool);
        results in order. Raises the first exception once all have finished."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return cast("list[T]", results)

    def close(self) -> None:
        """Closes the client's connections and threads (calls after it fail)."""
        if self._probe_pool is not None:
            self._probe_pool.shutdown(wait=False)
        self.client.close()
