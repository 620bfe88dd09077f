"""The same-host data plane's wire protocol (docs/LOCAL.md): one connection.

:class:`LocalConnection` is one Unix-socket connection to ``kvtier serve``:
16-byte frames, a request id per request, and a reader thread that hands
each response to the request that waits for it, so any number of threads (up
to 256 requests in flight, the server's limit) share one connection. It
knows nothing of reconnecting or of the caller's memory; that is
``kvtier._session`` (what :class:`kvtier.Client` uses). Tests and tools use
this class directly to speak the protocol op by op.

    conn = LocalConnection("/var/lib/kvtier/kvtier.sock")
    info = conn.hello(block_bytes=16 << 20)     # the server's geometry and epoch
    handle, access = conn.register(fd, 0, 64 << 20)
    conn.get_into([(handle, 0, 16 << 20, "key-0")])   # [(16777216, 2)]: bytes, tier

Every op raises the :mod:`kvtier.errors` class of a request-wide failure (its
``local_code`` is the negative code) and :class:`~kvtier.KvtierConnectionError`
(``local_code`` -21) when the connection is gone; per-item results are codes.

Descriptors come both ways. A ``REGISTER`` request carries one in
``SCM_RIGHTS``; a ``MAP_ARENA`` answer (version 3, docs/LOCAL.md "Leases")
brings one, sent with the answer's first byte. The reader thread reads with
``recvmsg_into`` and room for one descriptor, and since it never reads past
the end of the frame it is reading, a descriptor it receives belongs to that
frame: it goes with a ``MAP_ARENA`` answer to its caller
(:meth:`LocalConnection.map_arena`) and is closed with any other frame.

The bytes themselves are made and read by the pure functions of
:mod:`kvtier._frames`, re-exported here (:func:`encode_frame`,
:func:`decode_header`, :func:`decode_response`, and an
``encode_*``/``decode_*`` pair per payload), which the connection uses and
``tests/test_local_vectors.py`` checks against the frames the Rust crate
``kvtier-local-proto`` (the server's) encodes: ``tests/data/local_frame_vectors.json``.
"""

from __future__ import annotations

import array
import itertools
import logging
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from . import codes
from ._frames import _FD_ROOM, _bad_answer, _close_fds
from ._frames import ARENA as ARENA
from ._frames import CLIENT_NAME as CLIENT_NAME
from ._frames import HEADER as HEADER
from ._frames import LEASE_ITEM as LEASE_ITEM
from ._frames import MAGIC as MAGIC
from ._frames import MAX_IN_FLIGHT as MAX_IN_FLIGHT
from ._frames import MAX_ITEMS as MAX_ITEMS
from ._frames import MAX_PARTS as MAX_PARTS
from ._frames import MAX_PAYLOAD_BYTES as MAX_PAYLOAD_BYTES
from ._frames import OP_DELETE as OP_DELETE
from ._frames import OP_ERROR as OP_ERROR
from ._frames import OP_EXISTS as OP_EXISTS
from ._frames import OP_GET_INTO as OP_GET_INTO
from ._frames import OP_GET_INTO_V as OP_GET_INTO_V
from ._frames import OP_HELLO as OP_HELLO
from ._frames import OP_LEASE as OP_LEASE
from ._frames import OP_LOOKUP as OP_LOOKUP
from ._frames import OP_MAP_ARENA as OP_MAP_ARENA
from ._frames import OP_MAP_INDEX as OP_MAP_INDEX
from ._frames import OP_NAMES as OP_NAMES
from ._frames import OP_PREFETCH as OP_PREFETCH
from ._frames import OP_PUT_FROM as OP_PUT_FROM
from ._frames import OP_PUT_FROM_V as OP_PUT_FROM_V
from ._frames import OP_REGISTER as OP_REGISTER
from ._frames import OP_RELEASE as OP_RELEASE
from ._frames import OP_UNREGISTER as OP_UNREGISTER
from ._frames import RESPONSE as RESPONSE
from ._frames import VERSION_LEASES as VERSION_LEASES
from ._frames import VERSION_TAGS as VERSION_TAGS
from ._frames import VERSIONS as VERSIONS
from ._frames import Bytes as Bytes
from ._frames import decode_arena as decode_arena
from ._frames import decode_connection_error as decode_connection_error
from ._frames import decode_deleted as decode_deleted
from ._frames import decode_header as decode_header
from ._frames import decode_hello as decode_hello
from ._frames import decode_index as decode_index
from ._frames import decode_leases as decode_leases
from ._frames import decode_lookup as decode_lookup
from ._frames import decode_prefetched as decode_prefetched
from ._frames import decode_registered as decode_registered
from ._frames import decode_released as decode_released
from ._frames import decode_response as decode_response
from ._frames import decode_results as decode_results
from ._frames import decode_tiers as decode_tiers
from ._frames import encode_frame as encode_frame
from ._frames import encode_hello as encode_hello
from ._frames import encode_keys as encode_keys
from ._frames import encode_map_arena as encode_map_arena
from ._frames import encode_register as encode_register
from ._frames import encode_release as encode_release
from ._frames import encode_unregister as encode_unregister
from ._items import ITEM_BYTES as ITEM_BYTES
from ._items import PART_BYTES as PART_BYTES
from ._items import Item as Item
from ._items import Part as Part
from ._items import TaggedItem as TaggedItem
from ._items import encode_batch as encode_batch
from ._items import encode_items as encode_items
from ._items import encode_items_v as encode_items_v
from ._items import encode_tagged_items as encode_tagged_items
from ._items import encode_tagged_items_v as encode_tagged_items_v
from .errors import ProtocolError, error_from_code

log = logging.getLogger("kvtier.local")

T = TypeVar("T")

#: After giving up on a connection (a request timed out), how long the
#: client waits for the server's close, which confirms that no copy into or
#: out of the client's memory runs any more (docs/LOCAL.md, "When a client
#: gives up").
CLOSE_CONFIRM_S = 0.25


class _Response:
    __slots__ = ("fds", "op", "payload")

    def __init__(self, op: int, payload: bytearray, fds: list[int]) -> None:
        self.op, self.payload, self.fds = op, payload, fds


class LocalConnection:
    """One connection to a kvtier Unix socket (docs/LOCAL.md). Thread-safe.

    Args:
        path: the socket's path (``local.socket`` of ``/v1/stats``).
        timeout_s: limit for connecting and, unless a call names another,
            for each response. A request that times out gives up on the
            connection (:meth:`abandon`: its registrations go with it, and
            the server copies nothing more into or out of their memory).

    Raises:
        OSError: the socket cannot be connected (``FileNotFoundError``,
            ``ConnectionRefusedError``, ``PermissionError``, …).
    """

    def __init__(self, path: str, *, timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[_Response]] = {}
        self._ids = itertools.count(1)
        self._slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._dead: tuple[int, str] | None = None
        self._eof = False
        self.gave_up = False
        """``True`` once the client gave up on this connection (a request
        timed out): what it sent may still have been under way in the server."""
        self.close_confirmed = False
        """After :meth:`abandon`: whether the server's close came (within
        ``CLOSE_CONFIRM_S``): no copy into or out of this client's memory runs
        in the server any more, nor will, for anything sent here."""
        self.info: dict[str, Any] = {}
        """The server's hello answer (after :meth:`hello`): ``epoch``, ``block_bytes``, …"""
        # Lease ids to release, queued by finalizers (SimpleQueue.put is
        # reentrant) and sent by a thread of their own, started with the
        # first lease: a finalizer may run on any thread, the reader's or one
        # holding this connection's locks, so it must neither send nor wait.
        self._releases: queue.SimpleQueue[list[int] | None] = queue.SimpleQueue()
        self._releaser: threading.Thread | None = None
        self._reader = threading.Thread(target=self._read_loop, name="kvtier-local-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ framing

    @property
    def alive(self) -> bool:
        """``False`` once the connection broke or was closed."""
        return self._dead is None

    def peer_pid(self) -> int:
        """The server's pid as this process sees it (``SO_PEERCRED``); 0 when
        the server runs in a pid namespace this process cannot see into."""
        pid, _uid, _gid = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return int(pid)

    def close(self, reason: str = "the client closed the connection") -> None:
        """Closes the socket; requests in flight fail with ``CONNECTION_LOST``."""
        self._die(codes.CONNECTION_LOST, reason)

    def abandon(self, reason: str) -> None:
        """Gives up on the connection (a request timed out): the requests in
        flight fail with ``CONNECTION_LOST``, and the writing side is shut
        down at once, which the server takes as the client giving up: from
        then on it copies nothing into or out of this client's memory for
        them (docs/LOCAL.md, "When a client gives up"), ends them, and
        closes. Waits up to ``CLOSE_CONFIRM_S`` for that close;
        :attr:`close_confirmed` says whether it came. Never raises."""
        self.gave_up = True
        self._fail_pending(codes.CONNECTION_LOST, reason)
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if threading.current_thread() is not self._reader:
            self._reader.join(CLOSE_CONFIRM_S)
        self.close_confirmed = self._eof
        self._die(codes.CONNECTION_LOST, reason)

    def _fail_pending(self, code: int, message: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = (code, message)
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            self._slots.release()
            fut.set_exception(error_from_code(*self._dead))

    def _die(self, code: int, message: str) -> None:
        self._fail_pending(code, message)
        self._releases.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is self._reader:
            self._sock.close()

    def _recv_exact(self, n: int, fds: list[int]) -> bytearray | None:
        """``n`` bytes, or ``None`` at the end of the stream; descriptors that
        come with them (``SCM_RIGHTS``, close-on-exec) are added to ``fds``."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k, ancillary, flags, _ = self._sock.recvmsg_into([view[got:]], _FD_ROOM, socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
            if flags & socket.MSG_CTRUNC:  # the kernel closed what did not fit
                log.warning("kvtier: %s sent more than one descriptor with a frame; the others were closed", self.path)
            if k == 0:
                if got:
                    raise ConnectionError(f"the connection ended {got} bytes into a {n}-byte read")
                return None
            got += k
        return buf

    def _read_loop(self) -> None:
        code, message = codes.CONNECTION_LOST, "the server closed the connection"
        # Every read stops at the end of the frame it reads, so descriptors
        # received while reading a frame came with that frame.
        fds: list[int] = []
        try:
            while True:
                head = self._recv_exact(HEADER.size, fds)
                if head is None:
                    self._eof = True  # the server closed, at a frame's end
                    break
                try:
                    op, nbytes, rid = decode_header(head)
                except ProtocolError as e:
                    code, message = codes.BAD_FRAME, f"the server sent {e.message}"
                    break
                payload = self._recv_exact(nbytes, fds) if nbytes else bytearray()
                if payload is None:
                    message = "the server closed the connection inside a frame"
                    break
                if op == OP_ERROR:
                    code, text = decode_connection_error(payload)
                    message = f"the server closed the connection with {codes.name_of(code)}: {text}"
                    break
                with self._lock:
                    fut = self._pending.pop(rid, None)
                mine, fds = fds, []
                if mine and (fut is None or op not in (OP_MAP_ARENA | RESPONSE, OP_MAP_INDEX | RESPONSE)):
                    if fut is not None:
                        log.warning("kvtier: %s sent a descriptor with a %#x frame; closed", self.path, op)
                    _close_fds(mine)  # None: an answer nobody waits for (timed out, or posted)
                    mine = []
                if fut is not None:
                    self._slots.release()
                    fut.set_result(_Response(op, payload, mine))
        except OSError as e:
            message = f"the connection to {self.path} broke: {e}"
        finally:
            _close_fds(fds)
            self._die(code, message)

    def request(self, op: int, payload: bytes, *, fd: int | None = None) -> Future[_Response]:
        """Sends one request frame (with ``fd`` in ``SCM_RIGHTS``, in the same
        ``sendmsg``) and returns the future of its response; :meth:`wait` it."""
        self._slots.acquire()
        with self._lock:
            if self._dead is not None:
                self._slots.release()
                raise error_from_code(*self._dead)
            rid = next(self._ids)
            fut: Future[_Response] = Future()
            self._pending[rid] = fut
        frame = encode_frame(op, rid, payload)
        try:
            with self._send_lock:
                if fd is None:
                    self._sock.sendall(frame)
                else:
                    sent = socket.send_fds(self._sock, [frame], [fd])
                    if sent < len(frame):
                        self._sock.sendall(frame[sent:])
        except OSError as e:
            # The server may have closed after an error frame (UNAUTHORIZED):
            # let the reader take that frame in, then say what it said.
            self._reader.join(min(self.timeout_s, 2.0))
            self._die(codes.CONNECTION_LOST, f"sending {OP_NAMES.get(op, op)} to {self.path} failed: {e}")
        return fut

    def wait(self, fut: Future[_Response], op: int, timeout_s: float | None = None) -> memoryview:
        """The body of a response to ``op``; raises its request-wide error
        (:meth:`wait_hinted` also answers the response's ``retry_after_ms``)."""
        return self.wait_hinted(fut, op, timeout_s)[0]

    def wait_hinted(self, fut: Future[_Response], op: int, timeout_s: float | None = None) -> tuple[memoryview, int]:
        """``(body, retry_after_ms)`` of a response to ``op``: a response whose
        items were refused ``OVERLOADED`` has status 0 and the server's hint.
        A descriptor that came with it is closed (:meth:`wait_fds` keeps it).

        Raises:
            KvtierError: the status's class (``local_code`` set); for
                ``OVERLOADED`` an :class:`~kvtier.OverloadedError` whose
                ``retry_after_s`` is the server's hint.
            KvtierConnectionError: the connection broke, or no answer came
                within ``timeout_s`` (the connection is then closed).
        """
        resp = self._result(fut, op, timeout_s)
        _close_fds(resp.fds)
        return decode_response(op, resp.op, resp.payload)

    def wait_fds(self, fut: Future[_Response], op: int, timeout_s: float | None = None) -> tuple[memoryview, list[int]]:
        """``(body, descriptors)`` of a response to ``op``: the descriptors
        (``SCM_RIGHTS``, close-on-exec) that came with it are the caller's to
        close. Raises as :meth:`wait_hinted` (having closed them)."""
        resp = self._result(fut, op, timeout_s)
        try:
            return decode_response(op, resp.op, resp.payload)[0], resp.fds
        except BaseException:
            _close_fds(resp.fds)
            raise

    def _result(self, fut: Future[_Response], op: int, timeout_s: float | None) -> _Response:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(limit)
        except FutureTimeout:
            self.abandon(f"no answer to {OP_NAMES.get(op, op)} from {self.path} within {limit:.1f} s")
            return fut.result(5.0)  # failed by abandon, or answered just before it

    def post(self, op: int, payload: bytes) -> bool:
        """Sends one request frame whose answer nobody waits for (the reader
        drops it, and closes any descriptor that comes with it). Takes no
        in-flight slot. ``False`` when the connection is gone or the send
        failed; never raises for that."""
        with self._lock:
            if self._dead is not None:
                return False
            rid = next(self._ids)
        try:
            with self._send_lock:
                self._sock.sendall(encode_frame(op, rid, payload))
        except OSError:
            return False
        return True

    def start_releaser(self) -> None:
        """Starts the thread that sends what :meth:`release_later` queues
        (once; :class:`kvtier.leases.Leases` starts it with the first lease)."""
        with self._lock:
            if self._releaser is None and self._dead is None:
                self._releaser = threading.Thread(target=self._release_loop, name="kvtier-releaser", daemon=True)
                self._releaser.start()

    def release_later(self, ids: Sequence[int]) -> None:
        """Queues a ``RELEASE`` of ``ids`` for the releaser thread, without
        waiting for anything: safe from a finalizer (``__del__``) on any
        thread. Nothing is sent once the connection is gone (its leases
        ended with it)."""
        if ids and self._dead is None:
            self._releases.put(list(ids))

    def _release_loop(self) -> None:
        while True:
            ids = self._releases.get()
            if ids is None:  # the connection is gone
                return
            stop = False
            while not stop:  # what else is queued goes in the same frames
                try:
                    more = self._releases.get_nowait()
                except queue.Empty:
                    break
                stop = more is None
                ids += more or []
            for start in range(0, len(ids), MAX_ITEMS):
                if not self.post(OP_RELEASE, encode_release(ids[start : start + MAX_ITEMS])):
                    return
            if stop:
                return

    def call(self, op: int, payload: bytes, *, fd: int | None = None, timeout_s: float | None = None) -> memoryview:
        """:meth:`request` and :meth:`wait`: the response body."""
        return self.wait(self.request(op, payload, fd=fd), op, timeout_s)

    # ---------------------------------------------------------------- ops

    def hello(
        self,
        *,
        token: str | None = None,
        block_bytes: int | None = None,
        model: str | None = None,
        client: str = CLIENT_NAME,
    ) -> dict[str, Any]:
        """``HELLO``: the first request. Sends the versions this client speaks,
        and the token and expected geometry when given; returns the server's
        answer (``version``, ``epoch``, ``block_bytes``, ``model``,
        ``max_items``, …), also kept as :attr:`info`.

        Raises:
            UnauthorizedError: the peer is not allowed, or the token is wrong.
            GeometryMismatchError: ``block_bytes``/``model`` differ (both named).
            ProtocolError: no version in common, or an unreadable answer.
        """
        payload = encode_hello(token=token, block_bytes=block_bytes, model=model, client=client)
        info = decode_hello(self.call(OP_HELLO, payload), block_bytes=block_bytes)
        self.info = info
        return info

    def register(self, fd: int, offset: int, length: int) -> tuple[int, int]:
        """``REGISTER`` ``length`` bytes of file ``fd`` from ``offset`` (the
        descriptor travels in ``SCM_RIGHTS``; the caller keeps its own).
        Returns ``(handle, access)``: access 1 mapped, 2 file I/O, 3 guarded."""
        return decode_registered(self.call(OP_REGISTER, encode_register(offset, length), fd=fd))

    def unregister(self, handle: int) -> None:
        """``UNREGISTER`` ``handle``; items in flight on it finish."""
        self.call(OP_UNREGISTER, encode_unregister(handle))

    def get_into(self, items: Sequence[Item], timeout_s: float | None = None) -> list[tuple[int, int]]:
        """``GET_INTO``: each block into ``(handle, offset)``; per item
        ``(bytes written or a negative code, tier)``."""
        return decode_results(self.call(OP_GET_INTO, encode_items(items), timeout_s=timeout_s), len(items))

    @property
    def version(self) -> int:
        """The protocol version the hello chose (1 before it)."""
        return int(self.info.get("version", 1))

    def put_from(
        self, items: Sequence[Item], timeout_s: float | None = None, *, tags: Sequence[bytes] | None = None
    ) -> list[tuple[int, int]]:
        """``PUT_FROM``: each item's bytes stored under its key, with
        ``tags[i]`` (an encoded :class:`kvtier.BlockTag`, ``b""`` for none)
        when given; per item ``(result: >= 0 stored, else a negative code,
        created: 1 new key)``.

        Raises:
            ProtocolError: tags on a connection whose server speaks version 1.
        """
        if self.version < VERSION_TAGS:
            if tags is not None and any(tags):
                raise error_from_code(
                    codes.UNSUPPORTED_VERSION,
                    f"the server at {self.path} speaks protocol version {self.version}, whose PUT_FROM carries no "
                    f"block tags (version {VERSION_TAGS} does): upgrade kvtier, or put tagged blocks over HTTP",
                )
            payload = encode_items(items)
        else:
            tags = [b""] * len(items) if tags is None else tags
            payload = encode_tagged_items([(*item, tag) for item, tag in zip(items, tags, strict=True)])
        return decode_results(self.call(OP_PUT_FROM, payload, timeout_s=timeout_s), len(items))

    def exists(self, keys: Sequence[str]) -> list[int]:
        """``EXISTS``: each key's tier (0 not stored, 1 gpu, 2 ram, 3 nvme, 4 s3)."""
        return decode_tiers(self.call(OP_EXISTS, encode_keys(keys)), len(keys))

    def lookup(self, keys: Sequence[str]) -> tuple[int, list[int]]:
        """``LOOKUP`` a prefix chain: ``(prefix_hits, the hits' tiers)``."""
        return decode_lookup(self.call(OP_LOOKUP, encode_keys(keys)))

    def delete(self, keys: Sequence[str]) -> list[int]:
        """``DELETE``: per key 0 (deleted) or a negative code (-2: none stored)."""
        return decode_deleted(self.call(OP_DELETE, encode_keys(keys)), len(keys))

    def prefetch(self, keys: Sequence[str]) -> tuple[int, int]:
        """``PREFETCH``: ``(requested, found locally)``."""
        return decode_prefetched(self.call(OP_PREFETCH, encode_keys(keys)))

    def map_arena(self, arena: int) -> tuple[int, tuple[int, int, int, int]]:
        """``MAP_ARENA`` (version 3): ``(fd, (file_bytes, slot_bytes, slots,
        generations_offset))``. ``fd`` is a read-only descriptor of arena
        ``arena``'s sealed memfd, now the caller's to map
        (``mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)``) and
        close. :class:`kvtier.leases.ArenaMaps` does both.

        Raises:
            LeasesOffError: the server offers no leases (its reason).
            ProtocolError: ``NOT_FOUND`` for an unknown arena, an answer
                without exactly one descriptor, or a short body.
            UnsupportedVersionError: the connection did not choose version 3.
        """
        return self._map(OP_MAP_ARENA, arena, decode_arena)

    def map_index(self, shard: int) -> tuple[int, tuple[int, int, int]]:
        """``MAP_INDEX`` (version 3): ``(fd, (file_bytes, buckets, shards))``
        of shard ``shard``'s index table (docs/LOCAL.md, "The shared
        index"); ``fd`` is read-only and the caller's to map and close.

        Raises:
            LeasesOffError: the server offers no shared index (its reason).
            ProtocolError: ``NOT_FOUND`` for an unknown shard, an answer
                without exactly one descriptor, or a short body.
        """
        return self._map(OP_MAP_INDEX, shard, decode_index)

    def _map(self, op: int, number: int, decode: Callable[[memoryview], T]) -> tuple[int, T]:
        """``MAP_ARENA``/``MAP_INDEX`` of ``number`` (both send a u32): the one
        descriptor of the answer and its body decoded; any descriptor is
        closed when the answer is not exactly that."""
        body, fds = self.wait_fds(self.request(op, encode_map_arena(number)), op)
        try:
            if len(fds) != 1:
                raise _bad_answer(f"{OP_NAMES[op]} {number} came with {len(fds)} descriptors; it brings one")
            return fds[0], decode(body)
        except BaseException:
            _close_fds(fds)
            raise

    def lease(self, keys: Sequence[str]) -> list[tuple[int, int, int, int, int, int]]:
        """``LEASE`` (version 3) of up to 4,096 keys: per key ``(result, tier,
        arena, offset, generation, lease)`` (:func:`decode_leases`).
        :meth:`kvtier.Client.lease` is the form that maps and releases.

        Raises:
            LeasesOffError: the server offers no leases (its reason).
            UnsupportedVersionError: the connection did not choose version 3.
        """
        self.start_releaser()
        return decode_leases(self.call(OP_LEASE, encode_keys(keys)), len(keys))

    def release(self, ids: Sequence[int]) -> int:
        """``RELEASE`` of up to 4,096 lease ids: how many the connection still
        held (the others had ended, or were never its)."""
        return decode_released(self.call(OP_RELEASE, encode_release(ids)))

    def __enter__(self) -> LocalConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalConnection({self.path!r}, alive={self.alive})"
