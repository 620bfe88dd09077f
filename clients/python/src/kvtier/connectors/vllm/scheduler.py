"""The vLLM connector's scheduler side, in vLLM's engine core
(:class:`kvtier.vllm_connector.KvtierConnector` dispatches to it): per
request what kvtier holds (its lookup, :mod:`kvtier.connectors.vllm.lookup`),
which blocks load into the blocks vLLM allocates for a hit, which computed
blocks are stored, and which finished requests vLLM keeps for their stores.

A request's state is vLLM's own terms: ``num_computed_tokens`` as vLLM
counts them (its own prefix-cache hit), the blocks kvtier holds
(``hit_blocks``, once its lookup answered), the blocks stored so far, and
whether a background load or stores are in flight
(:class:`~kvtier.connectors.vllm.plan.RequestState`). The scheduler sends
block *hashes*, never keys: each worker keys them in its own rank's
namespace (:mod:`kvtier.connectors.vllm.plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core import ConnectorCore
from .groups import Group, load_transfers, lookup_hits, store_transfers
from .lookup import Lookups
from .plan import KvtierConnectorMetadata, RequestState
from .transfer import IDLE_STEP_WAIT_S, Transfer, block_key

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvtierScheduler:
    """The scheduler side of one engine (module docstring).

    Args:
        core: the connector's core (client, down window, counters).
        lookups: the lookups' pool and deadlines.
        groups: the KV cache groups (:func:`~kvtier.connectors.vllm.groups.groups_of`).
        block_size: tokens per vLLM block.
        loads, stores: the modes (:data:`~kvtier.connectors.vllm.mover.LOAD_MODES`,
            :data:`~kvtier.connectors.vllm.mover.STORE_MODES`).
        lookup_fingerprints: per group, every TP rank's namespace
            fingerprint: a lookup asks for each rank's key of each block.
    """

    def __init__(
        self,
        core: ConnectorCore,
        lookups: Lookups,
        *,
        groups: list[Group],
        block_size: int,
        loads: str,
        stores: str,
        lookup_fingerprints: list[list[str]],
    ) -> None:
        self.core = core
        self.lookups = lookups
        self.groups = groups
        self.block_size = block_size
        self.loads = loads
        self.stores = stores
        self.lookup_fingerprints = lookup_fingerprints
        self.requests: dict[str, RequestState] = {}
        self.planned_loads: list[Transfer] = []  # planned by update_state_after_alloc, sent with the next step
        self.stores_awaited: list[str] = []  # request_finished answered True, sent with the next step

    def on_new_request(self, request: Request) -> None:
        """Starts tracking ``request`` (its block hashes and blocks)."""
        self.requests.setdefault(request.request_id, RequestState(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose blocks every
        rank holds in kvtier, and whether they load in the background
        (``loads: async``; else before the forward that needs them).
        ``(None, False)`` while its lookup is in flight (vLLM asks again;
        :mod:`kvtier.connectors.vllm.lookup`); a lookup given up, or kvtier
        not known to answer, is no hit. Never the prompt's last token."""
        state = self.requests.setdefault(request.request_id, RequestState(request))
        state.local_tokens = num_computed_tokens
        if self.loads == "off":
            return 0, False
        limit_blocks = min((request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes))
        if state.hit_blocks is None:
            if limit_blocks * self.block_size <= num_computed_tokens:
                return 0, False  # vLLM holds every block kvtier could
            state.hit_blocks = self.ask(request.block_hashes[:limit_blocks], state)
            if state.hit_blocks is None:
                return None, False  # the lookup is in flight: vLLM asks again next step
        hit_tokens = min(state.hit_blocks, limit_blocks) * self.block_size
        tokens = max(0, hit_tokens - num_computed_tokens)
        return tokens, tokens > 0 and self.loads == "async"

    def ask(self, hashes: list[bytes], state: RequestState) -> int | None:
        """The leading blocks of ``hashes`` every rank holds: the request's
        lookup (started on the first ask), or ``None``: ask again
        (:mod:`kvtier.connectors.vllm.lookup`)."""
        if state.lookup is None:
            ranks = len(self.lookup_fingerprints[0])
            keys = [block_key(fp, h) for h in hashes for group in self.lookup_fingerprints for fp in group]
            state.lookup = self.lookups.start(lambda: lookup_hits(self.core, keys, self.groups, ranks, len(hashes)))
            if state.lookup is None:
                return 0
        return self.lookups.answer(state.lookup)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plans the load of the ``num_external_tokens`` kvtier holds into the
        blocks vLLM allocated for them."""
        if num_external_tokens == 0:
            return
        state = self.requests.setdefault(request.request_id, RequestState(request))
        # A background load's failures are found in them before it is scheduled.
        state.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        first = state.local_tokens // self.block_size
        last = (state.local_tokens + num_external_tokens) // self.block_size
        hashes = [bytes(h) for h in request.block_hashes[:last]]
        background = self.loads == "async"
        state.loading = background
        self.planned_loads += load_transfers(
            request.request_id, hashes, state.block_ids, first, last, background=background
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        """The step's loads (planned by :meth:`update_state_after_alloc`) and
        stores (every full block the step computes that kvtier does not hold
        yet, once), and whether to make the stores (kvtier not known down)."""
        self.core.count(scheduler_steps=1)
        meta = KvtierConnectorMetadata(store=self.core.ready(), idle=scheduler_output.total_num_scheduled_tokens == 0)
        meta.loads, self.planned_loads = self.planned_loads, []
        meta.stores_awaited, self.stores_awaited = self.stores_awaited, []
        meta.preempted = list(scheduler_output.preempted_req_ids or ())
        for req_id in meta.preempted:  # kvtier may hold more, or less, when vLLM resumes it: asked again
            if (state := self.requests.get(req_id)) is not None:
                state.hit_blocks, state.lookup = None, None
        if meta.idle:
            self.lookups.wait_any((state.lookup for state in self.requests.values()), IDLE_STEP_WAIT_S)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self.plan_stores(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else state.block_ids
            elif new_ids:
                for ids, more in zip(state.block_ids, new_ids, strict=True):
                    ids.extend(more)
            self.plan_stores(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def plan_stores(self, meta: KvtierConnectorMetadata, state: RequestState, tokens_after_step: int) -> None:
        """Adds to ``meta`` the stores of ``state``'s full blocks computed
        by the step that ends at ``tokens_after_step``, from the first that
        kvtier does not hold (nor was stored before)."""
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

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed (a miss, a CRC or digest failure) are
        recomputed by vLLM: from the first of them on, a request's blocks
        count as not in kvtier, so the steps that recompute them store them
        (the worker stored none of them in the failed step). A request
        named in ``finished_recving`` has no load in flight any more."""
        for req_id in connector_output.finished_recving or ():
            if (state := self.requests.get(req_id)) is not None:
                state.loading = False
        for req_id in connector_output.failed_recving or ():  # a hybrid model's: the request recomputes
            if (state := self.requests.get(req_id)) is not None:
                state.hit_blocks, state.stored_blocks = 0, 0
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for state in self.requests.values():
            first = next((i for i, b in enumerate(state.block_ids[0] if state.block_ids else []) if b in invalid), None)
            if first is not None:
                state.hit_blocks = min(state.hit_blocks or 0, first)
                state.stored_blocks = min(state.stored_blocks, first)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forgets ``request``. With ``stores: async`` and a store planned for
        it, ``True``: vLLM keeps its blocks until every worker reports its
        stores done (told by the next step's ``stores_awaited``). ``False``
        while its background load is in flight (aborted mid-load): vLLM keeps
        the blocks until the workers report that load, which they do once its
        stores have ended too (a ``finished_sending`` as well would free the
        blocks under the load, or name a freed request: vLLM asserts)."""
        state = self.requests.pop(request.request_id, None)
        awaited = self.stores == "async" and state is not None and state.has_stores and not state.loading
        if awaited:
            self.stores_awaited.append(request.request_id)
        return awaited, None
