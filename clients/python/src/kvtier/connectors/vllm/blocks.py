"""Moving blocks between vLLM's paged KV cache and kvtier: the worker side
of :class:`kvtier.vllm_connector.KvtierConnector` (its module docstring says
what is copied where).

A kvtier block is one vLLM block of every layer, each layer's page in model
order. The paths, chosen once when kvtier first answers (:meth:`PagedBlocks.ready`):

- the KV cache in a memfd (:class:`SharedAllocation`) registered over the
  same-host socket: kvtier copies each block straight into and out of the
  layers' pages, one span per layer (``GET_INTO_V``/``PUT_FROM_V``);
- otherwise a staging buffer of :data:`STAGING_BLOCKS` blocks registered
  with the client: one torch copy per layer page in this process, then
  kvtier copies into or out of the staging buffer (over HTTP the client
  receives into it); on a GPU the staging buffer is page-locked so the
  host-device copies are DMA;
- where the staging buffer would be used, over the same-host socket, and
  kvtier offers leases (``--ram-shared``), loads go straight from kvtier's
  RAM tier: the blocks are leased and each layer's page is copied from
  kvtier's pages into vLLM's, one copy instead of two. On a GPU the client
  first page-locks kvtier's arenas (:meth:`kvtier.Client.pin_arenas`), so
  that copy is the GPU's DMA reading kvtier's memory, with no host copy at
  all. The generation check after the copies catches a lease that ended;
  such blocks, and those not in RAM, are read through the staging buffer.
  Stores still go through staging.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import codes
from ...errors import (
    ConfigurationError,
    CudaError,
    InvalidTagError,
    KvtierConnectionError,
    KvtierError,
    LeasesOffError,
    error_from_code,
)
from ...memory import cuda as _cuda
from ...memory.shm import SharedBuffer
from ...tag import TAG_TOKENS_MAX, BlockTag
from ..core import ConnectorCore

#: Blocks the staging buffer holds (the path when the KV cache is not
#: registered); a larger transfer goes in rounds of this many.
STAGING_BLOCKS = 32

#: The mover's lanes (:mod:`kvtier.connectors.vllm.mover`): each a thread
#: and a staging buffer; the background lane's loads alone are copied by
#: kvtier into the registered cache (:meth:`PagedBlocks.move`).
BACKGROUND, FORWARD = 0, 1


def block_tags(
    block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int, first: int, last: int
) -> list[BlockTag | None]:
    """The block tags of a request's blocks ``first`` to ``last`` (one vLLM
    block per kvtier block): block ``i``'s vLLM hash ``block_hashes[i]``, its
    parent ``block_hashes[i - 1]`` (``None`` for the first block of the
    request), ``block_size`` and its token ids ``token_ids[i * block_size :
    (i + 1) * block_size]``: what vLLM's own ``BlockStored`` event says of
    the block. Token ids are left out when a block holds more than a tag
    takes (640), and a block whose tag would break the rules (a hash wider
    than 32 bytes) gets none: it is stored untagged, never refused for it."""
    tags: list[BlockTag | None] = []
    for i in range(first, last):
        tokens = list(token_ids[i * block_size : (i + 1) * block_size]) if block_size <= TAG_TOKENS_MAX else []
        tag: BlockTag | None = BlockTag(
            block_hashes=[bytes(block_hashes[i])],
            parent_hash=bytes(block_hashes[i - 1]) if i > 0 else None,
            block_size=block_size,
            token_ids=tokens if len(tokens) == block_size else [],
        )
        try:
            tag.validate()  # type: ignore[union-attr]
        except InvalidTagError as e:
            logging.getLogger("vllm.kvtier").warning("kvtier connector: block %d is stored untagged: %s", i, e)
            tag = None
        tags.append(tag)
    return tags


class PagedBlocks:
    """The layers' paged caches of one vLLM worker and the path blocks take
    to and from kvtier (module docstring).

    Args:
        core: the connector's core (client, failures, counters).
        kv_caches: vLLM's per-layer caches (``[blocks, ...]`` views; on the
            CPU backend ``[blocks, kv_heads, block_size, 2 x head_size]``).
        shared: the memfds :class:`SharedAllocation` put vLLM's cache in
            (empty when it did not).
        logger: where the chosen path is logged, once.
        owner: the pages of every layer, when these are one KV cache group's
            (a hybrid model): the owner registers the cache or the staging
            buffer, once, and these use it.

    Raises:
        ConfigurationError: a layer's cache is neither in host nor in CUDA memory.

    Attributes:
        layers: per layer, its pages as bytes (``[blocks, page_bytes]`` where
            a page is contiguous).
        layer_bytes: bytes of one layer's page of one block.
        block_bytes: ``layer_bytes`` x layers: one kvtier block.
        zero_copy: whether blocks move through the registered cache.
        leased_loads: whether loads copy from leases in kvtier's arenas
            (same-host socket, leases offered, not ``zero_copy``; on a GPU,
            the arenas page-locked).
        staging: the background lane's staging buffer, once kvtier answered
            (``None`` with ``zero_copy``); :meth:`staging_for` gives each lane's.
        pinned: the addresses of the staging buffers page-locked on a GPU.
        lanes: the mover's lanes whose staging buffers :meth:`ready` makes
            (another lane's is made on its first copy).
    """

    def __init__(
        self,
        core: ConnectorCore,
        kv_caches: dict[str, torch.Tensor],
        shared: list[SharedBuffer],
        logger: logging.Logger,
        owner: PagedBlocks | None = None,
    ) -> None:
        layers = []
        for name, cache in kv_caches.items():
            if cache.device.type not in ("cpu", "cuda"):
                raise ConfigurationError(
                    f"kvtier's vLLM connector moves host and CUDA memory; layer {name}'s KV cache is on {cache.device}"
                )
            pages = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
            layers.append(pages.reshape(pages.shape[0], -1) if pages[0].is_contiguous() else pages)
        self.core = core
        self.logger = logger
        self.layers = layers
        self.layer_bytes = layers[0][0].numel()
        self.block_bytes = self.layer_bytes * len(layers)
        self.shared = shared
        self.on_gpu = layers[0].device.type == "cuda"
        self.pinned: set[int] = set()  # the staging buffers page-locked (their addresses)
        self.kv_base = 0
        self.zero_copy = False
        self.leased_loads = False
        self.registered = False  # the KV cache (zero-copy) or the lanes' staging buffers, once kvtier answered
        self._stagings: dict[int, SharedBuffer] = {}  # per lane, once made (a retired one is made again)
        self.lanes: tuple[int, ...] = (0,)  # the mover's lanes that copy (BlockMover.register sets them)
        self.owner = owner
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether to move blocks now: kvtier not known down (the connector's
        down window), and the KV cache (zero-copy) or the staging buffer of
        each lane in :attr:`lanes` registered with the client, which happens
        the first time kvtier answers."""
        if not self.core.ready():
            return False
        if self.registered:
            return True
        if self.owner is not None:
            ready = self.owner.ready()
            if ready:
                owner = self.owner
                self.kv_base, self.zero_copy, self.leased_loads = owner.kv_base, owner.zero_copy, owner.leased_loads
                self.registered = True
            return ready
        with self._lock:
            if self.registered:
                return True
            client = self.core.client
            contiguous = all(layer.dim() == 2 for layer in self.layers)
            for buffer in self.shared:
                if not contiguous or self.core.transport != "unix":
                    break
                if client.register_buffer(buffer.ptr, buffer.nbytes) == codes.OK:
                    self.kv_base, self.zero_copy, self.registered = buffer.ptr, True, True
                    self.logger.info(
                        "kvtier connector: zero-copy over the same-host socket: vLLM's KV cache (%d bytes) is "
                        "registered; kvtier copies blocks straight into and out of its pages",
                        buffer.nbytes,
                    )
                    if FORWARD in self.lanes:  # the forward's loads: leased where they can be, else staged (move)
                        self._use_leases(forward_only=True)
                    return True
            try:
                for lane in self.lanes:  # made now, not in a later step's copy (kvtier may be stopped then)
                    self._stagings[lane] = self._new_staging()
            except KvtierError as e:
                for staging in self._stagings.values():
                    self._release(staging)
                self._stagings.clear()
                self.core.failed("register", e)
                return False
            self.registered = True
            if self.core.transport == "unix":
                self._use_leases()
            if self.on_gpu:
                why = "vLLM's KV cache is in GPU memory (the staging buffer is pinned)"
            elif self.core.transport != "unix":
                why = "the transport is HTTP"
            else:
                why = "vLLM's KV cache is not in shared memory (kv_cache_shared is off or its allocation was not seen)"
            if not self.leased_loads:  # else _use_leases said which path loads take
                self.logger.info("kvtier connector: blocks are staged (one more copy of each layer page): %s", why)
            return True

    def _new_staging(self) -> SharedBuffer:
        """A staging buffer of :data:`STAGING_BLOCKS` blocks, registered with
        the client (on a GPU page-locked, :meth:`_pin`).

        Raises:
            KvtierError: kvtier refused the registration.
        """
        staging = SharedBuffer(STAGING_BLOCKS * self.layer_bytes * len(self.layers), name="kvtier-vllm-staging")
        code = self.core.client.register_buffer(staging.ptr, staging.nbytes)
        if code != codes.OK:
            staging.close()
            raise error_from_code(code, "registering the staging buffer")
        if self.on_gpu and self._pin(staging):
            self.pinned.add(staging.ptr)
        return staging

    def staging_for(self, lane: int) -> SharedBuffer:
        """The staging buffer of the mover's ``lane``: each lane has its own,
        so the forward's copies never wait for the background's (lane 0's
        is made when kvtier first answers, another lane's on first use).

        Raises:
            KvtierError: kvtier refused to register a new one.
        """
        if self.owner is not None:
            return self.owner.staging_for(lane)
        with self._lock:
            staging = self._stagings.get(lane)
            if staging is None:
                staging = self._stagings[lane] = self._new_staging()
            return staging

    def _use_leases(self, forward_only: bool = False) -> None:
        """Turns leased loads on where kvtier offers leases (on a GPU, once
        its arenas are page-locked); logs which, or why not (loads are then
        staged). ``forward_only``: the cache is registered (zero-copy), and
        only the forward lane's loads, which never go straight into it
        (:meth:`move`), take leases."""
        offer = self.core.client.server_info.get("leases") or {}
        which = "loads on the forward path" if forward_only else "loads"
        if not offer.get("offered"):
            why = offer.get("why_not") or "the server's socket predates leases"
            self.logger.info("kvtier connector: %s are staged, not leased: %s", which, why)
            return
        if not self.on_gpu:
            self.leased_loads = True
            self.logger.info(
                "kvtier connector: %s copy from kvtier's RAM tier into vLLM's pages (leases: one copy, not two)%s",
                which,
                "" if forward_only else "; stores are staged",
            )
            return
        device = self.layers[0].device.index or 0
        try:
            pinned = self.core.client.pin_arenas(device)
        except (LeasesOffError, CudaError) as e:
            self.logger.info("kvtier connector: loads are staged, not leased: %s", e)
            return
        except KvtierError as e:
            self.core.failed("register", e)
            return
        self.leased_loads = pinned > 0
        if self.leased_loads:
            self.logger.info(
                "kvtier connector: loads copy from kvtier's RAM tier straight to GPU %d (leases; %d bytes of "
                "kvtier's memory page-locked, so each copy is a DMA from it); stores are staged",
                device,
                pinned,
            )

    def spans(self, block_id: int) -> tuple[list[int], list[int]]:
        """The layer pages of one block in the registered cache, adjacent ones merged."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for layer in self.layers:
            ptr = layer[block_id].data_ptr()
            if ptrs and ptrs[-1] + sizes[-1] == ptr:
                sizes[-1] += self.layer_bytes
            else:
                ptrs.append(ptr)
                sizes.append(self.layer_bytes)
        return ptrs, sizes

    def pages(self, block_id: int) -> list[Any]:
        """The layer pages of one block, in model order, as host buffers
        (what a kvtier block holds end to end): views of the cache on the
        CPU; on a GPU, copies to the host (one device-to-host copy per page:
        a digest there would rather be a reduction on the device)."""
        out = []
        for layer in self.layers:
            page = layer[block_id]
            if page.device.type != "cpu":
                page = page.cpu()
            out.append(page.contiguous().view(-1).numpy())
        return out

    def move(
        self,
        keys: list[str],
        block_ids: list[int],
        *,
        load: bool,
        tags: list[BlockTag | None] | None = None,
        layer_done: Callable[[int], None] | None = None,
        lane: int = 0,
    ) -> list[int]:
        """Blocks ``block_ids`` of the paged cache to or from kvtier keys
        ``keys`` (a store's block ``i`` with the block tag ``tags[i]``, if
        given), staged through ``lane``'s buffer; per block the call's result
        (``>= 0`` done, else a docs/LOCAL.md code). Never raises: a failure
        is a result. A staged load calls ``layer_done(layer)`` as each
        layer's pages of every block are in (the other paths write all
        layers of a block at once). Staged rounds stop at the first kvtier
        did not answer (:func:`in_rounds`).

        kvtier writes into the registered cache only for the background
        lane's loads: a load given up on (kvtier held still mid-copy) may
        still land a piece in the pages it named until kvtier closes that
        connection (:meth:`kvtier.Client.local_settled`), and only a
        background load's report can wait for that (the mover holds it;
        the forward cannot wait for a stopped kvtier), so the forward
        lane's loads are leased (one copy by this process from kvtier's RAM
        tier, where kvtier offers leases) or go through its staging buffer,
        which a give-up retires instead."""
        client = self.core.client
        kind = "load" if load else "store"
        out: list[int] = []
        try:
            if self.zero_copy and not (load and lane == FORWARD):
                spans = [self.spans(b) for b in block_ids]
                ptrs, sizes = [p for p, _ in spans], [s for _, s in spans]
                if load:
                    out = client.batch_get_into_multi_buffers(keys, ptrs, sizes)
                else:
                    out = client.batch_put_from_multi_buffers(keys, ptrs, sizes, tags)
                self.core.count(zero_copy_blocks=sum(1 for r in out if r >= 0))
            elif load and self.leased_loads:
                out = self._leased(keys, block_ids, lane)
            else:
                out = in_rounds(
                    len(keys),
                    lambda start, end: self._staged(
                        keys[start:end],
                        block_ids[start:end],
                        load=load,
                        tags=None if tags is None else tags[start:end],
                        layer_done=layer_done if end >= len(keys) else None,
                        lane=lane,
                    ),
                )
        except Exception as e:  # a kvtier failure is a miss, never an exception in vLLM
            self.core.failed(kind, e)
            out.extend([codes.CONNECTION_LOST] * (len(keys) - len(out)))
        for key, result in zip(keys, out, strict=True):
            if result < 0 and not (load and result == codes.NOT_FOUND):
                self.core.failed(kind, error_from_code(result, f"{kind} {key}: {codes.name_of(result)}"))
        return out

    def _leased(self, keys: list[str], block_ids: list[int], lane: int) -> list[int]:
        """Loads from leases: one copy per layer page from kvtier's arena into
        vLLM's (on a GPU a DMA from the page-locked arena, then a wait for
        the stream), then the generation check. Blocks not leased for want of
        room or RAM (``NOT_IN_RAM``, ``LIMIT``) and those whose lease had
        ended are read through staging, as is everything once the server
        says it offers no leases (restarted with ``--ram-shared off``)."""
        out = [codes.NOT_FOUND] * len(keys)
        again: list[int] = []
        leased = 0
        try:
            leases = self.core.client.lease(keys)
        except LeasesOffError as e:
            self.leased_loads = False
            self.logger.info("kvtier connector: loads are staged from now on: %s", e)
            leases, again = None, list(range(len(keys)))
        if leases is not None:
            with leases:
                copied = []
                for i, block_id in enumerate(block_ids):
                    if leases.views[i] is None:
                        if leases.results[i] in (codes.NOT_IN_RAM, codes.LIMIT):
                            again.append(i)
                        else:
                            out[i] = leases.results[i]
                        continue
                    rows = leases.torch(i).view(len(self.layers), self.layer_bytes)
                    for layer, layer_pages in enumerate(self.layers):
                        layer_pages[block_id].view(-1).copy_(rows[layer], non_blocking=True)
                    copied.append(i)
                if copied and self.on_gpu:
                    torch.cuda.current_stream(self.layers[0].device).synchronize()
                for i in copied:
                    if leases.valid(i):
                        out[i] = self.block_bytes
                        leased += 1
                    else:
                        again.append(i)
        self.core.count(leased_blocks=leased)
        staged = in_rounds(
            len(again),
            lambda start, end: self._staged(
                [keys[i] for i in again[start:end]], [block_ids[i] for i in again[start:end]], load=True, lane=lane
            ),
        )
        for i, result in zip(again, staged, strict=True):
            out[i] = result
        return out

    def _staged(
        self,
        keys: list[str],
        block_ids: list[int],
        *,
        load: bool,
        tags: list[BlockTag | None] | None = None,
        layer_done: Callable[[int], None] | None = None,
        lane: int = 0,
    ) -> list[int]:
        """Up to :data:`STAGING_BLOCKS` blocks through ``lane``'s staging
        buffer, one torch copy per layer page (a store with its blocks'
        tags); a load copies layer by layer, calling ``layer_done`` after
        each. On a GPU each copy runs on the calling thread's current stream
        and ends before it returns (``copy_`` without ``non_blocking``)."""
        staging = self.staging_for(lane)
        block_bytes = self.layer_bytes * len(self.layers)
        rows = staging.torch()[: STAGING_BLOCKS * len(self.layers) * self.layer_bytes]
        rows = rows.view(STAGING_BLOCKS, len(self.layers), self.layer_bytes)
        ptrs = [staging.ptr + i * block_bytes for i in range(len(keys))]
        client = self.core.client
        if load:
            results = client.batch_get_into(keys, ptrs, [block_bytes] * len(keys))
            for layer, layer_pages in enumerate(self.layers):  # the answered slots only: theirs are done
                for i, (block_id, result) in enumerate(zip(block_ids, results, strict=True)):
                    if result >= 0:
                        layer_pages[block_id].view(-1).copy_(rows[i, layer])
                if layer_done is not None:
                    layer_done(layer)
            if codes.CONNECTION_LOST in results and not self.core.settled():
                self._retire(lane, staging)  # the unanswered slots may still take a late piece
        else:
            for i, block_id in enumerate(block_ids):
                for layer, layer_pages in enumerate(self.layers):
                    rows[i, layer].copy_(layer_pages[block_id].reshape(-1))
            results = client.batch_put_from(keys, ptrs, [block_bytes] * len(keys), tags)
        self.core.count(staged_blocks=sum(1 for r in results if r >= 0))
        return list(results)

    def _retire(self, lane: int, staging: SharedBuffer) -> None:
        """Stops using ``lane``'s staging buffer after a load into it was
        given up on and kvtier has not closed that connection: kvtier, held
        still mid-copy, may still land a piece in it when it runs again
        (docs/LOCAL.md, "When a client gives up"), so a later load or store
        staged there could carry those bytes. The lane's next copy makes a
        new one; this one is unregistered (nothing names it again) and
        unmapped here, its pages freed once kvtier closes the connection
        that maps them. Counted in ``staging_retired_buffers``."""
        owner = self.owner or self
        with owner._lock:
            if owner._stagings.get(lane) is not staging:
                return
            del owner._stagings[lane]
        self.core.client.unregister_buffer(staging.ptr)
        owner._release(staging)
        self.core.count(staging_retired_buffers=1)
        self.logger.warning(
            "kvtier connector: kvtier did not answer a load through the staging buffer of lane %d and has not "
            "closed that connection (held still mid-copy?); a new buffer takes its place",
            lane,
        )

    def _pin(self, staging: SharedBuffer) -> bool:
        """Page-locks ``staging`` so the host-device copies are DMA from and
        to it, as kvtier's arenas are (:mod:`kvtier.memory.cuda`: ``PORTABLE``,
        so every CUDA context of the process sees it pinned), with the KV
        cache's device's context current when the thread has none (this runs
        on the mover thread: with the default, device 0, TP rank k would make
        a context on GPU 0). A refusal is logged and the copies stay pageable
        (slower, still correct)."""
        device = self.layers[0].device.index or 0
        try:
            cuda = _cuda.driver()
            cuda.use_device(device)
            cuda.register(staging.ptr, staging.nbytes, read_only=False)
        except CudaError as e:
            self.logger.warning(
                "kvtier connector: page-locking the staging buffer (%d bytes) for GPU %d failed: %s; staged copies "
                "to and from the GPU are pageable, slower",
                staging.nbytes,
                device,
                e,
            )
            return False
        return True

    def close(self) -> None:
        """Releases the staging buffer (its page lock on a GPU); a group's
        pages leave that to their owner."""
        if self.owner is None:
            for staging in self._stagings.values():
                self._release(staging)
            self._stagings.clear()
        self.registered = False

    def _release(self, staging: SharedBuffer) -> None:
        """Unpins (if pinned) and unmaps one staging buffer."""
        if staging.ptr in self.pinned:
            self.pinned.discard(staging.ptr)
            _cuda.driver().unregister(staging.ptr)
        staging.close()


def in_rounds(n: int, run: Callable[[int, int], list[int]]) -> list[int]:
    """The results of ``n`` blocks moved in rounds of :data:`STAGING_BLOCKS`
    (``run(start, end)`` per round). A round with a block kvtier did not
    answer (``CONNECTION_LOST``: the client waited its ``timeout_s``) ends
    them: the later blocks fail at once, so a stopped kvtier costs one
    give-up per transfer, not one per round (and the connector then counts
    it down, so the step's later transfers are not tried)."""
    out: list[int] = []
    for start in range(0, n, STAGING_BLOCKS):
        results = run(start, min(start + STAGING_BLOCKS, n))
        out.extend(results)
        if codes.CONNECTION_LOST in results:
            return out + [codes.CONNECTION_LOST] * (n - len(out))
    return out


def require_socket(core: ConnectorCore) -> None:
    """With ``local: on``, refuses to start when kvtier's same-host socket
    refuses this process (a server that is down is asked again later).

    Raises:
        ConfigurationError: the socket refused the hello (the peer's uid, or
            the token); the message names the uid and the flags.
    """
    try:
        core.client.transport  # noqa: B018 - the hello happens here
    except KvtierConnectionError:
        return
    except KvtierError as e:
        core.close()
        raise ConfigurationError(
            f"kvtier at {core.url} refused this engine on its same-host socket ({e}); this vLLM runs as "
            f"uid {os.getuid()}: start kvtier with --local-allow-uid {os.getuid()} (or run vLLM as kvtier's "
            f"user, or give a tenant's token as token_file), or set local to auto to move blocks over HTTP"
        ) from e
