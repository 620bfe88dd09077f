"""Mooncake Store's zero-copy calls: :class:`MooncakeStore`, which every
:class:`kvtier.Client` holds as ``client.mooncake`` (its methods of these
names hand over to it).

The names, arguments and return conventions are those of Mooncake's
``MooncakeDistributedStore`` (``mooncake-integration/store/store_py.cpp``), so
a connector written for it runs on kvtier: register memory once, then move
blocks between it and the store by address. Results are ints, one per item,
and no item's failure raises; the negative codes are :mod:`kvtier.codes`.

Wherever Mooncake takes a pointer and a size, these calls also take a buffer
object (a :class:`~kvtier.SharedBuffer`, a ``memoryview`` slice, a numpy array,
a CPU torch tensor) with its size optional. An object inside a registered
buffer is named by its offset there; one outside every registered buffer is
copied through the client's staging area (one bounce copy, counted by
:meth:`~MooncakeStore.local_stats`). A raw pointer outside every registered
buffer fails with -20 ``NOT_REGISTERED``.

Over the Unix transport the server copies straight into and out of the
registered memory, which must be backed by a shared file (see
:mod:`kvtier.shm`). Over HTTP the same calls work by copying through the
HTTP client (``register_buffer`` only records the region), so connector code
does not depend on the transport.

Mooncake's ``get_buffer``/``batch_get_buffer`` answer a :class:`BufferHandle`
(``ptr()``, ``size()``): here a lease of the block where it lies in the
server's RAM tier (docs/LOCAL.md, "Leases"; no copy, read-only), and a copy
where there is no lease to be had (HTTP, a server without leases, a block
served from the GPU tier or S3).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .. import codes
from ..errors import (
    GeometryMismatchError,
    InvalidKeyError,
    InvalidTagError,
    KvtierError,
    LeasesOffError,
    UnauthorizedError,
    UnsupportedVersionError,
)
from ..keys import check_key
from ..memory.leases import Leases
from ..memory.shm import _view_address, buffer_address
from ..tag import BlockTag, tags_for
from ..transport.base import Parts, Span
from ..transport.link import Link
from ..transport.local import MAX_PARTS, OP_GET_INTO, OP_GET_INTO_V, OP_PUT_FROM, OP_PUT_FROM_V

log = logging.getLogger("kvtier.local")


class MooncakeStore:
    """Mooncake Store's buffer calls on one client's transports.

    Made by :class:`kvtier.Client` (``client.mooncake``) over its
    :class:`~kvtier.transport.link.Link`: the transport each call goes over, the
    table of registered buffers and the store's block size. Everything that
    differs between HTTP and the socket is the transport's
    (:class:`~kvtier.transport.base.Transport`); what is here is the same for both.
    """

    def __init__(self, link: Link) -> None:
        self._link = link
        self._regions = link.regions

    # ---------------------------------------------------------- registering

    def register_buffer(self, buffer_ptr: int | Any, size: int | None = None) -> int:
        """Registers ``size`` bytes at address ``buffer_ptr`` (or a buffer
        object's memory: ``register_buffer(shared_buffer)``) for the batch calls.

        Over the Unix transport the memory must be backed by a shared file: a
        :class:`~kvtier.SharedBuffer` (mapped by the server), or a ``MAP_SHARED``
        mapping of a file in memory: tmpfs such as ``/dev/shm``, an unsealed
        memfd (mapped under the server's SIGBUS guard), or a sealed hugetlbfs
        memfd (the server refuses a file on a disk with -18). The client keeps a
        descriptor of the file and registers it again after a reconnect.
        Registering the same address and size again is a no-op.

        Returns:
            0, or a negative code: -18 ``BAD_BUFFER`` for memory no file backs
            (anonymous ``malloc``, numpy/torch allocations, pinned memory; a
            warning says why), a region overlapping a registered one, or a
            size the object does not have; -16 ``LIMIT`` over the server's
            registrations; -21 ``CONNECTION_LOST``.

        Raises:
            TypeError: ``size`` missing with an ``int`` pointer, or an object with no buffer.
            GeometryMismatchError, UnauthorizedError: the server refused the
                client (configuration, not this buffer's fault).
        """
        ptr, nbytes, obj = self._resolve(buffer_ptr, size, writable=True, what="register_buffer")
        if nbytes <= 0:
            log.warning("kvtier: register_buffer of %d bytes at %#x: the size must be positive", nbytes, ptr)
            return codes.BAD_BUFFER
        known = self._regions.find(ptr)
        if known is not None and known.ptr == ptr and known.size == nbytes:
            return codes.OK
        transport = self._link.current()
        region = transport.share(ptr, nbytes, obj)
        if isinstance(region, int):
            return region
        other = self._regions.add(region)
        if other is not None:
            region.close()
            log.warning(
                "kvtier: register_buffer(%#x, %d) overlaps the buffer registered at %#x (%d bytes)",
                ptr,
                nbytes,
                other.ptr,
                other.size,
            )
            return codes.BAD_BUFFER
        try:
            code = transport.register(region)
        except BaseException:
            self._regions.remove(ptr)
            raise
        if code != codes.OK:
            self._regions.remove(ptr)
        return code

    def unregister_buffer(self, buffer_ptr: int | Any) -> int:
        """Forgets the buffer registered at ``buffer_ptr`` (the address given
        to :meth:`register_buffer`, or the same object). Once it returns the
        server copies nothing into or out of the buffer (items in flight on
        it that had not copied yet fail -25 ``CANCELLED``), so the memory may
        be freed; later items naming it by pointer get -20.

        Returns:
            0, or -20 ``NOT_REGISTERED`` when nothing is registered there.
        """
        ptr = buffer_ptr if isinstance(buffer_ptr, int) else buffer_address(buffer_ptr, writable=False)[0]
        region = self._regions.remove(ptr)
        if region is None:
            return codes.NOT_REGISTERED
        self._link.current().unregister(region)
        region.obj = None
        return codes.OK

    # -------------------------------------------------------------- batches

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int | Any], sizes: Sequence[int | None] | None = None
    ) -> list[int]:
        """Reads block ``keys[i]`` into ``sizes[i]`` bytes at ``buffer_ptrs[i]``
        (an address in a registered buffer, or a buffer object; its size is
        the default of ``sizes[i]``). All items in flight at once.

        Returns:
            Per item the bytes read (``block_bytes``), or a negative code:
            -2 miss, -8 corrupt (a miss; the target may hold part of it),
            -3 bad key, -4 ``size < block_bytes`` (nothing copied), -6 past
            the end of the registered buffer or of the object, -18 an object
            with no usable buffer, -20 a pointer in no registered buffer,
            -21 no server within ``timeout_s``; any other code of docs/LOCAL.md.

        After -21 ``CONNECTION_LOST`` the item's memory is the caller's
        again: its bytes are unspecified (a copy cut off may have filled
        part), and the server will not write to it or read from it for this
        call afterwards (but a piece of at most 256 KiB it was copying at
        that moment, which a server stopped mid-copy finishes when it runs
        again). A timed-out request is not sent again: the client
        gives up on its connection, which ends the server's copies for it
        (docs/LOCAL.md, "When a client gives up"). Over HTTP each item's
        read ends before the call returns.

        Raises:
            ValueError: ``keys``, ``buffer_ptrs`` and ``sizes`` differ in length.
            TypeError: no size for an ``int`` pointer.
        """
        spans = self._spans(keys, buffer_ptrs, sizes, writable=True)
        return self._link.current().move(OP_GET_INTO, keys, spans)

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int | Any],
        sizes: Sequence[int | None] | None = None,
        tags: Sequence[BlockTag | None] | None = None,
    ) -> list[int]:
        """Stores ``sizes[i]`` bytes at ``buffer_ptrs[i]`` (exactly
        ``block_bytes``) under ``keys[i]``, each all-or-nothing and durable as
        an HTTP PUT, with the block tag ``tags[i]`` when given (kvtier's
        argument, not Mooncake's: the engine's block hashes for KV events).
        All items in flight at once.

        Returns:
            Per item 0, or a negative code: -3 bad key, -4 size not
            ``block_bytes`` (nothing stored), -9 overloaded (after the
            client's retries), -10 disk full, -22 a tag that breaks the rules
            (nothing stored; a warning says why), -14 a tag for a server
            whose socket takes none, and as :meth:`batch_get_into`.

        After -21 ``CONNECTION_LOST`` the caller may write the item's memory
        again at once: the server will not read from it for this call
        afterwards, and stores under ``keys[i]`` either nothing or the bytes
        it read before the client gave up, never what was written there
        since (the block stays all-or-nothing).

        Raises:
            ValueError: ``tags`` is given with another length than ``keys``.
        """
        spans = self._spans(keys, buffer_ptrs, sizes, writable=False)
        tag_list = self._tags(keys, tags)
        for i, tag in enumerate(tag_list):
            if tag is _BAD_TAG:
                spans[i] = codes.INVALID_TAG
        moved = self._link.current().move(OP_PUT_FROM, keys, spans, _good(tag_list) if tags is not None else None)
        return [min(result, 0) for result in moved]

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Reads block ``keys[i]`` scattered over the spans
        ``all_buffer_ptrs[i][j]`` of ``all_sizes[i][j]`` bytes (addresses in
        registered buffers), in order: the block's first ``all_sizes[i][0]``
        bytes to the first span, the next to the second, and so on (as
        Mooncake's call of this name). For pages a host pool keeps apart,
        such as SGLang's K and V halves. Over the socket one
        ``GET_INTO_V`` item each: the server copies into every span.

        Returns:
            Per item the bytes read (``block_bytes``), or a negative code: -4
            the sizes add up to less than ``block_bytes`` (nothing copied),
            -6 a span past the end of its registered buffer, -20 a pointer in
            no registered buffer, -16 more than 256 spans, and as
            :meth:`batch_get_into`. Spans, or their tails, past the block's
            end are left untouched. After -21 ``CONNECTION_LOST`` the spans
            are the caller's again, as :meth:`batch_get_into` says.

        Raises:
            ValueError: ``keys``, ``all_buffer_ptrs`` and ``all_sizes`` (or
                one item's pointers and sizes) differ in length.
        """
        return self._multi(OP_GET_INTO_V, keys, all_buffer_ptrs, all_sizes)

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        tags: Sequence[BlockTag | None] | None = None,
    ) -> list[int]:
        """Stores under ``keys[i]`` the block gathered from the spans
        ``all_buffer_ptrs[i]`` of ``all_sizes[i]`` bytes, in order (together
        exactly ``block_bytes``), each all-or-nothing as :meth:`batch_put_from`,
        with the block tag ``tags[i]`` when given.

        Returns:
            Per item 0, or a negative code: -4 the sizes do not add up to
            ``block_bytes`` (nothing stored), and as
            :meth:`batch_get_into_multi_buffers` and :meth:`batch_put_from`
            (after -21 ``CONNECTION_LOST`` too).
        """
        return [min(r, 0) for r in self._multi(OP_PUT_FROM_V, keys, all_buffer_ptrs, all_sizes, tags)]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 (stored in some tier, S3 included), 0 (not stored), or -1
        (a bad key, or the request failed)."""
        return self._link.current().exist_codes(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The block under ``key`` in a :class:`BufferHandle`, as Mooncake's
        ``get_buffer``: leased in the server's RAM tier (no copy; the handle
        holds the lease until :meth:`BufferHandle.release` or its
        collection), else copied. ``None`` on a miss, a bad key, or a
        failed request (logged), as Mooncake answers.

        Raises:
            GeometryMismatchError, UnauthorizedError: the server refused the
                client (configuration, not this key's fate).
        """
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """:meth:`get_buffer` of each key, the leases in one batch (one
        ``LEASE`` per 4,096 keys); each handle holds its own lease.

        Raises:
            GeometryMismatchError, UnauthorizedError: as :meth:`get_buffer`.
        """
        out: list[BufferHandle | None] = [None] * len(keys)
        good = []
        for i, key in enumerate(keys):
            try:
                check_key(key)
                good.append(i)
            except (InvalidKeyError, TypeError):
                log.warning("kvtier: get_buffer of a bad key %r", key)
        transport = self._link.current()
        copied: list[int] = []
        try:
            leases = transport.lease([keys[i] for i in good])
        except (LeasesOffError, UnsupportedVersionError) as e:
            log.debug("kvtier: get_buffer copies (no leases: %s)", e)
            copied = good
        except (GeometryMismatchError, UnauthorizedError):
            raise
        except KvtierError as e:
            log.warning("kvtier: get_buffer of %d keys failed: %s", len(good), e)
            return out
        else:
            for j, i in enumerate(good):
                view = leases.views[j]
                if view is not None:
                    out[i] = BufferHandle(view, leases, j)
                elif leases.results[j] == codes.NOT_IN_RAM:
                    copied.append(i)
        if copied:
            try:
                blocks = transport.get_many([keys[i] for i in copied])
            except (GeometryMismatchError, UnauthorizedError):
                raise
            except KvtierError as e:
                log.warning("kvtier: get_buffer of %d keys failed: %s", len(copied), e)
                return out
            for i, data in zip(copied, blocks, strict=True):
                out[i] = None if data is None else BufferHandle(memoryview(data))
        return out

    def local_settled(self, wait_s: float = 0.0) -> bool:
        """Whether no copy by the server can still land in this client's
        memory: every same-host connection given up on (a call's
        ``timeout_s``) has been closed by the server since. The server stops
        a given-up connection's copies at once, but one held still mid-copy
        (SIGSTOP, a frozen VM) finishes that piece, at most 256 KiB of each
        copy under way, when it runs again, and closes the connection after
        (docs/LOCAL.md, "When a client gives up"). Memory that such a call
        named is not the caller's to reuse for other bytes until this says
        ``True``; over HTTP it always does. Waits up to ``wait_s`` seconds
        for the closes (``local_stats()["closes_unconfirmed"]`` counts the
        give-ups whose close did not come within 0.25 s)."""
        unix = self._link.unix
        return True if unix is None else unix.session.settled(wait_s)

    def local_stats(self) -> dict[str, Any]:
        """The client's view of the same-host plane: ``transport``, ``socket``,
        the server's ``epoch``, ``registrations`` (count) and ``buffers``
        (``ptr``, ``size``, ``access``: 1 mapped, 2 file I/O, 3 guarded, 0 over HTTP),
        ``bounce_copies`` and ``bounce_bytes`` (items copied through the
        staging area, and their bytes), ``lease_copies`` and ``lease_bytes``
        (items read into unregistered memory by a copy from a lease, and
        their bytes), ``reconnects``,
        ``registrations_renewed``, ``retries_after_loss``, ``retries_overloaded``,
        ``staging_retired`` (staging areas replaced after a timeout the server
        did not confirm in time: it might still have copied into them),
        ``closes_unconfirmed`` (connections given up on whose close did not
        come within 0.25 s: :meth:`local_settled`),
        ``arenas_mapped`` (the server's RAM-tier arenas mapped for leases),
        ``index_probes`` (keys answered from the shared index, no round trip)."""
        transport = self._link.current()
        socket, epoch, counters = transport.plane()
        regions = self._regions.all()
        stats: dict[str, Any] = {
            "transport": transport.name,
            "socket": socket,
            "epoch": epoch,
            "registrations": len(regions),
            "buffers": [{"ptr": r.ptr, "size": r.size, "access": r.access} for r in regions],
        }
        stats.update(counters)
        return stats

    # ------------------------------------------------------------ internals

    def _resolve(self, target: int | Any, size: int | None, *, writable: bool, what: str) -> tuple[int, int, Any]:
        if isinstance(target, int):
            if size is None:
                raise TypeError(f"{what}: a pointer needs its size")
            return target, size, None
        ptr, nbytes = buffer_address(target, writable=writable)
        return ptr, nbytes if size is None else size, target

    def _spans(
        self,
        keys: Sequence[str],
        targets: Sequence[int | Any],
        sizes: Sequence[int | None] | None,
        *,
        writable: bool,
    ) -> list[Span]:
        if len(keys) != len(targets) or (sizes is not None and len(sizes) != len(keys)):
            raise ValueError(
                f"{len(keys)} keys, {len(targets)} buffers and {'no' if sizes is None else len(sizes)} sizes"
            )
        spans: list[Span] = []
        for i, target in enumerate(targets):
            size = None if sizes is None else sizes[i]
            if isinstance(target, int):
                if size is None:
                    raise TypeError(f"item {i}: a pointer needs its size")
                spans.append((target, size, False))
                continue
            try:
                ptr, nbytes = buffer_address(target, writable=writable)
            except (TypeError, ValueError) as e:
                log.warning("kvtier: item %d (%s): %s", i, keys[i], e)
                spans.append(codes.BAD_BUFFER)
                continue
            if size is not None and size > nbytes:
                spans.append(codes.OUT_OF_BOUNDS)
            else:
                spans.append((ptr, nbytes if size is None else size, True))
        return spans

    def _multi(
        self,
        op: int,
        keys: Sequence[str],
        all_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        tags: Sequence[BlockTag | None] | None = None,
    ) -> list[int]:
        """The multi-buffer calls: each item's spans (and a put's tag)
        checked and placed in their registered buffers, then one vectored
        batch over the socket, or a GET/PUT per item over HTTP through a
        buffer of its own."""
        if len(keys) != len(all_ptrs) or len(all_sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys, {len(all_ptrs)} pointer lists and {len(all_sizes)} size lists")
        get = op == OP_GET_INTO_V
        bb = self._link.block_bytes
        tag_list = self._tags(keys, tags)
        out = [codes.OK] * len(keys)
        placed: dict[int, Parts] = {}
        for i, (ptrs, sizes) in enumerate(zip(all_ptrs, all_sizes, strict=True)):
            if len(ptrs) != len(sizes):
                raise ValueError(f"item {i}: {len(ptrs)} pointers but {len(sizes)} sizes")
            out[i] = self._check_multi(keys[i], ptrs, sizes, bb, get)
            if out[i] == codes.OK and tag_list[i] is _BAD_TAG:
                out[i] = codes.INVALID_TAG
            if out[i] == codes.OK:
                placed[i] = [
                    (r, p - r.ptr, n) for p, n in zip(ptrs, sizes, strict=True) if (r := self._regions.find(p))
                ]
        idx = list(placed)
        good = _good(tag_list)
        results = self._link.current().move_parts(
            op, [keys[i] for i in idx], [placed[i] for i in idx], [good[i] for i in idx] if tags is not None else None
        )
        for i, result in zip(idx, results, strict=True):
            out[i] = result
        return out

    def _tags(self, keys: Sequence[str], tags: Sequence[BlockTag | None] | None) -> list[Any]:
        """Per item its tag, ``None``, or :data:`_BAD_TAG` for one that breaks
        the rules (logged: the item fails -22 ``INVALID_TAG`` alone).

        Raises:
            ValueError: ``tags`` is given with another length than ``keys``.
        """
        out: list[Any] = []
        for i, tag in enumerate(tags_for(tags, len(keys))):
            if tag is not None:
                try:
                    tag.validate()
                except InvalidTagError as e:
                    log.warning("kvtier: item %d (%s): %s", i, keys[i], e)
                    tag = _BAD_TAG
            out.append(tag)
        return out

    def _check_multi(self, key: str, ptrs: Sequence[int], sizes: Sequence[int], bb: int, get: bool) -> int:
        """``OK``, or the code of the first check one multi-buffer item fails:
        key, span count, each span in a registered buffer, the total size."""
        try:
            check_key(key)
        except (InvalidKeyError, TypeError):
            return codes.INVALID_KEY
        if not 0 < len(ptrs) <= MAX_PARTS:
            return codes.LIMIT if ptrs else codes.WRONG_SIZE
        for ptr, size in zip(ptrs, sizes, strict=True):
            region = self._regions.find(ptr)
            if region is None:
                return codes.NOT_REGISTERED
            if size < 0 or ptr + size > region.end:
                return codes.OUT_OF_BOUNDS
        total = sum(sizes)
        return codes.OK if (total >= bb if get else total == bb) else codes.WRONG_SIZE


class BufferHandle:
    """One block from :meth:`MooncakeStore.get_buffer`, as Mooncake's
    ``BufferHandle``: :meth:`ptr` (its address), :meth:`size` and ``len()``,
    and its bytes as :attr:`memoryview` (also the buffer protocol, on Python
    3.12 and later: ``memoryview(handle)``, ``numpy.frombuffer(handle)``).

    A leased handle (:attr:`leased`) is the block in the server's RAM tier,
    mapped read-only: never write through :meth:`ptr` (the pages are
    ``PROT_READ``; a write kills the process), and check :meth:`valid` after
    reading, as a lease ends ``lease_ms`` after it was granted. It holds its
    lease until :meth:`release` or until it is collected. Any other handle
    holds a copy, always valid.
    """

    def __init__(self, view: memoryview, leases: Leases | None = None, index: int = 0) -> None:
        self._view: memoryview | None = view
        self._leases = leases
        self._index = index
        self._size = view.nbytes

    @property
    def leased(self) -> bool:
        """Whether the handle is a lease (else a copy)."""
        return self._leases is not None

    @property
    def memoryview(self) -> memoryview:
        """The block's bytes, read-only.

        Raises:
            ValueError: the handle was released.
        """
        if self._view is None:
            raise ValueError("the BufferHandle was released")
        return self._view

    def __buffer__(self, flags: int) -> memoryview:
        return self.memoryview

    def ptr(self) -> int:
        """The address of the block's first byte in this process (read-only memory).

        Raises:
            ValueError: the handle was released.
        """
        return _view_address(self.memoryview)

    def size(self) -> int:
        """The block's bytes (``block_bytes``)."""
        return self._size

    def __len__(self) -> int:
        return self._size

    def valid(self) -> bool:
        """Whether the bytes are still the block's: a copy always is; a lease
        while its slot's generation is the lease's (check after reading)."""
        if self._view is None:
            return False
        return self._leases is None or self._leases.valid(self._index)

    def release(self, *, wait: bool = True) -> None:
        """Ends the handle's lease (a copy is dropped). Idempotent."""
        self._view = None
        leases, self._leases = self._leases, None
        if leases is not None:
            leases._release([self._index], wait=wait)

    def __del__(self) -> None:
        try:
            self.release(wait=False)
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "released" if self._view is None else ("leased" if self._leases is not None else "copied")
        return f"BufferHandle({self._size} bytes, {state})"


#: A tag :meth:`MooncakeStore._tags` found broken (its item fails alone).
_BAD_TAG = object()


def _good(tags: list[Any]) -> list[BlockTag | None]:
    """The tags with the broken ones as ``None`` (their items are not sent)."""
    return [None if tag is _BAD_TAG else tag for tag in tags]
