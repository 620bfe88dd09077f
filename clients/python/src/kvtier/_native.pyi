"""Type stubs of kvtier's native core (``clients/python/native``, PyO3)."""

from collections.abc import Sequence

#: :meth:`IndexTables.tiers`'s answer for a key the server would refuse.
BAD_KEY: int

class IndexTables:
    """The index tables of one server process's shards, mapped read-only."""

    def __init__(self, tables: Sequence[tuple[int, int, int]]) -> None: ...
    @property
    def shards(self) -> int: ...
    def overflowed(self) -> bool: ...
    def tiers(self, keys: list[object]) -> bytes | None: ...
    def exist(self, keys: list[object]) -> list[int] | None: ...

# The wire's constants, from kvtier-local-proto (the server's own).
OP_HELLO: int
OP_REGISTER: int
OP_UNREGISTER: int
OP_GET_INTO: int
OP_PUT_FROM: int
OP_EXISTS: int
OP_LOOKUP: int
OP_DELETE: int
OP_PREFETCH: int
OP_GET_INTO_V: int
OP_PUT_FROM_V: int
OP_MAP_ARENA: int
OP_LEASE: int
OP_RELEASE: int
OP_MAP_INDEX: int
OP_NAMES: dict[int, str]
OP_ERROR: int
RESPONSE: int
MAGIC: int
HEADER_BYTES: int
MAX_ITEMS: int
MAX_PARTS: int
MAX_PAYLOAD_BYTES: int
MAX_IN_FLIGHT: int
VERSIONS: list[int]
VERSION_TAGS: int
VERSION_LEASES: int
ITEM_BYTES: int
PART_BYTES: int
CLOSE_CONFIRM_S: float
CLIENT_NAME: str

#: A batch item: ``(handle, offset, length, key)``, or for a vectored op
#: ``(parts, key)`` with parts ``(handle, offset, length)``.
Item = tuple[int, int, int, str] | tuple[Sequence[tuple[int, int, int]], str]

class Ticket:
    """One request in flight; :meth:`Connection.wait` on it once."""

class Connection:
    """One same-host connection (kvtier-client), thread-safe; every wait releases the GIL."""

    def __init__(self, path: str, *, timeout_s: float = 30.0) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def alive(self) -> bool: ...
    @property
    def gave_up(self) -> bool: ...
    @property
    def close_confirmed(self) -> bool: ...
    def wait_close_confirmed(self, timeout_s: float) -> bool: ...
    @property
    def version(self) -> int: ...
    def peer_pid(self) -> int: ...
    def close(self, reason: str = ...) -> None: ...
    def abandon(self, reason: str) -> None: ...
    def request(self, op: int, payload: bytes, *, fd: int | None = None) -> Ticket: ...
    def wait(self, ticket: Ticket, timeout_s: float | None = None) -> tuple[bytes, int, list[int]]: ...
    def post(self, op: int, payload: bytes) -> bool: ...
    def hello(
        self,
        *,
        token: str | None = None,
        block_bytes: int | None = None,
        model: str | None = None,
        client: str = ...,
        versions: Sequence[int] | None = None,
    ) -> str: ...
    def register(self, fd: int, offset: int, length: int) -> tuple[int, int]: ...
    def unregister(self, handle: int) -> None: ...
    def get_into(self, items: Sequence[Item], timeout_s: float | None = None) -> list[tuple[int, int]]: ...
    def put_from(
        self, items: Sequence[Item], timeout_s: float | None = None, *, tags: Sequence[bytes] | None = None
    ) -> list[tuple[int, int]]: ...
    def transfer(
        self, op: int, items: Sequence[Item], tags: Sequence[bytes] | None, timeout_s: float, seconds_per_gib: float
    ) -> tuple[list[tuple[int, int]], int, list[str]]: ...
    def exists(self, keys: Sequence[str]) -> list[int]: ...
    def lookup(self, keys: Sequence[str]) -> tuple[int, list[int]]: ...
    def delete(self, keys: Sequence[str]) -> list[int]: ...
    def prefetch(self, keys: Sequence[str]) -> tuple[int, int]: ...
    def lease(self, keys: Sequence[str]) -> list[tuple[int, int, int, int, int, int]]: ...
    def release(self, ids: Sequence[int]) -> int: ...
    def release_post(self, ids: Sequence[int]) -> bool: ...
    def release_later(self, ids: Sequence[int]) -> None: ...
    def map_arena(self, arena: int) -> tuple[int, tuple[int, int, int, int]]: ...
    def map_index(self, shard: int) -> tuple[int, tuple[int, int, int]]: ...

def still_leased(generation: int, leased: int) -> bool:
    """Whether the generation at address ``generation`` still equals ``leased`` (after an acquire fence)."""

def copy_leased(dst: int, src: int, nbytes: int, generation: int, leased: int) -> bool:
    """Copies a leased block (GIL released), then checks its generation as :func:`still_leased`."""

#: Every same-host code by name (OK, the server's, the client's own two).
CODES: dict[str, int]
#: Tier numbers on the wire → names (1 gpu, 2 ram, 3 nvme, 4 s3).
TIER_NAMES: dict[int, str]
