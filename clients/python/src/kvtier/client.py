"""The blocking kvtier client: a pool of persistent HTTP/1.1 connections.

Why HTTP/1.1 and ``http.client`` (measured by ``make bench-python``, figures
in docs/BENCHMARKS.md): a 16 MiB block is one response whose body Python can
receive straight into the caller's buffer with ``recv_into`` — no framing to
parse and no intermediate ``bytes``. HTTP/2 from Python (``h2``/``httpx``)
frames every 16 KiB–1 MiB in pure Python and copies each frame. Parallelism
comes from the pool: each call takes one connection, and the batched forms
(``put_many``, ``get_many``, ``get_many_into``) run one call per connection
on a thread pool; socket I/O releases the GIL, so threads overlap.

A :class:`Client` is thread-safe. One instance per process is the intended use.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from ._http import _Answer, _Connection, _Pool
from ._session import Regions
from ._unix import LocalBlocks, open_local
from .errors import (
    BlockSizeError,
    GeometryMismatchError,
    KvtierConnectionError,
    KvtierError,
    ServerError,
)
from .keys import check_key
from .mooncake import MooncakeCalls

#: The server's lookup limits (docs/API.md, "Limits"): longer chains are sent
#: in pieces, each under both.
LOOKUP_KEYS_MAX = 4096
LOOKUP_BODY_BYTES_MAX = 1 << 20

# Failures worth a new connection and another try: the server closed a
# keep-alive connection (idle timeout, restart), refused one (starting up),
# or cut a body short. Timeouts are not retried: the server was reached and
# did not answer in time, and trying again would double the wait.
_RETRYABLE = (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine, http.client.IncompleteRead)


def byte_view(buf: Any, *, writable: bool) -> memoryview:
    """A flat byte ``memoryview`` over ``buf`` without copying it.

    Takes anything with the buffer protocol (``bytes``, ``bytearray``,
    ``memoryview``, numpy arrays, ``mmap``) and CPU ``torch.Tensor`` s (through
    their storage address: pinned host tensors included).

    Raises:
        TypeError: ``buf`` has no buffer, is read-only where ``writable`` is
            asked, or is a tensor not on the CPU.
        ValueError: ``buf`` is not contiguous.
    """
    if type(buf).__module__.startswith("torch") and hasattr(buf, "data_ptr"):
        if buf.device.type != "cpu":
            raise TypeError(f"a tensor on {buf.device} has no host memory to read into; use a CPU (pinned) tensor")
        if not buf.is_contiguous():
            raise ValueError("the tensor is not contiguous")
        nbytes = buf.numel() * buf.element_size()
        if nbytes == 0:
            return memoryview(bytearray())
        return memoryview((ctypes.c_ubyte * nbytes).from_address(buf.data_ptr())).cast("B")
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"{type(buf).__name__} has no buffer; pass bytes, bytearray, memoryview or an array") from None
    if writable and view.readonly:
        raise TypeError(f"{type(buf).__name__} is read-only; get_into needs a writable buffer")
    if not view.c_contiguous:
        raise ValueError("the buffer is not contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Client(MooncakeCalls):
    """Blocking client of one kvtier server.

    Args:
        url: ``http://HOST:PORT`` of ``kvtier serve`` (HTTP/1.1 is spoken), or
            ``unix:///PATH`` of its same-host socket (docs/LOCAL.md); its
            hello gives the HTTP address :meth:`stats` uses, or give it as
            ``?http=HOST:PORT``.
        token: bearer token for a server started with ``--auth-token-file``,
            or a tenant's token for one started with ``--tenants`` (the
            client then reads and writes that tenant's keys; docs/OPERATIONS.md,
            "Tenants"); sent in the socket's hello too.
        connections: connections in the pool, and so the most requests in
            flight at once (the batched forms use all of them).
        timeout_s: limit for connecting and for each socket read or write;
            on the socket, also how long a call keeps reconnecting to a
            restarted server before its items fail with ``CONNECTION_LOST``.
        retries: further tries, each on a new connection, after a refused,
            reset or cut-off connection (not after a timeout).
        local: with an HTTP ``url``: ``"off"`` (HTTP only), ``"auto"`` (on
            first use, read ``local.socket`` of ``/v1/stats`` and move blocks
            over that socket if its hello succeeds, else stay on HTTP), or
            ``"on"`` (the socket or an error). :attr:`transport` says which.
        expect_block_bytes, expect_model: the geometry the caller was built
            for; a server with another raises :class:`~kvtier.GeometryMismatchError`.
        staging_blocks: block-sized slots of the socket's staging area, for
            buffers outside every registered one (created on first use).

    Over the socket every method works as over HTTP; :meth:`stats` goes to
    the HTTP address of ``?http=`` or of the server's hello, and
    :meth:`ping` without ``?http=`` asks the socket. The Mooncake-style calls
    (:meth:`register_buffer`, :meth:`batch_get_into`, …) are in
    :class:`kvtier.mooncake.MooncakeCalls`.

    Every method raises :class:`~kvtier.KvtierConnectionError` when the server
    cannot be reached after the retries, and the :class:`~kvtier.KvtierError`
    subclass named in docs/API.md's error table when it refuses a request.
    A miss is never an exception.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8085",
        *,
        token: str | None = None,
        connections: int = 8,
        timeout_s: float = 30.0,
        retries: int = 2,
        local: str = "off",
        expect_block_bytes: int | None = None,
        expect_model: str | None = None,
        staging_blocks: int = 8,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        socket_path, http_host = None, None
        if parts.scheme == "unix":  # unix:///PATH[?http=HOST:PORT], as kvtier-loadgen takes it
            socket_path, _, query = url[len("unix://") :].partition("?")
            if query:
                http = urllib.parse.urlsplit("http://" + query.removeprefix("http="))
                if not query.startswith("http=") or not http.hostname:
                    raise ValueError(f"a unix:// url takes ?http=HOST:PORT only, got {url!r}")
                http_host = (http.hostname, http.port or 80)
        elif parts.scheme == "http" and parts.hostname:
            http_host = (parts.hostname, parts.port or 80)
        if socket_path == "" or (socket_path is None and http_host is None):
            raise ValueError(f"url must be http://HOST:PORT or unix:///PATH[?http=HOST:PORT], got {url!r}")
        if local not in ("off", "auto", "on"):
            raise ValueError(f"local must be 'off', 'auto' or 'on', got {local!r}")
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        self.url = url if socket_path is not None else f"http://{parts.netloc}"
        self.connections = connections
        self.timeout_s = timeout_s
        self.retries = retries
        self._token = token
        self._auth = f"Bearer {token}" if token else None
        self._pool = None if http_host is None else _Pool(*http_host, connections, timeout_s)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._block_bytes: int | None = None
        self._expect = (expect_block_bytes, expect_model, staging_blocks)
        self._local_mode = "on" if socket_path is not None else local
        self._socket_path = socket_path
        self._local: LocalBlocks | None = None
        self._transport: str | None = None if self._local_mode != "off" else "http"
        self._regions = Regions()

    @property
    def transport(self) -> str:
        """``"unix"`` when blocks move over the same-host socket, else
        ``"http"`` (with ``local="auto"``, decided on first use: now)."""
        self._unix()
        return self._transport or "http"

    def _unix(self) -> LocalBlocks | None:
        """The socket transport, or ``None`` for HTTP; makes the choice of
        ``local="auto"``/``"on"`` on first call."""
        if self._transport is None:
            with self._executor_lock:
                if self._transport is None:
                    self._local, self._transport = open_local(self, self._socket_path, self._local_mode, self._expect)
        return self._local

    def _pool_from_hello(self) -> None:
        """For a ``unix://`` url without ``?http=``: the HTTP pool at the
        address the server's hello gives (``http``), if any."""
        address = self.server_info.get("http") if self._socket_path is not None else None
        if isinstance(address, str):
            http = urllib.parse.urlsplit("http://" + address)
            with self._executor_lock:
                if self._pool is None and http.hostname:
                    self._pool = _Pool(http.hostname, http.port or 80, self.connections, self.timeout_s)

    @property
    def server_info(self) -> dict[str, Any]:
        """The socket's hello answer (``epoch``, ``block_bytes``, ``model``,
        ``block_tokens``, ``max_items``, …); empty over HTTP."""
        local = self._unix()
        if local is None:
            return {}
        local.session.connection()
        return dict(local.session.info)

    # ----------------------------------------------------------------- life

    def close(self) -> None:
        """Closes idle connections, the socket and its registrations, and the
        batch thread pool. Calls after it raise."""
        if self._pool is not None:
            self._pool.close()
        if self._local is not None:
            self._local.session.close()
        for region in self._regions.clear():
            region.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def executor(self) -> ThreadPoolExecutor:
        """The thread pool the batched forms (and :class:`~kvtier.AsyncClient`)
        run calls on: one thread per connection, started on first use."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.connections, thread_name_prefix="kvtier")
            return self._executor

    # ------------------------------------------------------------- exchange

    def _exchange(
        self,
        method: str,
        path: str,
        *,
        body: memoryview | None = None,
        json_body: bool = False,
        into: memoryview | None = None,
    ) -> _Answer:
        """One request, retried on a fresh connection after a connection failure."""
        if self._pool is None:
            self._pool_from_hello()
        if self._pool is None:
            raise KvtierError(
                f"{method} {path} needs the HTTP API and the server's hello gave no address; "
                f"give it as {self.url}?http=HOST:PORT",
                code="no_http",
            )
        failure: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.05 * (2 ** (attempt - 1)), 1.0))
            try:
                with self._pool.connection() as conn:
                    return self._once(conn, method, path, body, json_body, into)
            except TimeoutError as e:
                raise KvtierConnectionError(
                    f"{method} {path}: no answer from {self.url} within {self.timeout_s} s", code="timeout"
                ) from e
            except _RETRYABLE as e:
                failure = e
            except OSError as e:  # e.g. no route, name resolution
                failure = e
        raise KvtierConnectionError(
            f"{method} {path}: {self.url} failed {self.retries + 1} times; last: {failure!r}", code="connection_failed"
        ) from failure

    def _once(
        self,
        conn: _Connection,
        method: str,
        path: str,
        body: memoryview | None,
        json_body: bool,
        into: memoryview | None,
    ) -> _Answer:
        conn.putrequest(method, path, skip_accept_encoding=True)
        if self._auth is not None:
            conn.putheader("Authorization", self._auth)
        if body is not None:
            conn.putheader("Content-Length", str(body.nbytes))
            conn.putheader("Content-Type", "application/json" if json_body else "application/octet-stream")
        conn.endheaders()
        if body is not None:
            try:
                conn.send(body)
            except ConnectionError:
                # The server may have answered early (401) and closed: its
                # answer, if it arrived, says more than the broken pipe.
                pass
        resp = conn.getresponse()
        tier = resp.getheader("x-kvtier-tier")
        retry_after = resp.getheader("Retry-After")
        if into is not None and resp.status == 200:
            length = resp.length if resp.length is not None else -1
            if length < 0:
                conn.close()
                raise ServerError(f"GET {path} answered 200 without a Content-Length", status=200, code="no_length")
            if length > into.nbytes:
                conn.close()  # the body stays unread; the connection cannot be reused
                raise BlockSizeError(
                    f"buffer of {into.nbytes} bytes is too small for a block of {length} bytes",
                    status=200,
                    code="buffer_too_small",
                )
            got = 0
            while got < length:
                n = resp.readinto(into[got:length])
                if not n:
                    raise http.client.IncompleteRead(b"", length - got)
                got += n
            return _Answer(200, b"", got, tier, retry_after)
        data = resp.read()
        return _Answer(resp.status, data, len(data), tier, retry_after)

    def _block_path(self, key: str) -> str:
        return "/v1/blocks/" + check_key(key)

    # -------------------------------------------------------------- blocks

    @property
    def block_bytes(self) -> int:
        """The store's block size in bytes (fixed per store; every PUT body
        is exactly this long). Asked of the server once, then remembered."""
        if self._block_bytes is None:
            local = self._unix()
            bb = local.block_bytes if local is not None else int(self.stats()["geometry"]["block_bytes"])
            expect = self._expect[0]
            if expect is not None and bb != expect:
                raise GeometryMismatchError(
                    f"the server at {self.url} has block_bytes {bb}; the client expects {expect}",
                    code="geometry_mismatch",
                )
            self._block_bytes = bb
        return self._block_bytes

    def put(self, key: str, data: Any) -> bool:
        """Stores ``data`` (exactly ``block_bytes`` bytes, any buffer) under ``key``.

        Returns:
            ``True`` when the key was new (201), ``False`` when it replaced a
            stored block (200).

        Raises:
            InvalidKeyError: a bad key (checked before sending).
            BlockSizeError: ``data`` is not ``block_bytes`` long (checked
                before sending).
            DiskFullError: 507, the server's disk is full.
            UnauthorizedError, OverloadedError, ServerError,
            KvtierConnectionError: as for every call.
        """
        if (local := self._unix()) is not None:
            return local.put(key, data)
        path = self._block_path(key)
        view = byte_view(data, writable=False)
        if view.nbytes != self.block_bytes:
            raise BlockSizeError(
                f"block for {key!r} is {view.nbytes} bytes; the store's block_bytes is {self.block_bytes}",
                code="wrong_block_size",
            )
        answer = self._exchange("PUT", path, body=view)
        if answer.status in (200, 201):
            return answer.status == 201
        raise answer.error()

    def get(self, key: str) -> bytes | None:
        """The block stored under ``key``, or ``None`` on a miss (404, which
        includes a block dropped for failing its CRC)."""
        if (local := self._unix()) is not None:
            return local.get(key)
        answer = self._read(key)
        return None if answer is None else answer.body

    def get_into(self, key: str, buf: Any) -> bool:
        """Reads the block under ``key`` straight into ``buf`` (a writable,
        contiguous buffer of at least ``block_bytes``: ``bytearray``,
        ``memoryview``, numpy array, CPU/pinned torch tensor); no
        intermediate ``bytes`` is made.

        Returns:
            ``True`` when the block was read into ``buf[:block_bytes]``,
            ``False`` on a miss. After ``False`` or an exception the buffer's
            contents are unspecified (a cut-off read may have filled part).

        Raises:
            BlockSizeError: ``buf`` is smaller than the block.
            TypeError, ValueError: ``buf`` is read-only or not contiguous.
        """
        if (local := self._unix()) is not None:
            return local.get_into(key, buf)
        return self._read(key, byte_view(buf, writable=True)) is not None

    def exists(self, key: str) -> bool:
        """Whether a block is stored under ``key`` (HEAD; moves nothing)."""
        if (local := self._unix()) is not None:
            return local.exists(key)
        answer = self._exchange("HEAD", self._block_path(key))
        if answer.status in (200, 404):
            return answer.status == 200
        raise answer.error()

    def delete(self, key: str) -> bool:
        """Deletes the block under ``key``: ``True`` if there was one (204),
        ``False`` if not (404). The delete survives a restart."""
        if (local := self._unix()) is not None:
            return local.delete(key)
        answer = self._exchange("DELETE", self._block_path(key))
        if answer.status in (204, 404):
            return answer.status == 204
        raise answer.error()

    def tier_of(self, key: str) -> str | None:
        """Reads ``key`` and answers the tier it was served from (``"ram"``,
        ``"nvme"``, …), or ``None`` on a miss. For tests and diagnostics."""
        if (local := self._unix()) is not None:
            return local.tier_of(key)
        answer = self._read(key)
        return None if answer is None else answer.tier

    def _read(self, key: str, into: memoryview | None = None) -> _Answer | None:
        """One GET: the answer of a hit (its body read into ``into`` when
        given), ``None`` on a miss (404); any other status raises its error."""
        answer = self._exchange("GET", self._block_path(key), into=into)
        if answer.status == 200:
            return answer
        if answer.status == 404:
            return None
        raise answer.error()

    # ------------------------------------------------------ lookup, prefetch

    def _key_batches(self, keys: Sequence[str]) -> Iterator[list[str]]:
        """``keys`` in order, in pieces under the server's lookup limits."""
        batch: list[str] = []
        body_bytes = len('{"keys":[]}')
        for key in keys:
            check_key(key)
            cost = len(key) + 3  # quotes and comma
            if batch and (len(batch) == LOOKUP_KEYS_MAX or body_bytes + cost > LOOKUP_BODY_BYTES_MAX):
                yield batch
                batch, body_bytes = [], len('{"keys":[]}')
            batch.append(key)
            body_bytes += cost
        if batch:
            yield batch

    def _post_keys(self, path: str, keys: list[str], ok: int) -> dict[str, Any]:
        body = memoryview(json.dumps({"keys": keys}, separators=(",", ":")).encode())
        answer = self._exchange("POST", path, body=body, json_body=True)
        if answer.status != ok:
            raise answer.error()
        result: dict[str, Any] = json.loads(answer.body)
        return result

    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """The tier of each leading stored key of the chain ``keys`` (one
        ``POST /v1/lookup`` per 4,096 keys): ``len()`` is the prefix hits."""
        if (local := self._unix()) is not None:
            return local.lookup_tiers(keys)
        tiers: list[str] = []
        for batch in self._key_batches(keys):
            found = self._post_keys("/v1/lookup", batch, 200)["tiers"]
            tiers.extend(found)
            if len(found) < len(batch):
                break
        return tiers

    def lookup(self, keys: Sequence[str]) -> int:
        """Prefix hits: how many leading keys of the chain ``keys`` are stored.
        One round trip for chains of up to 4,096 keys; nothing moves."""
        return len(self.lookup_tiers(keys))

    def prefetch(self, keys: Sequence[str]) -> int:
        """Asks the server to promote the stored ones of ``keys`` into its
        fastest tier ahead of a read (it answers at once and copies in the
        background). Returns how many of ``keys`` are stored."""
        if (local := self._unix()) is not None:
            return local.prefetch(keys)
        return sum(int(self._post_keys("/v1/prefetch", batch, 202)["found"]) for batch in self._key_batches(keys))

    # ------------------------------------------------------- server state

    def stats(self) -> dict[str, Any]:
        """``GET /v1/stats``: geometry, per-tier and per-shard counters,
        latency percentiles (docs/API.md lists the fields).

        Raises:
            KvtierError: ``code`` ``"no_http"`` for a ``unix://`` url without
                ``?http=`` to a server whose hello gives no HTTP address.
        """
        answer = self._exchange("GET", "/v1/stats")
        if answer.status != 200:
            raise answer.error()
        result: dict[str, Any] = json.loads(answer.body)
        return result

    def ping(self) -> bool:
        """``True`` if the server answers ``/healthz`` with 200; ``False`` if it
        answers otherwise or cannot be reached (never raises for that). With
        a ``unix://`` url and no ``?http=``: whether the socket answers."""
        if self._pool is None:
            local = self._unix()
            return local is not None and local.ping()
        try:
            return self._exchange("GET", "/healthz").status == 200
        except KvtierConnectionError:
            return False

    # ------------------------------------------------------------- batches

    def put_many(self, items: Iterable[tuple[str, Any]]) -> list[bool]:
        """:meth:`put` of each ``(key, data)``, in parallel over the pool.
        Returns each put's answer in order. On the first error, puts not yet
        started are skipped and the error is raised once the running ones
        finish (puts before it may have been stored)."""
        if (local := self._unix()) is not None:
            return local.put_many(items)
        return self._map(self.put, list(items))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of each key, in parallel over the pool; ``None`` per miss."""
        if (local := self._unix()) is not None:
            return local.get_many(keys)
        return self._map(self.get, [(key,) for key in keys])

    def _map(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """``fn(*args)`` for every ``args`` in ``calls``, in parallel; results
        in order. The calling thread runs the first call itself (a batch of
        one costs no thread hand-off) while the pool runs the rest. On the
        first failure the calls not yet started are cancelled (a batch against
        a dead server ends at once), the running ones are waited for, and the
        failure is raised."""
        if not calls:
            return []
        futures = [self.executor().submit(fn, *args) for args in calls[1:]]
        try:
            first = fn(*calls[0])
        except BaseException:
            for future in futures:
                future.cancel()
            wait(futures)
            raise
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:
            for future in pending:
                future.cancel()
            wait(pending)
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [first, *(future.result() for future in futures)]

    def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        """:meth:`get_into` of ``keys[i]`` into ``bufs[i]``, in parallel over
        the pool; ``False`` per miss.

        Raises:
            ValueError: ``keys`` and ``bufs`` differ in length.
        """
        if (local := self._unix()) is not None:
            return local.get_many_into(keys, bufs)
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        return self._map(self.get_into, list(zip(keys, bufs, strict=True)))
