"""Result codes of the same-host data plane (docs/LOCAL.md, "Codes").

Every code is a negative ``int``. The server answers -1 … -19 and -22 … -25, either
for a whole request (the response's ``status``) or for one item of a batch
(its ``result``); the client adds -20 and -21. The Mooncake-style calls of
:class:`kvtier.Client` (``batch_get_into``, ``batch_put_from``, …) return these
numbers per item and never raise for one item's failure.

    >>> from kvtier import codes
    >>> codes.name_of(-2)
    'NOT_FOUND'

The numbers come from the Rust crates (``kvtier._native.CODES``: the server's
codes from ``kvtier-local-proto``, the client's own two from
``kvtier-client``), so none is written here a second time; this module
names and documents them.
"""

from __future__ import annotations

from ._native import CODES as _CODES
from ._native import TIER_NAMES as _TIER_NAMES

OK = _CODES["OK"]
"""Success (a whole request's ``status``; ``batch_put_from``'s per-item result)."""

IO_ERROR = _CODES["IO_ERROR"]
"""The server's disk failed, or an internal error (the server logs it)."""

NOT_FOUND = _CODES["NOT_FOUND"]
"""A miss: no block is stored under the key."""

INVALID_KEY = _CODES["INVALID_KEY"]
"""The key is empty, over 256 bytes, or has a byte outside ``[A-Za-z0-9._~-]``
(docs/API.md, "Keys"). The client checks keys before sending."""

WRONG_SIZE = _CODES["WRONG_SIZE"]
"""``size`` is below ``block_bytes`` (get) or not equal to it (put); nothing
was copied or stored."""

UNKNOWN_HANDLE = _CODES["UNKNOWN_HANDLE"]
"""The server knows no such registration on this connection (unregistered,
or the connection it was made on is gone)."""

OUT_OF_BOUNDS = _CODES["OUT_OF_BOUNDS"]
"""``offset + length`` lies past the end of the registered region."""

BUFFER_SHRUNK = _CODES["BUFFER_SHRUNK"]
"""The registered file is now shorter than the region (it was truncated
after ``register_buffer``); the items on the lost part fail with this."""

CORRUPT = _CODES["CORRUPT"]
"""The stored block failed its CRC check: a miss (the target may hold part of it)."""

OVERLOADED = _CODES["OVERLOADED"]
"""Too many PUT bytes in flight on the owning shard. The client retries after
the server's ``retry_after_ms`` a bounded number of times before answering it."""

DISK_FULL = _CODES["DISK_FULL"]
"""The server's log has no room for the block."""

SHUTTING_DOWN = _CODES["SHUTTING_DOWN"]
"""The server is stopping."""

UNAUTHORIZED = _CODES["UNAUTHORIZED"]
"""The peer's uid/gid is not allowed on the socket, the token is wrong, or a
request came before the hello."""

BAD_REQUEST = _CODES["BAD_REQUEST"]
"""A payload that does not parse for its op (a client bug)."""

UNSUPPORTED_VERSION = _CODES["UNSUPPORTED_VERSION"]
"""The client and the server speak no protocol version in common; also, per
item, a tagged put to a server whose socket speaks version 1 (no block tags:
upgrade kvtier, or put over HTTP)."""

GEOMETRY_MISMATCH = _CODES["GEOMETRY_MISMATCH"]
"""The client's expected ``block_bytes``/``model`` differ from the server's."""

LIMIT = _CODES["LIMIT"]
"""More than 4,096 items in a batch, or too many registrations on a connection."""

UNKNOWN_OP = _CODES["UNKNOWN_OP"]
"""An op this server does not know (the connection stays open)."""

BAD_BUFFER = _CODES["BAD_BUFFER"]
"""The memory cannot be registered: it is not backed by a shared file the
server can open (anonymous ``malloc``/pinned memory, a private mapping), or
the descriptor the server got is unusable (its message says why)."""

BAD_FRAME = _CODES["BAD_FRAME"]
"""A framing error; the server closed the connection."""

NOT_REGISTERED = _CODES["NOT_REGISTERED"]
"""Client-side: a raw pointer (``int``) that lies in no registered buffer (or
``unregister_buffer`` of a pointer that was never registered)."""

CONNECTION_LOST = _CODES["CONNECTION_LOST"]
"""Client-side: the connection broke and the server was not back (reconnect,
hello, re-registration) within the client's ``timeout_s``, or it did not
answer within it."""

INVALID_TAG = _CODES["INVALID_TAG"]
"""A ``PUT_FROM`` item's block tag breaks the rules (:class:`kvtier.BlockTag`,
docs/API.md "Block tags") or is longer than the store's slot header holds;
nothing was stored. The client checks tags before sending; its batch calls
answer this code for a tag that fails the check."""

NOT_IN_RAM = _CODES["NOT_IN_RAM"]
"""``LEASE``, per key: the block is stored but was served from a tier it does
not land in the RAM tier from (a GPU-tier or S3 hit), so there is no slot to
lease; read it with ``get_into`` (:attr:`kvtier.leases.Leases.not_in_ram`)."""

LEASES_OFF = _CODES["LEASES_OFF"]
"""``LEASE``, ``MAP_ARENA``, for the whole request: this server offers no
leases (no RAM tier, a RAM tier that is not shared memory: ``--ram-shared``,
or ``--tenants``); the message says which."""

CANCELLED = _CODES["CANCELLED"]
"""A ``GET_INTO``/``PUT_FROM`` item (or a vectored one) that the server
dropped because its client had given up on the connection (closed it, or
shut down its writing side) or unregistered the memory before the copy:
nothing was copied into the client's memory, and nothing was stored
(docs/LOCAL.md, "When a client gives up"). A client that gave up does not
read the answer; one that only half-closed its socket sees this code."""

#: ``code → name`` for every code above.
NAMES: dict[int, str] = {value: name for name, value in sorted(_CODES.items(), key=lambda kv: -kv[1])}

#: Tier numbers on the wire (``GET_INTO``, ``EXISTS``, ``LOOKUP`` answers) →
#: the names ``x-kvtier-tier`` and ``/v1/lookup`` use. 0 is "not stored".
TIER_NAMES: dict[int, str] = dict(sorted(_TIER_NAMES.items()))


def name_of(code: int) -> str:
    """The name of ``code`` (``"NOT_FOUND"`` for -2); ``"CODE_<n>"`` for an
    unknown one (a newer server)."""
    return NAMES.get(code, f"CODE_{code}")
