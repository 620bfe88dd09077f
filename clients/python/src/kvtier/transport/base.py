"""The one interface both transports of :class:`kvtier.Client` implement:
HTTP/1.1 (:class:`kvtier.transport.http.HttpTransport`) and the same-host socket
(:class:`kvtier.transport.unix.UnixTransport`).

The client's block methods and the Mooncake-style buffer calls
(:class:`kvtier.mooncake.MooncakeStore`) speak only this interface; which
transport serves a call is chosen by :class:`kvtier.transport.link.Link`. A transport
is handed what it needs when it is made (the client's settings, the table of
registered buffers, the batch threads) and never reads the client.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import GeometryMismatchError
from ..memory.regions import Region
from ..tag import BlockTag

if TYPE_CHECKING:
    from ..memory.leases import Leases

#: A target or source of one item of a buffer call: ``(address, nbytes, is a
#: buffer object)``, or the code it already failed with.
Span = tuple[int, int, bool] | int
#: The spans of one multi-buffer item: ``(region, offset in it, length)`` each.
Parts = Sequence[tuple[Region, int, int]]


def check_block_bytes(url: str, block_bytes: int, expect: int | None) -> int:
    """``block_bytes``, the server's, when it is the one the client expects.

    Raises:
        GeometryMismatchError: the client was built for another block size.
    """
    if expect is not None and block_bytes != expect:
        raise GeometryMismatchError(
            f"the server at {url} has block_bytes {block_bytes}; the client expects {expect}",
            code="geometry_mismatch",
        )
    return block_bytes


class Threads:
    """The thread pool the batched forms (and :class:`~kvtier.AsyncClient`)
    run calls on: ``size`` threads, started on first use."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        """The pool, started on the first call."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._size, thread_name_prefix="kvtier")
            return self._executor

    def shutdown(self) -> None:
        """Stops the pool's threads once their calls finish, without waiting."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)


class Transport(ABC):
    """How one client moves blocks: the block API of :class:`kvtier.Client`
    (same arguments, results and errors) and the item-level operations the
    Mooncake-style calls are built on (results per item, never raising for
    an item's fate)."""

    #: ``"http"`` or ``"unix"``: what :attr:`kvtier.Client.transport` says.
    name: str

    @property
    @abstractmethod
    def block_bytes(self) -> int:
        """The store's block size in bytes, as this transport learns it."""

    # ------------------------------------------------------------ block API

    @abstractmethod
    def put(self, key: str, data: Any, tag: BlockTag | None = None) -> bool:
        """:meth:`kvtier.Client.put`."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """:meth:`kvtier.Client.get`."""

    @abstractmethod
    def get_into(self, key: str, buf: Any) -> bool:
        """:meth:`kvtier.Client.get_into`."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """:meth:`kvtier.Client.exists`."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """:meth:`kvtier.Client.delete`."""

    @abstractmethod
    def tier_of(self, key: str) -> str | None:
        """:meth:`kvtier.Client.tier_of`."""

    @abstractmethod
    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """:meth:`kvtier.Client.lookup_tiers`."""

    @abstractmethod
    def prefetch(self, keys: Sequence[str]) -> int:
        """:meth:`kvtier.Client.prefetch`."""

    @abstractmethod
    def put_many(self, items: Iterable[tuple[str, Any]], tags: Sequence[BlockTag | None] | None = None) -> list[bool]:
        """:meth:`kvtier.Client.put_many`."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`kvtier.Client.get_many`."""

    @abstractmethod
    def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        """:meth:`kvtier.Client.get_many_into`."""

    @abstractmethod
    def ping(self) -> bool:
        """Whether the server answers on this transport (never raises for that)."""

    @abstractmethod
    def lease(self, keys: Sequence[str]) -> Leases:
        """:meth:`kvtier.Client.lease` (only the same-host socket has leases)."""

    @abstractmethod
    def pin_arenas(self, device: int) -> int:
        """:meth:`kvtier.Client.pin_arenas` (only the same-host socket has arenas)."""

    @abstractmethod
    def close(self) -> None:
        """Closes the transport's connections; calls after it raise."""

    # -------------------------------------------------- Mooncake's buffers

    @abstractmethod
    def share(self, ptr: int, nbytes: int, obj: Any) -> Region | int:
        """The :class:`~kvtier.memory.regions.Region` to register for ``nbytes`` at
        ``ptr`` (``obj`` the buffer object, if any, kept alive by it), or
        the code why this transport cannot use that memory."""

    @abstractmethod
    def register(self, region: Region) -> int:
        """Makes ``region`` known to the server: 0, or the code that refused it."""

    @abstractmethod
    def unregister(self, region: Region) -> None:
        """Forgets ``region`` on the server (a no-op where it never knew it)."""

    @abstractmethod
    def move(
        self, op: int, keys: Sequence[str], spans: Sequence[Span], tags: Sequence[BlockTag | None] | None = None
    ) -> list[int]:
        """``OP_GET_INTO``/``OP_PUT_FROM`` of ``keys[i]`` at ``spans[i]`` (a
        put with the block tag ``tags[i]``, checked already, if any); per
        item the bytes read (get), 0 or more (put), or a negative code."""

    @abstractmethod
    def move_parts(
        self, op: int, keys: Sequence[str], parts: Sequence[Parts], tags: Sequence[BlockTag | None] | None = None
    ) -> list[int]:
        """``OP_GET_INTO_V``/``OP_PUT_FROM_V`` of ``keys[i]`` scattered over
        (gathered from) ``parts[i]`` (a put with ``tags[i]``), all checked
        already; per item as :meth:`move`."""

    @abstractmethod
    def exist_codes(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 (stored), 0 (not), -1 (a bad key, or the request failed)."""

    @abstractmethod
    def plane(self) -> tuple[str | None, int | None, dict[str, int]]:
        """``(socket path, server epoch, counters)`` for
        :meth:`kvtier.Client.local_stats`."""


__all__ = ["Parts", "Span", "Threads", "Transport", "check_block_bytes"]
