"""The blocking kvtier client: a pool of persistent HTTP/1.1 connections.

Why HTTP/1.1 and ``http.client`` (measured by ``make bench-python``, figures
in docs/BENCHMARKS.md): a 16 MiB block is one response whose body Python can
receive straight into the caller's buffer with ``recv_into`` — no framing to
parse and no intermediate ``bytes``. HTTP/2 from Python (``h2``/``httpx``)
frames every 16 KiB–1 MiB in pure Python and copies each frame. Parallelism
comes from the pool: each call takes one connection, and the batched forms
(``put_many``, ``get_many``, ``get_many_into``) run one call per connection
on a thread pool; socket I/O releases the GIL, so threads overlap.

Blocks move over this pool or over the same-host socket of docs/LOCAL.md,
two transports of one interface (:class:`kvtier.transport.base.Transport`);
:class:`kvtier.transport.link.Link` picks one per call. A :class:`Client` is
thread-safe. One instance per process is the intended use.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .connectors.mooncake import BufferHandle, MooncakeStore
from .memory.leases import Leases
from .memory.shm import byte_view
from .tag import BlockTag
from .transport.http import LOOKUP_BODY_BYTES_MAX, LOOKUP_KEYS_MAX
from .transport.http_pool import _Answer
from .transport.link import Link


class Client:
    """Blocking client of one kvtier server.

    Args:
        url: ``http://HOST:PORT`` of ``kvtier serve`` (HTTP/1.1 is spoken), or
            ``unix:///PATH`` of its same-host socket (docs/LOCAL.md); its
            hello gives the HTTP address :meth:`stats` uses, or give it as
            ``?http=HOST:PORT``.
        token: bearer token for a server started with ``--auth-token-file``,
            or a tenant's token for one started with ``--tenants`` (the
            client then reads and writes that tenant's keys; docs/OPERATIONS.md,
            "Tenants"); sent in the socket's hello too.
        connections: connections in the pool, and so the most requests in
            flight at once (the batched forms use all of them).
        timeout_s: limit for connecting and for each socket read or write;
            on the socket, also how long a call keeps reconnecting to a
            restarted server before its items fail with ``CONNECTION_LOST``.
        connect_timeout_s: on the socket, how long a call keeps trying to
            reconnect (default ``timeout_s``); ``0``: one try, so a socket
            that is gone or refuses fails the call at once (the engine
            connectors, which must never wait on kvtier, ask again later).
        retries: further tries, each on a new connection, after a refused,
            reset or cut-off connection (not after a timeout).
        local: with an HTTP ``url``: ``"off"`` (HTTP only), ``"auto"`` (on
            first use, read ``local.socket`` of ``/v1/stats`` and move blocks
            over that socket if its hello succeeds, else stay on HTTP), or
            ``"on"`` (the socket or an error). :attr:`transport` says which.
        expect_block_bytes, expect_model: the geometry the caller was built
            for; a server with another raises :class:`~kvtier.GeometryMismatchError`.
        staging_blocks: block-sized slots of the socket's staging area, for
            buffers outside every registered one (created on first use).
        lease_reads: over the socket, read a block bound for a buffer outside
            every registered one by leasing it and copying it from kvtier's
            RAM tier (one copy, checked against the lease's generation;
            docs/LOCAL.md "Leases") where the server offers leases, instead
            of through the staging area (two copies). Blocks not in RAM, and
            servers without leases, take the staging area.

    Over the socket every method works as over HTTP; :meth:`stats` goes to
    the HTTP address of ``?http=`` or of the server's hello, and
    :meth:`ping` without ``?http=`` asks the socket. The Mooncake-style calls
    (:meth:`register_buffer`, :meth:`batch_get_into`, …) are
    :attr:`mooncake`'s (:class:`kvtier.mooncake.MooncakeStore`); the methods
    of those names here hand over to it.

    Every method raises :class:`~kvtier.KvtierConnectionError` when the server
    cannot be reached after the retries, and the :class:`~kvtier.KvtierError`
    subclass named in docs/API.md's error table when it refuses a request.
    A miss is never an exception.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8085",
        *,
        token: str | None = None,
        connections: int = 8,
        timeout_s: float = 30.0,
        connect_timeout_s: float | None = None,
        retries: int = 2,
        local: str = "off",
        expect_block_bytes: int | None = None,
        expect_model: str | None = None,
        staging_blocks: int = 8,
        lease_reads: bool = True,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        socket_path, http_host = None, None
        if parts.scheme == "unix":  # unix:///PATH[?http=HOST:PORT], as kvtier-loadgen takes it
            socket_path, _, query = url[len("unix://") :].partition("?")
            if query:
                http = urllib.parse.urlsplit("http://" + query.removeprefix("http="))
                if not query.startswith("http=") or not http.hostname:
                    raise ValueError(f"a unix:// url takes ?http=HOST:PORT only, got {url!r}")
                http_host = (http.hostname, http.port or 80)
        elif parts.scheme == "http" and parts.hostname:
            http_host = (parts.hostname, parts.port or 80)
        if socket_path == "" or (socket_path is None and http_host is None):
            raise ValueError(f"url must be http://HOST:PORT or unix:///PATH[?http=HOST:PORT], got {url!r}")
        if local not in ("off", "auto", "on"):
            raise ValueError(f"local must be 'off', 'auto' or 'on', got {local!r}")
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if connect_timeout_s is not None and connect_timeout_s < 0:
            raise ValueError(f"connect_timeout_s must be 0 or more, got {connect_timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        self.url = url if socket_path is not None else f"http://{parts.netloc}"
        self.connections = connections
        self.timeout_s = timeout_s
        self.retries = retries
        self._link = Link(
            self.url,
            socket_path=socket_path,
            http_host=http_host,
            mode="on" if socket_path is not None else local,
            token=token,
            connections=connections,
            timeout_s=timeout_s,
            connect_timeout_s=timeout_s if connect_timeout_s is None else connect_timeout_s,
            retries=retries,
            expect=(expect_block_bytes, expect_model, staging_blocks, lease_reads),
        )
        self.mooncake = MooncakeStore(self._link)
        """Mooncake Store's buffer calls on this client's transports."""

    @property
    def transport(self) -> str:
        """``"unix"`` when blocks move over the same-host socket, else
        ``"http"`` (with ``local="auto"``, decided on first use: now)."""
        return self._link.current().name

    @property
    def _transport(self) -> str | None:
        """The transport once chosen; ``None`` while ``local="auto"``/``"on"``
        has not chosen (``/v1/stats`` did not answer yet). Chooses nothing."""
        return self._link.decided

    @property
    def server_info(self) -> dict[str, Any]:
        """The socket's hello answer (``epoch``, ``block_bytes``, ``model``,
        ``block_tokens``, ``max_items``, …); empty over HTTP."""
        return self._link.server_info()

    # ----------------------------------------------------------------- life

    def close(self) -> None:
        """Closes idle connections, the socket and its registrations, and the
        batch thread pool. Calls after it raise."""
        self._link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def executor(self) -> ThreadPoolExecutor:
        """The thread pool the batched forms (and :class:`~kvtier.AsyncClient`)
        run calls on: one thread per connection, started on first use."""
        return self._link.threads.pool()

    def _exchange(
        self,
        method: str,
        path: str,
        *,
        body: memoryview | None = None,
        json_body: bool = False,
        into: memoryview | None = None,
    ) -> _Answer:
        """One HTTP request, retried on a fresh connection after a connection failure."""
        return self._link.http.exchange(method, path, body=body, json_body=json_body, into=into)

    # -------------------------------------------------------------- blocks

    @property
    def block_bytes(self) -> int:
        """The store's block size in bytes (fixed per store; every PUT body
        is exactly this long). Asked of the server once, then remembered."""
        return self._link.block_bytes

    def put(self, key: str, data: Any, tag: BlockTag | None = None) -> bool:
        """Stores ``data`` (exactly ``block_bytes`` bytes, any buffer) under ``key``.

        Args:
            key: the block's key (docs/API.md, "Keys").
            data: the block's bytes.
            tag: the inference engine's identity of the block (its block
                hashes, parent hash, tokens per block, token ids), kept with
                it so that KV events name it in the engine's hash space
                (:class:`kvtier.BlockTag`; docs/API.md, "Block tags"). A put
                without one stores the block untagged (replacing any tag).

        Returns:
            ``True`` when the key was new (201), ``False`` when it replaced a
            stored block (200).

        Raises:
            InvalidKeyError: a bad key (checked before sending).
            InvalidTagError: ``tag`` breaks the rules (checked before
                sending), or the server refused it (400 ``invalid_tag``,
                ``INVALID_TAG``); nothing was stored.
            BlockSizeError: ``data`` is not ``block_bytes`` long (checked
                before sending).
            DiskFullError: 507, the server's disk is full.
            ProtocolError: a tag for a server whose socket speaks protocol
                version 1 (``UNSUPPORTED_VERSION``: upgrade kvtier or use HTTP).
            UnauthorizedError, OverloadedError, ServerError,
            KvtierConnectionError: as for every call.
        """
        return self._link.current().put(key, data, tag)

    def get(self, key: str) -> bytes | None:
        """The block stored under ``key``, or ``None`` on a miss (404, which
        includes a block dropped for failing its CRC)."""
        return self._link.current().get(key)

    def get_into(self, key: str, buf: Any) -> bool:
        """Reads the block under ``key`` straight into ``buf`` (a writable,
        contiguous buffer of at least ``block_bytes``: ``bytearray``,
        ``memoryview``, numpy array, CPU/pinned torch tensor); no
        intermediate ``bytes`` is made.

        Returns:
            ``True`` when the block was read into ``buf[:block_bytes]``,
            ``False`` on a miss. After ``False`` or an exception the buffer's
            contents are unspecified (a cut-off read may have filled part),
            and nothing is written into it for this call once it has
            returned, after a timeout too (:class:`~kvtier.KvtierConnectionError`;
            over the socket the server stops its copies when the client gives
            up on the connection: docs/LOCAL.md, "When a client gives up").

        Raises:
            BlockSizeError: ``buf`` is smaller than the block.
            TypeError, ValueError: ``buf`` is read-only or not contiguous.
        """
        return self._link.current().get_into(key, buf)

    def exists(self, key: str) -> bool:
        """Whether a block is stored under ``key`` (HEAD; moves nothing)."""
        return self._link.current().exists(key)

    def delete(self, key: str) -> bool:
        """Deletes the block under ``key``: ``True`` if there was one (204),
        ``False`` if not (404). The delete survives a restart."""
        return self._link.current().delete(key)

    def tier_of(self, key: str) -> str | None:
        """Reads ``key`` and answers the tier it was served from (``"ram"``,
        ``"nvme"``, …), or ``None`` on a miss. For tests and diagnostics."""
        return self._link.current().tier_of(key)

    def lease(self, keys: Sequence[str]) -> Leases:
        """Leases the blocks of ``keys`` where they lie in the server's RAM
        tier, for reading in place with no copy (docs/LOCAL.md, "Leases";
        same-host socket, protocol version 3). A block found on NVMe is read
        into RAM first and leased there. Release the leases when done: use
        the result as a context manager (or call its ``release()``)::

            with client.lease(keys) as leases:
                for i, view in enumerate(leases.views):   # None: not leased
                    if view is not None:
                        dest[i].copy_(leases.torch(i))
                        ok = leases.valid(i)               # else the lease had ended

        Keys not leased are told per key in ``results``: -2 a miss, -23
        ``NOT_IN_RAM`` (a GPU-tier or S3 hit, listed in ``not_in_ram``: read
        those with :meth:`get_into`), -16 ``LIMIT`` (the connection holds the
        server's ``leases_max``). More than 4,096 keys go in several requests.

        Returns:
            A :class:`kvtier.leases.Leases`: per key a read-only ``memoryview``
            of the block (``views``), its tier, ``numpy(i)``, ``torch(i)``,
            ``valid(i)``, ``copy_into(i, dest)``.

        Raises:
            LeasesOffError: the server offers no leases, with its reason (no
                RAM tier, ``--ram-shared off``, ``--tenants``); or this client
                talks HTTP (``code`` ``"leases_need_socket"``): leases exist
                only on the same-host socket.
            UnsupportedVersionError: the server's socket does not speak
                protocol version 3 (an older kvtier).
            InvalidKeyError: a bad key (checked before sending).
            KvtierConnectionError: no server within ``timeout_s``.
        """
        return self._link.current().lease(keys)

    def pin_arenas(self, device: int = 0) -> int:
        """Page-locks the server's RAM-tier arenas, mapped read-only in this
        process for leases, for CUDA device ``device``
        (``cuMemHostRegister`` with ``READ_ONLY|PORTABLE``, through the
        driver library, ``libcuda.so.1``). A host-to-device copy from a lease
        (``gpu_tensor.copy_(leases.torch(i), non_blocking=True)``) then is
        one DMA from kvtier's pages: no host copy, and no bounce through the
        driver's pageable path. Arenas of a server that restarts are pinned
        as the next lease maps them. Call it once, before the first lease;
        the pin ends when the client closes.

        The whole of every arena is page-locked (``--ram-gb`` of the
        server's memory, resident while pinned: the RAM tier is resident
        anyway). On the thread that calls it, a context is made current if
        none is (the device's primary context, torch's).

        Returns:
            The bytes page-locked.

        Raises:
            LeasesOffError: the server offers no leases (its reason), or this
                client talks HTTP.
            CudaError: no CUDA driver (``code`` ``"no_cuda_driver"``), no
                such device, or the driver refused the range (a driver
                without read-only registration).
        """
        return self._link.current().pin_arenas(device)

    # ------------------------------------------------------ lookup, prefetch

    def lookup_tiers(self, keys: Sequence[str]) -> list[str]:
        """The tier of each leading stored key of the chain ``keys`` (one
        ``POST /v1/lookup`` per 4,096 keys; over the socket, the shared index
        where the server offers one, else ``LOOKUP``): ``len()`` is the
        prefix hits."""
        return self._link.current().lookup_tiers(keys)

    def lookup(self, keys: Sequence[str]) -> int:
        """Prefix hits: how many leading keys of the chain ``keys`` are stored.
        One round trip for chains of up to 4,096 keys (none over the socket
        where the server offers its shared index); nothing moves."""
        return len(self.lookup_tiers(keys))

    def prefetch(self, keys: Sequence[str]) -> int:
        """Asks the server to promote the stored ones of ``keys`` into its
        fastest tier ahead of a read (it answers at once and copies in the
        background). Returns how many of ``keys`` are stored."""
        return self._link.current().prefetch(keys)

    # ------------------------------------------------------- server state

    def stats(self) -> dict[str, Any]:
        """``GET /v1/stats``: geometry, per-tier and per-shard counters,
        latency percentiles (docs/API.md lists the fields).

        Raises:
            KvtierError: ``code`` ``"no_http"`` for a ``unix://`` url without
                ``?http=`` to a server whose hello gives no HTTP address.
        """
        return self._link.http.stats()

    def ping(self) -> bool:
        """``True`` if the server answers ``/healthz`` with 200; ``False`` if it
        answers otherwise or cannot be reached (never raises for that). With
        a ``unix://`` url and no ``?http=``: whether the socket answers."""
        return self._link.ping()

    # ------------------------------------------------------------- batches

    def put_many(self, items: Iterable[tuple[str, Any]], tags: Sequence[BlockTag | None] | None = None) -> list[bool]:
        """:meth:`put` of each ``(key, data)``, in parallel over the pool,
        item ``i`` with the block tag ``tags[i]`` when ``tags`` is given (one
        per item, ``None`` for an untagged one). Returns each put's answer
        in order. On the first error, puts not yet started are skipped and
        the error is raised once the running ones finish (puts before it may
        have been stored; over the socket every tag is checked before any is sent).

        Raises:
            ValueError: ``tags`` is given with another length than ``items``.
        """
        return self._link.current().put_many(items, tags)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of each key, in parallel over the pool; ``None`` per miss."""
        return self._link.current().get_many(keys)

    def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[bool]:
        """:meth:`get_into` of ``keys[i]`` into ``bufs[i]``, in parallel over
        the pool; ``False`` per miss.

        Raises:
            ValueError: ``keys`` and ``bufs`` differ in length.
        """
        return self._link.current().get_many_into(keys, bufs)

    # ---------------------------------------- Mooncake's calls (self.mooncake)

    def register_buffer(self, buffer_ptr: int | Any, size: int | None = None) -> int:
        """:meth:`MooncakeStore.register_buffer <kvtier.mooncake.MooncakeStore.register_buffer>`:
        registers memory for the batch calls; 0 or a negative code."""
        return self.mooncake.register_buffer(buffer_ptr, size)

    def unregister_buffer(self, buffer_ptr: int | Any) -> int:
        """:meth:`MooncakeStore.unregister_buffer <kvtier.mooncake.MooncakeStore.unregister_buffer>`:
        0, or -20 when nothing is registered there."""
        return self.mooncake.unregister_buffer(buffer_ptr)

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int | Any], sizes: Sequence[int | None] | None = None
    ) -> list[int]:
        """:meth:`MooncakeStore.batch_get_into <kvtier.mooncake.MooncakeStore.batch_get_into>`:
        per item the bytes read or a negative code."""
        return self.mooncake.batch_get_into(keys, buffer_ptrs, sizes)

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int | Any],
        sizes: Sequence[int | None] | None = None,
        tags: Sequence[BlockTag | None] | None = None,
    ) -> list[int]:
        """:meth:`MooncakeStore.batch_put_from <kvtier.mooncake.MooncakeStore.batch_put_from>`
        (with a block tag per item when ``tags`` is given): per item 0 or a negative code."""
        return self.mooncake.batch_put_from(keys, buffer_ptrs, sizes, tags)

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """:meth:`MooncakeStore.batch_get_into_multi_buffers
        <kvtier.mooncake.MooncakeStore.batch_get_into_multi_buffers>`: per item
        the bytes read or a negative code."""
        return self.mooncake.batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes)

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        tags: Sequence[BlockTag | None] | None = None,
    ) -> list[int]:
        """:meth:`MooncakeStore.batch_put_from_multi_buffers
        <kvtier.mooncake.MooncakeStore.batch_put_from_multi_buffers>` (with a
        block tag per item when ``tags`` is given): per item 0 or a negative code."""
        return self.mooncake.batch_put_from_multi_buffers(keys, all_buffer_ptrs, all_sizes, tags)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """:meth:`MooncakeStore.batch_is_exist <kvtier.mooncake.MooncakeStore.batch_is_exist>`:
        per key 1, 0 or -1."""
        return self.mooncake.batch_is_exist(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """:meth:`MooncakeStore.get_buffer <kvtier.mooncake.MooncakeStore.get_buffer>`:
        the block in a handle (``ptr()``, ``size()``), leased where the server
        offers leases; ``None`` on a miss."""
        return self.mooncake.get_buffer(key)

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """:meth:`MooncakeStore.batch_get_buffer <kvtier.mooncake.MooncakeStore.batch_get_buffer>`:
        :meth:`get_buffer` of each key, leased in one batch."""
        return self.mooncake.batch_get_buffer(keys)

    def local_settled(self, wait_s: float = 0.0) -> bool:
        """:meth:`MooncakeStore.local_settled <kvtier.mooncake.MooncakeStore.local_settled>`:
        whether no copy by the server can still land in this client's memory."""
        return self.mooncake.local_settled(wait_s)

    def local_stats(self) -> dict[str, Any]:
        """:meth:`MooncakeStore.local_stats <kvtier.mooncake.MooncakeStore.local_stats>`:
        the client's view of the same-host plane."""
        return self.mooncake.local_stats()


__all__ = ["LOOKUP_BODY_BYTES_MAX", "LOOKUP_KEYS_MAX", "Client", "byte_view"]
