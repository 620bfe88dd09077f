"""The asyncio kvtier client: :class:`AsyncClient`, the same methods as
:class:`~kvtier.Client`, as coroutines.

Each call runs the blocking client's exchange on the client's thread pool (one
thread per pooled connection) and is awaited on the running event loop, so
the loop never blocks on a socket. Why not asyncio's own transports: they hand
a protocol every received chunk as a new ``bytes`` object, a copy per chunk
that ``get_into`` exists to avoid, while a blocking ``recv_into`` in a worker
thread reads straight into the caller's buffer and releases the GIL while it
waits. ``make bench-python`` measures both clients side by side.

A worker thread cannot be stopped, so a call cancelled while its thread runs
(``asyncio.wait_for`` timing out, a task cancelled, a failed item of
``get_many_into``) ends once that thread has (within the client's
``timeout_s``): nothing is written into a caller's buffer after its
coroutine has ended. A call cancelled before its thread started never runs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from .client import Client
from .memory.leases import Leases
from .tag import BlockTag, tags_for

T = TypeVar("T")


class AsyncClient:
    """Asyncio client of one kvtier server. Arguments, errors and return
    values are those of :class:`~kvtier.Client`; every method is a coroutine.

    ``block_bytes`` is a property as on :class:`~kvtier.Client`; in a running
    loop, ``await client.get_block_bytes()`` (or ``async with``) first, so the
    property never has to ask the server from inside the loop.
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
    ) -> None:
        self.sync = Client(url, token=token, connections=connections, timeout_s=timeout_s, retries=retries, local=local)
        """The blocking client underneath (shares the pool and threads)."""

    @classmethod
    def over(cls, client: Client) -> AsyncClient:
        """An asyncio client over an existing blocking ``client``: the same
        pool, threads and remembered ``block_bytes`` (closing one closes both)."""
        self = cls.__new__(cls)
        self.sync = client
        return self

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        call = self.sync.executor().submit(functools.partial(fn, *args))
        done = asyncio.wrap_future(call)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            # A call running in its thread may be reading into the caller's
            # buffer: the cancellation takes effect once it has ended.
            if not call.cancel():
                await _finished([done])
            raise

    async def __aenter__(self) -> AsyncClient:
        await self.get_block_bytes()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the pool's connections and its threads."""
        self.sync.close()

    @property
    def block_bytes(self) -> int:
        """The store's block size in bytes (see the class docstring)."""
        return self.sync.block_bytes

    async def get_block_bytes(self) -> int:
        """The store's block size in bytes, asked of the server once."""
        return await self._run(lambda: self.sync.block_bytes)

    async def put(self, key: str, data: Any, tag: BlockTag | None = None) -> bool:
        """:meth:`kvtier.Client.put` (with ``tag``): ``True`` if created, ``False`` if replaced."""
        return await self._run(self.sync.put, key, data, tag)

    async def get(self, key: str) -> bytes | None:
        """:meth:`kvtier.Client.get`: the block, or ``None`` on a miss."""
        return await self._run(self.sync.get, key)

    async def get_into(self, key: str, buf: Any) -> bool:
        """:meth:`kvtier.Client.get_into`: read into ``buf``; ``False`` on a miss."""
        return await self._run(self.sync.get_into, key, buf)

    async def exists(self, key: str) -> bool:
        """:meth:`kvtier.Client.exists`."""
        return await self._run(self.sync.exists, key)

    async def delete(self, key: str) -> bool:
        """:meth:`kvtier.Client.delete`: ``True`` if a block was deleted."""
        return await self._run(self.sync.delete, key)

    async def lookup(self, keys: Sequence[str]) -> int:
        """:meth:`kvtier.Client.lookup`: prefix hits of the chain ``keys``."""
        return await self._run(self.sync.lookup, list(keys))

    async def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """:meth:`kvtier.Client.lookup_tiers`."""
        return await self._run(self.sync.lookup_tiers, list(keys))

    async def prefetch(self, keys: Sequence[str]) -> int:
        """:meth:`kvtier.Client.prefetch`: how many of ``keys`` are stored."""
        return await self._run(self.sync.prefetch, list(keys))

    async def lease(self, keys: Sequence[str]) -> Leases:
        """:meth:`kvtier.Client.lease`: leases the blocks of ``keys`` in the
        server's RAM tier (same-host socket). Use the result with ``with`` or
        ``async with``: leaving it sends the ``RELEASE`` without waiting for
        its answer, so it does not block the loop."""
        return await self._run(self.sync.lease, keys)

    async def pin_arenas(self, device: int = 0) -> int:
        """:meth:`kvtier.Client.pin_arenas`: page-locks the server's arenas
        for CUDA device ``device``; the bytes page-locked."""
        return await self._run(self.sync.pin_arenas, device)

    async def stats(self) -> dict[str, Any]:
        """:meth:`kvtier.Client.stats`."""
        return await self._run(self.sync.stats)

    async def ping(self) -> bool:
        """:meth:`kvtier.Client.ping`."""
        return await self._run(self.sync.ping)

    async def put_many(
        self, items: Iterable[tuple[str, Any]], tags: Sequence[BlockTag | None] | None = None
    ) -> list[bool]:
        """:meth:`kvtier.Client.put_many` (item ``i`` with ``tags[i]``), the puts running concurrently (on
        the first error, those not yet started are cancelled)."""
        pairs = list(items)
        tag_list = tags_for(tags, len(pairs))
        return await _gather([self.put(key, data, tag) for (key, data), tag in zip(pairs, tag_list, strict=True)])

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`kvtier.Client.get_many`."""
        return await _gather([self.get(key) for key in keys])

    async def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        """:meth:`kvtier.Client.get_many_into`.

        Raises:
            ValueError: ``keys`` and ``bufs`` differ in length.
        """
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        return await _gather([self.get_into(key, buf) for key, buf in zip(keys, bufs, strict=True)])


async def _finished(futs: Sequence[asyncio.Future[Any]]) -> None:
    """Waits until every one of ``futs`` is done, through further
    cancellations (a cancelled call's thread still runs); their outcomes are
    dropped."""
    while not all(f.done() for f in futs):
        try:
            await asyncio.wait([f for f in futs if not f.done()])
        except asyncio.CancelledError:
            continue
    for f in futs:
        if not f.cancelled():
            f.exception()  # retrieved: not logged as never retrieved


async def _gather(coros: list[Any]) -> list[Any]:
    """Every result in order. On the first failure the calls not yet started
    are cancelled and the failure is raised once the running ones finish (as
    the blocking batched forms do: a cancelled call's coroutine ends when its
    thread has, :meth:`AsyncClient._run`). Cancelled, it cancels every call
    and ends once they have."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        # Cancelled itself (``asyncio.wait_for``): so are its calls, and it
        # ends once they have.
        for task in tasks:
            task.cancel()
        await _finished(tasks)
        raise
    if pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return [task.result() for task in tasks]
