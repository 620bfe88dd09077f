"""kvtier as a secondary tier of vLLM's native KV offloading (vLLM 0.32.x).

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps a CPU
primary tier and cascades every chunk it stores there to its secondary tiers;
a chunk found only in a secondary tier is loaded back into the primary tier.
This module is such a tier, loaded out of tree by vLLM's tier factory (no
patch to vLLM; docs/INTEGRATIONS.md has the full command line)::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
        "block_size":128,"cpu_bytes_to_use":17179869184,
        "secondary_tiers":[{"type":"KvtierTier","module_path":"kvtier.vllm",
                            "url":"http://127.0.0.1:8085"}]}}'

One chunk row of the primary CPU view is one kvtier block, bytes as vLLM
laid them out (every worker's slice, padded to the page size): the store's
``block_bytes`` must equal the row stride. It is compared at start, where a
mismatch is refused with both numbers named; if kvtier is down then, at the
first transfer or lookup that reaches it, where a mismatch makes every job
fail and every lookup miss, with an error log (the rule of every connector,
``kvtier.connectors.core``).

Keys: vLLM's ``OffloadKey`` (the block hash of the chunk's last block and the
KV cache group index) under a namespace fingerprint (docs/KEYS.md) of the
model, KV dtype, parallel layout, tokens per chunk and KV cache groups, the
fields vLLM's own file-system tier names its directory by.

Block tags (kvtier's KV events): none. A tier is handed ``OffloadKey`` s
only (the hash of a chunk's last block and its group), not the hashes of
the chunk's blocks, their parent or their tokens; kvtier's own
``KvtierConnector`` (:mod:`kvtier.vllm_connector`) tags every block
(docs/INTEGRATIONS.md).

Nothing here blocks vLLM's scheduler: ``lookup`` answers from a per-step
batch that one background thread resolves with one ``POST /v1/lookup`` per
request chain (``RETRY`` until it has), and stores and loads run on the
client's connection pool and complete through ``get_finished_jobs``. A failed
or refused transfer is a failed job (vLLM recomputes, and a failed load marks
its keys missing so vLLM does not ask again); a kvtier that is down costs
misses and a rate-limited warning, never a stalled scheduler.

The same-host plane (``local``, docs/LOCAL.md): vLLM 0.32's primary CPU tier
is a ``MAP_SHARED`` mapping of ``/dev/shm/vllm_offload_<engine_id>.mmap``
(``SharedOffloadRegion``). Over the socket the tier registers that mapping
once, and each job is one batch call in which kvtier copies straight into the
primary rows (a load) or out of them (a store): no copy in vLLM's process
(``zero_copy_chunks``). A primary view that no shared file backs cannot be
registered; then each chunk is one call through the client's staging area, one
more copy of every byte in this process (``staged_chunks``). Over HTTP each
chunk is one request, received straight into its row. Which path is used, and
why, is logged once.

Settings (keys of the tier's entry in ``secondary_tiers``):

=================  ========================  ==========================================
key                default                   meaning
=================  ========================  ==========================================
``url``            ``http://127.0.0.1:8085``  the kvtier server
``local``          ``auto``                  ``auto``: the same-host socket when kvtier
                                             serves one (``local.socket`` of
                                             ``/v1/stats``), else HTTP; ``off``: HTTP
                                             only; ``on``: the socket or failed jobs
``token_file``     none                      file holding the bearer token
``connections``    8                         HTTP/1.1 connections (chunks in flight)
``timeout_s``      10                        per socket operation; then a failed job
``retries``        1                         new-connection retries after a reset
``down_s``         1                         after a connection failure, fail jobs and
                                             answer misses for this long untried
``locality``       none                      ``LOCAL`` or ``REMOTE``, as for vLLM's tiers
=================  ========================  ==========================================
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable
from typing import ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ... import codes
from ...errors import error_from_code
from ...keys import Namespace, block_id_hex
from ..core import ConnectorCore, GeometryError
from ..shared_host import SharedHost

logger = logging.getLogger("kvtier.vllm")


def namespace_of(offloading_spec: OffloadingSpec) -> Namespace:
    """The namespace of a vLLM offloading configuration.

    The fields are those vLLM's file-system tier hashes into its directory
    name (``FileMapper``, parallelism-agnostic where vLLM says the chunk
    bytes are): model, KV dtype, tokens per hash and blocks per chunk, TP, PP,
    PCP and DCP sizes, KV cache groups, canonical layout. Rank is not in it:
    the scheduler stores whole chunks, every worker's slice in one row.
    """
    mapper = FileMapper.from_offloading_spec(
        root_dir="",
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    fields = mapper.get_run_config()
    rest = {k: v for k, v in fields.items() if k not in ("model_name", "dtype", "tp_size", "pp_size")}
    return Namespace(
        model=str(fields["model_name"]),
        dtype=str(fields["dtype"]),
        tp_size=int(fields["tp_size"]),
        pp_size=int(fields["pp_size"]),
        block_tokens=int(fields["tokens_per_hash"]) * int(fields["blocks_per_file"]),
        extra="vllm-offload:" + json.dumps(rest, sort_keys=True, separators=(",", ":")),
    )


class _Lookups(AsyncLookupManager):
    """vLLM's own async lookup machinery (a per-step batch, one worker
    thread); each request's keys of a step go to kvtier as one chain."""

    def __init__(self, tier: KvtierTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.lookup_chain(keys, req_context)


class _Job:
    """An in-flight transfer job: which chunks are done, which failed."""

    __slots__ = ("failed", "job", "keys", "loaded", "missed", "remaining", "unsettled")

    def __init__(self, job: TransferJob, keys: list[OffloadKey]) -> None:
        self.job = job
        self.keys = keys
        self.loaded = [False] * len(keys)
        self.remaining = len(keys)
        self.failed = 0
        self.missed = 0
        self.unsettled = False  # a load given up on before kvtier closed that connection


class KvtierTier(SecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over a kvtier server.

    Built by vLLM's ``SecondaryTierFactory`` from a ``secondary_tiers`` entry
    ``{"type": "KvtierTier", "module_path": "kvtier.vllm", ...}``; the other
    keys of the entry are the settings in the module docstring. Readiness,
    the geometry check, failures, stats and fan-out are kvtier's shared
    connector core (``kvtier.connectors.core``).

    Raises (at construction, so vLLM refuses to start on a configuration a
    retry cannot fix):
        ValueError: the server answers and its ``block_bytes`` is not the
            primary view's row stride (a ``GeometryError``, both named), or
            ``locality`` is not ``LOCAL``/``REMOTE``. A mismatch found later
            (kvtier was down at start) raises nothing: every job fails, every
            lookup misses and an error naming both sizes is logged.

    Attributes:
        url: the kvtier server.
        client: the :class:`~kvtier.Client` every transfer goes through.
        namespace: the key namespace (see :func:`namespace_of`).
        stats: counters (``lookups``, ``lookup_hits``, ``stores``,
            ``stored_chunks``, ``loads``, ``loaded_chunks``, ``load_misses``,
            ``failed_jobs``, ``errors``; ``zero_copy_chunks``: chunks kvtier
            copied straight into or out of the registered primary tier;
            ``staged_chunks``: chunks moved over the socket through the
            client's staging area; ``load_reports_held``: failed loads into
            the registered primary tier reported only once kvtier closed the
            connection given up on, :meth:`get_finished_jobs`) for tests and
            debugging.
        transport: ``"unix"`` or ``"http"`` once known, else ``None`` (see
            :attr:`kvtier.connectors.core.ConnectorCore.transport`).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        url: str = "http://127.0.0.1:8085",
        local: str = "auto",
        token_file: str | None = None,
        connections: int = 8,
        timeout_s: float = 10.0,
        retries: int = 1,
        down_s: float = 1.0,
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        settings = {
            "url": url,
            "local": local,
            "token_file": token_file,
            "connections": connections,
            "timeout_s": timeout_s,
            "retries": retries,
            "down_s": down_s,
        }
        stats = (
            "lookups",
            "lookup_hits",
            "stores",
            "stored_chunks",
            "loads",
            "loaded_chunks",
            "load_misses",
            "zero_copy_chunks",
            "staged_chunks",
            "load_reports_held",
        )
        self._core = ConnectorCore(
            settings, logger=logger, stats=(*stats, "failed_jobs"), outcome="a miss or a failed job"
        )
        self.url = self._core.url
        self.client = self._core.client
        self.down_s = self._core.down_s
        self.stats = self._core.stats
        self.namespace = namespace_of(offloading_spec)
        self._fingerprint = self.namespace.fingerprint
        # One flat byte view over the primary tier: row c is chunk c.
        self._rows = (
            primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B" else primary_kv_view
        )
        self._num_chunks = self._rows.nbytes // self.block_size_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey]]] = queue.SimpleQueue()
        self._held: list[tuple[JobResult, list[OffloadKey]]] = []  # ended loads kvtier may still write into
        self._closed = False
        self._host = SharedHost(
            self._core,
            self._rows,
            what="the primary CPU tier",
            remedy="vLLM 0.32 keeps it in a shared /dev/shm file; the kvtier.local warning says why this one is not",
        )
        try:
            self._core.start(
                self.block_size_bytes, chunk="a chunk row of vLLM's CPU offloading tier", remedy="change block_size"
            )
        except GeometryError:
            if self._rows is not primary_kv_view:
                self._rows.release()  # else vLLM cannot unmap its CPU tier while cleaning up
            raise
        self._lookups = _Lookups(self)
        if self._core.transport is not None:
            self._choose_path()
        logger.info(
            "kvtier tier %s: chunks of %d bytes, namespace %s",
            url,
            self.block_size_bytes,
            self._fingerprint,
        )

    # ------------------------------------------------------------ helpers

    @property
    def transport(self) -> str | None:
        """``"unix"`` or ``"http"``: how blocks move, once known; else ``None``."""
        return self._core.transport

    @property
    def zero_copy(self) -> bool | None:
        """Whether jobs move rows through the registered primary tier;
        ``None`` until decided (the server has not answered yet)."""
        return self._host.zero_copy

    def _choose_path(self) -> bool | None:
        """Whether jobs go through the registered primary tier (registers it
        the first time the transport is known to be the socket); ``None``
        while undecided. Logs the choice once. Blocks at most one request."""
        return self._host.decide()

    def key_of(self, key: OffloadKey) -> str:
        """The kvtier key of a vLLM ``OffloadKey`` (block hash ‖ group index)."""
        return f"{self._fingerprint}-{block_id_hex(bytes(key))}"

    def _row(self, chunk_id: int) -> memoryview:
        if not 0 <= chunk_id < self._num_chunks:
            raise IndexError(f"chunk id {chunk_id} is outside the primary tier's {self._num_chunks} chunks")
        start = chunk_id * self.block_size_bytes
        return self._rows[start : start + self.block_size_bytes]

    # ------------------------------------------------------------- lookup

    def lookup_chain(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        """Which of one request's keys are stored, as a prefix: the keys of
        each KV cache group, in token order, are one chain and one
        ``POST /v1/lookup``. Runs on vLLM's lookup thread; all ``False`` when
        kvtier fails."""
        found = [False] * len(keys)
        by_group: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_group.setdefault(get_offload_group_idx(key), []).append(i)
        for indices in by_group.values():
            positions = [req_context.get_offload_key_position(keys[i]) for i in indices]
            if all(p is not None for p in positions):
                indices = [i for _, i in sorted(zip(positions, indices, strict=True))]  # type: ignore[type-var]
            hits = self._core.call("lookup", self.client.lookup, [self.key_of(keys[i]) for i in indices], failed=0)
            for i in indices[:hits]:
                found[i] = True
        self._core.count(lookups=len(keys), lookup_hits=sum(found))
        return found

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``HIT``/``MISS`` once this step's batch has been looked up,
        ``RETRY`` until then (never waits on kvtier)."""
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Sends this step's lookups to the lookup thread."""
        self._lookups.flush()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Chunk-level offloading, vLLM's default."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Releases the request's lookup state."""
        self._lookups.cleanup(req_context.req_id)

    # ---------------------------------------------------------- transfers

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Stores the job's chunk rows under their keys on the client's pool
        and returns at once: one ``batch_put_from`` for the job when the
        primary tier is registered (kvtier reads the rows), else one call
        per chunk (an HTTP PUT, or a staged put over the socket)."""
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Reads the job's chunks into their primary rows on the client's pool
        and returns at once: one ``batch_get_into`` for the job when the
        primary tier is registered (kvtier writes the rows), else one call
        per chunk (an HTTP GET received straight into the row, or a staged
        read over the socket)."""
        self._submit(job_metadata, load=True)

    def _submit(self, job: TransferJob, load: bool) -> None:
        keys = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        state = _Job(job, keys)
        with self._lock:
            self._in_flight += 1
        self._core.count(**{"loads" if load else "stores": 1})
        if len(keys) != len(chunk_ids):
            logger.error("kvtier: job %s has %d keys but %d chunk ids", job.job_id, len(keys), len(chunk_ids))
            state.failed, state.remaining = len(keys) or 1, 0
            self._finish(state)
            return
        if not keys:
            self._finish(state)
            return
        if self.zero_copy is not False and self._core.transport != "http":
            # Registered, or not decided yet: decided on the pool (it may ask the server).
            try:
                self.client.executor().submit(self._run_job, state, chunk_ids, load)
            except RuntimeError:  # the pool is shut down
                state.failed, state.remaining = len(keys), 0
                self._finish(state)
            return
        self._submit_chunks(state, chunk_ids, load)

    def _run_job(self, state: _Job, chunk_ids: list[int], load: bool) -> None:
        """On the pool: the job as one batch call when the primary tier is
        registered, else its chunks one by one. Never raises."""
        try:
            if self._core.ready() and self._choose_path():
                self._run_batch(state, chunk_ids, load)
                return
        except Exception:
            logger.exception("kvtier: job %s failed", state.job.job_id)
            with self._lock:
                state.failed, state.remaining = len(state.keys), 0
            self._finish(state)
            return
        self._submit_chunks(state, chunk_ids, load)

    def _run_batch(self, state: _Job, chunk_ids: list[int], load: bool) -> None:
        """One ``batch_get_into``/``batch_put_from`` over the job's rows (by
        address in the registered primary tier). Per item: ``>= 0`` done,
        ``NOT_FOUND`` a miss, any other code a failed chunk (counted in
        ``errors`` and warned about, rate-limited; ``CONNECTION_LOST`` opens
        the down window)."""
        kind = "load" if load else "store"
        size = self.block_size_bytes
        items = [i for i, c in enumerate(chunk_ids) if 0 <= c < self._num_chunks]
        if len(items) < len(chunk_ids):
            logger.error(
                "kvtier: job %s names chunk ids outside the primary tier's %d chunks",
                state.job.job_id,
                self._num_chunks,
            )
        keys = [self.key_of(state.keys[i]) for i in items]
        ptrs = [self._host.base + chunk_ids[i] * size for i in items]
        call = self.client.batch_get_into if load else self.client.batch_put_from
        results = call(keys, ptrs, [size] * len(items)) if items else []
        outcome = dict(zip(items, results, strict=True))
        done = 0
        for i in range(len(state.keys)):
            result = outcome.get(i, codes.OUT_OF_BOUNDS)
            if result >= 0:
                state.loaded[i] = True
                done += 1
            elif result == codes.NOT_FOUND and load:
                state.missed += 1
            else:
                state.failed += 1
                if i in outcome:
                    message = f"{kind} {self.key_of(state.keys[i])}: {codes.name_of(result)}"
                    self._core.failed(kind, error_from_code(result, message))
                else:
                    self._core.count(errors=1)
        state.remaining = 0
        state.unsettled = load and codes.CONNECTION_LOST in results and not self._core.settled()
        self._core.count(zero_copy_chunks=done)
        self._finish(state)

    def _submit_chunks(self, state: _Job, chunk_ids: list[int], load: bool) -> None:
        """The job's chunks one call each on the client's pool."""
        self._core.submit_each(
            "load" if load else "store",
            self._load_one if load else self._store_one,
            list(zip(state.keys, chunk_ids, strict=True)),
            functools.partial(self._chunk_done, state),
        )

    def _store_one(self, key: OffloadKey, chunk_id: int) -> bool:
        self._core.require_ready()
        self.client.put(self.key_of(key), self._row(chunk_id))
        if self._core.transport == "unix":
            self._core.count(staged_chunks=1)
        return True

    def _load_one(self, key: OffloadKey, chunk_id: int) -> bool:
        self._core.require_ready()
        found = self.client.get_into(self.key_of(key), self._row(chunk_id))
        if found and self._core.transport == "unix":
            self._core.count(staged_chunks=1)
        return found

    def _chunk_done(self, state: _Job, i: int, result: bool | None, error: BaseException | None) -> None:
        """Records one chunk's outcome (the core has logged an error); the
        last one finishes the job."""
        ok = error is None and bool(result)
        with self._lock:
            state.loaded[i] = ok
            if error is not None:
                state.failed += 1
            elif not ok:
                state.missed += 1
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            self._finish(state)

    def _finish(self, state: _Job) -> None:
        job = state.job
        ok = [k for k, done in zip(state.keys, state.loaded, strict=True) if done]
        success = not state.failed and not state.missed
        failed_keys: list[OffloadKey] = []
        successful_keys: tuple[OffloadKey, ...] | None = None
        if job.is_promotion and not success:
            failed_keys = [k for k, done in zip(state.keys, state.loaded, strict=True) if not done]
            successful_keys = tuple(ok) or None
        result = JobResult(
            job_id=job.job_id,
            success=success,
            successful_keys=successful_keys,
            transfer_time=time.monotonic() - job.submit_time,
            transfer_bytes=len(ok) * self.block_size_bytes if ok else None,
        )
        if job.is_promotion:
            self._core.count(loaded_chunks=len(ok), load_misses=state.missed)
        else:
            self._core.count(stored_chunks=len(ok))
        if not success:
            self._core.count(failed_jobs=1)
        with self._lock:
            if state.unsettled:
                self._held.append((result, failed_keys))
            else:
                self._finished.put((result, failed_keys))
            self._in_flight -= 1
            self._idle.notify_all()
        if state.unsettled:
            self._core.count(load_reports_held=1)
            self._core.failures.warn(
                "unsettled",
                f"load job {job.job_id} failed and kvtier has not closed the connection given up on (held still "
                f"mid-copy?): a late piece may still land in its chunks, so vLLM gets the job's end once it has",
            )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job finished since the last call. A failed load marks its
        missing keys as misses, so vLLM does not promote them again. A load
        into the registered primary tier that kvtier did not answer, and
        whose connection kvtier has not closed since, is reported once it
        has (``load_reports_held``): kvtier held still mid-copy finishes
        that piece when it runs again (docs/LOCAL.md, "When a client gives
        up"), and vLLM, told the job ended, reuses its chunks."""
        if self._held and self._core.settled():
            with self._lock:
                for entry in self._held:
                    self._finished.put(entry)
                self._held.clear()
        results: list[JobResult] = []
        while True:
            try:
                result, failed_keys = self._finished.get_nowait()
            except queue.Empty:
                break
            if failed_keys:
                self._lookups.mark_miss(failed_keys)
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        """While transfers are in flight or unreported, vLLM keeps stepping."""
        with self._lock:
            return self._in_flight > 0 or not self._finished.empty() or bool(self._held)

    def drain_jobs(self) -> None:
        """Waits until every submitted job has finished (each chunk is bounded
        by the client's timeout, so this ends even if kvtier hangs)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: kvtier keeps its own recency (a read counts as a use)."""
        return

    def shutdown(self) -> None:
        """Stops the lookup thread, waits for running transfers, closes the
        client and releases its view of the primary tier (vLLM unmaps the
        primary tier after its secondary tiers have shut down)."""
        if self._closed:
            return
        self._closed = True
        self._lookups.shutdown()
        self.drain_jobs()
        self._host.release()
        self._core.close()
        if self._rows is not self._primary_kv_view:
            self._rows.release()

    def __repr__(self) -> str:
        return f"<KvtierTier {self.url} {self.block_size_bytes} B/chunk>"
