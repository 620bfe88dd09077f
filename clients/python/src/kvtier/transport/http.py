"""The HTTP/1.1 transport of :class:`kvtier.Client` (see client.py for why
HTTP/1.1): :class:`HttpTransport`, the block API and the Mooncake-style item
operations over the keep-alive connections of :mod:`kvtier.transport.http_pool`."""

from __future__ import annotations

import ctypes
import http.client
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from typing import TYPE_CHECKING, Any, Protocol

from .. import codes
from ..errors import (
    BadRequestError,
    BlockSizeError,
    DiskFullError,
    InvalidKeyError,
    InvalidTagError,
    KvtierConnectionError,
    KvtierError,
    LeasesOffError,
    OverloadedError,
    ServerError,
    UnauthorizedError,
)
from ..keys import check_key
from ..memory.regions import Region, Regions
from ..memory.shm import byte_view
from ..tag import BlockTag, tags_for
from .base import Parts, Span, Threads, Transport, check_block_bytes
from .http_pool import _Answer, _Connection, _Pool
from .local import OP_GET_INTO, OP_GET_INTO_V
from .retry import HTTP_BACKOFF, retrying

if TYPE_CHECKING:
    from ..memory.leases import Leases

#: The server's lookup limits (docs/API.md, "Limits"): longer chains are sent
#: in pieces, each under both.
LOOKUP_KEYS_MAX = 4096
LOOKUP_BODY_BYTES_MAX = 1 << 20

# Failures worth a new connection and another try: the server closed a
# keep-alive connection (idle timeout, restart), refused one (starting up),
# or cut a body short. Timeouts are not retried: the server was reached and
# did not answer in time, and trying again would double the wait.
_RETRYABLE = (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine, http.client.IncompleteRead)


def code_of(e: BaseException) -> int:
    """The :mod:`kvtier.codes` code of an exception of the HTTP block API."""
    if e.__class__ is KvtierError or not isinstance(e, KvtierError):
        return codes.BAD_BUFFER if isinstance(e, (TypeError, ValueError)) else codes.IO_ERROR
    if e.local_code is not None:
        return e.local_code
    for cls, code in (
        (InvalidKeyError, codes.INVALID_KEY),
        (InvalidTagError, codes.INVALID_TAG),
        (BlockSizeError, codes.WRONG_SIZE),
        (DiskFullError, codes.DISK_FULL),
        (UnauthorizedError, codes.UNAUTHORIZED),
        (KvtierConnectionError, codes.CONNECTION_LOST),
        (BadRequestError, codes.BAD_REQUEST),
    ):
        if isinstance(e, cls):
            return code
    if isinstance(e, OverloadedError):
        return codes.SHUTTING_DOWN if e.code == "shutting_down" else codes.OVERLOADED
    return codes.IO_ERROR


class Blocks(Protocol):
    """What :func:`get_code` and :func:`put_code` call: a
    :class:`kvtier.Client` or a transport."""

    @property
    def block_bytes(self) -> int:
        """The store's block size."""
        ...

    def get_into(self, key: str, buf: Any) -> bool:
        """Reads a block into ``buf``: ``False`` on a miss."""
        ...

    def put(self, key: str, data: Any, tag: BlockTag | None = None) -> bool:
        """Stores a block (with its block tag, if any)."""
        ...


def get_code(blocks: Blocks, key: str, view: memoryview) -> int:
    """``get_into`` of one item as a buffer call answers it: ``block_bytes``,
    -2 on a miss, -4 for a view smaller than a block; raises any other failure."""
    bb = blocks.block_bytes
    if view.nbytes < bb:
        return codes.WRONG_SIZE
    return bb if blocks.get_into(key, view) else codes.NOT_FOUND


def put_code(blocks: Blocks, key: str, view: memoryview, tag: BlockTag | None = None) -> int:
    """``put`` of one item (with its block tag, if any) as a buffer call
    answers it: 0, or -4 for a view not a block long; raises any other failure."""
    if view.nbytes != blocks.block_bytes:
        return codes.WRONG_SIZE
    blocks.put(key, view, tag=tag)
    return codes.OK


class HttpTransport(Transport):
    """:class:`~kvtier.transport.base.Transport` over a pool of keep-alive
    HTTP/1.1 connections: one call per connection, the batched forms one
    call per connection on ``threads`` (socket I/O releases the GIL).

    Args:
        url: the client's url, as errors name it.
        host: ``(host, port)`` of the HTTP API, or ``None`` to ask
            ``hello_address`` on first use (a ``unix://`` url without ``?http=``).
        token: the bearer token, if any.
        connections, timeout_s, retries: as :class:`kvtier.Client` takes them.
        threads: the client's batch threads.
        regions: the client's registered buffers (which raw pointers may name).
        expect_block_bytes: the block size the client was built for, if given.
        hello_address: ``HOST:PORT`` of the HTTP API the socket's hello gave, if any.
    """

    name = "http"

    def __init__(
        self,
        url: str,
        host: tuple[str, int] | None,
        *,
        token: str | None,
        connections: int,
        timeout_s: float,
        retries: int,
        threads: Threads,
        regions: Regions,
        expect_block_bytes: int | None,
        hello_address: Callable[[], object],
    ) -> None:
        self.url, self.timeout_s, self.retries, self._connections = url, timeout_s, retries, connections
        self._auth = f"Bearer {token}" if token else None
        self._pool = None if host is None else _Pool(*host, connections, timeout_s)
        self._pool_lock = threading.Lock()
        self._threads, self._regions = threads, regions
        self._expect = expect_block_bytes
        self._hello_address = hello_address
        self._block_bytes: int | None = None

    @property
    def has_pool(self) -> bool:
        """Whether the HTTP API's address is known (a pool to send on)."""
        return self._pool is not None

    def close(self) -> None:
        """Closes idle connections; calls after it raise."""
        if self._pool is not None:
            self._pool.close()

    # ------------------------------------------------------------- exchange

    def _pool_for(self, method: str, path: str) -> _Pool:
        """The pool; for a ``unix://`` url without ``?http=``, made at the
        address the server's hello gives (``http``), if any."""
        if self._pool is None:
            address = self._hello_address()
            if isinstance(address, str):
                http = urllib.parse.urlsplit("http://" + address)
                with self._pool_lock:
                    if self._pool is None and http.hostname:
                        self._pool = _Pool(http.hostname, http.port or 80, self._connections, self.timeout_s)
        if self._pool is None:
            raise KvtierError(
                f"{method} {path} needs the HTTP API and the server's hello gave no address; "
                f"give it as {self.url}?http=HOST:PORT",
                code="no_http",
            )
        return self._pool

    def exchange(
        self,
        method: str,
        path: str,
        *,
        body: memoryview | None = None,
        json_body: bool = False,
        into: memoryview | None = None,
        headers: dict[str, str] | None = None,
    ) -> _Answer:
        """One request (with ``headers`` added), retried on a fresh
        connection after a connection failure."""
        pool = self._pool_for(method, path)

        def once() -> _Answer:
            with pool.connection() as conn:
                return self._once(conn, method, path, body, json_body, into, headers)

        def wait_before(e: Exception, retry: int) -> float | None:
            if retry > self.retries or isinstance(e, TimeoutError) or not isinstance(e, (*_RETRYABLE, OSError)):
                return None
            return HTTP_BACKOFF.delay(retry)

        try:
            return retrying(once, wait_before)
        except TimeoutError as e:
            raise KvtierConnectionError(
                f"{method} {path}: no answer from {self.url} within {self.timeout_s} s", code="timeout"
            ) from e
        except (*_RETRYABLE, OSError) as e:  # OSError: e.g. no route, name resolution
            raise KvtierConnectionError(
                f"{method} {path}: {self.url} failed {self.retries + 1} times; last: {e!r}", code="connection_failed"
            ) from e

    def _once(
        self,
        conn: _Connection,
        method: str,
        path: str,
        body: memoryview | None,
        json_body: bool,
        into: memoryview | None,
        headers: dict[str, str] | None = None,
    ) -> _Answer:
        conn.putrequest(method, path, skip_accept_encoding=True)
        if self._auth is not None:
            conn.putheader("Authorization", self._auth)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
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

    # -------------------------------------------------------------- blocks

    @property
    def block_bytes(self) -> int:
        """``geometry.block_bytes`` of ``/v1/stats``, asked once and checked
        against the block size the client expects."""
        if self._block_bytes is None:
            bb = int(self.stats()["geometry"]["block_bytes"])
            self._block_bytes = check_block_bytes(self.url, bb, self._expect)
        return self._block_bytes

    def _block_path(self, key: str) -> str:
        return "/v1/blocks/" + check_key(key)

    def put(self, key: str, data: Any, tag: BlockTag | None = None) -> bool:
        """``PUT /v1/blocks/KEY``, with ``tag``'s ``x-kvtier-*`` headers when
        given (checked first): ``True`` when the key was new (201)."""
        path = self._block_path(key)
        headers = None if tag is None else tag.headers()
        view = byte_view(data, writable=False)
        if view.nbytes != self.block_bytes:
            raise BlockSizeError(
                f"block for {key!r} is {view.nbytes} bytes; the store's block_bytes is {self.block_bytes}",
                code="wrong_block_size",
            )
        answer = self.exchange("PUT", path, body=view, headers=headers)
        if answer.status in (200, 201):
            return answer.status == 201
        raise answer.error()

    def get(self, key: str) -> bytes | None:
        """``GET``: the body, ``None`` on a miss."""
        answer = self._read(key)
        return None if answer is None else answer.body

    def get_into(self, key: str, buf: Any) -> bool:
        """``GET`` with the body read straight into ``buf``."""
        return self._read(key, byte_view(buf, writable=True)) is not None

    def exists(self, key: str) -> bool:
        """``HEAD``: moves nothing."""
        answer = self.exchange("HEAD", self._block_path(key))
        if answer.status in (200, 404):
            return answer.status == 200
        raise answer.error()

    def delete(self, key: str) -> bool:
        """``DELETE``: ``True`` if there was a block (204)."""
        answer = self.exchange("DELETE", self._block_path(key))
        if answer.status in (204, 404):
            return answer.status == 204
        raise answer.error()

    def tier_of(self, key: str) -> str | None:
        """``GET``: the tier its ``x-kvtier-tier`` names, ``None`` on a miss."""
        answer = self._read(key)
        return None if answer is None else answer.tier

    def _read(self, key: str, into: memoryview | None = None) -> _Answer | None:
        """One GET: the answer of a hit (its body read into ``into`` when
        given), ``None`` on a miss (404); any other status raises its error."""
        answer = self.exchange("GET", self._block_path(key), into=into)
        if answer.status == 200:
            return answer
        if answer.status == 404:
            return None
        raise answer.error()

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
        answer = self.exchange("POST", path, body=body, json_body=True)
        if answer.status != ok:
            raise answer.error()
        result: dict[str, Any] = json.loads(answer.body)
        return result

    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """``POST /v1/lookup`` per 4,096 keys, stopping at the first miss."""
        tiers: list[str] = []
        for batch in self._key_batches(keys):
            found = self._post_keys("/v1/lookup", batch, 200)["tiers"]
            tiers.extend(found)
            if len(found) < len(batch):
                break
        return tiers

    def prefetch(self, keys: Sequence[str]) -> int:
        """``POST /v1/prefetch`` per 4,096 keys: how many are stored."""
        return sum(int(self._post_keys("/v1/prefetch", batch, 202)["found"]) for batch in self._key_batches(keys))

    def stats(self) -> dict[str, Any]:
        """``GET /v1/stats``."""
        answer = self.exchange("GET", "/v1/stats")
        if answer.status != 200:
            raise answer.error()
        result: dict[str, Any] = json.loads(answer.body)
        return result

    def ping(self) -> bool:
        """Whether ``/healthz`` answers 200 (``False`` when unreachable)."""
        try:
            return self.exchange("GET", "/healthz").status == 200
        except KvtierConnectionError:
            return False

    def lease(self, keys: Sequence[str]) -> Leases:
        """Refused: a lease maps the server's memory, which only a process on
        its host reaches, through the same-host socket.

        Raises:
            LeasesOffError: always (``code`` ``"leases_need_socket"``).
        """
        raise self._no_leases()

    def pin_arenas(self, device: int) -> int:
        """Refused, as :meth:`lease` is: the arenas are mapped through the
        same-host socket.

        Raises:
            LeasesOffError: always (``code`` ``"leases_need_socket"``).
        """
        raise self._no_leases()

    def _no_leases(self) -> LeasesOffError:
        return LeasesOffError(
            f"leases exist only on kvtier's same-host socket (docs/LOCAL.md, Leases); this client talks HTTP "
            f"to {self.url}: use Client('unix:///…/kvtier.sock') or Client(url, local='on'), or read with get_into",
            code="leases_need_socket",
        )

    # ------------------------------------------------------------- batches

    def put_many(self, items: Iterable[tuple[str, Any]], tags: Sequence[BlockTag | None] | None = None) -> list[bool]:
        """:meth:`put` of each item (with ``tags[i]``), in parallel over the pool."""
        pairs = list(items)
        return self._map(self.put, [(*pair, tag) for pair, tag in zip(pairs, tags_for(tags, len(pairs)), strict=True)])

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of each key, in parallel over the pool."""
        return self._map(self.get, [(key,) for key in keys])

    def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        """:meth:`get_into` of each key, in parallel over the pool."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        return self._map(self.get_into, list(zip(keys, bufs, strict=True)))

    def _map(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """``fn(*args)`` for every ``args`` in ``calls``, in parallel; results
        in order. The calling thread runs the first call itself (a batch of
        one costs no thread hand-off) while the pool runs the rest. On the
        first failure the calls not yet started are cancelled (a batch against
        a dead server ends at once), the running ones are waited for, and the
        failure is raised."""
        if not calls:
            return []
        futures = [self._threads.pool().submit(fn, *args) for args in calls[1:]]
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

    # -------------------------------------------------- Mooncake's buffers

    def share(self, ptr: int, nbytes: int, obj: Any) -> Region | int:
        """A region only recorded here: HTTP copies through the client."""
        return Region(ptr, nbytes, obj=obj)

    def register(self, region: Region) -> int:
        """Nothing to tell the server: 0."""
        return codes.OK

    def unregister(self, region: Region) -> None:
        """Nothing to tell the server."""

    def move(
        self, op: int, keys: Sequence[str], spans: Sequence[Span], tags: Sequence[BlockTag | None] | None = None
    ) -> list[int]:
        """A GET or PUT (with its tag's headers) per item on the pool's
        threads, each through a view of the item's memory."""
        tag_list = tags_for(tags, len(keys))

        def one(i: int) -> int:
            span = spans[i]
            if isinstance(span, int):
                return span
            ptr, size, is_obj = span
            if not is_obj:
                region = self._regions.find(ptr)
                if region is None:
                    return codes.NOT_REGISTERED
                if ptr + size > region.end:
                    return codes.OUT_OF_BOUNDS
            try:
                view = memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B") if size else memoryview(b"")
                if op == OP_GET_INTO:
                    return get_code(self, keys[i], view)
                return put_code(self, keys[i], view, tag_list[i])
            except Exception as e:
                return code_of(e)

        return list(self._threads.pool().map(one, range(len(keys))))

    def move_parts(
        self, op: int, keys: Sequence[str], parts: Sequence[Parts], tags: Sequence[BlockTag | None] | None = None
    ) -> list[int]:
        """A GET or PUT (with its tag's headers) per item through a
        block-sized buffer of its own, scattered to (gathered from) its parts here."""
        get = op == OP_GET_INTO_V
        bb = self.block_bytes
        tag_list = tags_for(tags, len(keys))

        def one(i: int) -> int:
            spans = [(r.ptr + at, n) for r, at, n in parts[i]]
            block = bytearray(bb)
            try:
                if get:
                    if not self.get_into(keys[i], block):
                        return codes.NOT_FOUND
                    at = 0
                    for ptr, n in spans:
                        n = min(n, bb - at)
                        if n <= 0:
                            break
                        ctypes.memmove(ptr, (ctypes.c_char * n).from_buffer(block, at), n)
                        at += n
                    return bb
                at = 0
                for ptr, n in spans:
                    ctypes.memmove((ctypes.c_char * n).from_buffer(block, at), ptr, n)
                    at += n
                self.put(keys[i], block, tag_list[i])
                return codes.OK
            except Exception as e:
                return code_of(e)

        return list(self._threads.pool().map(one, range(len(keys))))

    def exist_codes(self, keys: Sequence[str]) -> list[int]:
        """A HEAD per key on the pool's threads."""

        def one(key: str) -> int:
            try:
                return 1 if self.exists(key) else 0
            except Exception:
                return -1

        return list(self._threads.pool().map(one, keys))

    def plane(self) -> tuple[str | None, int | None, dict[str, int]]:
        """No socket, no epoch, nothing bounced."""
        return (
            None,
            None,
            {
                "bounce_copies": 0,
                "bounce_bytes": 0,
                "lease_copies": 0,
                "lease_bytes": 0,
                "reconnects": 0,
                "arenas_mapped": 0,
                "index_probes": 0,
            },
        )


__all__ = [
    "LOOKUP_BODY_BYTES_MAX",
    "LOOKUP_KEYS_MAX",
    "Blocks",
    "HttpTransport",
    "code_of",
    "get_code",
    "put_code",
]
