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

The bytes themselves are made and read by the module's pure functions
(:func:`encode_frame`, :func:`decode_header`, :func:`decode_response`, and an
``encode_*``/``decode_*`` pair per payload), which the connection uses and
``tests/test_local_vectors.py`` checks against the frames the Rust crate
``kvtier-local-proto`` (the server's) encodes: ``tests/data/local_frame_vectors.json``.
"""

from __future__ import annotations

import itertools
import json
import socket
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from . import codes
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

MAGIC = 0x4B54
"""``b"TK"`` on the wire (little-endian u16)."""
HEADER = struct.Struct("<HBBIQ")
"""magic u16, op u8, flags u8, payload_bytes u32, request_id u64: 16 bytes."""
_STATUS = struct.Struct("<iI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TWO_U32 = struct.Struct("<II")
_REGISTERED = struct.Struct("<QB")

OP_HELLO, OP_REGISTER, OP_UNREGISTER, OP_GET_INTO, OP_PUT_FROM = 1, 2, 3, 4, 5
OP_EXISTS, OP_LOOKUP, OP_DELETE, OP_PREFETCH = 6, 7, 8, 9
OP_GET_INTO_V, OP_PUT_FROM_V = 10, 11
OP_ERROR = 0xFF
"""A connection error frame (request id 0): the server closes after it."""
RESPONSE = 0x80
"""A response's op is the request's ``op | 0x80``."""
OP_NAMES = {1: "HELLO", 2: "REGISTER", 3: "UNREGISTER", 4: "GET_INTO", 5: "PUT_FROM"}
OP_NAMES.update({6: "EXISTS", 7: "LOOKUP", 8: "DELETE", 9: "PREFETCH", 10: "GET_INTO_V", 11: "PUT_FROM_V"})

MAX_ITEMS = 4096
"""Items in one batch request, at most."""
MAX_PARTS = 256
"""Parts of one ``GET_INTO_V``/``PUT_FROM_V`` item, at most."""
MAX_PAYLOAD_BYTES = 1 << 20
"""A frame's payload, at most (both ways)."""
MAX_IN_FLIGHT = 256
"""Requests in flight on one connection, at most (the server stops reading beyond)."""
CLIENT_NAME = "kvtier-python 0.1.0"
"""What the hello's ``client`` field says."""
VERSIONS = (1, 2)
"""Protocol versions this client speaks (the server picks the highest both speak)."""
VERSION_TAGS = 2
"""The first version whose ``PUT_FROM``/``PUT_FROM_V`` items end with a block
tag (u16 ``tag_bytes``, then :meth:`kvtier.BlockTag.encode`'s bytes; 0: untagged)."""


def _str(key: str) -> bytes:
    raw = key.encode()
    return _U16.pack(len(raw)) + raw


def encode_keys(keys: Sequence[str]) -> bytes:
    """``EXISTS``/``LOOKUP``/``DELETE``/``PREFETCH`` payload: u32 n, n × str."""
    return _U32.pack(len(keys)) + b"".join(_str(k) for k in keys)


#: Bytes a decoder reads: a response's body, a frame's payload or header.
Bytes = bytes | bytearray | memoryview


def _bad_answer(message: str) -> ProtocolError:
    return ProtocolError(message, code="bad_answer")


def decode_results(body: Bytes, n: int) -> list[tuple[int, int]]:
    """``GET_INTO``/``PUT_FROM`` (and ``_V``) body: u32 n, n × (i64 result,
    u8 tier or created), for a request of ``n`` items.

    Raises:
        ProtocolError: another count, or a body too short for it.
    """
    count = _check_count(body, n, 9)
    return [(r, f) for r, f in struct.iter_unpack("<qB", body[4 : 4 + 9 * count])]


def _check_count(body: Bytes, n: int, each: int) -> int:
    if len(body) < _U32.size:
        raise _bad_answer(f"answer of {len(body)} bytes has no item count (a request of {n})")
    (count,) = _U32.unpack_from(body)
    if count != n or len(body) < 4 + each * count:
        raise _bad_answer(f"answer holds {count} items in {len(body)} bytes for a request of {n}")
    return int(count)


def encode_frame(op: int, request_id: int, payload: bytes) -> bytes:
    """A whole frame (docs/LOCAL.md, "Framing"): the 16-byte header (u16 magic
    ``b"TK"``, u8 ``op``, u8 flags 0, u32 ``payload_bytes``, u64
    ``request_id``; little-endian) and ``payload``.

    Raises:
        struct.error: ``op`` is not 0–255 or ``request_id`` not a u64.
    """
    return HEADER.pack(MAGIC, op, 0, len(payload), request_id) + payload


def decode_header(head: Bytes) -> tuple[int, int, int]:
    """``(op, payload_bytes, request_id)`` of a 16-byte frame header.

    Raises:
        ProtocolError: (``local_code`` ``BAD_FRAME``) not 16 bytes, a wrong
            magic, nonzero flags, or a payload over :data:`MAX_PAYLOAD_BYTES`:
            the stream cannot be framed.
    """
    if len(head) != HEADER.size:
        raise error_from_code(codes.BAD_FRAME, f"a frame header of {len(head)} bytes (a header is {HEADER.size})")
    magic, op, flags, nbytes, rid = HEADER.unpack(head)
    if magic != MAGIC or flags != 0 or nbytes > MAX_PAYLOAD_BYTES:
        raise error_from_code(
            codes.BAD_FRAME, f"a bad frame header (magic {magic:#06x}, flags {flags}, {nbytes} bytes)"
        )
    return int(op), int(nbytes), int(rid)


def decode_connection_error(payload: Bytes) -> tuple[int, str]:
    """``(code, message)`` of a connection-error frame (op ``0xFF``, sent
    before the server closes): its status (``BAD_FRAME`` when absent or 0)
    and the server's message."""
    status = _STATUS.unpack_from(payload)[0] if len(payload) >= _STATUS.size else 0
    return int(status) or codes.BAD_FRAME, bytes(payload[_STATUS.size :]).decode("utf-8", "replace")


def decode_response(op: int, frame_op: int, payload: Bytes) -> tuple[memoryview, int]:
    """``(body, retry_after_ms)`` of the response frame (op ``frame_op``,
    ``payload``) to a request of ``op``: i32 ``status``, u32
    ``retry_after_ms``, then the body. Status 0 may carry a hint too (items
    refused ``OVERLOADED``).

    Raises:
        ProtocolError: ``frame_op`` is not ``op | 0x80``, or the payload is
            shorter than its status and hint.
        KvtierError: a nonzero status, as its class (:func:`kvtier.errors.error_from_code`;
            ``local_code`` the status, the message the server's text; an
            :class:`~kvtier.OverloadedError`'s ``retry_after_s`` the hint).
    """
    name = OP_NAMES.get(op, op)
    if frame_op != op | RESPONSE or len(payload) < _STATUS.size:
        raise _bad_answer(f"answer to {name} has op {frame_op:#x} and {len(payload)} bytes")
    status, retry_after_ms = _STATUS.unpack_from(payload)
    view = memoryview(payload)
    if status != 0:
        text = bytes(view[_STATUS.size :]).decode("utf-8", "replace")
        raise error_from_code(status, f"{name}: {text}", retry_after_ms / 1000.0)
    return view[_STATUS.size :], int(retry_after_ms)


def encode_hello(
    *, token: str | None = None, block_bytes: int | None = None, model: str | None = None, client: str = CLIENT_NAME
) -> bytes:
    """``HELLO`` payload: a JSON object of the :data:`VERSIONS` this client
    speaks, ``client``, and ``token``, ``block_bytes``, ``model`` when given."""
    req: dict[str, Any] = {"versions": list(VERSIONS), "client": client}
    if token is not None:
        req["token"] = token
    if block_bytes is not None:
        req["block_bytes"] = block_bytes
    if model is not None:
        req["model"] = model
    return json.dumps(req, separators=(",", ":")).encode()


def decode_hello(body: Bytes, *, block_bytes: int | None = None) -> dict[str, Any]:
    """The server's ``HELLO`` answer (JSON: ``version``, ``epoch``,
    ``block_bytes``, ``model``, ``max_items``, …), ``epoch`` an ``int``.

    Raises:
        ProtocolError: not JSON, a field missing or not a number, or a
            version this client does not speak.
        GeometryMismatchError: ``block_bytes`` is given and the server's differs.
    """
    try:
        info = json.loads(bytes(body))
        version, epoch, bb = int(info["version"]), int(info["epoch"]), int(info["block_bytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise _bad_answer(f"unreadable HELLO answer {bytes(body[:200])!r}: {e!r}") from e
    if version not in VERSIONS:
        raise ProtocolError(f"the server chose version {version}; this client speaks {list(VERSIONS)}")
    if block_bytes is not None and bb != block_bytes:
        raise error_from_code(
            codes.GEOMETRY_MISMATCH, f"the server's block_bytes is {bb}; the client expects {block_bytes}"
        )
    info["epoch"] = epoch
    return dict(info)


def encode_register(offset: int, length: int) -> bytes:
    """``REGISTER`` payload: u64 ``offset``, u64 ``length`` (bytes of the
    file whose descriptor travels with the frame)."""
    return _U64.pack(offset) + _U64.pack(length)


def decode_registered(body: Bytes) -> tuple[int, int]:
    """``REGISTER`` body: ``(handle, access)`` (u64, u8: 1 mapped, 2 file I/O, 3 guarded).

    Raises:
        ProtocolError: a body shorter than 9 bytes.
    """
    if len(body) < _REGISTERED.size:
        raise _bad_answer(f"REGISTER answered {len(body)} bytes; a handle and access are {_REGISTERED.size}")
    handle, access = _REGISTERED.unpack_from(body)
    return int(handle), int(access)


def encode_unregister(handle: int) -> bytes:
    """``UNREGISTER`` payload: u64 ``handle`` (the answer's body is empty)."""
    return _U64.pack(handle)


def decode_tiers(body: Bytes, n: int) -> list[int]:
    """``EXISTS`` body for ``n`` keys: u32 n, n × u8 tier (0 not stored, 1 gpu, 2 ram, 3 nvme, 4 s3).

    Raises:
        ProtocolError: another count, or a body too short for it.
    """
    count = _check_count(body, n, 1)
    return list(bytes(body[4 : 4 + count]))


def decode_lookup(body: Bytes) -> tuple[int, list[int]]:
    """``LOOKUP`` body: ``(prefix_hits, the hits' tiers)`` (u32 prefix_hits, u32 n, n × u8).

    Raises:
        ProtocolError: ``n`` is not ``prefix_hits``, or the body is too short.
    """
    if len(body) < _TWO_U32.size:
        raise _bad_answer(f"LOOKUP answered {len(body)} bytes, too few for its two counts")
    hits, n = _TWO_U32.unpack_from(body)
    if n != hits or len(body) < 8 + n:
        raise _bad_answer(f"LOOKUP answered {hits} hits with {n} tiers in {len(body)} bytes")
    return int(hits), list(bytes(body[8 : 8 + n]))


def decode_deleted(body: Bytes, n: int) -> list[int]:
    """``DELETE`` body for ``n`` keys: per key 0 (deleted) or a negative code (-2: none stored).

    Raises:
        ProtocolError: another count, or a body too short for it.
    """
    count = _check_count(body, n, 8)
    return [r for (r,) in struct.iter_unpack("<q", body[4 : 4 + 8 * count])]


def decode_prefetched(body: Bytes) -> tuple[int, int]:
    """``PREFETCH`` body: ``(requested, found locally)`` (u32, u32).

    Raises:
        ProtocolError: a body shorter than 8 bytes.
    """
    if len(body) < _TWO_U32.size:
        raise _bad_answer(f"PREFETCH answered {len(body)} bytes; requested and found are {_TWO_U32.size}")
    requested, found = _TWO_U32.unpack_from(body)
    return int(requested), int(found)


class _Response:
    __slots__ = ("op", "payload")

    def __init__(self, op: int, payload: bytearray) -> None:
        self.op, self.payload = op, payload


class LocalConnection:
    """One connection to a kvtier Unix socket (docs/LOCAL.md). Thread-safe.

    Args:
        path: the socket's path (``local.socket`` of ``/v1/stats``).
        timeout_s: limit for connecting and, unless a call names another,
            for each response. A request that times out closes the
            connection (its registrations go with it).

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
        self.info: dict[str, Any] = {}
        """The server's hello answer (after :meth:`hello`): ``epoch``, ``block_bytes``, …"""
        self._reader = threading.Thread(target=self._read_loop, name="kvtier-local-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------ framing

    @property
    def alive(self) -> bool:
        """``False`` once the connection broke or was closed."""
        return self._dead is None

    def close(self, reason: str = "the client closed the connection") -> None:
        """Closes the socket; requests in flight fail with ``CONNECTION_LOST``."""
        self._die(codes.CONNECTION_LOST, reason)

    def _die(self, code: int, message: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = (code, message)
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            self._slots.release()
            fut.set_exception(error_from_code(*self._dead))
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is self._reader:
            self._sock.close()

    def _recv_exact(self, n: int) -> bytearray | None:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                if got:
                    raise ConnectionError(f"the connection ended {got} bytes into a {n}-byte read")
                return None
            got += k
        return buf

    def _read_loop(self) -> None:
        code, message = codes.CONNECTION_LOST, "the server closed the connection"
        try:
            while True:
                head = self._recv_exact(HEADER.size)
                if head is None:
                    break
                try:
                    op, nbytes, rid = decode_header(head)
                except ProtocolError as e:
                    code, message = codes.BAD_FRAME, f"the server sent {e.message}"
                    break
                payload = self._recv_exact(nbytes) if nbytes else bytearray()
                if payload is None:
                    message = "the server closed the connection inside a frame"
                    break
                if op == OP_ERROR:
                    code, text = decode_connection_error(payload)
                    message = f"the server closed the connection with {codes.name_of(code)}: {text}"
                    break
                with self._lock:
                    fut = self._pending.pop(rid, None)
                if fut is not None:  # None: a request that timed out
                    self._slots.release()
                    fut.set_result(_Response(op, payload))
        except OSError as e:
            message = f"the connection to {self.path} broke: {e}"
        finally:
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

        Raises:
            KvtierError: the status's class (``local_code`` set); for
                ``OVERLOADED`` an :class:`~kvtier.OverloadedError` whose
                ``retry_after_s`` is the server's hint.
            KvtierConnectionError: the connection broke, or no answer came
                within ``timeout_s`` (the connection is then closed).
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            resp = fut.result(limit)
        except FutureTimeout:
            self.close(f"no answer to {OP_NAMES.get(op, op)} from {self.path} within {limit:.1f} s")
            resp = fut.result(5.0)  # failed by the close, or answered just before it
        return decode_response(op, resp.op, resp.payload)

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

    def __enter__(self) -> LocalConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalConnection({self.path!r}, alive={self.alive})"
