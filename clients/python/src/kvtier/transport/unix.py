"""The same-host transport of :class:`kvtier.Client`: :class:`UnixTransport`
moves blocks over a :class:`~kvtier.transport.session.LocalSession`, and
:func:`open_local` decides whether to use one.

Each call names memory: the caller's own where it lies in a registered buffer
(the server copies straight into or out of it), else a slot of the session's
staging area and one copy here (a *bounce*, counted in ``local_stats()``).
``get`` and ``get_many`` always bounce (they return new ``bytes``). Errors
are those of the HTTP client: a miss is ``None``/``False``, anything else
raises its :mod:`kvtier.errors` class.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import codes
from ..errors import (
    BlockSizeError,
    GeometryMismatchError,
    InvalidKeyError,
    InvalidTagError,
    KvtierError,
    LeasesOffError,
    UnauthorizedError,
    UnsupportedVersionError,
    error_from_code,
)
from ..keys import all_keys_valid, check_key
from ..memory.leases import ArenaMaps, Leases, lease_keys
from ..memory.regions import Region, Regions
from ..memory.shm import UnshareableMemoryError, backing_fd, buffer_address
from ..tag import BlockTag, tags_for
from .base import Parts, Span, Transport
from .local import OP_GET_INTO, OP_PUT_FROM, VERSION_TAGS
from .session import LocalSession, copy_bytes, key_chunks
from .shared_index import BAD_KEY, SharedIndex

log = logging.getLogger("kvtier.local")

_MISS = (codes.NOT_FOUND, codes.CORRUPT)


def open_local(
    socket_path: str | None,
    mode: str,
    *,
    url: str,
    stats: Callable[[], dict[str, Any]],
    token: str | None,
    timeout_s: float,
    expect: tuple[int | None, str | None, int, bool],
    regions: Regions,
    connect_timeout_s: float | None = None,
) -> tuple[UnixTransport | None, str | None]:
    """Chooses a client's transport: ``(transport, "unix")`` or ``(None, "http")``;
    ``(None, None)`` leaves it open (``/v1/stats`` did not answer: asked again
    on the next call, which goes over HTTP meanwhile).

    With ``unix://`` (``socket_path``) the socket is connected on first use.
    From an HTTP ``url`` (``mode`` ``"auto"``/``"on"``) the socket named by
    ``local.socket`` of ``stats()`` is tried once now; ``"auto"`` stays on HTTP
    when there is none or its connect or hello fails, ``"on"`` raises.
    ``token``, ``timeout_s``, ``connect_timeout_s`` and ``expect`` (block
    bytes, model, staging blocks, lease reads) are the client's; ``regions``
    its table of registered buffers.

    Raises:
        GeometryMismatchError: the hello found another geometry (both modes).
        KvtierError: with ``"on"``, why the socket cannot be used.
    """
    path = socket_path
    if path is None:
        try:
            path = (stats().get("local") or {}).get("socket")
        except KvtierError as e:
            if mode == "on":
                raise
            log.info("kvtier: /v1/stats of %s did not answer (%s); HTTP for now", url, e)
            return None, None
        if not path:
            if mode == "on":
                raise KvtierError(f"{url} serves no local socket (--local-socket none?)", code="no_local_socket")
            log.info("kvtier: %s serves no local socket; blocks go over HTTP", url)
            return None, "http"
        if not os.path.isabs(path):
            log.warning("kvtier: %s names a relative socket path %r (its --data-dir is relative)", url, path)
    session = LocalSession(
        str(path),
        token=token,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        expect_block_bytes=expect[0],
        expect_model=expect[1],
        staging_blocks=expect[2],
    )
    if socket_path is None:
        try:
            session.probe()
        except GeometryMismatchError:
            session.close()
            raise
        except KvtierError as e:
            session.close()
            if mode == "on":
                raise
            log.warning("kvtier: the local socket %s is not usable (%s); blocks go over HTTP", path, e)
            return None, "http"
    return UnixTransport(session, regions, lease_reads=expect[3]), "unix"


def _encoded(tags: Sequence[BlockTag | None] | None, n: int) -> list[bytes | int]:
    """Per item its encoded tag (``b""``: none), or ``INVALID_TAG`` for one
    that breaks the rules."""
    out: list[bytes | int] = []
    for tag in tags_for(tags, n):
        try:
            out.append(b"" if tag is None else tag.encode())
        except InvalidTagError as e:
            log.warning("kvtier: %s", e)
            out.append(codes.INVALID_TAG)
    return out


def _raise(op: str, key: str, code: int) -> KvtierError:
    return error_from_code(code, f"{op} {key!r}: {codes.name_of(code)}")


class UnixTransport(Transport):
    """:class:`~kvtier.transport.base.Transport` over a
    :class:`~kvtier.transport.session.LocalSession`; ``regions`` is the client's table
    of registered buffers."""

    name = "unix"

    def __init__(self, session: LocalSession, regions: Regions, *, lease_reads: bool = True) -> None:
        self.session = session
        self.regions = regions
        self.arenas = ArenaMaps()
        """The server's RAM-tier arenas this client mapped for leases."""
        self.index = SharedIndex()
        """The server's shared index (its shards' index tables), mapped on
        first use: existence and prefix lookups probe it instead of asking."""
        self.lease_reads = lease_reads
        """Read blocks bound for unregistered memory from a lease (one copy)
        where the server offers leases; turned off for good once it says it
        offers none."""

    def info(self) -> dict[str, Any]:
        """The server's hello answer (connects if needed)."""
        self.session.connection()
        return dict(self.session.info)

    def close(self) -> None:
        """Closes the session (its connection and descriptors) and unmaps the
        arenas no lease view holds."""
        self.session.close()
        self.arenas.close()
        self.index.close()

    @property
    def block_bytes(self) -> int:
        """The store's block size, from the hello (connects if needed)."""
        self.session.connection()
        assert self.session.block_bytes is not None
        return self.session.block_bytes

    # ----------------------------------------------------- items, any memory

    def _place(self, span: tuple[int, int, bool]) -> tuple[Region, int, int] | int | None:
        """Where one item's bytes are: ``(region, offset, length)`` to name them
        directly, ``None`` to bounce, or a code (a raw pointer in no buffer)."""
        ptr, size, is_obj = span
        region = self.regions.find(ptr)
        if region is not None and not (is_obj and ptr + size > region.end):
            return region, ptr - region.ptr, size
        return None if is_obj else codes.NOT_REGISTERED

    def items(
        self, op: int, keys: Sequence[str], spans: Sequence[Span], tags: Sequence[BlockTag | None] | None = None
    ) -> list[tuple[int, int]]:
        """``GET_INTO``/``PUT_FROM`` of ``keys[i]`` at ``spans[i]`` (a put with
        the block tag ``tags[i]``, if any), direct where registered, else
        bounced; per item ``(result, tier or created)``: ``INVALID_TAG`` for
        a tag that breaks the rules."""
        out: list[tuple[int, int]] = [(codes.OK, 0)] * len(keys)
        encoded = _encoded(tags, len(keys))
        direct: list[int] = []
        placed: list[tuple[Region, int, int]] = []
        bounced: list[int] = []
        try:
            bb = self.session.block_bytes or self.block_bytes
        except KvtierError as e:  # never connected, and no server within the timeout
            if e.local_code != codes.CONNECTION_LOST:
                raise
            return [(codes.CONNECTION_LOST, 0)] * len(keys)
        for i, (key, span) in enumerate(zip(keys, spans, strict=True)):
            try:
                check_key(key)
            except (InvalidKeyError, TypeError):
                out[i] = (codes.INVALID_KEY, 0)
                continue
            if isinstance(span, int):
                out[i] = (span, 0)
                continue
            if isinstance(encoded[i], int):
                out[i] = (codes.INVALID_TAG, 0)
                continue
            where = self._place(span)
            if isinstance(where, int):
                out[i] = (where, 0)
            elif where is not None:
                direct.append(i)
                placed.append(where)
            elif span[1] < bb or (op == OP_PUT_FROM and span[1] != bb):
                out[i] = (codes.WRONG_SIZE, 0)
            else:
                bounced.append(i)

        def tags_of(idx: list[int]) -> list[bytes] | None:
            return None if tags is None else [encoded[i] for i in idx]  # type: ignore[misc]

        if direct:
            results = self.session.transfer(op, [keys[i] for i in direct], placed, tags_of(direct))
            for i, result in zip(direct, results, strict=True):
                out[i] = result
        if bounced and op == OP_GET_INTO and self.lease_reads:
            bounced = self._get_by_lease(keys, spans, bounced, out, bb)
        if bounced:
            counters = self.session
            if op == OP_GET_INTO:

                def sink(j: int, addr: int, nbytes: int) -> None:
                    span = spans[bounced[j]]
                    assert not isinstance(span, int)
                    copy_bytes(span[0], addr, nbytes)
                    counters.count("bounce_copies")
                    counters.count("bounce_bytes", nbytes)

                results = self.session.bounce_get([keys[i] for i in bounced], sink)
            else:

                def fill(j: int, addr: int) -> None:
                    span = spans[bounced[j]]
                    assert not isinstance(span, int)
                    copy_bytes(addr, span[0], bb)
                    counters.count("bounce_copies")
                    counters.count("bounce_bytes", bb)

                results = self.session.bounce_put([keys[i] for i in bounced], fill, tags_of(bounced))
            for i, result in zip(bounced, results, strict=True):
                out[i] = result
        return out

    def _get_by_lease(
        self, keys: Sequence[str], spans: Sequence[Span], idx: list[int], out: list[tuple[int, int]], bb: int
    ) -> list[int]:
        """Reads ``keys[i]`` for each ``i`` of ``idx`` into its unregistered
        span by leasing the block and copying it from kvtier's RAM tier (one
        copy, here; docs/LOCAL.md "Leases"), checking the lease's generation
        after the copy. Sets ``out[i]`` for the keys it settled (read, or a
        miss) and returns the others, for the staging path: keys not in RAM
        (``NOT_IN_RAM``), over the lease limit, or whose lease ended before
        the copy was checked."""
        try:
            leases = self.lease([keys[i] for i in idx])
        except (LeasesOffError, UnsupportedVersionError) as e:
            log.info("kvtier: reads into unregistered memory go through the staging buffer: %s", e)
            self.lease_reads = False
            return idx
        except KvtierError:
            return idx
        rest: list[int] = []
        with leases:
            for j, i in enumerate(idx):
                result = leases.results[j]
                if result in (codes.NOT_FOUND, codes.CORRUPT):
                    out[i] = (result, 0)
                    continue
                span = spans[i]
                assert not isinstance(span, int)
                dest = memoryview((ctypes.c_char * bb).from_address(span[0])).cast("B")
                if result < 0 or not leases.copy_into(j, dest):
                    rest.append(i)
                    continue
                out[i] = (bb, leases.tier_codes[j])
                self.session.count("lease_copies")
                self.session.count("lease_bytes", bb)
        return rest

    def _indexed(self, keys: Sequence[str], *, exist: bool = False) -> tuple[Any, bool] | None:
        """Per key the fastest local tier the shared index lists (``bytes``;
        0: none, ``BAD_KEY``: a key the server would refuse) or, with
        ``exist``, ``batch_is_exist``'s codes (1, 0, -1: refused); and
        whether the server has a remote tier (whose blocks the index does
        not list). ``None`` when the index cannot answer."""
        try:
            conn, _ = self.session.connection()
        except KvtierError:
            return None
        try:
            found = self.index.exist(conn, keys) if exist else self.index.tiers(conn, keys)
        except KvtierError:
            return None  # the request path says what is wrong
        if found is None:
            return None
        return found, bool((conn.info.get("shared_index") or {}).get("remote_tier"))

    def exist_codes(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 (stored in some tier), 0 (not), -1 (a bad key, or the
        request failed). Answered from the shared index where the server
        offers one (the key rule checked there too); keys it does not list
        are asked of the server when the server has a remote tier."""
        indexed = self._indexed(keys, exist=True) if keys else None
        if indexed is not None:
            out, remote = indexed
            if not remote:
                return out
            good = [i for i, code in enumerate(out) if code == 0]  # maybe in the remote tier: asked
            for i in good:
                out[i] = -1  # until the server answers for it
        else:
            out = [-1] * len(keys)
            good = list(range(len(keys))) if all_keys_valid(keys) else []
            for i, key in enumerate(keys if not good else ()):
                try:
                    check_key(key)
                    good.append(i)
                except (InvalidKeyError, TypeError):
                    pass
        for chunk in key_chunks(keys, good, 2):
            names = [keys[i] for i in chunk]
            try:
                tiers = self.session.keys_call(lambda c, names=names: c.exists(names))
            except (GeometryMismatchError, UnauthorizedError):
                raise  # a reconnect refused: configuration, not these keys' fate
            except KvtierError:
                continue
            for i, tier in zip(chunk, tiers, strict=True):
                out[i] = 1 if tier else 0
        return out

    # ---------------------------------------------------------- block API

    def _span(self, buf: Any, *, writable: bool) -> tuple[int, int, bool]:
        ptr, nbytes = buffer_address(buf, writable=writable)
        return ptr, nbytes, True

    def put_many(self, items: Iterable[tuple[str, Any]], tags: Sequence[BlockTag | None] | None = None) -> list[bool]:
        """``put`` of each ``(key, data)`` (with ``tags[i]``) in batches;
        raises the first item's error after the batch (others may be stored).

        Raises:
            InvalidTagError: a tag breaks the rules (checked before sending).
            ProtocolError: tags for a server whose socket speaks version 1.
        """
        pairs = list(items)
        keys = [check_key(key) for key, _ in pairs]
        tag_list = tags_for(tags, len(pairs))
        for tag in tag_list:
            if tag is not None:
                tag.validate()
        bb = self.block_bytes
        version = int(self.session.info.get("version", 1))
        if version < VERSION_TAGS and any(tag is not None for tag in tag_list):
            raise error_from_code(
                codes.UNSUPPORTED_VERSION,
                f"the server at {self.session.path} speaks socket protocol version {version}, whose PUT_FROM carries "
                f"no block tags: upgrade kvtier, or put tagged blocks over HTTP (Client(local='off'))",
            )
        spans: list[Span] = []
        for key, data in pairs:
            span = self._span(data, writable=False)
            if span[1] != bb:
                raise BlockSizeError(
                    f"block for {key!r} is {span[1]} bytes; the store's block_bytes is {bb}", code="wrong_block_size"
                )
            spans.append(span)
        results = self.items(OP_PUT_FROM, keys, spans, tag_list if tags is not None else None)
        for key, (result, _) in zip(keys, results, strict=True):
            if result < 0:
                raise _raise("PUT_FROM", key, result)
        return [created == 1 for _, created in results]

    def put(self, key: str, data: Any, tag: BlockTag | None = None) -> bool:
        """``put`` over the socket (with ``tag``): ``True`` if the key was new."""
        return self.put_many([(key, data)], None if tag is None else [tag])[0]

    def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        """``get_into`` of ``keys[i]`` into ``bufs[i]``; ``False`` per miss."""
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        for key in keys:
            check_key(key)
        bb = self.block_bytes
        spans: list[Span] = []
        for buf in bufs:
            span = self._span(buf, writable=True)
            if span[1] < bb:
                raise BlockSizeError(
                    f"buffer of {span[1]} bytes is too small for a block of {bb} bytes", code="buffer_too_small"
                )
            spans.append(span)
        results = self.items(OP_GET_INTO, keys, spans)
        out = []
        for key, (result, _) in zip(keys, results, strict=True):
            if result < 0 and result not in _MISS:
                raise _raise("GET_INTO", key, result)
            out.append(result > 0)
        return out

    def get_into(self, key: str, buf: Any) -> bool:
        """``get_into`` over the socket."""
        return self.get_many_into([key], [buf])[0]

    def _fetch(self, keys: Sequence[str], copy: bool) -> list[tuple[bytes | None, int]]:
        for key in keys:
            check_key(key)
        got: dict[int, bytes] = {}

        def sink(j: int, addr: int, nbytes: int) -> None:
            if copy:
                got[j] = ctypes.string_at(addr, nbytes)
                self.session.count("bounce_copies")
                self.session.count("bounce_bytes", nbytes)

        results = self.session.bounce_get(list(keys), sink)
        out: list[tuple[bytes | None, int]] = []
        for j, (key, (result, tier)) in enumerate(zip(keys, results, strict=True)):
            if result < 0 and result not in _MISS:
                raise _raise("GET_INTO", key, result)
            out.append((got.get(j, b"") if result > 0 else None, tier if result > 0 else 0))
        return out

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get`` of each key; ``None`` per miss."""
        return [data for data, _ in self._fetch(keys, True)]

    def get(self, key: str) -> bytes | None:
        """``get`` over the socket (through the staging area)."""
        return self.get_many([key])[0]

    def tier_of(self, key: str) -> str | None:
        """Reads ``key`` into the staging area: the tier it came from, or ``None``."""
        _, tier = self._fetch([key], False)[0]
        return codes.TIER_NAMES.get(tier, str(tier)) if tier else None

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored in some tier (the shared index, else
        ``EXISTS``)."""
        check_key(key)
        code = self.exist_codes([key])[0]
        if code < 0:
            return self.session.keys_call(lambda c: c.exists([key]))[0] != 0
        return code == 1

    def delete(self, key: str) -> bool:
        """``DELETE`` of one key: ``True`` if there was a block."""
        check_key(key)
        result = self.session.keys_call(lambda c: c.delete([key]))[0]
        if result < 0 and result != codes.NOT_FOUND:
            raise _raise("DELETE", key, result)
        return result >= 0

    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """The chain's prefix hits and their tiers: from the shared index
        where the server offers one (unless the chain goes on past the
        local tiers and the server has a remote tier), else ``LOOKUP``,
        4,096 keys (and under 1 MiB) per request."""
        indexed = self._indexed(keys) if keys else None
        if indexed is not None and BAD_KEY not in indexed[0]:
            found, remote = indexed
            hits = found.find(0)
            hits = len(found) if hits < 0 else hits
            if hits == len(found) or not remote:
                tier_names = codes.TIER_NAMES
                return [tier_names.get(t, str(t)) for t in found[:hits]]
        for key in keys:
            check_key(key)  # raises for the first key the server would refuse
        tiers: list[str] = []
        for chunk in key_chunks(keys, range(len(keys)), 2):
            names = [keys[i] for i in chunk]
            hits, found = self.session.keys_call(lambda c, names=names: c.lookup(names))
            tiers += [codes.TIER_NAMES.get(t, str(t)) for t in found]
            if hits < len(names):
                break
        return tiers

    def prefetch(self, keys: Sequence[str]) -> int:
        """``PREFETCH``: how many of ``keys`` are stored."""
        for key in keys:
            check_key(key)
        total = 0
        for chunk in key_chunks(keys, range(len(keys)), 2):
            names = [keys[i] for i in chunk]
            total += self.session.keys_call(lambda c, names=names: c.prefetch(names))[1]
        return total

    def lease(self, keys: Sequence[str]) -> Leases:
        """``LEASE`` of ``keys``, with their arenas mapped
        (:func:`kvtier.leases.lease_keys`)."""
        return lease_keys(self.session, self.arenas, keys)

    def pin_arenas(self, device: int) -> int:
        """Maps every arena and page-locks it for CUDA device ``device``
        (:meth:`kvtier.leases.ArenaMaps.pin`): the bytes page-locked."""
        arenas = self.session.keys_call(lambda conn: self.arenas.pin(conn, device))
        return sum(a.file_bytes for a in arenas)

    def ping(self) -> bool:
        """Whether the server answers on the socket (an ``EXISTS`` of no keys)."""
        try:
            self.session.keys_call(lambda c: c.exists([]))
        except KvtierError as e:
            return e.local_code not in (codes.CONNECTION_LOST, None)
        return True

    # -------------------------------------------------- Mooncake's buffers

    def share(self, ptr: int, nbytes: int, obj: Any) -> Region | int:
        """A region with a descriptor of the file behind the memory, or -18
        ``BAD_BUFFER`` (with a warning) for memory no file backs."""
        try:
            fd, offset = backing_fd(ptr, nbytes)
        except UnshareableMemoryError as e:
            log.warning("kvtier: register_buffer(%#x, %d): cannot share it with the server: %s", ptr, nbytes, e)
            return codes.BAD_BUFFER
        return Region(ptr, nbytes, obj=obj, fd=fd, file_offset=offset)

    def register(self, region: Region) -> int:
        """``REGISTER`` on the session (again after every reconnect)."""
        return self.session.register(region)

    def unregister(self, region: Region) -> None:
        """``UNREGISTER`` on the session; closes the region's descriptor."""
        self.session.unregister(region)

    def move(
        self, op: int, keys: Sequence[str], spans: Sequence[Span], tags: Sequence[BlockTag | None] | None = None
    ) -> list[int]:
        """:meth:`items`, per item its result."""
        return [result for result, _ in self.items(op, keys, spans, tags)]

    def move_parts(
        self, op: int, keys: Sequence[str], parts: Sequence[Parts], tags: Sequence[BlockTag | None] | None = None
    ) -> list[int]:
        """One vectored batch (a put's items with their tags, checked
        already): the server copies into (from) every part."""
        encoded = _encoded(tags, len(keys))
        good = [i for i, e in enumerate(encoded) if isinstance(e, bytes)]
        out = [codes.INVALID_TAG] * len(keys)  # the callers check tags first; a bad one fails alone
        if good:
            tag_bytes = None if tags is None else [encoded[i] for i in good]
            results = self.session.transfer(op, [keys[i] for i in good], [parts[i] for i in good], tag_bytes)  # type: ignore[arg-type]
            for i, (result, _) in zip(good, results, strict=True):
                out[i] = result
        return out

    def plane(self) -> tuple[str | None, int | None, dict[str, int]]:
        """The socket, the server's epoch and the session's counters (and
        ``arenas_mapped``: ``MAP_ARENA`` calls made for leases)."""
        return (
            self.session.path,
            self.session.epoch,
            {
                **self.session.counters,
                "arenas_mapped": self.arenas.maps_made,
                "arenas_pinned": self.arenas.pinned(),
                "index_probes": self.index.probes,
            },
        )
