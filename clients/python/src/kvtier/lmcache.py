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
logs an error: the rule of every connector, ``kvtier._connector``),
``save_chunk_meta`` must be off, and partial chunks (``save_unfull_chunk:
true``) are not stored — a partial chunk is a miss next time, as the default
LMCache setting makes it anyway.

Keys: ``CacheEngineKey`` (``model@world@worker@hash@dtype[@tags]``) becomes
``<fingerprint>-<hash>`` where the fingerprint (docs/KEYS.md) covers the model,
dtype, worker rank and world size, chunk tokens and tags.

A kvtier that is down, slow or answering 5xx costs misses and a warning (at
most one per 10 s per kind), never an exception where LMCache waits on the
answer (``exists``, ``get``, lookups). A failed ``put`` raises into LMCache's
put task, which counts it (``put_failed_count``) and logs it; nothing waits
on that task.

Settings, all under ``remote_storage_plugin.kvtier.`` in ``extra_config``:

=================  ========================  ==========================================
key                default                   meaning
=================  ========================  ==========================================
``url``            ``http://127.0.0.1:8085``  the kvtier server
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

from ._connector import ConnectorCore, GeometryError
from .aio import AsyncClient
from .errors import KvtierError
from .keys import Namespace

logger = logging.getLogger("kvtier.lmcache")

#: Prefix of this plugin's settings in LMCache's ``extra_config``.
SETTINGS_PREFIX = "remote_storage_plugin.kvtier."


class KvtierConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvtier server.

    Built by LMCache's ``DynamicConnectorAdapter`` as
    ``KvtierConnector(loop=, local_cpu_backend=, config=)``; the chunk shape
    comes from ``local_cpu_backend.metadata``. Readiness, the geometry check,
    failures, stats and fan-out are kvtier's shared connector core
    (``kvtier._connector``).

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
            ``puts_skipped_partial``, ``errors``) for tests and debugging.
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
        self._core = ConnectorCore(
            _settings(config), logger=logger, stats=("gets", "hits", "misses", "puts", "puts_skipped_partial")
        )
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
        pool (no intermediate copy); ``None`` on a miss, a full pool or a
        kvtier failure."""
        self._core.count(gets=1)
        if not await self._core.ready_async():
            return None
        memory_obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if memory_obj is None:
            logger.debug("LMCache's CPU pool is full; kvtier get of %s skipped", key)
            return None
        found = await self._core.call_async(
            "get", self.client.sync.get_into, self.key_of(key), memory_obj.byte_array, failed=None
        )
        if not found:
            memory_obj.ref_count_down()
            if found is False:
                self._core.count(misses=1)
            return None
        self._core.count(hits=1)
        return memory_obj

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Stores a full chunk. A partial chunk (shorter than ``block_bytes``)
        is skipped. Raises :class:`~kvtier.KvtierError` when kvtier refuses,
        cannot be reached or is marked down, or the geometry does not match
        (LMCache's put task counts and logs it; nothing waits on it)."""
        data = memory_obj.byte_array
        if len(data) != self.full_chunk_size_bytes:
            self._core.count(puts_skipped_partial=1)
            logger.debug("kvtier skips a partial chunk of %d bytes (%s)", len(data), key)
            return
        if not await self._core.ready_async():
            raise self._core.not_ready()
        try:
            await self.client.put(self.key_of(key), data)
        except KvtierError as e:
            self._core.failed("put", e)
            raise
        self._core.count(puts=1)

    def support_batched_get(self) -> bool:
        """Batched gets run over the connection pool in parallel."""
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """:meth:`get` of every key, concurrently; ``None`` per miss."""
        return await self._core.gather(self.get(key) for key in keys)

    def support_batched_put(self) -> bool:
        """Batched puts run over the connection pool in parallel."""
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """:meth:`put` of every pair, concurrently; raises the first failure
        once all have finished."""
        await self._core.gather(self.put(k, m) for k, m in zip(keys, memory_objs, strict=True))

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
        """Closes the client's connections."""
        self._core.close()

    def __repr__(self) -> str:
        return f"<KvtierConnector {self.url}>"


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
