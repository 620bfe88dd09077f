"""What the vLLM connector's scheduler side keeps per request and hands its
workers as vLLM's types (:class:`kvtier.vllm_connector.KvtierConnector`;
the plan itself, free of vLLM, is :mod:`kvtier.connectors.vllm.transfer`);
the namespaces their keys live in are :mod:`kvtier.connectors.vllm.groups`'s.

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

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...errors import ConfigurationError as ConfigurationError  # where the connector's modules import it from
from .transfer import STATS, StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from .lookup import PendingLookup


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
class KvtierConnectorMetadata(StepPlan, KVConnectorMetadata):
    """The step's :class:`~kvtier.connectors.vllm.transfer.StepPlan` as
    vLLM's ``KVConnectorMetadata``: what the scheduler side hands every
    worker with the step."""


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
