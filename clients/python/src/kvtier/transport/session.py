"""The client's side of the same-host plane above one connection: connecting
and reconnecting, the buffers it registered, batches with their retries, and
the staging area for memory that is not registered.

Registrations live on a connection (docs/LOCAL.md: the server drops them when
it closes), so every new connection re-registers every buffer, from the
descriptor the client keeps of each, before any batch runs on it; the handle
of a buffer is per connection and never leaves this module (the user's name
for a buffer is its address). A batch whose connection the server closed
is sent once more on a new one; ``OVERLOADED`` is retried after the server's
hint. A batch that timed out is not sent again: the client gives up on its
connection (the server then copies nothing more into or out of the memory
it named, docs/LOCAL.md "When a client gives up"), and retires the staging
area that batch used unless the server's close confirmed it in time.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from .. import codes
from ..errors import GeometryMismatchError, KvtierConnectionError, KvtierError, UnauthorizedError, error_from_code
from ..memory.regions import Region, Staging
from .local import (
    CLIENT_NAME,
    MAX_ITEMS,
    MAX_PAYLOAD_BYTES,
    OP_GET_INTO,
    OP_GET_INTO_V,
    OP_PUT_FROM,
    OP_PUT_FROM_V,
    LocalConnection,
)
from .retry import CONNECT_BACKOFF, OVERLOAD_BACKOFF, OVERLOAD_RETRIES, retrying

log = logging.getLogger("kvtier.local")
T = TypeVar("T")

#: A batch's answer may take this long per GiB moved, on top of ``timeout_s``.
SECONDS_PER_GIB = 10.0


def key_chunks(keys: Sequence[str], idx: Sequence[int], each: int | Callable[[int], int]) -> Iterator[list[int]]:
    """``idx`` in order, in pieces of at most 4,096 items whose payload (u32 n,
    ``each`` bytes per item, or ``each(i)`` for item ``i``, plus its key)
    stays within 1 MiB."""
    chunk: list[int] = []
    nbytes = 4
    for i in idx:
        cost = (each if isinstance(each, int) else each(i)) + len(keys[i].encode())
        if chunk and (len(chunk) == MAX_ITEMS or nbytes + cost > MAX_PAYLOAD_BYTES):
            yield chunk
            chunk, nbytes = [], 4
        chunk.append(i)
        nbytes += cost
    if chunk:
        yield chunk


class LocalSession:
    """The Unix transport of one :class:`kvtier.Client`: one connection at a
    time to ``path``, made on first use and again after it breaks.

    Args:
        path: the server's socket.
        token: sent in the hello (``--auth-token-file``).
        timeout_s: how long to keep trying to connect (and say hello, and
            re-register) before items fail with ``CONNECTION_LOST``; also the
            limit for an answer (plus ``SECONDS_PER_GIB`` per GiB moved).
        connect_timeout_s: how long a call keeps trying to connect
            (default ``timeout_s``); 0: one try.
        expect_block_bytes, expect_model: checked by the server's hello.
        staging_blocks: slots of the staging area (created on first bounce).
    """

    def __init__(
        self,
        path: str,
        *,
        token: str | None,
        timeout_s: float,
        connect_timeout_s: float | None = None,
        expect_block_bytes: int | None = None,
        expect_model: str | None = None,
        staging_blocks: int = 8,
        client_name: str = CLIENT_NAME,
    ) -> None:
        self.path, self.token, self.timeout_s = path, token, timeout_s
        self.connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.expect_block_bytes, self.expect_model = expect_block_bytes, expect_model
        self.staging_blocks, self.client_name = max(1, staging_blocks), client_name
        self.info: dict[str, Any] = {}
        self.epoch: int | None = None
        self.block_bytes: int | None = None
        self._lock = threading.RLock()  # connecting, registering
        self._conn: LocalConnection | None = None
        self._handles: dict[int, int] = {}  # Region.id → handle on self._conn
        self._regions: dict[int, Region] = {}  # every region to register on a connection
        self._staging: Staging | None = None
        self._unsettled: list[LocalConnection] = []  # given up on, the server's close not seen yet
        self._closed = False
        self.counters = dict.fromkeys(
            ("reconnects", "registrations_renewed", "retries_after_loss", "retries_overloaded"), 0
        )
        self.counters.update(bounce_copies=0, bounce_bytes=0, lease_copies=0, lease_bytes=0, staging_retired=0)
        self.counters.update(closes_unconfirmed=0)
        self._count_lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += n

    # ------------------------------------------------------------ connection

    def connection(self) -> tuple[LocalConnection, dict[int, int]]:
        """The live connection and its handles; connects (hello, re-registering
        every buffer) when there is none.

        Raises:
            KvtierConnectionError: not connected within ``timeout_s`` (``local_code`` -21).
            UnauthorizedError, GeometryMismatchError, ProtocolError: refused.
        """
        conn = self._conn
        if conn is not None and conn.alive:
            return conn, self._handles
        with self._lock:
            conn = self._conn
            if conn is not None and conn.alive:
                return conn, self._handles
            if self._closed:
                raise KvtierError("the client is closed", code="client_closed")
            return self._connect(self.connect_timeout_s)

    def probe(self) -> None:
        """Connects and says hello once, without waiting for a server to come up.

        Raises:
            KvtierConnectionError: no server answers on the socket now.
            UnauthorizedError, GeometryMismatchError, ProtocolError: refused.
        """
        with self._lock:
            self._connect(0.0)

    def _connect(self, patience_s: float) -> tuple[LocalConnection, dict[int, int]]:
        """Connects and says hello, again (backing off) while no server
        answers, for ``patience_s`` at most (one try when 0)."""
        deadline = time.monotonic() + patience_s
        connected = False

        def once() -> tuple[LocalConnection, dict[int, int]]:
            nonlocal connected
            connected = False
            left = deadline - time.monotonic()
            try:
                conn = LocalConnection(self.path, timeout_s=self.timeout_s if left <= 0 else min(left, self.timeout_s))
            except PermissionError as e:
                raise KvtierConnectionError(f"{self.path}: {e}", code="permission_denied") from e
            connected = True
            try:
                return conn, self._hello_and_register(conn)
            except BaseException:
                conn.close()
                raise

        def why(e: Exception) -> str | None:
            """What a failure worth another try says; ``None`` for one that is not."""
            if isinstance(e, KvtierError):  # closed under the hello: a server stopping or starting
                return str(e) if connected and e.local_code == codes.CONNECTION_LOST else None
            return repr(e) if not connected and isinstance(e, OSError) else None  # not there yet, refused

        try:
            conn, handles = retrying(
                once, lambda e, retry: None if why(e) is None else CONNECT_BACKOFF.delay(retry), deadline=deadline
            )
        except Exception as e:
            last = why(e)
            if last is None:
                raise
            raise error_from_code(
                codes.CONNECTION_LOST, f"cannot reach {self.path} within {patience_s:g} s; last: {last}"
            ) from None
        if self._conn is not None:
            self.count("reconnects")
            self.count("registrations_renewed", len(handles))
        self._conn, self._handles = conn, handles
        return conn, handles

    def _hello_and_register(self, conn: LocalConnection) -> dict[int, int]:
        expect = self.block_bytes if self.block_bytes is not None else self.expect_block_bytes
        info = conn.hello(token=self.token, block_bytes=expect, model=self.expect_model, client=self.client_name)
        if self.block_bytes is not None and info["block_bytes"] != self.block_bytes:
            raise GeometryMismatchError(
                f"the server at {self.path} now has block_bytes {info['block_bytes']}; "
                f"this client started with {self.block_bytes}",
                code="geometry_mismatch",
            )
        if self.epoch is not None and info["epoch"] != self.epoch:
            log.info("kvtier at %s restarted (epoch %s -> %s)", self.path, self.epoch, info["epoch"])
        self.info, self.epoch, self.block_bytes = info, info["epoch"], int(info["block_bytes"])
        handles: dict[int, int] = {}
        for region in list(self._regions.values()):
            try:
                handles[region.id], region.access = conn.register(region.fd, region.file_offset, region.size)
            except KvtierError as e:
                if e.local_code == codes.CONNECTION_LOST:
                    raise
                log.warning("kvtier: cannot register %#x (%d bytes) again: %s", region.ptr, region.size, e)
        return handles

    def close(self) -> None:
        """Closes the connection and every descriptor it keeps."""
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
            for conn in self._unsettled:
                conn.close()
            self._unsettled.clear()
            for region in self._regions.values():
                region.close()
            self._regions.clear()
            if self._staging is not None:
                self._staging.buf.close()

    # --------------------------------------------------------- registration

    def register(self, region: Region) -> int:
        """Registers ``region`` (its ``fd`` now belongs to the session): 0, or
        the code that refused it (the fd is then closed).

        Raises:
            GeometryMismatchError, UnauthorizedError: a (re)connection was refused.
        """

        def once() -> int:
            conn, handles = self.connection()
            if region.id not in handles:
                handles[region.id], region.access = conn.register(region.fd, region.file_offset, region.size)
            return codes.OK

        def refused(e: KvtierError) -> int:
            log.warning("kvtier: registering %d bytes at %#x failed: %s", region.size, region.ptr, e)
            return e.local_code if e.local_code is not None else codes.IO_ERROR

        def wait(e: Exception, retry: int) -> float | None:
            """A second try, at once, after any failure but the client's
            refusal (configuration); all but a lost connection are logged."""
            if retry > 1 or not isinstance(e, KvtierError) or isinstance(e, (GeometryMismatchError, UnauthorizedError)):
                return None
            if e.local_code != codes.CONNECTION_LOST:
                refused(e)
            return 0.0

        with self._lock:
            self._regions[region.id] = region
            try:
                return retrying(once, wait)
            except (GeometryMismatchError, UnauthorizedError):
                del self._regions[region.id]
                region.close()
                raise
            except KvtierError as e:
                code = refused(e)
            del self._regions[region.id]
            self._handles.pop(region.id, None)
            region.close()
            return code

    def unregister(self, region: Region) -> None:
        """Forgets ``region`` here and on the server, and closes its fd."""
        with self._lock:
            self._regions.pop(region.id, None)
            handle = self._handles.pop(region.id, None)
            conn = self._conn
            if handle is not None and conn is not None and conn.alive:
                try:
                    conn.unregister(handle)
                except KvtierError as e:  # gone with the connection, or already
                    log.debug("kvtier: UNREGISTER %d: %s", handle, e)
            region.close()

    def staging(self) -> Staging:
        """The staging area, registered on first use (and again after one
        was retired)."""
        staging = self._staging
        if staging is None:
            with self._lock:
                staging = self._staging
                if staging is None:
                    self.connection()
                    assert self.block_bytes is not None
                    staging = Staging(self.staging_blocks, self.block_bytes)
                    code = self.register(staging.region)
                    if code != codes.OK:
                        staging.buf.close()
                        raise error_from_code(code, "the client's staging area could not be registered")
                    self._staging = staging
        return staging

    def _retire_staging(self, used: set[int]) -> None:
        """After giving up on a connection whose close the server did not
        confirm: when ``used`` (the ids of the regions its requests named)
        holds the staging area, a copy into it may still be running in the
        server, so later calls get a new one. This one is registered no
        more, and its memory is freed once no call holds it."""
        with self._lock:
            staging = self._staging
            if staging is None or staging.region.id not in used:
                return
            self._staging = None
            self._regions.pop(staging.region.id, None)
            self._handles.pop(staging.region.id, None)
            staging.region.close()
        self.count("staging_retired")
        log.info("kvtier: %s did not confirm the close of a connection given up on; a new staging area", self.path)

    def _linger(self, conn: LocalConnection) -> None:
        """Keeps a connection given up on whose close the server did not
        confirm in time, its reading side open, until that close comes
        (:meth:`settled`)."""
        with self._lock:
            if any(c is conn for c in self._unsettled):
                return
            self._unsettled.append(conn)
        self.count("closes_unconfirmed")

    def settled(self, wait_s: float = 0.0) -> bool:
        """Whether no copy into this client's memory can still land: every
        connection given up on (a timeout) has been closed by the server,
        which closes once nothing it started for that connection runs. A
        server held still (SIGSTOP, a frozen VM) while it copied may finish
        that piece, at most 256 KiB of each copy under way, when it runs
        again (docs/LOCAL.md, "When a client gives up"); until its close
        comes, memory the connection's requests named is not the caller's
        to reuse. Waits up to ``wait_s`` seconds for the closes."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            pending = list(self._unsettled)
        for conn in pending:
            conn.wait_close_confirmed(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._unsettled = [c for c in self._unsettled if not c.close_confirmed]
            return not self._unsettled

    # -------------------------------------------------------------- batches

    def _answer_timeout(self, nbytes: int) -> float:
        return self.timeout_s + SECONDS_PER_GIB * nbytes / (1 << 30)

    def transfer(
        self, op: int, keys: Sequence[str], spans: Sequence[Any], tags: Sequence[bytes] | None = None
    ) -> list[tuple[int, int]]:
        """``GET_INTO``/``PUT_FROM`` of ``keys[i]`` at ``spans[i]`` = ``(region,
        offset in it, length)``, or for ``GET_INTO_V``/``PUT_FROM_V`` at the
        parts ``spans[i]`` = a list of such spans; all chunks in flight at
        once. A put's item ``i`` carries the encoded block tag ``tags[i]``
        (``b""``: none) on a connection of version 2 or later; on an older
        server a tagged item fails with ``UNSUPPORTED_VERSION`` (untagged
        ones are stored). Per item ``(result, tier or created)``; never
        raises for an item. A chunk whose connection the server closed is
        sent once more; ``OVERLOADED`` items are retried. A chunk with no
        answer within the timeout fails ``CONNECTION_LOST`` and is not sent
        again: the client gives up on the connection, and from then on the
        server copies nothing into or out of the spans its requests named
        (docs/LOCAL.md, "When a client gives up").

        Raises:
            GeometryMismatchError, UnauthorizedError, ProtocolError: a
                reconnect was refused (configuration, not an item's fate).
        """
        vectored = op in (OP_GET_INTO_V, OP_PUT_FROM_V)
        parts_of: list[Sequence[tuple[Region, int, int]]] = [s if vectored else (s,) for s in spans]
        out: list[tuple[int, int]] = [(codes.CONNECTION_LOST, 0)] * len(keys)
        todo = list(range(len(keys)))
        lost_left, stalls, pause = 1, 0, 0.0
        while todo:
            if pause:
                time.sleep(pause)
            try:
                conn, handles = self.connection()
            except KvtierError as e:
                if e.local_code != codes.CONNECTION_LOST:
                    raise
                for i in todo:
                    out[i] = (codes.CONNECTION_LOST, 0)
                break
            sendable, rows = [], []
            for i in todo:
                named = [handles.get(region.id) for region, _, _ in parts_of[i]]
                if None in named:  # unregistered meanwhile, or refused on this connection
                    out[i] = (codes.UNKNOWN_HANDLE, 0)
                    continue
                sendable.append(i)
                if vectored:
                    rows.append(([(h, p[1], p[2]) for h, p in zip(named, parts_of[i], strict=True)], keys[i]))
                else:
                    rows.append((named[0], spans[i][1], spans[i][2], keys[i]))
            # The form of a put's items is the connection's (a server
            # restarted meanwhile may speak another version): the native
            # batch sends tags where it carries them, splits the rows into
            # requests within the protocol's limits, sends them all, and
            # waits with the GIL released.
            sent_tags = [tags[i] for i in sendable] if tags is not None else None
            results, retry_after_ms, failures = conn.transfer(op, rows, sent_tags, self.timeout_s, SECONDS_PER_GIB)
            for message in failures:
                log.warning("kvtier: %s", message)
            hint = retry_after_ms / 1000.0
            lost: list[int] = []
            overloaded: list[int] = []
            for i, result in zip(sendable, results, strict=True):
                out[i] = result
                if result[0] == codes.CONNECTION_LOST:
                    lost.append(i)
                elif result[0] == codes.OVERLOADED:
                    overloaded.append(i)
            # A shard admits PUT bytes up to its budget and refuses the rest of
            # a batch item by item (OVERLOADED, with retry_after_ms). While a
            # round stores some, the refused ones go again at once: the budget
            # they met was this batch's own, free again once its answer came.
            # Rounds that store none (others hold the budget) wait the hint,
            # back off and count against OVERLOAD_RETRIES.
            sent, todo, pause = len(todo), [], 0.0
            if conn.gave_up:
                # Given up on (a timeout, here or on another thread): its
                # requests may be under way in the server until it sees the
                # end of the stream, so none goes again into the same memory.
                if not conn.close_confirmed:
                    self._retire_staging({region.id for i in sendable for region, _, _ in parts_of[i]})
                    self._linger(conn)
                lost = []
            if lost and lost_left:
                lost_left -= 1
                self.count("retries_after_loss")
                todo += lost
            if overloaded:
                stalls = 0 if len(overloaded) < sent else stalls + 1
                if stalls <= OVERLOAD_RETRIES:
                    self.count("retries_overloaded")
                    todo += overloaded
                    pause = OVERLOAD_BACKOFF.delay(stalls, hint)
            todo.sort()
        return out

    def keys_call(self, fn: Callable[[LocalConnection], T]) -> T:
        """``fn(connection)``, one request of keys, again once on a new
        connection after it broke and after ``OVERLOADED`` hints.

        Raises:
            KvtierError: the request's error (``local_code`` set).
        """
        lost_left, overloads, connected = 1, 0, False

        def once() -> T:
            nonlocal connected
            connected = False
            conn, _ = self.connection()  # its failure is not retried: it waited timeout_s already
            connected = True
            return fn(conn)

        def wait(e: Exception, _retry: int) -> float | None:
            nonlocal lost_left, overloads
            if not connected or not isinstance(e, KvtierError):
                return None
            if e.local_code == codes.CONNECTION_LOST and lost_left:
                lost_left -= 1
                self.count("retries_after_loss")
                return 0.0
            if e.local_code == codes.OVERLOADED and overloads < OVERLOAD_RETRIES:
                overloads += 1
                self.count("retries_overloaded")
                return OVERLOAD_BACKOFF.delay(overloads, getattr(e, "retry_after_s", None) or 0.0)
            return None

        return retrying(once, wait)

    # ------------------------------------------------------------- bouncing

    def bounce_get(self, keys: Sequence[str], sink: Callable[[int, int, int], None]) -> list[tuple[int, int]]:
        """``GET_INTO`` of ``keys`` through the staging area: for each hit,
        ``sink(i, address, nbytes)`` copies the block out of its slot. Per
        item ``(result, tier)``."""
        return self._bounce(OP_GET_INTO, keys, sink=sink)

    def bounce_put(
        self, keys: Sequence[str], fill: Callable[[int, int], None], tags: Sequence[bytes] | None = None
    ) -> list[tuple[int, int]]:
        """``PUT_FROM`` of ``keys`` (with the encoded block tags ``tags``, if
        given) through the staging area: ``fill(i, address)`` copies item
        i's ``block_bytes`` into its slot first."""
        return self._bounce(OP_PUT_FROM, keys, fill=fill, tags=tags)

    def _bounce(
        self,
        op: int,
        keys: Sequence[str],
        fill: Callable[[int, int], None] | None = None,
        sink: Callable[[int, int, int], None] | None = None,
        tags: Sequence[bytes] | None = None,
    ) -> list[tuple[int, int]]:
        """``op`` over ``keys`` in rounds of as many staging slots as are
        free: ``fill`` each slot before the call, ``sink`` each hit after."""
        out: list[tuple[int, int]] = []
        start = 0
        while start < len(keys):
            staging = self.staging()  # a new one after a round retired it
            bb = staging.slot_bytes
            slots = staging.acquire(len(keys) - start)
            try:
                addresses = [staging.buf.ptr + s * bb for s in slots]
                if fill is not None:
                    for j, address in enumerate(addresses):
                        fill(start + j, address)
                spans = [(staging.region, s * bb, bb) for s in slots]
                end = start + len(slots)
                results = self.transfer(op, keys[start:end], spans, None if tags is None else tags[start:end])
                if sink is not None:
                    for j, (result, _) in enumerate(results):
                        if result > 0:
                            sink(start + j, addresses[j], result)
                out += results
            finally:
                staging.release(slots)
            start += len(slots)
        return out


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` between two addresses of this process."""
    ctypes.memmove(dst, src, nbytes)
