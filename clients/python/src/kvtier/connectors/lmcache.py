"""kvtier as an LMCache remote storage plugin (lmcache 0.5.x).

LMCache loads it by name, without patching LMCache (docs/INTEGRATIONS.md has
the full settings for vLLM and SGLang)::

    remote_storage_plugins: ["kvtier"]
    extra_config:
      remote_storage_plugin.kvtier.module_path: kvtier.lmcache
      remote_storage_plugin.kvtier.class_name: KvtierConnector
      remote_storage_plugin.kvtier.url: http://127.0.0.1:8085
      save_chunk_meta: false

One LMCache chunk is one kvtier block, stored header-free: the store's
``block_bytes`` must equal LMCache's full chunk size (compared at start and
refused with both numbers named; if kvtier is down then, compared at the
first call that reaches it, and a mismatch then makes every call a miss and
logs an error: the rule of every connector, ``kvtier.connectors.core``),
``save_chunk_meta`` must be off, and partial chunks (``save_unfull_chunk:
true``) are not stored — a partial chunk is a miss next time, as the default
LMCache setting makes it anyway.

Keys: ``CacheEngineKey`` (``model@world@worker@hash@dtype[@tags]``) becomes
``<fingerprint>-<hash>`` where the fingerprint (docs/KEYS.md) covers the model,
dtype, worker rank and world size, chunk tokens and tags.

Block tags (kvtier's KV events): none. LMCache hands a remote connector a
``CacheEngineKey`` and the chunk's bytes only: no token ids, not vLLM's
block hashes, and LMCache's own chunk hash (an int, chained over its
chunks) with nothing naming the chunk before, so a tag could only claim
that every chunk starts a sequence (docs/INTEGRATIONS.md).

A kvtier that is down, slow or answering 5xx costs misses and a warning (at
most one per 10 s per kind), never an exception where LMCache waits on the
answer (``exists``, ``get``, lookups). A failed ``put`` raises into LMCache's
put task, which counts it (``put_failed_count``) and logs it; nothing waits
on that task.

The same-host plane (``local``, docs/LOCAL.md): with ``extra_config.shm_name``
set, LMCache 0.5.6 allocates its CPU buffer, where every ``MemoryObj`` of a
chunk lives, as a POSIX shared-memory file (``/dev/shm/<shm_name>``). Over
the socket the connector registers that buffer once, and each batch is one
``batch_get_into``/``batch_put_from`` in which kvtier copies straight into
or out of the ``MemoryObj`` s: no copy in LMCache's process
(``zero_copy_chunks``). Without ``shm_name`` the buffer is anonymous memory,
which cannot be registered: chunks are staged through the client's staging
area, one more copy of every byte (``staged_chunks``; a warning says so
once). Over HTTP each chunk is one request, received straight into its
``MemoryObj``. LMCache uses ``shm_name`` as given in every worker process:
give each worker its own (with tensor parallelism, one config per rank).

Settings, all under ``remote_storage_plugin.kvtier.`` in ``extra_config``
(and LMCache's own ``shm_name`` beside them):

=================  ========================  ==========================================
key                default                   meaning
=================  ========================  ==========================================
``url``            ``http://127.0.0.1:8085``  the kvtier server
``local``          ``auto``                  ``auto``: the same-host socket when kvtier
                                             serves one (``local.socket`` of
                                             ``/v1/stats``), else HTTP; ``off``: HTTP
                                             only; ``on``: the socket or misses
``token_file``     none                      file holding the bearer token
``connections``    8                         HTTP/1.1 connections (transfers in flight)
``timeout_s``      10                        per socket operation; then a miss
``retries``        1                         new-connection retries after a reset
``down_s``         1                         after a connection failure, answer misses
                                             for this long without trying (so a down
                                             server costs no time per lookup)
=================  ========================  ==========================================
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .. import codes
from ..aio import AsyncClient
from ..errors import KvtierError, error_from_code
from ..keys import Namespace
from ..transport.http import get_code, put_code
from .core import CALL_ERRORS, ConnectorCore, GeometryError
from .shared_host import SharedHost

logger = logging.getLogger("kvtier.lmcache")

#: Prefix of this plugin's settings in LMCache's ``extra_config``.
SETTINGS_PREFIX = "remote_storage_plugin.kvtier."


class KvtierConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvtier server.

    Built by LMCache's ``DynamicConnectorAdapter`` as
    ``KvtierConnector(loop=, local_cpu_backend=, config=)``; the chunk shape
    comes from ``local_cpu_backend.metadata``. Readiness, the geometry check,
    failures, stats and fan-out are kvtier's shared connector core
    (``kvtier.connectors.core``).

    Raises (at construction, so LMCache logs it and runs without the remote
    tier, since they are configuration errors a retry cannot fix):
        IrrecoverableException: ``save_chunk_meta`` is on, or the server
            answers and its ``block_bytes`` is not LMCache's full chunk size
            (both named; the cause is a ``GeometryError``). A mismatch found
            later (kvtier was down at start) raises nothing: every call is a
            miss (a failed put) and an error naming both sizes is logged.

    Attributes:
        url: the kvtier server.
        client: the :class:`~kvtier.AsyncClient` every call goes through.
        stats: counters (``gets``, ``hits``, ``misses``, ``puts``,
            ``puts_skipped_partial``, ``errors``; ``zero_copy_chunks``:
            chunks kvtier copied straight into or out of LMCache's registered
            CPU buffer; ``staged_chunks``: chunks moved over the socket
            through the client's staging area) for tests and debugging.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any, **_: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        if self.save_chunk_meta:
            raise IrrecoverableException(
                "kvtier stores each LMCache chunk as one fixed-size block without LMCache's metadata header: "
                "set extra_config save_chunk_meta: false (and keep use_layerwise off)"
            )
        stats = ("gets", "hits", "misses", "puts", "puts_skipped_partial", "zero_copy_chunks", "staged_chunks")
        self._core = ConnectorCore(_settings(config), logger=logger, stats=stats)
        self.url = self._core.url
        self.down_s = self._core.down_s
        self.client = AsyncClient.over(self._core.client)
        self.stats = self._core.stats
        self.chunk_tokens = int(local_cpu_backend.metadata.chunk_size)
        try:
            self._core.start(
                self.full_chunk_size_bytes,
                chunk=f"an LMCache chunk here (chunk_size {self.chunk_tokens} tokens × {self.single_token_size} bytes)",
                remedy="change chunk_size",
            )
        except GeometryError as e:
            raise IrrecoverableException(str(e)) from e
        self._host = SharedHost(
            self._core,
            _cpu_buffer(local_cpu_backend),
            what="LMCache's CPU buffer",
            remedy="Set extra_config shm_name (one name per worker process) so LMCache allocates it in /dev/shm.",
        )

    @property
    def transport(self) -> str | None:
        """``"unix"`` or ``"http"``: how chunks move, once known; else ``None``."""
        return self._core.transport

    def key_of(self, key: CacheEngineKey) -> str:
        """The kvtier key of an LMCache chunk key (see the module docstring)."""
        return _kvtier_key(key.model_name, key.world_size, key.worker_id, str(key.dtype), key.tags, self.chunk_tokens)(
            key.chunk_hash
        )

    # ------------------------------------------------------- RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        """Whether the chunk is stored (one HEAD); ``False`` when kvtier fails."""
        return await self._core.call_async("exists", self.client.sync.exists, self.key_of(key), failed=False)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """:meth:`exists`, blocking the calling thread."""
        return self._core.call("exists", self.client.sync.exists, self.key_of(key), failed=False)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """Reads the chunk straight into a new ``MemoryObj`` of LMCache's CPU
        pool (over the socket with the buffer registered, kvtier writes it;
        no intermediate copy); ``None`` on a miss, a full pool or a kvtier
        failure."""
        return (await self.batched_get([key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Stores a full chunk. A partial chunk (shorter than ``block_bytes``)
        is skipped. Raises :class:`~kvtier.KvtierError` when kvtier refuses,
        cannot be reached or is marked down, or the geometry does not match
        (LMCache's put task counts and logs it; nothing waits on it)."""
        await self.batched_put([key], [memory_obj])

    def support_batched_get(self) -> bool:
        """Batched gets are one call: one frame over the socket, or GETs in
        parallel over the connection pool."""
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """:meth:`get` of every key: one ``batch_get_into`` into new
        ``MemoryObj`` s; ``None`` per miss, per object the pool could not
        give, or for every key when kvtier fails."""
        if not keys:
            return []
        self._core.count(gets=len(keys))
        if not await self._core.ready_async():
            return [None] * len(keys)
        objs: list[MemoryObj | None] = []
        for key in keys:
            memory_obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if memory_obj is None:
                logger.debug("LMCache's CPU pool is full; kvtier get of %s skipped", key)
            objs.append(memory_obj)
        batches = self._batches(len(keys))
        calls = [
            self._core.call_async("get", self._get_batch, keys[a : a + n], objs[a : a + n], failed=None)
            for a, n in batches
        ]
        results: list[MemoryObj | None] = [None] * len(keys)
        for (a, n), got in zip(batches, await self._core.gather(calls), strict=True):
            if got is not None:
                results[a : a + n] = got
        for memory_obj, result in zip(objs, results, strict=True):
            if memory_obj is not None and result is None:
                memory_obj.ref_count_down()
        return results

    def _get_batch(self, keys: list[CacheEngineKey], objs: list[MemoryObj | None]) -> list[MemoryObj | None]:
        """On the client's pool: the batch read into ``objs`` (``None``
        entries skipped); each read chunk's object, else ``None``."""
        self._host.decide()
        idx = [i for i, o in enumerate(objs) if o is not None]
        views = [objs[i].byte_array for i in idx]  # type: ignore[union-attr]
        names = [self.key_of(keys[i]) for i in idx]
        results = self._read(names, views) if idx else []
        out: list[MemoryObj | None] = [None] * len(keys)
        for i, name, view, result in zip(idx, names, views, results, strict=True):
            if result >= 0:
                out[i] = objs[i]
                self._host.count_moved(view)
            elif result in (codes.NOT_FOUND, codes.CORRUPT):
                self._core.count(misses=1)
            else:
                self._core.failed("get", error_from_code(result, f"get {name}: {codes.name_of(result)}"))
        self._core.count(hits=sum(o is not None for o in out))
        return out

    def support_batched_put(self) -> bool:
        """Batched puts are one call, as batched gets."""
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Stores every full chunk in one ``batch_put_from`` (partial chunks
        are skipped); raises the first item's failure once all are done."""
        full = []
        for key, memory_obj in zip(keys, memory_objs, strict=True):
            if len(memory_obj.byte_array) != self.full_chunk_size_bytes:
                self._core.count(puts_skipped_partial=1)
                logger.debug("kvtier skips a partial chunk of %d bytes (%s)", len(memory_obj.byte_array), key)
            else:
                full.append((key, memory_obj))
        if not full:
            return
        if not await self._core.ready_async():
            raise self._core.not_ready()
        loop = asyncio.get_running_loop()
        pool = self.client.sync.executor()
        calls = [loop.run_in_executor(pool, self._put_batch, full[at : at + n]) for at, n in self._batches(len(full))]
        for error in await self._core.gather(calls):
            if error is not None:
                raise error

    def _put_batch(self, pairs: list[tuple[CacheEngineKey, MemoryObj]]) -> KvtierError | None:
        """On the client's pool: the batch stored; the first failure, recorded."""
        self._host.decide()
        names = [self.key_of(key) for key, _ in pairs]
        views = [memory_obj.byte_array for _, memory_obj in pairs]
        try:
            results = self._write(names, views)
        except CALL_ERRORS as e:
            self._core.failed("put", e)
            return e if isinstance(e, KvtierError) else KvtierError(f"put: {e}")
        first: KvtierError | None = None
        for name, view, result in zip(names, views, results, strict=True):
            if result >= 0:
                self._core.count(puts=1)
                self._host.count_moved(view)
                continue
            error = error_from_code(result, f"put {name}: {codes.name_of(result)}")
            self._core.failed("put", error)
            first = first or error
        return first

    def _batches(self, n: int) -> list[tuple[int, int]]:
        """``(start, count)`` of the calls ``n`` chunks take: one over the
        socket (one frame, kvtier runs the items concurrently), one per
        chunk over HTTP (each on its own pooled connection)."""
        if self._core.transport == "unix":
            return [(0, n)]
        return [(i, 1) for i in range(n)]

    def _read(self, names: list[str], views: list[Any]) -> list[int]:
        """Per chunk the bytes read or a negative code (docs/LOCAL.md). Over
        HTTP one chunk per call, raising its error (the pool runs the calls
        in parallel; a batch here would wait on the pool from inside it)."""
        if self._core.transport == "unix":
            return self.client.sync.batch_get_into(names, views)
        return [get_code(self.client.sync, k, v) for k, v in zip(names, views, strict=True)]

    def _write(self, names: list[str], views: list[Any]) -> list[int]:
        """Per chunk 0 or a negative code; over HTTP as :meth:`_read`."""
        if self._core.transport == "unix":
            return self.client.sync.batch_put_from(names, views)
        return [put_code(self.client.sync, k, v) for k, v in zip(names, views, strict=True)]

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading chunks of a prompt's chain that are stored: one
        ``POST /v1/lookup`` for the whole chain. 0 when kvtier fails."""
        if not keys:
            return 0
        return await self._core.call_async("lookup", self.client.sync.lookup, [self.key_of(k) for k in keys], failed=0)

    def support_batched_contains(self) -> bool:
        """Blocking prefix lookups go to :meth:`batched_contains`."""
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """:meth:`batched_async_contains`, blocking the calling thread."""
        if not keys:
            return 0
        return self._core.call("lookup", self.client.sync.lookup, [self.key_of(k) for k in keys], failed=0)

    def support_ping(self) -> bool:
        """LMCache's health check may ping kvtier's ``/healthz``."""
        return True

    async def ping(self) -> int:
        """0 when ``/healthz`` answers 200, 1 otherwise."""
        return 0 if await self.client.ping() else 1

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Deletes the chunk; ``True`` if one was stored, ``False`` if not or
        when kvtier fails."""
        return self._core.call("remove", self.client.sync.delete, self.key_of(key), failed=False)

    async def list(self) -> list[str]:
        """Always empty: kvtier does not enumerate its keys (blocks are found
        by their chain; LMCache lists only to warm up from its FS connector)."""
        return []

    async def close(self) -> None:
        """Unregisters LMCache's CPU buffer and closes the client's connections."""
        self._host.release()
        self._core.close()

    def __repr__(self) -> str:
        return f"<KvtierConnector {self.url}>"


def _cpu_buffer(local_cpu_backend: Any) -> Any:
    """The tensor LMCache carves its CPU ``MemoryObj`` s from (the local CPU
    backend's allocator's ``buffer``), or ``None`` when it has none."""
    buffer = getattr(getattr(local_cpu_backend, "memory_allocator", None), "buffer", None)
    if buffer is None or not hasattr(buffer, "data_ptr") or buffer.numel() == 0:
        return None
    return buffer


def _settings(config: Any) -> dict[str, Any]:
    """This plugin's ``remote_storage_plugin.kvtier.*`` settings, prefix removed."""
    extra = getattr(config, "extra_config", None) or {}
    return {k[len(SETTINGS_PREFIX) :]: v for k, v in extra.items() if k.startswith(SETTINGS_PREFIX)}


@functools.lru_cache(maxsize=256)
def _kvtier_key(
    model: str, world_size: int, worker_id: int, dtype: str, tags: tuple[Any, ...] | None, chunk_tokens: int
) -> Any:
    """The key maker of one (model, layout, dtype, tags): the fingerprint is
    hashed once per namespace, not per chunk."""
    extra = "@".join(f"{k}%{v}" for k, v in tags) if tags else ""
    namespace = Namespace(
        model=model, dtype=dtype, tp_rank=worker_id, tp_size=world_size, block_tokens=chunk_tokens, extra=extra
    )
    return namespace.key
