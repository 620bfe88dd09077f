"""The frames of the same-host protocol (docs/LOCAL.md), as bytes: the
header, every op's request and answer payloads, HELLO, and the lease ops'
payloads. Pure functions, checked against the server's frame vectors
(``tests/data/local_frame_vectors.json``, ``tests/test_local_vectors.py``);
:mod:`kvtier.local` sends and receives them."""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

from . import codes
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
ARENA = struct.Struct("<QQIQ")
"""``MAP_ARENA`` body: u64 ``file_bytes``, u64 ``slot_bytes``, u32 ``slots``,
u64 ``generations_offset`` (28 bytes, no padding)."""
LEASE_ITEM = struct.Struct("<qBIQQQ")
"""One ``LEASE`` answer item: i64 ``result``, u8 ``tier``, u32 ``arena``, u64
``offset``, u64 ``generation``, u64 ``lease`` (37 bytes, no padding)."""
#: Ancillary room the reader thread gives each read: one descriptor.
_FD_ROOM = socket.CMSG_SPACE(array.array("i").itemsize)


OP_HELLO, OP_REGISTER, OP_UNREGISTER, OP_GET_INTO, OP_PUT_FROM = 1, 2, 3, 4, 5
OP_EXISTS, OP_LOOKUP, OP_DELETE, OP_PREFETCH = 6, 7, 8, 9
OP_GET_INTO_V, OP_PUT_FROM_V = 10, 11
OP_MAP_ARENA, OP_LEASE, OP_RELEASE, OP_MAP_INDEX = 12, 13, 14, 15
OP_ERROR = 0xFF
"""A connection error frame (request id 0): the server closes after it."""
RESPONSE = 0x80
"""A response's op is the request's ``op | 0x80``."""
OP_NAMES = {1: "HELLO", 2: "REGISTER", 3: "UNREGISTER", 4: "GET_INTO", 5: "PUT_FROM"}
OP_NAMES.update({6: "EXISTS", 7: "LOOKUP", 8: "DELETE", 9: "PREFETCH", 10: "GET_INTO_V", 11: "PUT_FROM_V"})
OP_NAMES.update({12: "MAP_ARENA", 13: "LEASE", 14: "RELEASE", 15: "MAP_INDEX"})

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
VERSIONS = (1, 2, 3)
"""Protocol versions this client speaks (the server picks the highest both speak)."""
VERSION_TAGS = 2
"""The first version whose ``PUT_FROM``/``PUT_FROM_V`` items end with a block
tag (u16 ``tag_bytes``, then :meth:`kvtier.BlockTag.encode`'s bytes; 0: untagged)."""
VERSION_LEASES = 3
"""The first version with ``MAP_ARENA``, ``LEASE`` and ``RELEASE`` (docs/LOCAL.md,
"Leases") and the hello answer's ``leases`` object."""


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
    *,
    token: str | None = None,
    block_bytes: int | None = None,
    model: str | None = None,
    client: str = CLIENT_NAME,
    versions: Sequence[int] = VERSIONS,
) -> bytes:
    """``HELLO`` payload: a JSON object of the ``versions`` offered (by
    default the :data:`VERSIONS` this client speaks), ``client``, and
    ``token``, ``block_bytes``, ``model`` when given."""
    req: dict[str, Any] = {"versions": list(versions), "client": client}
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
    if version >= VERSION_LEASES:
        _check_leases_offer(info.get("leases"))
    return dict(info)


def _check_leases_offer(offer: Any) -> None:
    """The hello answer's ``leases`` object (version 3): ``{"offered": bool,
    "why_not": str or null, "lease_ms": int, "leases_max": int}`` and, from
    servers that name them, ``"arenas"``: the arena numbers (ints).

    Raises:
        ProtocolError: it is missing, or a field is missing or of another type.
    """
    ok = (
        isinstance(offer, dict)
        and isinstance(offer.get("offered"), bool)
        and (offer.get("why_not") is None or isinstance(offer.get("why_not"), str))
        and all(type(offer.get(k)) is int for k in ("lease_ms", "leases_max"))
        and isinstance(offer.get("arenas", []), list)
        and all(type(n) is int for n in offer.get("arenas", []))
    )
    if not ok:
        raise _bad_answer(
            f"a version-{VERSION_LEASES} HELLO answer needs leases: "
            f'{{"offered": bool, "why_not": str|null, "lease_ms": int, "leases_max": int}}, got {offer!r}'
        )


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


def encode_map_arena(arena: int) -> bytes:
    """``MAP_ARENA`` payload: u32 ``arena`` (the answer brings its descriptor).

    Raises:
        struct.error: ``arena`` is not a u32.
    """
    return _U32.pack(arena)


def decode_arena(body: Bytes) -> tuple[int, int, int, int]:
    """``MAP_ARENA`` body: ``(file_bytes, slot_bytes, slots, generations_offset)``
    (u64, u64, u32, u64). The arena's file holds ``slots`` slots of
    ``slot_bytes`` and, at ``generations_offset``, one u64 generation per slot.

    Raises:
        ProtocolError: a body shorter than 28 bytes.
    """
    if len(body) < ARENA.size:
        raise _bad_answer(f"MAP_ARENA answered {len(body)} bytes; its layout is {ARENA.size}")
    file_bytes, slot_bytes, slots, generations_offset = ARENA.unpack_from(body)
    return int(file_bytes), int(slot_bytes), int(slots), int(generations_offset)


def decode_leases(body: Bytes, n: int) -> list[tuple[int, int, int, int, int, int]]:
    """``LEASE`` body for ``n`` keys: u32 n, then per key ``(result, tier,
    arena, offset, generation, lease)`` (i64, u8, u32, u64, u64, u64; 37
    bytes). ``result`` is ``block_bytes`` when leased, else a negative code
    (``NOT_FOUND``, ``NOT_IN_RAM``, ``CORRUPT``, ``LIMIT``, ``INVALID_KEY``)
    with the other fields 0 (``NOT_IN_RAM``: ``tier`` where it is stored).

    Raises:
        ProtocolError: another count, or a body too short for it.
    """
    count = _check_count(body, n, LEASE_ITEM.size)
    return [
        (int(r), int(t), int(a), int(o), int(g), int(lease))
        for r, t, a, o, g, lease in LEASE_ITEM.iter_unpack(body[4 : 4 + LEASE_ITEM.size * count])
    ]


def encode_release(ids: Sequence[int]) -> bytes:
    """``RELEASE`` payload: u32 n, n × u64 ``lease``.

    Raises:
        struct.error: an id is not a u64.
    """
    return _U32.pack(len(ids)) + struct.pack(f"<{len(ids)}Q", *ids)


def decode_released(body: Bytes) -> int:
    """``RELEASE`` body: u32 ``released`` (the ids the connection still held).

    Raises:
        ProtocolError: a body shorter than 4 bytes.
    """
    if len(body) < _U32.size:
        raise _bad_answer(f"RELEASE answered {len(body)} bytes; released is {_U32.size}")
    return int(_U32.unpack_from(body)[0])


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


INDEX = struct.Struct("<QII")
"""``MAP_INDEX``'s answer: u64 ``file_bytes``, u32 ``buckets``, u32 ``shards``."""


def decode_index(body: Bytes) -> tuple[int, int, int]:
    """``MAP_INDEX`` answer body: ``(file_bytes, buckets, shards)``.

    Raises:
        ProtocolError: a body of another size.
    """
    if len(body) != INDEX.size:
        raise _bad_answer(f"a MAP_INDEX answer is {INDEX.size} bytes, got {len(body)}")
    file_bytes, buckets, shards = INDEX.unpack(body)
    return int(file_bytes), int(buckets), int(shards)
