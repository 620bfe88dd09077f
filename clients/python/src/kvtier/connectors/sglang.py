"""kvtier as an SGLang HiCache storage backend (sglang 0.5.x).

SGLang's hierarchical cache keeps KV pages in GPU memory, then in a host
memory pool, then in a storage backend; this module is such a backend,
loaded by name without patching SGLang (docs/INTEGRATIONS.md has the full
command line)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"kvtier",
        "module_path":"kvtier.sglang","class_name":"KvtierHiCacheStorage",
        "url":"http://127.0.0.1:8085","interface_v1":1,"allocator":"shm"}'

One HiCache page is one kvtier block, the flat K+V page SGLang hands its
storage backends: the store's ``block_bytes`` must equal the host pool's page
size in bytes (``get_size_per_token() * page_size``). It is compared when
SGLang registers its host pool, where a mismatch is refused with both numbers
named; if kvtier is down then, at the first call that reaches it, where a
mismatch makes every call a miss with an error log (the rule of every
connector, ``kvtier.connectors.core``).

Keys: SGLang's page hash (a SHA-256 chain over pages, 64 hex digits) under a
namespace fingerprint (docs/KEYS.md) of the model, KV dtype, TP rank and size
(``0/1`` for MLA models, whose KV every TP rank holds whole), PP rank and
size, page size, and the host layout and context-parallel shard.

Block tags (kvtier's KV events, docs/INTEGRATIONS.md): every stored page
carries its page hash as the engine block hash, the previous page's as its
parent and the page size (:meth:`KvtierHiCacheStorage.page_tags`); no token
ids, which HiCache never hands a storage backend. The first page of a call
is tagged only when SGLang says what precedes it (``prefix_keys``, sent with
``"hicache_storage_pass_prefix_keys": true`` in the extra config).

``batch_exists`` is one ``POST /v1/lookup`` for the whole chain of pages.
Both of HiCache's page interfaces are served:

- ``interface_v1`` (``batch_get_v1``/``batch_set_v1`` by host-pool slots, the
  documented setting): with ``"allocator": "shm"`` SGLang allocates its host
  KV pool in a memfd; over the same-host socket (docs/LOCAL.md) the backend
  registers the pool once, and a batch of pages is one
  ``batch_get_into_multi_buffers``/``batch_put_from_multi_buffers``: kvtier
  scatters each page into, or gathers it from, the pool's K and V spans
  (``get_page_buffer_meta``), with no copy in SGLang's process
  (``zero_copy_chunks``). A pool that cannot be registered (SGLang's default
  allocator is anonymous memory, registrable only by a process that may open
  ``/proc/self/map_files``, such as root), or HTTP, moves each page through a
  flat page (``get_data_page``/``set_from_flat_data_page``): one more copy
  (``staged_chunks`` on the socket; said once in a warning).
- the generic interface (``batch_get`` into the flat pages SGLang hands as
  targets, ``batch_set`` of flat pages): each page is one GET or PUT on the
  client's pool, straight into or out of the tensor.

Either way a page's bytes are those of SGLang's flat page (K of every layer,
then V), so pages stored through one interface read back through the
other. ``batch_set`` and ``batch_set_v1`` first ask which leading pages are
already stored (one lookup) and store the rest. A kvtier that is down, slow
or answering 5xx costs misses (``batch_exists`` 0, ``get`` ``None``, ``set``
``False``) and a rate-limited warning, never an exception into SGLang's
storage threads.

Settings, keys of ``--hicache-storage-backend-extra-config`` next to the
three SGLang needs:

=================  ========================  ==========================================
key                default                   meaning
=================  ========================  ==========================================
``url``            ``http://127.0.0.1:8085``  the kvtier server
``local``          ``auto``                  ``auto``: the same-host socket when kvtier
                                             serves one, else HTTP; ``off``: HTTP only;
                                             ``on``: the socket or misses
``interface_v1``   0                         SGLang's setting: 1 for the zero-copy page
                                             path by host slots (documented)
``allocator``      default                   SGLang's setting: ``shm`` puts the host
                                             pool in a memfd kvtier can register
``token_file``     none                      file holding the bearer token
``connections``    8                         HTTP/1.1 connections (pages in flight)
``timeout_s``      10                        per socket operation; then a miss
``retries``        1                         new-connection retries after a reset
``down_s``         1                         after a connection failure, answer misses
                                             for this long without trying
``skip_existing``  true                      ``batch_set`` skips leading stored pages
``page_size``      host pool's               tokens per page, for use without a host
                                             pool (tests, tools)
``dtype``          host pool's               KV dtype name, likewise
=================  ========================  ==========================================
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from .. import codes
from ..errors import InvalidTagError, error_from_code
from ..keys import Namespace
from ..tag import TAG_HASH_BYTES_MAX, BlockTag
from .core import ConnectorCore
from .shared_host import SharedHost

logger = logging.getLogger("kvtier.sglang")


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a kvtier server.

    Built by SGLang's ``StorageBackendFactory`` for ``dynamic`` as
    ``KvtierHiCacheStorage(storage_config, kwargs)``; its settings are the
    keys of ``storage_config.extra_config`` (module docstring). SGLang then
    calls :meth:`register_mem_pool_host`, which fixes the page size and dtype
    of the keys and checks the server's ``block_bytes``. Readiness, the
    geometry check, failures, stats and fan-out are kvtier's shared
    connector core (``kvtier.connectors.core``).

    Raises:
        ValueError: from :meth:`register_mem_pool_host` when the server
            answers and its ``block_bytes`` is not the host pool's page size
            (a ``GeometryError``, both named), which makes SGLang refuse to
            attach the backend. A mismatch found later (kvtier was down then)
            raises nothing: every call is a miss and an error naming both
            sizes is logged.

    Attributes:
        url: the kvtier server.
        client: the :class:`~kvtier.Client` every call goes through.
        page_bytes: bytes of one flat HiCache page, once a host pool is
            registered.
        stats: counters (``exists_queries``, ``exists_hits``, ``gets``,
            ``hits``, ``misses``, ``sets``, ``sets_skipped``, ``errors``;
            ``zero_copy_chunks``: pages kvtier copied straight into or out
            of the registered host pool; ``staged_chunks``: pages moved over
            the socket through the client's staging area).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        settings = dict(storage_config.extra_config or {})
        stats = ("exists_queries", "exists_hits", "gets", "hits", "misses", "sets", "sets_skipped")
        self._core = ConnectorCore(settings, logger=logger, stats=(*stats, "zero_copy_chunks", "staged_chunks"))
        self.url = self._core.url
        self.client = self._core.client
        self.down_s = self._core.down_s
        self.stats = self._core.stats
        self.skip_existing = _truthy(settings.get("skip_existing", True))
        self._page_size: int | None = int(settings["page_size"]) if settings.get("page_size") else None
        self._dtype: str | None = str(settings["dtype"]) if settings.get("dtype") else None
        self._layout = ""
        self.page_bytes: int | None = None
        self._namespace: Namespace | None = None
        self._fingerprint = ""
        self.mem_pool_host: Any = None
        self._host = SharedHost(self._core, None, what="SGLang's host KV pool", remedy=_SHM_REMEDY)
        self._kv_pairs = False

    # ------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands its host KV pool: the page size, dtype and layout of
        the keys come from it, and the server's ``block_bytes`` must be its
        page size in bytes (compared now if the server answers, else at the
        first call that reaches it).

        Raises:
            ValueError: a ``GeometryError``: the server's ``block_bytes`` is
                not the page size in bytes (both named).
        """
        super().register_mem_pool_host(mem_pool_host)
        self._host.release()
        self._host = SharedHost(
            self._core, _pool_buffer(mem_pool_host), what="SGLang's host KV pool", remedy=_SHM_REMEDY
        )
        self._kv_pairs = isinstance(mem_pool_host, MHATokenToKVPoolHost)
        self._page_size = int(getattr(mem_pool_host, "page_size", 0) or 0) or self._page_size
        dtype = getattr(mem_pool_host, "dtype", None)
        if dtype is not None:
            self._dtype = str(dtype)
        self._layout = str(getattr(mem_pool_host, "layout", "") or "")
        self.page_bytes = _page_bytes(mem_pool_host)
        self._namespace = None
        self._core.start(
            self.page_bytes,
            chunk=f"an SGLang HiCache page here (page_size {self._page_size} tokens)",
            remedy="change --page-size",
        )

    @property
    def namespace(self) -> Namespace:
        """The key namespace: model, dtype, TP/PP layout, page size, host
        layout and context-parallel shard (see the module docstring).

        Raises:
            ValueError: no page size is known (no host pool registered and no
                ``page_size`` setting).
        """
        if self._namespace is None:
            if not self._page_size:
                raise ValueError(
                    "kvtier: the page size is unknown; SGLang registers its host pool first, "
                    "or set page_size in the extra config"
                )
            cfg = self.storage_config
            extra = [f"sglang-hicache:layout={self._layout}"]
            if cfg.attn_cp_size > 1:
                extra.append(f"cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}")
            if cfg.dcp_size > 1:
                extra.append(f"dcp={cfg.dcp_rank}/{cfg.dcp_size}/page{cfg.logical_page_size}")
            mla = bool(cfg.is_mla_model)
            self._namespace = Namespace(
                model=cfg.model_name or "",
                dtype=self._dtype or "",
                tp_rank=0 if mla else cfg.tp_rank,
                tp_size=1 if mla else cfg.tp_size,
                pp_rank=cfg.pp_rank,
                pp_size=cfg.pp_size,
                block_tokens=self._page_size,
                extra=";".join(extra),
            )
            self._fingerprint = self._namespace.fingerprint
        return self._namespace

    @property
    def transport(self) -> str | None:
        """``"unix"`` or ``"http"``: how pages move, once known; else ``None``."""
        return self._core.transport

    def key_of(self, key: str) -> str:
        """The kvtier key of an SGLang page hash."""
        return self.namespace.key(key)

    # ------------------------------------------------------------ reads

    def exists(self, key: str) -> bool:
        """Whether the page is stored (one HEAD); ``False`` when kvtier fails."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages of the chain ``keys`` that are stored: one
        ``POST /v1/lookup``. 0 when kvtier fails."""
        if not keys:
            return 0
        self._core.count(exists_queries=len(keys))
        hits = self._core.call("lookup", self.client.lookup, [self.key_of(k) for k in keys], failed=0)
        self._core.count(exists_hits=hits)
        return hits

    def _get_one(self, key: str, target: Any) -> Any:
        if target is None:
            data = self.client.get(self.key_of(key))
            found = None if data is None else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            found = target if self.client.get_into(self.key_of(key), target) else None
        if found is not None:
            self._host.count_moved(target)
        return found

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> Any:
        """The page, read straight into ``target_location`` (a CPU tensor of
        at least a page) when given, else a new ``uint8`` tensor; ``None`` on
        a miss or a kvtier failure."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[Any]:
        """:meth:`get` of every page, in parallel over the pool; each result
        is its target tensor (filled) or ``None``."""
        if not keys:
            return []
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
        self._core.count(gets=len(keys))
        results = self._core.map("get", self._get_one, list(zip(keys, targets, strict=True)), None)
        hits = sum(r is not None for r in results)
        self._core.count(hits=hits, misses=len(keys) - hits)
        return results

    # ----------------------------------------------------------- writes

    def _set_one(self, key: str, value: Any, tag: BlockTag | None = None) -> bool:
        self.client.put(self.key_of(key), value, tag=tag)
        self._host.count_moved(value)
        return True

    def page_tags(self, keys: list[str], prefix_keys: list[str] | None) -> list[BlockTag | None]:
        """The block tag of each page of the chain ``keys``: its SGLang page
        hash (the 64 hex digits of the key, 32 bytes), the previous page's
        hash as its parent, and the page size; no token ids (HiCache hands a
        storage backend none). ``prefix_keys`` are the pages before
        ``keys[0]`` (SGLang's ``HiCacheStorageExtraInfo.prefix_keys``, sent
        with ``"hicache_storage_pass_prefix_keys": true``; empty: ``keys[0]``
        starts a sequence); when SGLang does not say (``None``), the first
        page's parent is unknown and it is stored untagged rather than
        claimed to start a sequence. A key that is not a hex hash is untagged too."""
        parent = _unknown = object()
        if prefix_keys is not None:
            parent = _page_hash(prefix_keys[-1]) if prefix_keys else None
        tags: list[BlockTag | None] = []
        for key in keys:
            page = _page_hash(key)
            tag = None
            if page is not None and parent is not _unknown and self._page_size:
                tag = BlockTag(block_hashes=[page], parent_hash=parent, block_size=self._page_size)  # type: ignore[arg-type]
                try:
                    tag.validate()
                except InvalidTagError:
                    tag = None
            tags.append(tag)
            parent = page if page is not None else _unknown
        return tags

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        """Stores one page (``value``, or ``target_location`` when ``value``
        is ``None``): ``True`` when stored, ``False`` when kvtier failed or
        refused it (a page of another size is refused, both sizes logged)."""
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Stores every page (CPU tensors, one per key), in parallel over the
        pool, after one lookup skips the leading pages already stored.
        ``True`` when all are stored."""
        if not keys:
            return True
        pages = list(values) if values is not None else list(target_locations or [])
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(pages)} values")
        if not self._core.ready():
            return False
        start = 0
        if self.skip_existing and len(keys) > 1:
            start = self._core.call("set", self.client.lookup, [self.key_of(k) for k in keys], failed=-1)
            if start < 0:
                return False
        self._core.count(sets=len(keys) - start, sets_skipped=start)
        tags = self.page_tags(keys, None)[start:]
        results = self._core.map("set", self._set_one, list(zip(keys[start:], pages[start:], tags, strict=True)), False)
        return all(results)

    # --------------------------------------------------- interface_v1

    def _page_spans(self, n: int, host_indices: Any) -> tuple[list[list[int]], list[list[int]]]:
        """Per page of ``host_indices`` (``n`` pages), its spans in the host
        pool (``get_page_buffer_meta``) in the order of the flat page of the
        generic interface: an MHA pool's K spans (one per layer, or one per
        page) and then its V spans, so a page stored by either interface
        reads back the same through the other."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        each = len(ptrs) // n
        all_ptrs, all_sizes = [], []
        for p in range(n):
            pp, ss = list(ptrs[p * each : (p + 1) * each]), list(sizes[p * each : (p + 1) * each])
            if self._kv_pairs:
                pp, ss = pp[0::2] + pp[1::2], ss[0::2] + ss[1::2]
            all_ptrs.append(pp)
            all_sizes.append(ss)
        return all_ptrs, all_sizes

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """HiCache's zero-copy read (``interface_v1``): page ``i`` into the
        host pool's slots ``host_indices[i * page_size :]``. With the pool
        registered (``"allocator": "shm"`` over the socket) one
        ``batch_get_into_multi_buffers``: kvtier writes the K and V spans of
        every page; else each page through a flat page and
        ``set_from_flat_data_page`` (one more copy). ``False`` per miss or
        failure, never an exception."""
        if not keys:
            return []
        if not self._core.ready():
            self._core.count(gets=len(keys), misses=len(keys))
            return [False] * len(keys)
        if not self._host.decide():
            return self._staged_get_v1(keys, host_indices)
        self._core.count(gets=len(keys))
        ptrs, sizes = self._page_spans(len(keys), host_indices)
        names = [self.key_of(k) for k in keys]
        results = self._core.call("get", self.client.batch_get_into_multi_buffers, names, ptrs, sizes, failed=None)
        if results is None:
            self._core.count(misses=len(keys))
            return [False] * len(keys)
        out = []
        for name, result in zip(names, results, strict=True):
            out.append(result >= 0)
            if result < 0 and result not in (codes.NOT_FOUND, codes.CORRUPT):
                self._core.failed("get", error_from_code(result, f"get {name}: {codes.name_of(result)}"))
        hits = sum(out)
        self._core.count(hits=hits, misses=len(keys) - hits, zero_copy_chunks=hits)
        return out

    def _staged_get_v1(self, keys: list[str], host_indices: Any) -> list[bool]:
        pool = self.mem_pool_host
        pages = self.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(pages):
            if page is not None:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), page)
        return [p is not None for p in pages]

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """HiCache's zero-copy write (``interface_v1``): page ``i`` from the
        host pool's slots ``host_indices[i * page_size :]``, after one
        lookup skips the leading pages already stored. With the pool
        registered one ``batch_put_from_multi_buffers`` (kvtier gathers the
        K and V spans); else each page's flat copy (``get_data_page``) is
        put. ``False`` per page not stored, never an exception."""
        if not keys:
            return []
        if not self._core.ready():
            return [False] * len(keys)
        start = 0
        if self.skip_existing and len(keys) > 1:
            start = self._core.call("set", self.client.lookup, [self.key_of(k) for k in keys], failed=-1)
            if start < 0:
                return [False] * len(keys)
        self._core.count(sets=len(keys) - start, sets_skipped=start)
        rest = keys[start:]
        tags = self.page_tags(keys, getattr(extra_info, "prefix_keys", None))[start:]
        pool = self.mem_pool_host
        if not self._host.decide():
            pages = [pool.get_data_page(int(host_indices[i * pool.page_size])) for i in range(start, len(keys))]
            staged = list(zip(rest, pages, tags, strict=True))
            return [True] * start + self._core.map("set", self._set_one, staged, False)
        ptrs, sizes = self._page_spans(len(keys), host_indices)
        names = [self.key_of(k) for k in rest]
        put = self.client.batch_put_from_multi_buffers
        results = self._core.call("set", put, names, ptrs[start:], sizes[start:], tags, failed=None)
        if results is None:
            return [True] * start + [False] * len(rest)
        for name, result in zip(names, results, strict=True):
            if result < 0:
                self._core.failed("set", error_from_code(result, f"set {name}: {codes.name_of(result)}"))
        self._core.count(zero_copy_chunks=sum(r >= 0 for r in results))
        return [True] * start + [r >= 0 for r in results]

    # ------------------------------------------------------------ misc

    def clear(self) -> None:
        """Nothing: kvtier does not enumerate or bulk-delete its keys (evict
        by capacity, or start it on a new data directory)."""
        logger.info("kvtier: clear() is a no-op; blocks stay until kvtier evicts them")

    def get_stats(self) -> None:
        """No SGLang storage metrics; see :attr:`stats` and kvtier's own."""
        return None

    def close(self) -> None:
        """Unregisters the host pool and closes the client's connections."""
        self._host.release()
        self._core.close()

    def __repr__(self) -> str:
        return f"<KvtierHiCacheStorage {self.url}>"


_SHM_REMEDY = (
    'Add "allocator": "shm" (with "interface_v1": 1) to --hicache-storage-backend-extra-config so SGLang '
    "allocates it in shared memory."
)


def _pool_buffer(mem_pool_host: Any) -> Any:
    """The tensor a host pool keeps its pages in (``kv_buffer``, or
    ``k_buffer`` for a K-only pool), or ``None``."""
    for name in ("kv_buffer", "k_buffer"):
        buffer = getattr(mem_pool_host, name, None)
        if buffer is not None and hasattr(buffer, "data_ptr"):
            return buffer
    return None


def _page_bytes(mem_pool_host: Any) -> int | None:
    """Bytes of one flat HiCache page of ``mem_pool_host``: the size of the
    page SGLang hands its storage backends (``get_data_page``), which for
    every host pool is ``get_size_per_token() * page_size``."""
    size_per_token = getattr(mem_pool_host, "get_size_per_token", None)
    page_size = getattr(mem_pool_host, "page_size", None)
    if callable(size_per_token) and page_size:
        return int(size_per_token()) * int(page_size)
    return None


def _page_hash(key: str) -> bytes | None:
    """An SGLang page key as the hash bytes it spells (hex, 1 to 32 bytes),
    or ``None`` for a key that is not one."""
    try:
        raw = bytes.fromhex(key)
    except (TypeError, ValueError):
        return None
    return raw if 0 < len(raw) <= TAG_HASH_BYTES_MAX else None
