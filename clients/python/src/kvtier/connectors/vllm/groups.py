"""Hybrid models in the vLLM connector: KV cache groups, which blocks of
each a hit needs, and which of each are loaded and stored
(:class:`kvtier.vllm_connector.KvtierConnector` implements vLLM's
``SupportsHMA``).

**Groups.** vLLM's hybrid KV cache manager splits a model's attention layers
into KV cache groups of equal page size: full-attention groups and
sliding-window groups (Gemma 2/3: local and global layers). Every group has
its own block table, its blocks drawn from one pool (block ids unique across
groups, 0 the null block), and a block of group ``g`` lives in the pages of
``g``'s layers only. A kvtier block is one vLLM block of one group (its
layers' pages in model order), keyed under that group's namespace, so every
group must have the same block bytes and the same block tokens (vLLM's
uniform page grouping gives that; a model where it does not, where vLLM
gives a group of smaller pages a larger block, or one served with context
parallelism is refused at start, naming why).

**Which blocks.** A full-attention group needs every block up to a hit's
boundary; a sliding-window group of window ``w`` tokens only the blocks
holding the ``w - 1`` tokens before it: :attr:`Group.window_blocks` =
``ceil((w - 1) / block_size)`` blocks. vLLM allocates the null block for the
others. So:

- a *lookup* finds the largest boundary ``m`` such that every full group
  holds blocks ``0 .. m - 1`` and every sliding group blocks
  ``m - window_blocks .. m - 1`` (:func:`best_hit`);
- a *load* copies each group's non-null blocks of the hit (:func:`load_transfers`);
- a *store* copies each full group's new blocks, and of each sliding group
  only the last ``window_blocks`` blocks before the step's boundary (the
  ones a later hit ending there needs): per block position, the bytes stored
  are the full groups' share plus, near the boundaries, the sliding ones'.
  A sliding group's store ends inside its step (``inline``): vLLM frees a
  block that left the window when it schedules the next step and may hand it
  to another request at once (measured, vLLM 0.32: the next forward wrote
  it).

Failures of a hybrid model's loads cannot be reported per block (vLLM's
scheduler refuses block-level failures with more than one group), so its
loads are asynchronous and a failed one fails the request's load as a whole
(``failed_recving``): vLLM recomputes the request, and the connector does
not offer the same hit again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import ConfigurationError
from ...keys import Namespace
from ..core import ConnectorCore
from .blocks import block_tags
from .transfer import Transfer

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: vLLM's null block (a sliding group's blocks outside its window).
NULL_BLOCK = 0


@dataclass(frozen=True)
class Group:
    """One KV cache group: its index, its layers (model order) and, for a
    sliding-window group, the blocks before a boundary a hit needs
    (``None``: full attention, every block)."""

    index: int
    layer_names: tuple[str, ...]
    window_blocks: int | None = None
    window_tokens: int | None = None

    @property
    def kind(self) -> str:
        """``full`` or ``sliding<window tokens>`` (the namespace names it)."""
        return "full" if self.window_tokens is None else f"sliding{self.window_tokens}"


def groups_of(kv_cache_config: KVCacheConfig, block_size: int, parallel: ParallelConfig | None = None) -> list[Group]:
    """The KV cache groups of ``kv_cache_config``, whose blocks are all of
    vLLM's ``block_size`` tokens (``cache_config.block_size``); ``parallel``:
    vLLM's parallel config (context parallelism is refused).

    Raises:
        ConfigurationError: a group that is neither full attention nor a
            sliding window (Mamba, chunked local attention, cross attention),
            groups whose blocks differ in bytes or in tokens (vLLM gives a
            group of smaller pages a larger block: its blocks would be keyed
            by a shorter prefix's hash), or decode or prefill context
            parallelism (a block's tokens split across ranks, hashed at the
            block times the ranks); the message names them.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups: list[Group] = []
    kinds = ", ".join(
        f"{type(g.kv_cache_spec).__name__} x{len(g.layer_names)}" for g in kv_cache_config.kv_cache_groups
    )
    page_bytes = set()
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        names = tuple(g.layer_names)
        page_bytes.add(spec.page_size_bytes * len(names))
        if isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window)
            groups.append(Group(i, names, -(-(window - 1) // block_size), window))
        elif isinstance(spec, FullAttentionSpec) and getattr(spec, "sliding_window", None) is None:
            groups.append(Group(i, names))
        else:
            raise ConfigurationError(
                f"kvtier's vLLM connector moves full-attention and sliding-window KV caches; this model's KV cache "
                f"groups are {kinds}: serve it without --kv-transfer-config"
            )
    sizes = [int(getattr(g.kv_cache_spec, "block_size", block_size)) for g in kv_cache_config.kv_cache_groups]
    if any(size != block_size for size in sizes):
        raise ConfigurationError(
            f"kvtier's vLLM connector keys every KV cache group's blocks at vLLM's block size ({block_size} tokens); "
            f"this model's groups ({kinds}) have blocks of {', '.join(map(str, sizes))} tokens (vLLM gives groups "
            f"whose pages differ in size blocks of their own): serve it without --kv-transfer-config"
        )
    context = [
        f"--{name.replace('_', '-')} {getattr(parallel, name)}"
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
        if int(getattr(parallel, name, 1) or 1) > 1
    ]
    if context:
        raise ConfigurationError(
            f"kvtier's vLLM connector keys whole blocks of one rank; context parallelism ({', '.join(context)}) "
            f"splits a block's tokens across ranks: serve it without --kv-transfer-config or without context "
            f"parallelism"
        )
    if len(page_bytes) > 1:
        raise ConfigurationError(
            f"kvtier's vLLM connector stores one block per KV cache group, all of one size; this model's groups "
            f"({kinds}) hold {sorted(page_bytes)} bytes per block: serve it without --kv-transfer-config"
        )
    if not any(g.window_blocks is None for g in groups):
        raise ConfigurationError(
            f"kvtier's vLLM connector needs a full-attention layer to key a prefix by; this model's KV cache groups "
            f"are {kinds}: serve it without --kv-transfer-config"
        )
    return groups


def parallel_rank() -> tuple[int, int]:
    """This process's (TP rank, PP rank): vLLM's once its model-parallel
    groups exist (the workers), else (0, 0) (the scheduler)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    return 0, 0


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of this worker's tensor-parallel
    group: one all-reduce (max) of one integer over the group's CPU (gloo)
    group, which every rank must make in the same step; this rank's own flag
    where vLLM's model-parallel groups do not exist or hold one rank."""
    import torch
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return bool(value.item())


def replicas_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Consecutive TP ranks holding identical KV for every layer (``r``):
    vLLM's ``KVCacheConfig.kv_tp_replicas`` (0.32 on), which is the TP size
    for an MLA model (one latent per token and layer, the same on every
    rank) and 1 under decode context parallelism or where any layer's heads
    are split; on a vLLM without it, the TP size when the model uses MLA,
    every KV cache group is ``MLAAttentionSpec`` and no context parallelism
    is set, else 1. Keys drop the rank within a replica set
    (:func:`namespace_of`) and one rank of the set writes each block
    (:func:`~kvtier.connectors.vllm.transfer.writer_of`). A value that does
    not divide the TP size is taken as 1 (per-rank keys, as without it)."""
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    replicas = getattr(kv_cache_config, "kv_tp_replicas", None)
    if replicas is None:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        mla = bool(getattr(vllm_config.model_config, "use_mla", False)) and all(
            isinstance(g.kv_cache_spec, MLAAttentionSpec) for g in kv_cache_config.kv_cache_groups
        )
        context = any(
            int(getattr(parallel, name, 1) or 1) > 1
            for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
        )
        replicas = tp_size if mla and not context else 1
    replicas = int(replicas)
    return replicas if replicas >= 1 and tp_size % replicas == 0 else 1


def namespace_of(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    model: str | None,
    rank: tuple[int, int] | None = None,
    group: int = 0,
) -> Namespace:
    """The namespace of one vLLM rank's blocks of KV cache group ``group``
    (docs/KEYS.md): model, KV dtype, TP and PP rank, tokens per block, and in
    ``extra`` the layer geometry (layers, the KV heads this rank holds, head
    size, page bytes), the KV layout and the hash algorithm, everything else
    that changes a block's bytes or key. A hybrid model's groups each have
    their own (``extra`` names the group, its kind and the group count); a
    model of one group keeps the namespace it had before groups were known.
    Ranks whose KV is identical (``r`` = :func:`replicas_of` > 1: an MLA
    model) share one namespace: its TP rank is ``tp_rank // r`` (the replica
    set's), and the TP size stays the engine's.

    Args:
        rank: ``(tp_rank, pp_rank)``; default this process's (a worker's own
            rank, or 0 in the scheduler, where no model-parallel group exists).

    Raises:
        ConfigurationError: a KV cache group the connector cannot move
            (:func:`kvtier.connectors.vllm.groups.groups_of`).
    """
    cache = vllm_config.cache_config
    groups = groups_of(kv_cache_config, cache.block_size)
    spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    parallel = vllm_config.parallel_config
    tp_rank, pp_rank = rank if rank is not None else parallel_rank()
    tp_rank //= replicas_of(vllm_config, kv_cache_config)
    layout = cache.get_resolved_kv_cache_layout()
    which = f"group={group}/{len(groups)};kind={groups[group].kind};" if len(groups) > 1 else ""
    extra = (
        f"vllm-connector:{which}layers={len(groups[group].layer_names)};kv_heads={spec.num_kv_heads};"
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


def rank_namespaces(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model: str | None, group: int = 0
) -> list[Namespace]:
    """The namespaces the scheduler's lookup asks for in KV cache group
    ``group``: every replica set's (every TP rank's, without replicas), of
    PP stage 0: ``tp_size // r`` of them (:func:`replicas_of`; one for an
    MLA model). Under tensor parallelism a block is usable only when every
    rank's slice of its heads is held; the stages of pipeline parallelism
    hold other layers under another page count, which the scheduler cannot
    see (a stage that misses reports a failed load and vLLM recomputes)."""
    size = vllm_config.parallel_config.tensor_parallel_size
    step = replicas_of(vllm_config, kv_cache_config)
    return [namespace_of(vllm_config, kv_cache_config, model, rank=(tp, 0), group=group) for tp in range(0, size, step)]


def best_hit(held: Sequence[int], groups: Sequence[Group], ranks: int, positions: int) -> int:
    """The largest hit boundary, in blocks, given ``held``: kvtier's answer
    per key, laid out position-major, then group, then rank
    (``held[(p * len(groups) + g) * ranks + r] > 0``: block ``p`` of group
    ``g`` on rank ``r`` is held)."""

    def has(p: int, g: int) -> bool:
        base = (p * len(groups) + g) * ranks
        return all(held[base + r] > 0 for r in range(ranks))

    full = [g.index for g in groups if g.window_blocks is None]
    leading = 0
    while leading < positions and all(has(leading, g) for g in full):
        leading += 1
    for m in range(leading, 0, -1):
        if all(
            all(has(p, g.index) for p in range(max(0, m - g.window_blocks), m))
            for g in groups
            if g.window_blocks is not None
        ):
            return m
    return 0


def lookup_hits(core: ConnectorCore, keys: list[str], groups: Sequence[Group], ranks: int, positions: int) -> int:
    """The blocks of a prompt's chain kvtier can serve, asked with ``keys``
    (per block position, per group, ``ranks`` keys); 0 when it cannot say.
    One group: the leading blocks held (``lookup``); a hybrid model: the
    largest boundary every group can serve (:func:`best_hit`, from
    ``batch_is_exist``). Over the socket a hit is confirmed by a round trip:
    the shared index answers from memory even while its server is stopped,
    and a hit kvtier cannot serve would cost a load's timeout instead of the
    lookup's deadline."""
    client = core.client
    if len(groups) > 1:
        held = core.call("lookup", client.batch_is_exist, keys, failed=[0] * len(keys))
        hits = best_hit(held, groups, ranks, positions)
    else:
        hits = core.call("lookup", client.lookup, keys, failed=0) // ranks
    if hits and core.transport == "unix" and not core.call("lookup", client.ping, failed=False):
        hits = 0
    core.count(lookups=1, lookup_hit_blocks=hits)
    return hits


def load_transfers(
    req_id: str,
    hashes: Sequence[bytes],
    block_ids: Sequence[Sequence[int]],
    first: int,
    last: int,
    *,
    background: bool,
) -> list[Transfer]:
    """Per group, the load of blocks ``first .. last - 1`` into the blocks
    vLLM allocated (``block_ids[g]``, the request's whole table), from the
    first that is not the null block (a sliding group's outside its window)."""
    out = []
    for g, ids in enumerate(block_ids):
        start = first
        while start < last and ids[start] == NULL_BLOCK:
            start += 1
        if start < last:
            out.append(
                Transfer(req_id, start, list(hashes[start:last]), list(ids[start:last]), None, background, group=g)
            )
    return out


def store_transfers(
    req_id: str,
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    groups: Sequence[Group],
    block_size: int,
    start: int,
    full: int,
) -> list[Transfer]:
    """Per group, the store of the step's new full blocks ``start .. full - 1``
    (module docstring: a sliding group's last blocks only, ``inline``). The
    first full-attention group's blocks carry the block tags (vLLM's
    ``BlockStored`` fields), the others none (one event per prefix block)."""
    out = []
    tagged = next(g.index for g in groups if g.window_blocks is None)
    hybrid = len(groups) > 1
    for g in groups:
        lo = start if g.window_blocks is None else max(start, full - g.window_blocks)
        ids = block_ids[g.index]
        while lo < full and ids[lo] == NULL_BLOCK:
            lo += 1
        if lo >= full:
            continue
        hashes = [bytes(h) for h in block_hashes[lo:full]]
        tags = block_tags(block_hashes, token_ids, block_size, lo, full) if g.index == tagged else None
        inline = hybrid and g.window_blocks is not None
        out.append(Transfer(req_id, lo, hashes, list(ids[lo:full]), tags, group=g.index, inline=inline))
    return out
