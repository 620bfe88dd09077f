"""Leases: reading blocks in kvtier's own memory (docs/LOCAL.md, "Leases").

A ``get_into`` copies a block into the caller's memory. A lease copies
nothing: the server pins the block's slot in its RAM tier and says where it
lies in the tier's memory file, which this client maps read-only, so the
block is read in place (a ``memoryview``, a numpy array, a CPU torch tensor,
a ``cudaMemcpy`` from its address) and released when done::

    with client.lease(keys) as leases:
        for i, view in enumerate(leases.views):
            if view is None:                  # a miss, or NOT_IN_RAM: get_into
                continue
            gpu[i].copy_(leases.torch(i))     # reads the server's pages
            assert leases.valid(i)            # still the block's bytes

Why a client checks :meth:`Leases.valid` after reading: a lease ends at
:meth:`Leases.release`, when its connection closes, or ``lease_ms`` after it
was granted (the server's ``--lease-ms``: the bound keeps a stuck client
from pinning the tier). After that the server may write the slot again, and
before it does it adds one to the slot's **generation**, a u64 in a table at
the end of the same mapped file. Bytes read while the generation still
equals the lease's, checked after reading, were the block's.

The mapping: each shard's RAM tier is one sealed memfd (an *arena*), handed
out once per server process (``MAP_ARENA``) as a read-only descriptor and
mapped here ``PROT_READ``/``MAP_SHARED`` (:class:`ArenaMaps`, remapped when
a reconnect finds another server ``epoch``). A view of it cannot be written
(``TypeError``); a torch tensor over it can be, by torch, and a write kills
the process with ``SIGSEGV``: never write one.

Ordering: the generation is loaded after an acquire fence that follows the
reads of the bytes (:func:`kvtier._native.still_leased`, the reader's half of
the server's protocol: the generation up by one, then a release fence, then
the new bytes), so the check is exact on arm64 as on x86-64;
``local-proto/tests/loom_model.rs`` checks the protocol under loom.
:meth:`Leases.copy_into` copies and checks in one native call, with the GIL
released.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import codes
from .._native import copy_leased, still_leased
from ..errors import BlockSizeError, CudaError, KvtierError, ProtocolError, error_from_code
from ..keys import check_key
from ..transport.local import LocalConnection
from . import cuda as _cuda
from .shm import _view_address, byte_view

if TYPE_CHECKING:
    from ..transport.session import LocalSession

log = logging.getLogger("kvtier.local")

_GENERATION = struct.Struct("<Q")


def _bad_answer(message: str) -> ProtocolError:
    return ProtocolError(message, code="bad_answer")


class Arena:
    """One shard's RAM-tier file, mapped read-only: ``slots`` slots of
    ``slot_bytes`` and, at ``generations_offset``, one u64 (little-endian)
    generation per slot.

    Args:
        arena: the server's arena number.
        fd: a descriptor of the file (the caller keeps and closes it;
            :class:`mmap.mmap` keeps a duplicate of its own).
        layout: ``(file_bytes, slot_bytes, slots, generations_offset)`` of
            the ``MAP_ARENA`` answer.

    Raises:
        ProtocolError: a layout whose generation table does not fit the file.
        OSError: the file cannot be mapped (``file_bytes`` past its end).
    """

    def __init__(self, arena: int, fd: int, layout: tuple[int, int, int, int]) -> None:
        file_bytes, slot_bytes, slots, generations_offset = layout
        if file_bytes <= 0 or slot_bytes <= 0 or generations_offset + 8 * slots > file_bytes:
            raise _bad_answer(
                f"arena {arena}: {slots} slots of {slot_bytes} bytes with generations at {generations_offset} "
                f"do not fit a file of {file_bytes} bytes"
            )
        self.arena = arena
        self.file_bytes, self.slot_bytes, self.slots = file_bytes, slot_bytes, slots
        self.generations_offset = generations_offset
        self.map = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self.view = memoryview(self.map)
        """A read-only view of the whole file (every block view is a slice of it)."""
        self.address = _view_address(self.view)
        """The mapping's first byte."""
        self.pinned_device: int | None = None
        """The CUDA device for which the mapping is page-locked
        (:meth:`ArenaMaps.pin`), or ``None``."""

    def pin(self, device: int) -> None:
        """Page-locks the whole mapping for the GPU (read-only registration).

        Raises:
            CudaError: no driver, or it refused the range.
        """
        if self.pinned_device is None:
            cuda = _cuda.driver()
            cuda.use_device(device)
            cuda.register(self.address, self.file_bytes, read_only=True)
            self.pinned_device = device

    def unpin(self) -> None:
        """Ends the page lock, if any (a refusal is logged: the mapping is
        going anyway)."""
        if self.pinned_device is not None:
            device, self.pinned_device = self.pinned_device, None
            try:
                cuda = _cuda.driver()
                cuda.use_device(device)
                cuda.unregister(self.address)
            except CudaError as e:
                log.warning("kvtier: unpinning arena %d: %s", self.arena, e)

    def slot_of(self, offset: int) -> int:
        """The slot holding byte ``offset``."""
        return offset // self.slot_bytes

    def generation(self, offset: int) -> int:
        """The generation now in the table for the slot holding byte ``offset``."""
        return int(_GENERATION.unpack_from(self.map, self.generations_offset + 8 * self.slot_of(offset))[0])

    def generation_address(self, offset: int) -> int:
        """The address of the generation of the slot holding byte ``offset``."""
        return self.address + self.generations_offset + 8 * self.slot_of(offset)

    def block(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of ``nbytes`` at ``offset``.

        Raises:
            ProtocolError: the range is not within one of the arena's slots.
        """
        slot = self.slot_of(offset)
        if slot >= self.slots or offset + nbytes > min((slot + 1) * self.slot_bytes, self.generations_offset):
            raise _bad_answer(
                f"a lease of {nbytes} bytes at offset {offset} lies outside the slots of arena {self.arena} "
                f"({self.slots} of {self.slot_bytes} bytes)"
            )
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmaps the file now if nothing made from it is left (no lease
        view, numpy array or tensor: each holds a buffer of the mapping),
        else when the last of them goes: nothing can read unmapped memory."""
        self.unpin()
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            pass  # views of held leases keep it mapped; the mmap goes with them

    def __repr__(self) -> str:
        return f"Arena({self.arena}, {self.slots} x {self.slot_bytes} bytes)"


class ArenaMaps:
    """The arenas this client mapped, for one server process: a reconnect
    that finds another ``epoch`` (a restarted server, whose arenas are new
    files) drops them, and the next lease maps the new ones. Arenas live as
    long as the server process, so a reconnect to the same one keeps them.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._arenas: dict[int, Arena] = {}
        self.maps_made = 0
        """``MAP_ARENA`` calls made (for tests and ``local_stats``)."""
        self.pin_device: int | None = None
        """The CUDA device every arena is page-locked for once mapped
        (:meth:`pin`), or ``None``."""

    def get(self, conn: LocalConnection, arena: int) -> Arena:
        """Arena ``arena`` of the server ``conn`` talks to, mapped on first use.

        Raises:
            LeasesOffError, ProtocolError: as :meth:`LocalConnection.map_arena`.
        """
        epoch = conn.info.get("epoch")
        with self._lock:
            if epoch != self._epoch:
                self._drop()
                self._epoch = epoch
            mapped = self._arenas.get(arena)
            if mapped is None:
                fd, layout = conn.map_arena(arena)
                try:
                    mapped = Arena(arena, fd, layout)
                finally:
                    os.close(fd)
                self._arenas[arena] = mapped
                self.maps_made += 1
                if self.pin_device is not None:  # a new server's arenas, after pin()
                    try:
                        mapped.pin(self.pin_device)
                    except CudaError as e:
                        log.warning("kvtier: arena %d stays pageable: %s", arena, e)
            return mapped

    def pin(self, conn: LocalConnection, device: int) -> list[Arena]:
        """Maps every arena of the server ``conn`` talks to (one per shard)
        and page-locks each for CUDA device ``device``; arenas of a
        restarted server are page-locked as they are mapped.

        Raises:
            LeasesOffError, ProtocolError: as :meth:`get`.
            CudaError: no driver, or it refused an arena (those pinned
                before stay pinned).
        """
        offer = conn.info.get("leases") or {}
        if not offer.get("offered", False):
            raise error_from_code(codes.LEASES_OFF, f"no leases: {offer.get('why_not') or 'not offered'}")
        # HELLO names the arenas (a server before that names none: then each
        # is pinned as a lease maps it).
        arenas = [self.get(conn, int(n)) for n in offer.get("arenas", [])]
        with self._lock:
            for arena in arenas:
                arena.pin(device)
            self.pin_device = device
        return arenas

    def _drop(self) -> None:
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()

    def __len__(self) -> int:
        return len(self._arenas)

    def pinned(self) -> int:
        """How many mapped arenas are page-locked now."""
        with self._lock:
            return sum(1 for a in self._arenas.values() if a.pinned_device is not None)

    def close(self) -> None:
        """Unmaps every arena no lease view still holds."""
        with self._lock:
            self._drop()
            self._epoch = None


class Leases:
    """The leases of one :meth:`kvtier.Client.lease` call: per key a
    read-only view of its block in the server's RAM tier, or ``None``.

    A context manager: leaving the ``with`` block releases every lease (one
    batched ``RELEASE``), as do :meth:`release` and the object's collection.
    Each lease ends on its own too, ``lease_ms`` after it was granted; read
    the bytes, then check :meth:`valid` (or use :meth:`copy_into`, which
    does both).

    Attributes:
        keys: the keys, in the order asked.
        results: per key ``block_bytes`` (leased) or a negative code
            (:mod:`kvtier.codes`): -2 ``NOT_FOUND``, -23 ``NOT_IN_RAM``
            (stored where it is served from without landing in RAM, a GPU or
            S3 hit: read it with ``get_into``), -8 ``CORRUPT``, -16 ``LIMIT``
            (the connection holds the server's ``leases_max``).
        tiers: per key the tier the block was found in (``"ram"``, or
            ``"nvme"`` for a block read into RAM to be leased; for
            ``NOT_IN_RAM`` the tier that holds it), or ``None`` (a miss).
        views: per key a read-only 1-D ``memoryview`` (format ``"B"``) of
            the block's ``block_bytes`` in the mapped arena, or ``None``
            (not leased, or released: a view taken before is released too,
            and reading it raises ``ValueError``). A numpy array or tensor
            made from a view keeps the arena mapped, and readable, for as
            long as it lives, but after the release its bytes are no
            longer the block's to trust.
        ids: per key the server's lease id (0: none).
        generations: per key the slot's generation when leased (0: none).
        not_in_ram: the indices answered ``NOT_IN_RAM``.
        lease_ms: the server's bound on a lease (``--lease-ms``).
        granted_at: ``time.monotonic()`` when the answer came; a lease may
            end ``lease_ms`` after the server granted it (a little earlier).
    """

    def __init__(
        self,
        conn: LocalConnection,
        keys: Sequence[str],
        items: Sequence[tuple[int, int, int, int, int, int]],
        arenas: Sequence[Arena | None],
        block_bytes: int,
        lease_ms: int,
    ) -> None:
        # Reentrant: a finalizer of one of its BufferHandles may run (GC) on
        # this thread inside _release.
        self._lock = threading.RLock()
        self._conn = conn
        self._released = False
        self.keys = list(keys)
        self.block_bytes = block_bytes
        self.results = [r for r, *_ in items]
        self.tiers: list[str | None] = [codes.TIER_NAMES.get(t, str(t)) if t else None for _, t, *_ in items]
        self.tier_codes = [t for _, t, *_ in items]
        """Per key the tier's wire number (docs/LOCAL.md: 0 none, 1 gpu, 2 ram,
        3 nvme, 4 s3)."""
        self.ids = [lease if r >= 0 else 0 for r, _, _, _, _, lease in items]
        self.generations = [g if r >= 0 else 0 for r, _, _, _, g, _ in items]
        self._offsets = [o for _, _, _, o, _, _ in items]
        self._arenas = list(arenas)
        self.views: list[memoryview | None] = [
            arena.block(o, block_bytes) if arena is not None else None
            for arena, o in zip(self._arenas, self._offsets, strict=True)
        ]
        self.not_in_ram = [i for i, r in enumerate(self.results) if r == codes.NOT_IN_RAM]
        self.lease_ms = lease_ms
        self.granted_at = time.monotonic()

    # ------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran (or the leases were dropped)."""
        return self._released

    def _view(self, i: int) -> memoryview:
        view = self.views[i]
        if view is None:
            why = "released" if self._released or self.ids[i] else codes.name_of(self.results[i])
            raise ValueError(f"key {self.keys[i]!r} holds no lease ({why})")
        return view

    def numpy(self, i: int) -> Any:
        """Key ``i``'s block as a read-only numpy ``uint8`` array of
        ``block_bytes`` over the server's pages (no copy; numpy is imported
        here). Reinterpret it with ``.view(dtype)``.

        Raises:
            ValueError: key ``i`` holds no lease (a miss, ``NOT_IN_RAM``, or released).
        """
        import numpy as np

        return np.frombuffer(self._view(i), dtype=np.uint8)

    def torch(self, i: int) -> Any:
        """Key ``i``'s block as a CPU ``torch.uint8`` tensor of ``block_bytes``
        over the server's pages (no copy; torch is imported here), e.g. the
        source of a ``gpu_tensor.copy_(...)``. Torch has no read-only
        tensors: this one must not be written, since the pages are mapped
        ``PROT_READ`` and a write kills the process (``SIGSEGV``).

        Raises:
            ValueError: key ``i`` holds no lease.
        """
        import torch

        array = self.numpy(i)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            return torch.from_numpy(array)

    def valid(self, i: int) -> bool:
        """Whether key ``i``'s slot still holds the leased block: its
        generation equals the lease's. Check it after reading; ``False``
        (the lease ended and the server wrote the slot again) means the
        bytes read must not be used. ``False`` too for a key with no lease,
        and after :meth:`release`."""
        arena = self._arenas[i]
        if arena is None or self.views[i] is None:
            return False
        return still_leased(arena.generation_address(self._offsets[i]), self.generations[i])

    def copy_into(self, i: int, dest: Any) -> bool:
        """Copies key ``i``'s block into the first ``block_bytes`` of ``dest``
        (a writable, contiguous buffer: ``bytearray``, ``memoryview``, numpy
        array, CPU torch tensor, :class:`~kvtier.SharedBuffer`), then checks
        the generation.

        Returns:
            ``True``: ``dest`` holds the block. ``False``: key ``i`` holds no
            lease (see :attr:`results`; read it with ``get_into``) or the
            lease had ended, and ``dest``'s contents are not to be trusted.

        Raises:
            BlockSizeError: ``dest`` is smaller than ``block_bytes``.
            TypeError, ValueError: ``dest`` is read-only or not contiguous.
        """
        target = byte_view(dest, writable=True)
        if target.nbytes < self.block_bytes:
            raise BlockSizeError(
                f"a buffer of {target.nbytes} bytes is too small for a block of {self.block_bytes}",
                code="buffer_too_small",
            )
        with self._lock:  # the view (and its mapping) lives while it copies
            view, arena = self.views[i], self._arenas[i]
            if view is None or arena is None:
                return False
            generation = arena.generation_address(self._offsets[i])
            return copy_leased(
                _view_address(target), _view_address(view), self.block_bytes, generation, self.generations[i]
            )

    # ------------------------------------------------------------ releasing

    def release(self) -> int:
        """Ends every lease still held (one ``RELEASE`` per 4,096) and
        releases the views. Idempotent; a lease whose connection closed
        already ended with it.

        Returns:
            How many leases the server still held (the others had ended).

        Raises:
            KvtierError: the server refused the ``RELEASE`` (not a lost
                connection, which ends the leases as well).
        """
        return self._release(range(len(self.keys)), wait=True)

    def _release(self, indices: Sequence[int] | range, *, wait: bool | str) -> int:
        """Ends the leases of ``indices`` still held; ``wait=False`` queues
        the ``RELEASE`` for the connection's releaser thread (a finalizer's
        way), ``wait="post"`` sends it without waiting for its answer."""
        with self._lock:
            ids = [self.ids[i] for i in indices if self.ids[i] and self.views[i] is not None]
            for i in indices:
                view, self.views[i] = self.views[i], None
                if view is not None:
                    try:
                        view.release()
                    except BufferError:
                        pass  # a C extension holds a buffer of it; it goes with that
            if all(v is None for v in self.views):
                self._released = True
        return release_ids(self._conn, ids, wait=wait)

    def __enter__(self) -> Leases:
        return self

    async def __aenter__(self) -> Leases:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    def __exit__(self, *exc: object) -> None:
        # Sent, not waited for: the answer only counts, and the leases end
        # on the server whether or not this thread waits (one round trip
        # less per batch; a refused RELEASE is logged by nobody but harms
        # nothing: the leases then end at --lease-ms or with the connection).
        self._release(range(len(self.keys)), wait="post")

    def __del__(self) -> None:
        try:
            if not self._released:
                self._release(range(len(self.keys)), wait=False)
        except Exception:  # interpreter shutdown, or a half-made object
            pass

    def __repr__(self) -> str:
        held = sum(1 for v in self.views if v is not None)
        return f"Leases({len(self.keys)} keys, {held} held)"


def release_ids(conn: LocalConnection, ids: Sequence[int], *, wait: bool | str = True) -> int:
    """``RELEASE`` of lease ids on ``conn``, 4,096 per request: how many the
    server still held. ``wait=False`` queues them for the connection's
    releaser thread and answers 0 at once (a finalizer's way: it neither
    sends nor waits); ``wait="post"`` sends them and answers 0 without
    waiting for the answers. Nothing is sent on a closed connection (its
    leases ended).

    Raises:
        KvtierError: the server refused a ``RELEASE`` (not a lost connection).
    """
    if not ids or not conn.alive:
        return 0
    if not wait:
        conn.release_later(ids)
        return 0
    if wait == "post":
        conn.release_post(list(ids))
        return 0
    try:
        return int(conn.release(list(ids)))
    except KvtierError as e:
        if e.local_code != codes.CONNECTION_LOST:
            raise
    return 0


def lease_keys(session: LocalSession, maps: ArenaMaps, keys: Sequence[str]) -> Leases:
    """``LEASE`` of ``keys`` on ``session``'s connection, 4,096 keys (and
    under 1 MiB) per request, all in flight at once, then the arenas they
    name mapped. On a new connection once if the first one broke (its leases
    ended with it). A failure after some leases were granted releases them.

    Raises:
        InvalidKeyError: a bad key (checked before sending).
        UnsupportedVersionError: the server's socket does not speak version 3.
        LeasesOffError: the server offers no leases (its reason).
        KvtierConnectionError: no server within the client's ``timeout_s``.
        ProtocolError: an answer that breaks docs/LOCAL.md (a lease outside
            its arena, a result that is not ``block_bytes``).
    """
    keys = [check_key(key) for key in keys]

    def once(conn: LocalConnection) -> Leases:
        # Every request in flight at once, in the native client; a failure
        # after some were granted has released those already.
        items = conn.lease(keys)
        granted = [item[5] for item in items if item[0] >= 0]
        try:
            bb = int(conn.info["block_bytes"])
            arenas: list[Arena | None] = []
            for r, _, arena, *_ in items:
                if r >= 0 and r != bb:
                    raise _bad_answer(f"LEASE answered {r} bytes for a block of {bb}")
                arenas.append(maps.get(conn, arena) if r >= 0 else None)
            offer = conn.info.get("leases") or {}
            return Leases(conn, keys, items, arenas, bb, int(offer.get("lease_ms", 0)))
        except BaseException:
            try:
                release_ids(conn, granted)
            except KvtierError as e:
                log.warning("kvtier: releasing %d leases after a failed LEASE: %s", len(granted), e)
            raise

    return session.keys_call(once)
