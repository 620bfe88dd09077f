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
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ...errors import ConfigurationError as ConfigurationError  # where the connector's modules import it from
from .transfer import STATS, StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
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


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The connector's counters (:data:`~kvtier.connectors.vllm.transfer.STATS`)
    on vLLM's ``/metrics``, summed over the workers and the scheduler as
    vLLM's stats logger sums them: ``vllm:kvtier_<name>_total`` per counter,
    the microsecond ones as seconds (``vllm:kvtier_scheduler_seconds_total``
    for ``scheduler_us``), with vLLM's own labels per engine
    (``model_name``, ``engine``). The counters' meaning: docs/INTEGRATIONS.md."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvtier_{prom_name(name)}",
                documentation=f"kvtier connector: {name} (docs/INTEGRATIONS.md, the connector's counters)",
                labelnames=labelnames,
            )
            for name in STATS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one interval's counters (``KvtierConnectorStats.data``) of engine ``engine_idx``."""
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*labels).inc(value / 1e6 if name.endswith("_us") else value)


def prom_name(name: str) -> str:
    """A counter's Prometheus name: microseconds become seconds (``load_us``: ``load_seconds``)."""
    return name.removesuffix("_us") + "_seconds" if name.endswith("_us") else name


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
