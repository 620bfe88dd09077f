"""The worker side of the vLLM connector: when and on which thread blocks
move (:class:`kvtier.vllm_connector.KvtierConnector`; how they are copied is
:class:`kvtier.connectors.vllm.blocks.PagedBlocks`).

Copies run on two threads per worker, the mover's *lanes*, each in the
order it was asked for and each with its own staging buffer: the
background lane (``kvtier-mover``: background loads, asynchronous stores)
and the forward's lane (``kvtier-mover-forward``: what the forward waits
for, loads on its path, synchronous and inline stores), so the forward
never waits behind a background transfer. A preemption waits for the
preempted requests' own stores, not for the lane. When the forward waits
depends on the settings:

``loads``
    ``async`` (default): a hit is loaded off the forward path. The scheduler
    answers ``(tokens, True)``; vLLM parks the request
    (``WAITING_FOR_REMOTE_KVS``) and runs the others; the worker starts the
    request's load after the step's forward; :meth:`BlockMover.finished`
    reports it when its blocks are in, with any block that failed. One
    request's long prefix then costs the running requests nothing but the
    mover's CPU, and costs the loading request one scheduler step more than a
    synchronous load (it is scheduled in the step after its load ends).

    ``layer``: loads stay on the forward path (vLLM schedules the request in
    the step that loads it), but the forward waits per layer: the step's
    loads start before the forward, and :meth:`BlockMover.wait_layer` waits
    for one layer's pages only. A layer is ready when kvtier's copies and the
    connector's have reached it: with the staging buffer that is per layer
    (the connector copies layer-major); with leases every layer is ready
    when the step's last block is. Loads on the forward path never go
    straight into the registered cache (:meth:`PagedBlocks.move` says why).

    ``sync``: the step's loads finish before the forward starts.

    ``off``: nothing is loaded (no lookup is made; blocks are still
    stored): the reference of ``make bench-engine``, the same compiled graph
    and the same stores as a connector that loads.

``stores``
    ``async`` (default): :meth:`BlockMover.start_stores` hands the step's
    stores to the mover and returns, so they overlap the next forward. A
    block's pages are never read after vLLM may reuse them: a finished
    request with stores planned is kept by vLLM (``request_finished``
    answers ``True``; the scheduler names it in the next step's
    ``stores_awaited``) until :meth:`BlockMover.finished` reports its stores
    done, and a preempted request's stores are waited for in
    :meth:`BlockMover.preempt`, before vLLM hands its blocks to another.

    ``sync``: the step's stores finish before ``wait_for_save`` returns.

Per-layer stores (``save_kv_layer``) are not made: a kvtier block is every
layer of a vLLM block, stored in one call, and an asynchronous store already
takes the whole store off the forward path.

**GPU order.** With the KV cache in GPU memory, ``start_loads`` and
``start_stores`` record a CUDA event on the forward thread's current stream
(the forward's writes enqueued so far: vLLM calls ``wait_for_save`` as soon
as the forward is enqueued, not when it has run), and each lane runs its
copies and digests on a CUDA stream of its own that first waits for that
event: a store never reads a page before the forward wrote it, a load
never writes a page a step still in flight reads. Each copy ends before
the lane reports it (``copy_`` to or from page-locked staging, or a
stream synchronize after leased copies), so a reported load is on the GPU
before vLLM schedules its request.

**A load given up on.** A load kvtier does not answer within ``timeout_s``
is given up on: kvtier stops that connection's copies, but one held still
mid-copy (SIGSTOP, a frozen VM) finishes the piece it was in, up to 256 KiB,
when it runs again, and closes the connection after (docs/LOCAL.md, "When a
client gives up"). So a failed load is reported only once nothing more of
it can land: a background load into the registered cache is reported when
kvtier has closed that connection (:meth:`BlockMover.finished`), loads on
the forward path are leased or staged, and a staging buffer a load was
given up in is replaced (``staging_retired_buffers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import codes
from ..core import ConnectorCore
from .blocks import BACKGROUND, FORWARD, PagedBlocks
from .transfer import StepPlan, Transfer
from .verify import Digests, Oracle, digest_of

#: The values of the ``loads`` setting (module docstring).
LOAD_MODES = ("async", "layer", "sync", "off")
#: The values of the ``stores`` setting (module docstring).
STORE_MODES = ("async", "sync")


def mode_of(settings: dict[str, object], name: str, allowed: tuple[str, ...]) -> str:
    """The setting ``name`` (default ``allowed[0]``).

    Raises:
        ValueError: a value not in ``allowed`` (the message names them).
    """
    value = str(settings.get(name) or allowed[0]).lower()
    if value not in allowed:
        raise ValueError(f"kvtier connector: {name} is {settings.get(name)!r}; it is one of {', '.join(allowed)}")
    return value


@dataclass
class _Layers:
    """The per-layer readiness of one step's synchronous loads."""

    events: list[threading.Event]
    future: Future[None] | None = None

    def done(self, layer: int | None = None) -> None:
        """Marks ``layer`` (every layer when ``None``) ready."""
        for event in self.events if layer is None else self.events[layer : layer + 1]:
            event.set()


@dataclass
class _Pending:
    """What the mover owes vLLM: per request, stores not finished yet;
    requests whose background load ended, with the blocks that failed."""

    stores: dict[str, int] = field(default_factory=dict)
    loaded: list[tuple[str, list[int]]] = field(default_factory=list)
    loading: int = 0  # background loads started, not reported
    # Ended loads whose report waits for kvtier's close of a connection
    # given up on (:meth:`BlockMover.finished`).
    unsettled: list[tuple[str, list[int]]] = field(default_factory=list)


class BlockMover:
    """One worker's loads and stores (module docstring).

    Args:
        core: the connector's core (client, failures, counters).
        key_of: the kvtier key of a vLLM block hash of a KV cache group in
            this rank's namespace (``key_of(block_hash, group)``).
        loads, stores: the modes (:data:`LOAD_MODES`, :data:`STORE_MODES`).
        digests: the digests this worker stored (``digest`` on), else ``None``.
        oracle: the byte oracle (tests), else ``None``.
        logger: vLLM's logger.
        writes: whether this rank writes the block of a vLLM block hash
            (an MLA model's replica set stores each block once:
            :func:`~kvtier.connectors.vllm.transfer.writer_of`); ``None``:
            every block. A block another rank writes counts as stored here
            (``store_replica_blocks``), its digest recorded from this rank's
            own pages, so this rank's loads of it are checked as well.
    """

    def __init__(
        self,
        core: ConnectorCore,
        key_of: Callable[[bytes, int], str],
        *,
        loads: str,
        stores: str,
        digests: Digests | None,
        oracle: Oracle | None,
        logger: logging.Logger,
        writes: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.core = core
        self.key_of = key_of
        self.writes = writes
        self.loads = loads
        self.stores = stores
        self.digests = digests
        self.oracle = oracle
        self.logger = logger
        self.groups: list[PagedBlocks] = []
        self.layer_index: dict[str, int] = {}
        self._lanes = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-mover"),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-mover-forward"),
        ]
        self._streams: dict[int, Any] = {}  # per lane, its CUDA stream (a GPU KV cache)
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # a background load, or a request's last store, ended
        self._pending = _Pending()
        self._load_errors: set[int] = set()
        self._load_failed = False  # a load on this step's forward path failed on this rank
        self._layers: _Layers | None = None
        self._any_rank: Callable[[bool], bool] | None = None
        self._awaiting: set[str] = set()  # finished requests whose stores vLLM waits for

    def register(
        self, groups: list[PagedBlocks], layer_names: list[str], any_rank: Callable[[bool], bool] | None = None
    ) -> None:
        """The paged cache of each KV cache group, the layers' names in
        model order (one group: every layer), and ``any_rank``: whether a
        flag holds on any rank of this worker's tensor-parallel group (a
        collective every rank makes in the same step; ``None``: this rank
        alone)."""
        self.groups = groups
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self._any_rank = any_rank
        # The forward's lane copies on-path loads, synchronous stores and a
        # hybrid model's inline ones: its staging buffer is made up front then.
        forward = self.loads in ("sync", "layer") or self.stores == "sync" or len(groups) > 1
        for blocks in groups:
            (blocks.owner or blocks).lanes = (BACKGROUND, FORWARD) if forward else (BACKGROUND,)

    # ------------------------------------------------------------ loads

    def start_loads(self, meta: StepPlan) -> None:
        """Starts (``async``, ``layer``) or makes (``sync``) the step's loads."""
        if self.oracle is not None:
            self.oracle.step += 1
        self._load_failed = False
        self._layers = None
        background: dict[str, list[Transfer]] = {}
        for t in meta.loads:
            if t.background:
                background.setdefault(t.req_id, []).append(t)
        on_path = [t for t in meta.loads if not t.background]
        mark = self._mark() if meta.loads else None
        for transfers in background.values():  # one job per request: its groups' loads, reported together
            with self._lock:
                self._pending.loading += 1
            self._lanes[BACKGROUND].submit(self._background_load, transfers, self._step(), mark)
        if not on_path:
            return
        forward = self._lanes[FORWARD]
        if self.loads == "layer" and len(self.groups) == 1:
            layers = _Layers([threading.Event() for _ in self.groups[0].layers])
            layers.future = forward.submit(self._loads_on_path, on_path, self._step(), layers, mark)
            self._layers = layers
        else:
            forward.submit(self._loads_on_path, on_path, self._step(), None, mark).result()

    def _mark(self) -> Any:
        """With a GPU KV cache, a CUDA event recorded now on the calling
        (forward) thread's current stream, which the lanes' copies wait for
        (module docstring); else ``None``."""
        if not self.groups or not self.groups[0].on_gpu:
            return None
        device = self.groups[0].layers[0].device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @contextmanager
    def _after(self, mark: Any, lane: int) -> Iterator[None]:
        """Runs the body's copies on ``lane``'s CUDA stream once ``mark``
        (:meth:`_mark`) has passed; on the CPU, as they are."""
        if mark is None:
            yield
            return
        stream = self._streams.get(lane)
        if stream is None:
            stream = self._streams[lane] = torch.cuda.Stream(device=self.groups[0].layers[0].device)
        stream.wait_event(mark)
        with torch.cuda.stream(stream):
            yield

    def wait_layer(self, layer_name: str) -> None:
        """Waits until ``layer_name``'s pages of the step's loads are in (``layer`` mode)."""
        layers = self._layers
        index = self.layer_index.get(layer_name)
        if layers is None or index is None:
            return  # every layer, every step, with loads off the forward path: nothing to count
        started = time.perf_counter_ns()
        layers.events[index].wait()  # set by the mover at the latest when its job ends (each call has a timeout)
        self.core.count(layer_wait_us=(time.perf_counter_ns() - started) // 1000)

    def end_loads_on_path(self) -> None:
        """Waits for the step's ``layer`` loads to end (before its stores are planned from what failed)."""
        layers, self._layers = self._layers, None
        if layers is not None and layers.future is not None:
            layers.future.result()

    def _step(self) -> int:
        return self.oracle.step if self.oracle is not None else 0

    def _background_load(self, transfers: list[Transfer], step: int, mark: Any) -> None:
        """One request's background load; reported by :meth:`finished`
        whatever happens in it (a request vLLM parks for its load waits for
        that report, holding its blocks): a fault fails the blocks not known
        loaded."""
        failed_blocks: list[int] = []
        done = 0
        try:
            self.core.count(background_loads=1)
            with self._after(mark, BACKGROUND):
                for transfer in transfers:
                    failed = self._load(transfer, step, None, BACKGROUND)
                    if failed is not None:
                        failed_blocks += transfer.block_ids[failed:]
                    done += 1
        finally:
            for transfer in transfers[done:]:
                failed_blocks += transfer.block_ids
            entry = (transfers[0].req_id, failed_blocks)
            into_cache = any(self.groups[t.group].zero_copy for t in transfers)
            held = bool(failed_blocks) and into_cache and not self.core.settled()
            with self._lock:
                if held:
                    self._pending.unsettled.append(entry)
                else:
                    self._pending.loaded.append(entry)
                    self._pending.loading -= 1
                    self._ended.notify_all()
            if held:
                self.core.count(load_reports_held=1)
                self.core.failures.warn(
                    "unsettled",
                    f"the load of request {entry[0]} failed and kvtier has not closed the connection given up on "
                    f"(held still mid-copy?): a late piece may still land in its pages, so vLLM gets the failure "
                    f"(and the pages) once kvtier closes it",
                )

    def _loads_on_path(self, transfers: list[Transfer], step: int, layers: _Layers | None, mark: Any) -> None:
        try:
            with self._after(mark, FORWARD):
                for transfer in transfers:
                    failed = self._load(transfer, step, layers if transfer is transfers[-1] else None, FORWARD)
                    if failed is not None:
                        with self._lock:
                            self._load_errors.update(transfer.block_ids[failed:])
                        self._load_failed = True
        finally:
            if layers is not None:
                layers.done()

    def _load(self, transfer: Transfer, step: int, layers: _Layers | None, lane: int) -> int | None:
        """Loads one request's blocks; the index of its first block that
        failed (a miss, CRC or digest), ``None`` when all loaded. A fault
        anywhere in it (staging, a copy, the digest) fails every
        block of the transfer, logged: a failed load vLLM recomputes, never
        an exception in the forward or a lost completion."""
        try:
            return self._load_blocks(transfer, step, layers, lane)
        except Exception as error:  # any fault is this load's failure
            self.core.count(load_failed_blocks=len(transfer.hashes), errors=1)
            self.core.failures.warn(
                "copy",
                f"loading {len(transfer.hashes)} block(s) of request {transfer.req_id} failed: {error!r}; a failed "
                f"load (vLLM recomputes them)",
                logging.ERROR,
            )
            return 0

    def _load_blocks(self, transfer: Transfer, step: int, layers: _Layers | None, lane: int) -> int | None:
        blocks = self.groups[transfer.group]
        keys = [self.key_of(h, transfer.group) for h in transfer.hashes]
        on_layer = layers.done if layers is not None else None
        started = time.perf_counter_ns()
        if blocks.ready():
            results = blocks.move(keys, transfer.block_ids, load=True, layer_done=on_layer, lane=lane)
        else:
            results = [codes.CONNECTION_LOST] * len(keys)
        loaded = next((i for i, r in enumerate(results) if r < 0), len(results))
        loaded = self._verify(transfer, keys, loaded, step)
        self.core.count(loaded_blocks=loaded, load_us=(time.perf_counter_ns() - started) // 1000)
        if loaded == len(results):
            return None
        self.core.count(load_failed_blocks=len(results) - loaded)
        self._tell("load_failed", transfer, loaded, keys[loaded], None, step)
        return loaded

    def _verify(self, transfer: Transfer, keys: list[str], loaded: int, step: int) -> int:
        """The leading blocks of ``loaded`` whose pages hold what this worker
        stored under their keys (with ``digest`` on; all of them when off, or
        when no digest is known), each told to the oracle."""
        if self.digests is None and self.oracle is None:
            return loaded
        for i in range(loaded):
            digest = digest_of(self.groups[transfer.group].pages(transfer.block_ids[i]))
            verdict = None if self.digests is None else self.digests.check(keys[i], digest)
            self._tell("loaded" if verdict is not False else "digest_refused", transfer, i, keys[i], digest, step)
            if self.digests is None:
                continue
            if verdict is None:
                self.core.count(digest_unknown_blocks=1)
            elif verdict:
                self.core.count(digest_checked_blocks=1)
            else:
                self.core.count(digest_mismatch_blocks=1)
                self.core.failures.warn(
                    "digest",
                    f"block {keys[i]} loaded with a digest that is not the one this worker stored; a failed load "
                    f"(vLLM recomputes)",
                    logging.ERROR,
                )
                return i
        return loaded

    def _tell(self, kind: str, transfer: Transfer, i: int, key: str, digest: int | None, step: int) -> None:
        """One oracle event of block ``i`` of ``transfer`` (with ``oracle_dir``).
        The oracle only watches: an event it cannot write is logged and
        counted (``errors``), and the copy goes on."""
        if self.oracle is None:
            return
        tag = transfer.tags[i] if transfer.tags is not None else None
        try:
            self.oracle.event(
                kind,
                step=step,
                req_id=transfer.req_id,
                index=transfer.first + i,
                block_hash=transfer.hashes[i],
                key=key,
                digest=digest,
                tokens=tag.token_ids if tag is not None else None,
                parent=tag.parent_hash if tag is not None else None,
            )
        except Exception as error:  # an observer's fault is not the copy's
            self.core.count(errors=1)
            self.core.failures.warn("oracle", f"the byte oracle could not record a {kind} event: {error!r}")

    # ----------------------------------------------------------- stores

    def start_stores(self, meta: StepPlan) -> None:
        """Starts (``async``) or makes (``sync``) the step's stores, none
        while kvtier is not known to answer (``store_dropped_blocks``). In a
        step whose loads ran on the forward path, none at all when a load
        failed on any rank of the tensor-parallel group
        (``stores_skipped_after_failed_load``): the forward read the failed
        pages, other requests of the step may have taken the loaded blocks as
        a prefix hit of vLLM's own, and the other ranks' slices of every
        block went through the all-reduce with it. The ranks agree on that
        with one collective in such steps only (:meth:`register`'s
        ``any_rank``); background loads need none, since vLLM schedules their
        requests only once every rank has reported them."""
        self.end_loads_on_path()
        step = self._step()
        mark = self._mark() if meta.stores else None
        jobs: list[Future[None]] = []
        failed_anywhere = False
        if any(not t.background for t in meta.loads):
            failed_here = self._load_failed
            failed_anywhere = self._any_rank(failed_here) if self._any_rank is not None else failed_here
        for transfer in meta.stores:
            n = len(transfer.hashes)
            keys = [self.key_of(h, transfer.group) for h in transfer.hashes]
            keep = 0 if failed_anywhere else n
            if keep < n:
                self.core.count(stores_skipped_after_failed_load=n - keep)
                for i in range(keep, n):
                    self._tell("store_skipped", transfer, i, keys[i], None, step)
            if keep == 0:
                continue
            if not meta.store:
                self.core.count(store_dropped_blocks=keep)
                continue
            with self._lock:
                self._pending.stores[transfer.req_id] = self._pending.stores.get(transfer.req_id, 0) + 1
            waited = self.stores == "sync" or transfer.inline
            lane = FORWARD if waited else BACKGROUND
            job = self._lanes[lane].submit(self._store, transfer, keys[:keep], step, mark, lane)
            if waited:
                jobs.append(job)
        for job in jobs:
            job.result()

    def _store(self, transfer: Transfer, keys: list[str], step: int, mark: Any, lane: int) -> None:
        """One transfer's store; a fault anywhere in it (staging, a copy, the
        digest) is a failed store of its blocks, logged, and the request's
        stores end all the same (vLLM waits for them)."""
        try:
            with self._after(mark, lane):
                self._store_blocks(transfer, keys, step, lane)
        except Exception as error:  # any fault is this store's failure
            if self.digests is not None:
                for key in keys:
                    self.digests.forget(key)
            self.core.count(store_failed_blocks=len(keys), errors=1)
            self.core.failures.warn(
                "copy",
                f"storing {len(keys)} block(s) of request {transfer.req_id} failed: {error!r}; they are not in kvtier",
                logging.ERROR,
            )
        finally:
            with self._lock:
                left = self._pending.stores[transfer.req_id] - 1
                if left:
                    self._pending.stores[transfer.req_id] = left
                else:
                    del self._pending.stores[transfer.req_id]
                    self._ended.notify_all()

    def _store_blocks(self, transfer: Transfer, keys: list[str], step: int, lane: int) -> None:
        blocks = self.groups[transfer.group]
        keep = len(keys)
        if not blocks.ready():
            self.core.count(store_dropped_blocks=keep)
            return
        mine = [i for i in range(keep) if self.writes is None or self.writes(transfer.hashes[i])]
        check = self.digests is not None or self.oracle is not None
        digests = [digest_of(blocks.pages(b)) for b in transfer.block_ids[:keep]] if check else []
        tags = [transfer.tags[i] for i in mine] if transfer.tags is not None else None
        ids = [transfer.block_ids[i] for i in mine]
        results = blocks.move([keys[i] for i in mine], ids, load=False, tags=tags, lane=lane) if mine else []
        result_of = dict(zip(mine, results, strict=True))
        for i in range(keep):
            if not digests:
                break
            result = result_of.get(i)
            if result is None or result >= 0:
                # Stored here, or by the rank of the replica set that writes
                # it, from pages equal to these.
                if self.digests is not None:
                    self.digests.record(keys[i], digests[i])
                self._tell("stored" if result is not None else "replica", transfer, i, keys[i], digests[i], step)
                continue
            # What kvtier holds under it is not known: this block, if the
            # store landed and only its answer was lost, else the last.
            if self.digests is not None:
                self.digests.forget(keys[i])
            self._tell("store_failed", transfer, i, keys[i], digests[i], step)
        failed = sum(1 for r in results if r < 0)
        self.core.count(
            stored_blocks=len(results) - failed, store_failed_blocks=failed, store_replica_blocks=keep - len(mine)
        )

    def preempt(self, preempted: list[str]) -> None:
        """Waits for the stores of ``preempted`` requests still in flight
        (theirs only, not the lane's other work): vLLM hands their blocks to
        others once this returns."""
        with self._lock:
            if any(req_id in self._pending.stores for req_id in preempted):
                self.core.count(preemption_waits=1)
                self._ended.wait_for(lambda: not any(r in self._pending.stores for r in preempted))

    def drain(self) -> None:
        """Waits until every copy asked for so far has ended (each lane runs its copies in order)."""
        for job in [lane.submit(lambda: None) for lane in self._lanes]:
            job.result()

    # ------------------------------------------------------ completions

    def wait_idle(self, timeout_s: float) -> None:
        """In a step with nothing to compute: waits at most ``timeout_s`` for
        a background load or a finished request's stores to end, when one is
        in flight and nothing is ready to report. Without it vLLM runs empty
        steps back to back while a request waits for its load (about 600 a
        second here), and those take the CPU the copy needs (docs/BENCHMARKS.md,
        issue 54)."""
        with self._lock:
            waiting = self._pending.loading > 0 or any(r in self._pending.stores for r in self._awaiting)
            if waiting and not self._pending.loaded:
                self._ended.wait(timeout_s)

    def finished(self, stores_awaited: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(sending, recving, failed)`` for vLLM's ``get_transfer_results``:
        the finished requests vLLM keeps for their stores (``stores_awaited``
        of this step and earlier ones: ``request_finished`` answered
        ``True``) whose stores have all ended; requests whose background load
        ended and that have no store in flight (an aborted request's blocks
        are freed when its load is reported), its failed blocks then in
        :meth:`load_errors`; with more than one KV cache group, which vLLM
        takes no block failures for, the requests among them whose load
        failed instead. A background load that failed while kvtier, given up
        on, had not closed that connection is reported only once it has
        (``load_reports_held``): until then kvtier may still finish a piece
        of its copy into the request's pages, and vLLM, told of the failure,
        would recompute into them or, for a request aborted meanwhile, hand
        them to another. The request waits (``WAITING_FOR_REMOTE_KVS``) as
        long as kvtier is held still."""
        hybrid = len(self.groups) > 1
        settled = not self._pending.unsettled or self.core.settled()  # no late piece can land
        with self._lock:
            pending = self._pending
            if settled and pending.unsettled:
                pending.loaded += pending.unsettled
                pending.loading -= len(pending.unsettled)
                pending.unsettled = []
            self._awaiting |= stores_awaited
            sending = {r for r in self._awaiting if r not in pending.stores}
            loaded = [entry for entry in pending.loaded if entry[0] not in pending.stores]
            pending.loaded = [entry for entry in pending.loaded if entry[0] in pending.stores]
            if not hybrid:
                for _, failed_blocks in loaded:
                    self._load_errors.update(failed_blocks)
        self._awaiting -= sending
        recving = {req_id for req_id, _ in loaded}
        return sending, recving, {req_id for req_id, blocks in loaded if blocks} if hybrid else set()

    def load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Waits for the copies in flight, then ends the mover's lanes."""
        for lane in self._lanes:
            lane.shutdown(wait=True)
