"""What a :class:`kvtier.Client` holds of its server: the HTTP transport,
the same-host one once chosen, the registered buffers and the batch threads.

:meth:`Link.current` answers the transport a call goes over. With
``local="auto"``/``"on"`` (or a ``unix://`` url) the choice is made on the
first call that needs it (:func:`kvtier.transport.unix.open_local`); until it is made
(``/v1/stats`` did not answer), calls go over HTTP.
"""

from __future__ import annotations

import threading
from typing import Any

from ..memory.regions import Regions
from .base import Threads, Transport, check_block_bytes
from .http import HttpTransport
from .unix import UnixTransport, open_local


class Link:
    """The transports of one client and what they share.

    Args:
        url: the client's url, as errors name it.
        socket_path: the socket of a ``unix://`` url, else ``None``.
        http_host: ``(host, port)`` of the HTTP API, if known.
        mode: ``"off"``, ``"auto"`` or ``"on"`` (``"on"`` for a ``unix://`` url).
        token, connections, timeout_s, connect_timeout_s, retries: as
            :class:`kvtier.Client` takes them.
        expect: ``(expect_block_bytes, expect_model, staging_blocks, lease_reads)``.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_path: str | None,
        http_host: tuple[str, int] | None,
        mode: str,
        token: str | None,
        connections: int,
        timeout_s: float,
        connect_timeout_s: float,
        retries: int,
        expect: tuple[int | None, str | None, int, bool],
    ) -> None:
        self.url, self.socket_path, self.mode = url, socket_path, mode
        self.token, self.timeout_s, self.expect = token, timeout_s, expect
        self.connect_timeout_s = connect_timeout_s
        self.regions = Regions()
        """The registered buffers, by address."""
        self.threads = Threads(connections)
        """The batch thread pool."""
        self.http = HttpTransport(
            url,
            http_host,
            token=token,
            connections=connections,
            timeout_s=timeout_s,
            retries=retries,
            threads=self.threads,
            regions=self.regions,
            expect_block_bytes=expect[0],
            hello_address=self._hello_http_address,
        )
        """The HTTP transport (always there: ``stats`` goes over it)."""
        self.unix: UnixTransport | None = None
        """The same-host transport, once chosen."""
        self.decided: str | None = None if mode != "off" else "http"
        """``"unix"`` or ``"http"`` once chosen; ``None`` while undecided."""
        self._lock = threading.Lock()
        self._block_bytes: int | None = None

    def choose(self) -> UnixTransport | None:
        """The same-host transport, or ``None`` for HTTP; makes the choice
        of ``local="auto"``/``"on"`` on first call (and again after an
        undecided one)."""
        if self.decided is None:
            with self._lock:
                if self.decided is None:
                    self.unix, self.decided = open_local(
                        self.socket_path,
                        self.mode,
                        url=self.url,
                        stats=self.http.stats,
                        token=self.token,
                        timeout_s=self.timeout_s,
                        connect_timeout_s=self.connect_timeout_s,
                        expect=self.expect,
                        regions=self.regions,
                    )
        return self.unix

    def current(self) -> Transport:
        """The transport a call goes over now."""
        unix = self.choose()
        return self.http if unix is None else unix

    def _hello_http_address(self) -> object:
        """For a ``unix://`` url: the HTTP address its hello gives, if any."""
        return self.server_info().get("http") if self.socket_path is not None else None

    def server_info(self) -> dict[str, Any]:
        """The socket's hello answer; empty over HTTP."""
        unix = self.choose()
        return {} if unix is None else unix.info()

    @property
    def block_bytes(self) -> int:
        """The store's block size, asked of the current transport once and
        checked against the one the client expects."""
        if self._block_bytes is None:
            self._block_bytes = check_block_bytes(self.url, self.current().block_bytes, self.expect[0])
        return self._block_bytes

    def ping(self) -> bool:
        """Over HTTP when its address is known, else whether the socket answers."""
        if not self.http.has_pool:
            unix = self.choose()
            return unix is not None and unix.ping()
        return self.http.ping()

    def close(self) -> None:
        """Closes both transports, the registrations and the thread pool."""
        self.http.close()
        if self.unix is not None:
            self.unix.close()
        for region in self.regions.clear():
            region.close()
        self.threads.shutdown()


__all__ = ["Link"]
