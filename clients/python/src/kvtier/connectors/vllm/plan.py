"""What the vLLM connector's scheduler side hands its workers
(:class:`kvtier.vllm_connector.KvtierConnector`); the namespaces their keys
live in are :mod:`kvtier.connectors.vllm.groups`'s.

**Keys per rank.** A block's key is vLLM's block hash under the namespace of
the worker that holds it (docs/KEYS.md): the namespace covers the TP and PP
rank and the KV heads each rank holds, because under tensor parallelism
every rank holds its own slice of the heads of one block. The scheduler
therefore sends block *hashes*, never keys; each worker keys them in its own
namespace (``namespace_of`` with the rank vLLM gave that worker). The
scheduler's lookup asks for every TP rank's keys (``rank_namespaces``),
interleaved, so a block counts as held only when every rank's slice is.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...errors import ConfigurationError as ConfigurationError  # where the connector's modules import it from
from ...tag import BlockTag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from .lookup import PendingLookup


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
class KvtierConnectorMetadata(KVConnectorMetadata):
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
class RequestState:
    """What the scheduler side keeps of one request: its blocks, the
    leading blocks kvtier holds (once asked), the blocks stored so far;
    ``has_stores`` once a store was planned (with asynchronous stores vLLM
    then keeps its blocks until the workers report its stores done);
    ``loading`` while a background load of its blocks is in flight (from
    the step that plans it until the workers name it in
    ``finished_recving``: a request finished meanwhile is freed by vLLM when
    its load ends, not by its stores)."""

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    hit_blocks: int | None = None
    lookup: PendingLookup | None = None  # in flight until hit_blocks is known
    local_tokens: int = 0
    stored_blocks: int = 0
    has_stores: bool = False
    loading: bool = False
