"""The engine's own host buffer, shared with kvtier over the same-host
socket (docs/LOCAL.md), for the connectors whose engine has one (LMCache's
CPU buffer, vLLM's offloading tier, SGLang's host pool): see
:class:`SharedHost`. The connectors' common core is :mod:`kvtier.connectors.core`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .. import codes
from ..errors import KvtierError
from ..memory.shm import buffer_address

if TYPE_CHECKING:
    from .core import ConnectorCore


class SharedHost:
    """The engine's own host buffer, shared with kvtier over the same-host
    socket (docs/LOCAL.md): registered once, so the server copies chunks
    straight into it (a load) and out of it (a store), with no copy in the
    engine's process.

    Decided by :meth:`decide` the first time the client's transport is known:
    over HTTP nothing is registered; over the socket the buffer is
    registered, and if it cannot be (anonymous memory: the engine was not
    told to allocate it in shared memory) chunks are staged through the
    client's staging area, one more copy per byte. The choice is logged
    once: at info when zero-copy, as a warning naming ``remedy`` when staged.

    Args:
        core: the connector's core (its client, transport and logger).
        buffer: the engine's host buffer (a CPU tensor or a buffer object), or
            ``None`` when the engine has none to share.
        what: the buffer in the engine's words, for the log
            (``"LMCache's CPU buffer"``).
        remedy: the engine setting that puts it in shared memory.

    Attributes:
        zero_copy: ``True`` registered, ``False`` staged or HTTP, ``None``
            undecided (the server has not answered yet).
        base: the buffer's address, once registered.
        nbytes: its size in bytes.
    """

    def __init__(self, core: ConnectorCore, buffer: Any, *, what: str, remedy: str) -> None:
        self.core = core
        self.buffer = buffer
        self.what = what
        self.remedy = remedy
        self.zero_copy: bool | None = None
        self.base = 0
        self.nbytes = 0
        self._lock = threading.Lock()

    def decide(self) -> bool | None:
        """Whether chunks move through the registered buffer; registers it the
        first time the transport is known to be the socket. ``None`` while
        undecided (asked again at the next call). Never raises; blocks at
        most one request."""
        core = self.core
        if self.zero_copy is not None or core.transport is None:
            return self.zero_copy
        with self._lock:
            if self.zero_copy is not None:
                return self.zero_copy
            if core.transport != "unix":
                self.zero_copy = False  # the core has logged the transport
                return False
            if self.buffer is None:
                code, base, nbytes = codes.BAD_BUFFER, 0, 0
            else:
                try:
                    base, nbytes = buffer_address(self.buffer, writable=True)
                    code = core.client.register_buffer(base, nbytes)
                except (KvtierError, TypeError, ValueError) as e:
                    core.logger.warning("kvtier %s: registering %s failed (%s); tried again", core.url, self.what, e)
                    return None
            if code == codes.CONNECTION_LOST:
                return None
            self.zero_copy = code == codes.OK
            if self.zero_copy:
                self.base, self.nbytes = base, nbytes
                core.logger.info(
                    "kvtier %s: zero-copy over the same-host socket: %s (%d bytes) is registered; kvtier copies "
                    "chunks straight into and out of it",
                    core.url,
                    self.what,
                    nbytes,
                )
            else:
                core.logger.warning(
                    "kvtier %s: staged over the same-host socket: %s cannot be registered (%s); every chunk is "
                    "copied once more, through the client's staging area. %s",
                    core.url,
                    self.what,
                    "none given" if self.buffer is None else codes.name_of(code),
                    self.remedy,
                )
            return self.zero_copy

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in the registered buffer."""
        return bool(self.zero_copy) and self.base <= ptr and ptr + nbytes <= self.base + self.nbytes

    def count_moved(self, buf: Any) -> None:
        """Counts one chunk moved over the socket to or from ``buf`` (a
        buffer object, ``None`` for the client's own): straight through the
        registered buffer (``zero_copy_chunks``) or through the staging area
        (``staged_chunks``). Nothing over HTTP."""
        if self.core.transport != "unix":
            return
        ptr, nbytes = buffer_address(buf, writable=False) if buf is not None else (0, 0)
        self.core.count(**{"zero_copy_chunks" if nbytes and self.covers(ptr, nbytes) else "staged_chunks": 1})

    def release(self) -> None:
        """Unregisters the buffer (before the engine frees it); a server that
        is gone has nothing to release."""
        if self.zero_copy:
            try:
                self.core.client.unregister_buffer(self.base)
            except KvtierError as e:
                self.core.logger.debug("kvtier: unregistering %s: %s", self.what, e)
            self.zero_copy = None
