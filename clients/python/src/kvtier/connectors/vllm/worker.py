"""The vLLM connector's worker side, in each of vLLM's workers
(:class:`kvtier.vllm_connector.KvtierConnector` dispatches to it): it learns
the layers' paged caches, checks kvtier's block size against them, and
carries out each step's :class:`~kvtier.connectors.vllm.transfer.StepPlan`
through the :class:`~kvtier.connectors.vllm.mover.BlockMover` (when blocks
move) and :class:`~kvtier.connectors.vllm.blocks.PagedBlocks` (how they are
copied).

Nothing here imports vLLM: given torch tensors for the layers' caches and
a step's plan, a :class:`KvtierWorker` moves blocks as it does inside vLLM,
which is how ``make gpu-check`` drives the data path on a GPU machine that
has torch and no vLLM (``clients/python/tools/gpu_connector_check.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ...memory.shm import SharedBuffer
from ..core import ConnectorCore
from .blocks import PagedBlocks, require_socket
from .groups import Group
from .mover import BlockMover
from .transfer import IDLE_STEP_WAIT_S, StepPlan, block_key, writer_of
from .verify import Digests, Oracle


class KvtierWorker:
    """The worker side of one vLLM worker (module docstring).

    Args:
        core: the connector's core (client, down window, counters).
        groups: the KV cache groups (:func:`~kvtier.connectors.vllm.groups.groups_of`).
        block_size: tokens per vLLM block (named in a geometry error).
        group_fingerprints: this rank's namespace fingerprint per group.
        loads, stores: the modes (:data:`~kvtier.connectors.vllm.mover.LOAD_MODES`,
            :data:`~kvtier.connectors.vllm.mover.STORE_MODES`).
        digests: the digests this worker stored (``digest`` on), else ``None``.
        oracle: the byte oracle (tests), else ``None``.
        local: the ``local`` setting (``on`` refuses an engine the socket refuses).
        logger: vLLM's logger.
        replicas: consecutive TP ranks holding identical KV (an MLA model:
            :func:`~kvtier.connectors.vllm.groups.replicas_of`); they share
            ``group_fingerprints`` and each block is written by one of them.
        replica_rank: this rank within its replica set (``tp_rank % replicas``):
            it writes the blocks :func:`~kvtier.connectors.vllm.transfer.writer_of`
            gives it, and counts the others as stored.

    Attributes:
        shared: the memfds vLLM's KV cache was allocated in
            (:class:`~kvtier.connectors.vllm.shared_cache.SharedAllocation` fills it).
        blocks: the pages of every layer, once :meth:`register_kv_caches` ran.
        mover: the loads' and stores' threads.
    """

    def __init__(
        self,
        core: ConnectorCore,
        *,
        groups: list[Group],
        block_size: int,
        group_fingerprints: list[str],
        loads: str,
        stores: str,
        digests: Digests | None,
        oracle: Oracle | None,
        local: str,
        logger: logging.Logger,
        replicas: int = 1,
        replica_rank: int = 0,
    ) -> None:
        self.core = core
        self.groups = groups
        self.block_size = block_size
        self.group_fingerprints = group_fingerprints
        self.local = local
        self.logger = logger
        self.shared: list[SharedBuffer] = []
        self.blocks: PagedBlocks | None = None
        self.mover = BlockMover(
            core,
            lambda block_hash, group: block_key(group_fingerprints[group], block_hash),
            loads=loads,
            stores=stores,
            digests=digests,
            oracle=oracle,
            logger=logger,
            writes=None if replicas <= 1 else (lambda block_hash: writer_of(block_hash, replicas) == replica_rank),
        )

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], any_rank: Callable[[bool], bool] | None = None
    ) -> None:
        """Learns the layers' paged caches (``[blocks, ...]`` per layer, in
        model order; on vLLM's CPU backend ``[blocks, kv_heads, block_size,
        2 x head_size]``, one page per block), checks kvtier's
        ``block_bytes`` against layers x page bytes, and registers the
        cache's memory (or a staging buffer) with the client. ``any_rank``:
        whether a flag holds on any rank of the TP group
        (:func:`~kvtier.connectors.vllm.groups.any_rank`; ``None``: this rank).

        Raises:
            kvtier.GeometryError: kvtier answers with another ``block_bytes``.
            ConfigurationError: with ``local: on``, the socket refused this process.
        """
        hybrid = len(self.groups) > 1
        blocks = PagedBlocks(self.core, kv_caches, self.shared, self.logger)
        groups = [blocks]
        if hybrid:  # one set of pages per group, registered once (their layers share one allocation)
            groups = [
                PagedBlocks(self.core, {n: kv_caches[n] for n in g.layer_names}, self.shared, self.logger, owner=blocks)
                for g in self.groups
            ]
        block_bytes = groups[0].block_bytes
        self.core.start(
            block_bytes,
            chunk=(
                f"a vLLM block here ({self.block_size} tokens x {len(groups[0].layers)} layers x "
                f"{groups[0].layer_bytes} bytes{' of one KV cache group' if hybrid else ''})"
            ),
            remedy="serve vLLM with a --block-size that makes its blocks this size",
        )
        if self.local == "on":
            require_socket(self.core)
        self.blocks = blocks
        self.mover.register(groups, list(kv_caches), any_rank)
        self.logger.info(
            "kvtier connector: %d layers in %d KV cache group(s), %d bytes per layer page, blocks of %d bytes; KV "
            "cache in shared memory: %s",
            len(blocks.layers),
            len(groups),
            blocks.layer_bytes,
            block_bytes,
            bool(self.shared),
        )

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Waits for the stores in flight of the requests vLLM preempted in
        this step, before vLLM hands their blocks to others."""
        if plan.preempted:
            self.mover.preempt(plan.preempted)

    def start_load_kv(self, plan: StepPlan) -> None:
        """Starts the step's loads (in the background, per layer, or before
        the forward; :mod:`kvtier.connectors.vllm.mover`). A block that misses
        or fails (its CRC in kvtier, or its digest here), and every later
        block of its request, is reported by :meth:`load_errors`; in a step
        that loads on the forward path, no store of that step is made."""
        self.mover.start_loads(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``loads: layer``, waits for this layer's pages of the step's loads."""
        self.mover.wait_layer(layer_name)

    def wait_for_save(self, plan: StepPlan) -> None:
        """Starts (``stores: async``) or makes the step's stores of newly
        computed full blocks (:meth:`~kvtier.connectors.vllm.mover.BlockMover.start_stores`).
        A failed store is counted and is a later miss."""
        self.core.count(worker_steps=1)
        self.mover.start_stores(plan)

    def wait_idle(self, plan: StepPlan) -> None:
        """In a step that computes nothing, waits up to ``IDLE_STEP_WAIT_S``
        for a background copy to end (:meth:`~kvtier.connectors.vllm.mover.BlockMover.wait_idle`)."""
        if plan.idle:
            self.mover.wait_idle(IDLE_STEP_WAIT_S)

    def finished(self, plan: StepPlan) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)``
        (:meth:`~kvtier.connectors.vllm.mover.BlockMover.finished`)."""
        return self.mover.finished(set(plan.stores_awaited))

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        return self.mover.load_errors()

    def shutdown(self) -> None:
        """Waits for the copies in flight, closes the client, unregisters the buffers."""
        self.mover.close()
        self.core.close()
        if self.blocks is not None:
            self.blocks.close()
