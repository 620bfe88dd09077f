"""The HTTP/1.1 plumbing of :class:`kvtier.Client`: keep-alive connections,
their pool, and a finished exchange (see client.py for why HTTP/1.1)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import KvtierError, error_from_response

#: Socket buffers large enough for a 16 MiB block to stream without stalls.
SOCKET_BUFFER_BYTES = 4 << 20


class _Connection(http.client.HTTPConnection):
    """One keep-alive connection, with Nagle off (a request's headers and
    body are separate writes) and socket buffers sized for whole blocks."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


class _Pool:
    """At most ``size`` connections in use at once; idle ones are reused,
    most recently used first (its TCP window is the warmest)."""

    def __init__(self, host: str, port: int, size: int, timeout_s: float) -> None:
        self._host, self._port, self._timeout_s = host, port, timeout_s
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[_Connection]:
        """Lends a connection; one that raised is closed, not returned."""
        self._slots.acquire()
        try:
            with self._lock:
                if self._closed:
                    raise KvtierError("the client is closed", code="client_closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = _Connection(self._host, self._port, timeout=self._timeout_s)
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._idle.append(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _Answer:
    """A finished exchange: status, headers that matter, and the body (empty
    when it went into the caller's buffer)."""

    __slots__ = ("body", "nbytes", "retry_after", "status", "tier")

    def __init__(self, status: int, body: bytes, nbytes: int, tier: str | None, retry_after: str | None) -> None:
        self.status, self.body, self.nbytes, self.tier, self.retry_after = status, body, nbytes, tier, retry_after

    def error(self) -> KvtierError:
        """The error this answer carries (docs/API.md's JSON error body)."""
        code, message = "http_error", self.body[:200].decode("utf-8", "replace") or f"HTTP {self.status}"
        try:
            err = json.loads(self.body)["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            pass
        retry_after_s = None
        if self.retry_after is not None:
            try:
                retry_after_s = float(self.retry_after)
            except ValueError:
                pass
        return error_from_response(self.status, code, message, retry_after_s)


__all__ = ["SOCKET_BUFFER_BYTES", "_Answer", "_Connection", "_Pool"]
