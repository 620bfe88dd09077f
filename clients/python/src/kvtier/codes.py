"""Result codes of the same-host data plane (docs/LOCAL.md, "Codes").

Every code is a negative ``int``. The server answers -1 … -19 and -22 … -25, either
for a whole request (the response's ``status``) or for one item of a batch
(its ``result``); the Python client adds -20 and -21. The Mooncake-style calls of
:class:`kvtier.Client` (``batch_get_into``, ``batch_put_from``, …) return these
numbers per item and never raise for one item's failure.

    >>> from kvtier import codes
    >>> codes.name_of(-2)
    'NOT_FOUND'
"""

from __future__ import annotations

OK = 0
"""Success (a whole request's ``status``; ``batch_put_from``'s per-item result)."""

IO_ERROR = -1
"""The server's disk failed, or an internal error (the server logs it)."""

NOT_FOUND = -2
"""A miss: no block is stored under the key."""

INVALID_KEY = -3
"""The key is empty, over 256 bytes, or has a byte outside ``[A-Za-z0-9._~-]``
(docs/API.md, "Keys"). The client checks keys before sending."""

WRONG_SIZE = -4
"""``size`` is below ``block_bytes`` (get) or not equal to it (put); nothing
was copied or stored."""

UNKNOWN_HANDLE = -5
"""The server knows no such registration on this connection (unregistered,
or the connection it was made on is gone)."""

OUT_OF_BOUNDS = -6
"""``offset + length`` lies past the end of the registered region."""

BUFFER_SHRUNK = -7
"""The registered file is now shorter than the region (it was truncated
after ``register_buffer``); the items on the lost part fail with this."""

CORRUPT = -8
"""The stored block failed its CRC check: a miss (the target may hold part of it)."""

OVERLOADED = -9
"""Too many PUT bytes in flight on the owning shard. The client retries after
the server's ``retry_after_ms`` a bounded number of times before answering it."""

DISK_FULL = -10
"""The server's log has no room for the block."""

SHUTTING_DOWN = -11
"""The server is stopping."""

UNAUTHORIZED = -12
"""The peer's uid/gid is not allowed on the socket, the token is wrong, or a
request came before the hello."""

BAD_REQUEST = -13
"""A payload that does not parse for its op (a client bug)."""

UNSUPPORTED_VERSION = -14
"""The client and the server speak no protocol version in common; also, per
item, a tagged put to a server whose socket speaks version 1 (no block tags:
upgrade kvtier, or put over HTTP)."""

GEOMETRY_MISMATCH = -15
"""The client's expected ``block_bytes``/``model`` differ from the server's."""

LIMIT = -16
"""More than 4,096 items in a batch, or too many registrations on a connection."""

UNKNOWN_OP = -17
"""An op this server does not know (the connection stays open)."""

BAD_BUFFER = -18
"""The memory cannot be registered: it is not backed by a shared file the
server can open (anonymous ``malloc``/pinned memory, a private mapping), or
the descriptor the server got is unusable (its message says why)."""

BAD_FRAME = -19
"""A framing error; the server closed the connection."""

NOT_REGISTERED = -20
"""Client-side: a raw pointer (``int``) that lies in no registered buffer (or
``unregister_buffer`` of a pointer that was never registered)."""

CONNECTION_LOST = -21
"""Client-side: the connection broke and the server was not back (reconnect,
hello, re-registration) within the client's ``timeout_s``, or it did not
answer within it."""

INVALID_TAG = -22
"""A ``PUT_FROM`` item's block tag breaks the rules (:class:`kvtier.BlockTag`,
docs/API.md "Block tags") or is longer than the store's slot header holds;
nothing was stored. The client checks tags before sending; its batch calls
answer this code for a tag that fails the check."""

NOT_IN_RAM = -23
"""``LEASE``, per key: the block is stored but was served from a tier it does
not land in the RAM tier from (a GPU-tier or S3 hit), so there is no slot to
lease; read it with ``get_into`` (:attr:`kvtier.leases.Leases.not_in_ram`)."""

LEASES_OFF = -24
"""``LEASE``, ``MAP_ARENA``, for the whole request: this server offers no
leases (no RAM tier, a RAM tier that is not shared memory: ``--ram-shared``,
or ``--tenants``); the message says which."""

CANCELLED = -25
"""A ``GET_INTO``/``PUT_FROM`` item (or a vectored one) that the server
dropped because its client had given up on the connection (closed it, or
shut down its writing side) or unregistered the memory before the copy:
nothing was copied into the client's memory, and nothing was stored
(docs/LOCAL.md, "When a client gives up"). A client that gave up does not
read the answer; one that only half-closed its socket sees this code."""

#: ``code → name`` for every code above.
NAMES: dict[int, str] = {
    value: name for name, value in dict(globals()).items() if name.isupper() and isinstance(value, int) and value <= 0
}

#: Tier numbers on the wire (``GET_INTO``, ``EXISTS``, ``LOOKUP`` answers) →
#: the names ``x-kvtier-tier`` and ``/v1/lookup`` use. 0 is "not stored".
TIER_NAMES: dict[int, str] = {1: "gpu", 2: "ram", 3: "nvme", 4: "s3"}


def name_of(code: int) -> str:
    """The name of ``code`` (``"NOT_FOUND"`` for -2); ``"CODE_<n>"`` for an
    unknown one (a newer server)."""
    return NAMES.get(code, f"CODE_{code}")
