"""The shared index (docs/LOCAL.md, "The shared index"): each shard's
index table mapped read-only, probed in the client so that
``batch_is_exist`` and ``lookup`` need no round trip.

The tables are mapped and probed by the native core
(:class:`kvtier._native.IndexTables`, the ``kvtier-client`` crate): the
layout and its reader are ``local-proto``'s, the code the server's shards
write with, and each bucket is read under its seqlock with acquire loads,
so the answers hold on arm64 as on x86-64; the probe runs with the GIL
released. Answers are advisory: a block listed may be gone by the time it
is read (the read checks again), and a probe racing a delete can miss a
block (it reads as absent).

A table stays mapped after its server dies, frozen as it was; the client
then must not believe it. Beside the connection's own state, the server's
process is watched through a pidfd (its pid from ``SO_PEERCRED``), which
becomes readable the moment the process exits, before its socket is torn
down (``kill -9`` leaves a listening io_uring socket up for about a
second). A server in a pid namespace the client cannot see has no pid
there; then only the connection says whether it lives.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Sequence

from .._native import BAD_KEY as BAD_KEY  # tiers' answer for a key the server would refuse
from .._native import IndexTables
from ..errors import KvtierError, LeasesOffError
from .local import LocalConnection


class SharedIndex:
    """The index tables of one server process, mapped on first use and
    dropped when a reconnect finds another ``epoch``. Thread-safe.

    :meth:`tiers` answers ``None`` when the index cannot answer (the server
    offers none, speaks an older version, or a table overflowed): the caller
    then asks the server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._tables: IndexTables | None = None
        self._pidfd: int | None = None
        self._exit_poll: select.poll | None = None
        self.off: str | None = None
        """Why this server's index is not used (set once it said so)."""
        self.probes = 0
        """Keys answered from the index (for tests and ``local_stats``)."""

    def _ensure(self, conn: LocalConnection) -> bool:
        epoch = conn.info.get("epoch")
        if epoch == self._epoch:
            return self.off is None
        self._drop()
        self._epoch, self.off = epoch, None
        offer = conn.info.get("shared_index") or {}
        pid = conn.peer_pid()
        if pid > 0 and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(pid)
                self._exit_poll = select.poll()
                self._exit_poll.register(self._pidfd, select.POLLIN)
            except OSError:
                self._pidfd, self._exit_poll = None, None
        if not offer.get("offered"):
            self.off = str(offer.get("why_not") or f"the server speaks socket protocol version {conn.version}")
            return False
        fds: list[int] = []
        try:
            shards = int(conn.info["shards"])
            maps = []
            for shard in range(shards):
                fd, (file_bytes, buckets, told_shards) = conn.map_index(shard)
                fds.append(fd)
                if told_shards != shards:
                    raise KvtierError(f"MAP_INDEX says {told_shards} shards, HELLO {shards}", code="bad_index")
                maps.append((fd, file_bytes, buckets))
            try:
                self._tables = IndexTables(maps)
            except ValueError as e:
                raise KvtierError(str(e), code="bad_index") from e
        except LeasesOffError as e:
            self._drop()
            self.off = str(e)
            return False
        except BaseException:
            # Mapped in part (the connection broke, say): map again next time.
            self._drop()
            self._epoch = None
            raise
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def tiers(self, conn: LocalConnection, keys: Sequence[str]) -> bytes | None:
        """Per key the wire number of the fastest local tier listed (0: none;
        :data:`BAD_KEY`: a key the server would refuse, not probed), or
        ``None`` when the index cannot answer for all of them."""
        return self._probe(conn, keys, exist=False)  # type: ignore[return-value]

    def exist(self, conn: LocalConnection, keys: Sequence[str]) -> list[int] | None:
        """Per key 1 (a local tier lists it), 0 (none does), -1 (a key the
        server would refuse), or ``None`` as for :meth:`tiers`."""
        return self._probe(conn, keys, exist=True)  # type: ignore[return-value]

    def _probe(self, conn: LocalConnection, keys: Sequence[str], *, exist: bool) -> bytes | list[int] | None:
        with self._lock:
            if not conn.alive or not self._ensure(conn) or self._server_exited():
                return None
            assert self._tables is not None
            keys = keys if isinstance(keys, list) else list(keys)
            out = self._tables.exist(keys) if exist else self._tables.tiers(keys)
            if out is not None:
                self.probes += len(keys)
            return out

    def _server_exited(self) -> bool:
        """Whether the server process this index was mapped from has exited
        (its pidfd is readable); ``False`` when it cannot be watched."""
        return self._exit_poll is not None and bool(self._exit_poll.poll(0))

    def _drop(self) -> None:
        self._tables = None  # unmapped when the last probe holding it ends
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd, self._exit_poll = None, None

    def close(self) -> None:
        """Unmaps every table."""
        with self._lock:
            self._drop()
            self._epoch = None
