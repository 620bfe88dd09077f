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
``block_bytes`` must equal LMCache's full chunk size (checked at start; both
numbers are named when they differ), ``save_chunk_meta`` must be off, and
partial chunks (``save_unfull_chunk: true``) are not stored — a partial chunk
is a miss next time, as the default LMCache setting makes it anyway.

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

from ._connector import Failures, client_options
from .aio import AsyncClient
from .errors import KvtierConnectionError, KvtierError
from .keys import Namespace

logger = logging.getLogger("kvtier.lmcache")

#: Prefix of this plugin's settings in LMCache's ``extra_config``.
SETTINGS_PREFIX = "remote_storage_plugin.kvtier."


class KvtierConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over a kvtier server.

    Built by LMCache's ``DynamicConnectorAdapter`` as
    ``KvtierConnector(loop=, local_cpu_backend=, config=)``; the chunk shape
    comes from ``local_cpu_backend.metadata``.

    Raises (at construction, stopping LMCache's start, since they are
    configuration errors a retry cannot fix):
        IrrecoverableException: ``save_chunk_meta`` is on, or the server's
            ``block_bytes`` is not LMCache's full chunk size (both named).

    Attributes:
        stats: counters (``gets``, ``hits``, ``misses``, ``puts``,
            ``puts_skipped_partial``, ``errors``) for tests and debugging.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any, **_: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        settings = _settings(config)
        if self.save_chunk_meta:
            raise IrrecoverableException(
                "kvtier stores each LMCache chunk as one fixed-size block without LMCache's metadata header: "
                "set extra_config save_chunk_meta: false (and keep use_layerwise off)"
            )
        options = client_options(settings)
        self.url = options["url"]
        self.client = AsyncClient(**options)
        self.down_s = float(settings.get("down_s", 1.0))
        self.chunk_tokens = int(local_cpu_backend.metadata.chunk_size)
        self.stats = {"gets": 0, "hits": 0, "misses": 0, "puts": 0, "puts_skipped_partial": 0, "errors": 0}
        self._failures = Failures(logger, self.down_s)
        self._geometry_checked = False
        self._check_geometry()

    # ------------------------------------------------------------ helpers

    def _check_geometry(self) -> bool:
        """Compares the server's ``block_bytes`` with the full chunk size once
        the server is reachable. Unreachable: ``False`` (checked again at the
        next call). Mismatch: raises."""
        if self._failures.down():
            return False
        if self._geometry_checked:
            return True
        try:
            block_bytes = self.client.sync.block_bytes
        except KvtierError as e:
            self._failed("start", e)
            return False
        if block_bytes != self.full_chunk_size_bytes:
            raise IrrecoverableException(
                f"kvtier at {self.url} stores blocks of {block_bytes} bytes but an LMCache chunk here is "
                f"{self.full_chunk_size_bytes} bytes (chunk_size {self.chunk_tokens} tokens × "
                f"{self.single_token_size} bytes): start kvtier with --block-bytes {self.full_chunk_size_bytes} "
                "on a new data directory, or change chunk_size"
            )
        self._geometry_checked = True
        return True

    async def _ready(self) -> bool:
        """Whether to try kvtier now: not marked down, geometry checked."""
        if self._failures.down():
            return False
        if self._geometry_checked:
            return True
        return await asyncio.get_running_loop().run_in_executor(self.client.sync.executor(), self._check_geometry)

    def key_of(self, key: CacheEngineKey) -> str:
        """The kvtier key of an LMCache chunk key (see the module docstring)."""
        return _kvtier_key(key.model_name, key.world_size, key.worker_id, str(key.dtype), key.tags, self.chunk_tokens)(
            key.chunk_hash
        )

    def _failed(self, what: str, error: Exception) -> None:
        """Counts and (rate-limited) logs a failure; a connection failure also
        marks the server down for ``down_s``."""
        self.stats["errors"] += 1
        self._failures.record(what, f"{self.url}: {error}; answered as a miss", error)

    # ------------------------------------------------------- RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        """Whether the chunk is stored (one HEAD); ``False`` when kvtier fails."""
        try:
            return await self._ready() and await self.client.exists(self.key_of(key))
        except KvtierError as e:
            self._failed("exists", e)
            return False

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """:meth:`exists`, blocking the calling thread."""
        try:
            return self._check_geometry() and self.client.sync.exists(self.key_of(key))
        except KvtierError as e:
            self._failed("exists", e)
            return False

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """Reads the chunk straight into a new ``MemoryObj`` of LMCache's CPU
        pool (no intermediate copy); ``None`` on a miss, a full pool or a
        kvtier failure."""
        self.stats["gets"] += 1
        try:
            if not await self._ready():
                return None
        except KvtierError as e:
            self._failed("get", e)
            return None
        memory_obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if memory_obj is None:
            logger.debug("LMCache's CPU pool is full; kvtier get of %s skipped", key)
            return None
        try:
            found = await self.client.get_into(self.key_of(key), memory_obj.byte_array)
        except KvtierError as e:
            memory_obj.ref_count_down()
            self._failed("get", e)
            return None
        if not found:
            memory_obj.ref_count_down()
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        return memory_obj

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Stores a full chunk. A partial chunk (shorter than ``block_bytes``)
        is skipped. Raises :class:`~kvtier.KvtierError` when kvtier refuses
        or cannot be reached (LMCache's put task counts and logs it)."""
        data = memory_obj.byte_array
        if len(data) != self.full_chunk_size_bytes:
            self.stats["puts_skipped_partial"] += 1
            logger.debug("kvtier skips a partial chunk of %d bytes (%s)", len(data), key)
            return
        if not await self._ready():
            raise KvtierConnectionError(f"{self.url} is marked down after a failure; put skipped", code="server_down")
        try:
            await self.client.put(self.key_of(key), data)
        except KvtierError as e:
            self._failed("put", e)
            raise
        self.stats["puts"] += 1

    def support_batched_get(self) -> bool:
        """Batched gets run over the connection pool in parallel."""
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """:meth:`get` of every key, concurrently; ``None`` per miss."""
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    def support_batched_put(self) -> bool:
        """Batched puts run over the connection pool in parallel."""
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """:meth:`put` of every pair, concurrently; raises the first failure
        once all have finished."""
        results = await asyncio.gather(
            *(self.put(k, m) for k, m in zip(keys, memory_objs, strict=True)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """Leading chunks of a prompt's chain that are stored: one
        ``POST /v1/lookup`` for the whole chain. 0 when kvtier fails."""
        try:
            if not keys or not await self._ready():
                return 0
            return await self.client.lookup([self.key_of(k) for k in keys])
        except KvtierError as e:
            self._failed("lookup", e)
            return 0

    def support_batched_contains(self) -> bool:
        """Blocking prefix lookups go to :meth:`batched_contains`."""
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """:meth:`batched_async_contains`, blocking the calling thread."""
        try:
            if not keys or not self._check_geometry():
                return 0
            return self.client.sync.lookup([self.key_of(k) for k in keys])
        except KvtierError as e:
            self._failed("lookup", e)
            return 0

    def support_ping(self) -> bool:
        """LMCache's health check may ping kvtier's ``/healthz``."""
        return True

    async def ping(self) -> int:
        """0 when ``/healthz`` answers 200, 1 otherwise."""
        return 0 if await self.client.ping() else 1

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Deletes the chunk; ``True`` if one was stored."""
        try:
            return self.client.sync.delete(self.key_of(key))
        except KvtierError as e:
            self._failed("remove", e)
            return False

    async def list(self) -> list[str]:
        """Always empty: kvtier does not enumerate its keys (blocks are found
        by their chain; LMCache lists only to warm up from its FS connector)."""
        return []

    async def close(self) -> None:
        """Closes the client's connections."""
        await self.client.close()

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
