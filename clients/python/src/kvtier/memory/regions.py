"""The client's memory the server copies into and out of: the registered
buffers by address (:class:`Regions`, shared by both transports), and the
same-host transport's staging area (:class:`Staging`) for memory that is not
registered."""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from typing import Any

from .shm import SharedBuffer


class Region:
    """One registered buffer: ``size`` bytes at address ``ptr``; on the Unix
    transport also ``fd`` (the client's own descriptor, kept for
    re-registration), the region's offset in that file, and the server's
    ``access`` (1 mapped, 2 file I/O, 3 guarded). ``obj`` keeps a buffer object alive."""

    _ids = itertools.count(1)

    def __init__(self, ptr: int, size: int, *, obj: Any = None, fd: int = -1, file_offset: int = 0) -> None:
        self.id = next(Region._ids)
        self.ptr, self.size, self.end = ptr, size, ptr + size
        self.obj, self.fd, self.file_offset = obj, fd, file_offset
        self.access = 0

    def close(self) -> None:
        """Closes the client's descriptor of the region's file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Regions:
    """The registered buffers by address (non-overlapping). Thread-safe."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._by_start: dict[int, Region] = {}
        self._lock = threading.Lock()

    def add(self, region: Region) -> Region | None:
        """Adds ``region``; returns an existing one it overlaps instead (and adds nothing)."""
        with self._lock:
            i = bisect.bisect_right(self._starts, region.ptr)
            for j in (i - 1, i):
                if 0 <= j < len(self._starts):
                    other = self._by_start[self._starts[j]]
                    if other.ptr < region.end and region.ptr < other.end:
                        return other
            self._starts.insert(i, region.ptr)
            self._by_start[region.ptr] = region
            return None

    def remove(self, ptr: int) -> Region | None:
        """Removes and returns the region registered at exactly ``ptr``."""
        with self._lock:
            region = self._by_start.pop(ptr, None)
            if region is not None:
                self._starts.remove(ptr)
            return region

    def find(self, ptr: int) -> Region | None:
        """The region holding address ``ptr``, if any."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            region = self._by_start[self._starts[i]]
            return region if ptr < region.end else None

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._by_start.values())

    def clear(self) -> list[Region]:
        with self._lock:
            regions = list(self._by_start.values())
            self._starts.clear()
            self._by_start.clear()
            return regions


class Staging:
    """A registered :class:`SharedBuffer` of ``slots`` block-sized slots for
    memory that is not registered (one bounce copy per item)."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.buf = SharedBuffer(slots * slot_bytes, name="kvtier-staging")
        self.slot_bytes = slot_bytes
        self.region = Region(self.buf.ptr, self.buf.nbytes, fd=os.dup(self.buf.fd))
        self._free = list(range(slots))
        self._cond = threading.Condition()

    def acquire(self, want: int) -> list[int]:
        """Up to ``want`` free slots (waits for at least one; never holds some while waiting)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            take, self._free = self._free[:want], self._free[want:]
            return take

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()


__all__ = ["Region", "Regions", "Staging"]
