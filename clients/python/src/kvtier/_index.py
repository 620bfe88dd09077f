"""The shared index (docs/LOCAL.md, "The shared index"): each shard's
presence table mapped read-only, probed in the client so that
``batch_is_exist`` and ``lookup`` need no round trip.

A table is a 4,096-byte header and ``buckets`` 32-byte buckets (``seq`` u32,
``tiers`` u8, ``lo`` and ``hi`` u64: the block hash's halves), open
addressing with linear probing from bucket ``lo & (buckets - 1)``; a key's
block hash is xxh3-128 of its bytes, its shard the hash mod ``shards``.
Each bucket is a seqlock: it is believed only when ``seq`` reads the same
even number before and after its fields. Answers are advisory: a block
listed may be gone by the time it is read (the read checks again), and a
probe racing a delete can miss a block (it reads as absent).

A table stays mapped after its server dies, frozen as it was; the client
then must not believe it. Beside the connection's own state, the server's
process is watched through a pidfd (its pid from ``SO_PEERCRED``), which
becomes readable the moment the process exits, before its socket is torn
down (``kill -9`` leaves a listening io_uring socket up for about a
second). A server in a pid namespace the client cannot see has no pid
there; then only the connection says whether it lives.

Reading ``seq`` after the fields without a load fence is exact on x86-64,
whose loads are not reordered with other loads; on arm64 pure Python has
no fence to put there (as for leases, :mod:`kvtier.leases`).
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import threading
from collections.abc import Sequence

import xxhash

from .errors import KvtierError, LeasesOffError
from .local import LocalConnection

_HEADER = struct.Struct("<4sIIIII")
_BUCKET = struct.Struct("<IB3xQQ")
_SEQ = struct.Struct("<I")
_HEADER_BYTES = 4096
_BUCKET_BYTES = 32
_MAGIC = b"KVPX"
_OVERFLOWED = 1
_LO = (1 << 64) - 1
#: Tier bits of a bucket, and the wire tier number of the fastest one held
#: (docs/LOCAL.md: 1 gpu, 2 ram, 3 nvme).
_FASTEST = {1: 1, 2: 2, 4: 3}
#: A probe gives up (and the caller asks the server) after this many
#: buckets that were being written each time it looked.
_RETRIES = 8


class _Table:
    """One shard's table, mapped read-only."""

    def __init__(self, fd: int, file_bytes: int, buckets: int) -> None:
        self.map = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        magic, version, mapped_buckets, _shard, _shards, _flags = _HEADER.unpack_from(self.map, 0)
        if magic != _MAGIC or version != 1 or mapped_buckets != buckets or buckets & (buckets - 1):
            self.map.close()
            raise KvtierError(f"not a version-1 presence table of {buckets} buckets", code="bad_index")
        self.mask = buckets - 1
        self.buckets = buckets

    def overflowed(self) -> bool:
        return bool(_HEADER.unpack_from(self.map, 0)[5] & _OVERFLOWED)

    def tiers(self, lo: int, hi: int) -> int | None:
        """The tier bits listed for the hash ``(lo, hi)``: 0 absent, ``None``
        unknown (buckets kept changing under the probe)."""
        unpack, m, mask = _BUCKET.unpack_from, self.map, self.mask
        i = lo & mask
        for _ in range(self.buckets):
            for _ in range(_RETRIES):
                at = _HEADER_BYTES + i * _BUCKET_BYTES
                seq, tiers, blo, bhi = unpack(m, at)
                if seq & 1 == 0 and unpack(m, at)[0] == seq:
                    break
            else:
                return None
            if tiers == 0 and blo == 0 and bhi == 0:
                return 0
            if blo == lo and bhi == hi:
                return tiers
            i = (i + 1) & mask
        return 0

    def close(self) -> None:
        self.map.close()


class SharedIndex:
    """The presence tables of one server process, mapped on first use and
    dropped when a reconnect finds another ``epoch``. Thread-safe.

    :meth:`tiers` answers ``None`` when the index cannot answer (the server
    offers none, speaks an older version, or a table overflowed): the caller
    then asks the server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._tables: list[_Table] = []
        self._shards = 0
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
        try:
            shards = int(conn.info["shards"])
            for shard in range(shards):
                fd, (file_bytes, buckets, told_shards) = conn.map_index(shard)
                try:
                    if told_shards != shards:
                        raise KvtierError(f"MAP_INDEX says {told_shards} shards, HELLO {shards}", code="bad_index")
                    self._tables.append(_Table(fd, file_bytes, buckets))
                finally:
                    os.close(fd)
        except LeasesOffError as e:
            self._drop()
            self.off = str(e)
            return False
        except BaseException:
            # Mapped in part (the connection broke, say): map again next time.
            self._drop()
            self._epoch = None
            raise
        self._shards = shards
        return True

    def tiers(self, conn: LocalConnection, keys: Sequence[str]) -> list[int] | None:
        """Per key the wire number of the fastest local tier listed (0: none),
        or ``None`` when the index cannot answer for all of them."""
        with self._lock:
            if not conn.alive or not self._ensure(conn) or self._server_exited():
                return None
            tables, shards = self._tables, self._shards
            if any(t.overflowed() for t in tables):
                return None
            # The probe of _Table.tiers, inlined: this loop is the call's cost.
            unpack, seq_of, digest, fastest = _BUCKET.unpack_from, _SEQ.unpack_from, xxhash.xxh3_128_intdigest, _FASTEST
            maps = [(t.map, t.mask, t) for t in tables]
            out = []
            for key in keys:
                h = digest(key.encode())
                m, mask, table = maps[h % shards]
                lo, hi = h & _LO, h >> 64
                i = lo & mask
                while True:
                    at = _HEADER_BYTES + i * _BUCKET_BYTES
                    seq, bits, blo, bhi = unpack(m, at)
                    if seq & 1 or seq_of(m, at)[0] != seq:
                        # Being written: the careful probe, with retries.
                        slow = table.tiers(lo, hi)
                        if slow is None:
                            return None
                        bits = slow
                        break
                    if blo == lo and bhi == hi:
                        break
                    if not bits and not blo and not bhi:
                        break
                    i = (i + 1) & mask
                out.append(fastest[bits & -bits] if bits else 0)
            self.probes += len(keys)
            return out

    def _server_exited(self) -> bool:
        """Whether the server process this index was mapped from has exited
        (its pidfd is readable); ``False`` when it cannot be watched."""
        return self._exit_poll is not None and bool(self._exit_poll.poll(0))

    def _drop(self) -> None:
        for t in self._tables:
            t.close()
        self._tables = []
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd, self._exit_poll = None, None

    def close(self) -> None:
        """Unmaps every table."""
        with self._lock:
            self._drop()
            self._epoch = None
