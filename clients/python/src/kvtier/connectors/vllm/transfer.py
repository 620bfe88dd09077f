"""What one step moves, as the vLLM connector's scheduler side plans it
and its workers carry it out: :class:`Transfer` and :class:`StepPlan`,
with the counters both sides keep (:data:`STATS`). Nothing here imports
vLLM, so the worker's data path (:mod:`~kvtier.connectors.vllm.mover`,
:mod:`~kvtier.connectors.vllm.blocks`, :mod:`~kvtier.connectors.vllm.verify`,
:mod:`~kvtier.connectors.vllm.worker`) runs with torch alone (``make
gpu-check`` drives it on a GPU machine without vLLM); vLLM's
``KVConnectorMetadata`` is :class:`kvtier.connectors.vllm.plan.KvtierConnectorMetadata`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from ...keys import block_id_hex
from ...tag import BlockTag

F = TypeVar("F", bound=Callable[..., Any])


#: A worker's longest wait for a background copy in a step with nothing to
#: compute, seconds: the most it delays a request that arrives meanwhile.
IDLE_STEP_WAIT_S = 0.005

#: The counters of :attr:`KvtierConnector.stats` (worker and scheduler).
STATS = (
    "lookups",
    "lookup_hit_blocks",
    "lookup_timeouts",
    # Asks answered "ask again" while a lookup was in flight (_vllm_lookup).
    "lookup_retries",
    "loaded_blocks",
    "load_failed_blocks",
    "stored_blocks",
    # Blocks another rank of this rank's replica set writes (an MLA model's
    # KV, the same on every TP rank, is stored once: writer_of).
    "store_replica_blocks",
    "store_failed_blocks",
    "store_dropped_blocks",
    "stores_skipped_after_failed_load",
    "zero_copy_blocks",
    "staged_blocks",
    "leased_blocks",
    "digest_checked_blocks",
    "digest_mismatch_blocks",
    "digest_unknown_blocks",
    "background_loads",
    # A failed background load's report held until kvtier closed the
    # connection given up on (a late piece could land in its pages), and a
    # lane's staging buffer replaced for the same reason (blocks.py).
    "load_reports_held",
    "staging_retired_buffers",
    "preemption_waits",
    "scheduler_steps",
    "scheduler_us",
    # The connector's own time: microseconds in its scheduler-side calls
    # (lookups waited for included) and its worker-side calls on the
    # forward's thread, the steps they ran in (make bench-engine divides one
    # by the other), and the wait in wait_for_layer_load with loads: layer.
    "worker_steps",
    "worker_us",
    "layer_wait_us",
    # Wall time of the mover's loads, microseconds (the load's share of a
    # hit's TTFT in make bench-engine).
    "load_us",
)


def timed(counter: str) -> Callable[[F], F]:
    """Adds the decorated method's wall time, in microseconds, to the
    counter ``counter`` of ``self._core`` (a :class:`ConnectorCore`)."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._core.count(**{counter: (time.perf_counter_ns() - started) // 1000})

        return inner  # type: ignore[return-value]

    return wrap


def flag(value: Any) -> bool:
    """A boolean setting given as a JSON boolean or a string."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def block_key(fingerprint: str, block_hash: bytes) -> str:
    """The kvtier key of one vLLM block hash in the namespace of
    ``fingerprint`` (docs/KEYS.md)."""
    return f"{fingerprint}-{block_id_hex(bytes(block_hash))}"


def writer_of(block_hash: bytes, replicas: int) -> int:
    """Which rank of a replica set writes the block of ``block_hash``
    (``0 .. replicas - 1``, a rank's ``tp_rank % replicas``): the set's
    ``replicas`` consecutive TP ranks hold identical KV (an MLA model's
    latent), so one of them stores each block and the others count it as
    stored; a stripe by the xxh3-64 of the hash, so the writes spread
    evenly over the set whatever the hash's own bits (vLLM's are sha256 or
    xxhash output; a test's may be patterned). Every rank of the set
    computes the same answer from the hash alone."""
    if replicas <= 1:
        return 0
    return xxhash.xxh3_64_intdigest(bytes(block_hash)) % replicas


@dataclass
class Transfer:
    """Blocks of one request to move in one step: ``hashes[i]`` is vLLM's
    hash of block ``first + i`` of the request (each worker keys it in its
    own namespace), held in vLLM block ``block_ids[i]``; a store's
    ``tags[i]`` names it in vLLM's hash space for kvtier's KV events. A
    ``background`` load runs off the forward path (vLLM parks the request
    until the worker reports it loaded). ``group``: the KV cache group the
    blocks belong to (:mod:`kvtier.connectors.vllm.groups`); an ``inline`` store ends
    inside its step even with asynchronous stores (a sliding-window group's
    blocks may be reused by the next step)."""

    req_id: str
    first: int
    hashes: list[bytes]
    block_ids: list[int]
    tags: list[BlockTag | None] | None = None
    background: bool = False
    group: int = 0
    inline: bool = False


@dataclass
class StepPlan:
    """What the worker does in one step: loads (before the forward, or in
    the background), stores after it. ``store`` is ``False`` while the
    scheduler finds kvtier down or too slow for its lookup deadline: the
    step's stores are then dropped (counted), never waited on.
    ``preempted``: the requests vLLM preempted in this step (their stores
    in flight end before their blocks are reused). ``idle``: the step
    computes nothing (the workers may wait a little for a copy to end:
    :meth:`kvtier.connectors.vllm.mover.BlockMover.wait_idle`).
    ``stores_awaited``: the requests finished since the last step for which
    ``request_finished`` answered ``True`` (vLLM keeps their blocks): each
    worker names each of them in ``finished_sending`` once its stores have
    ended, and names no other request there (vLLM frees a request's blocks
    at the first of ``finished_sending`` and ``finished_recving``, and a
    second naming is an unknown request to its scheduler)."""

    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    store: bool = True
    preempted: list[str] = field(default_factory=list)
    idle: bool = False
    stores_awaited: list[str] = field(default_factory=list)
