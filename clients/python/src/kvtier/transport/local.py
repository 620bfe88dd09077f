"""The same-host data plane's wire protocol (docs/LOCAL.md): one connection.

:class:`LocalConnection` is one Unix-socket connection to ``kvtier serve``,
written in Rust (the ``kvtier-client`` crate, bound as
:class:`kvtier._native.Connection`): 16-byte frames, a request id per
request, and a reader thread that hands each response to the request that
waits for it, so any number of threads (up to 256 requests in flight, the
server's limit) share one connection. Every call that waits releases the
GIL. It knows nothing of reconnecting or of the caller's memory; that is
``kvtier.transport.session`` (what :class:`kvtier.Client` uses). Tests and tools use
this class directly to speak the protocol op by op.

    conn = LocalConnection("/var/lib/kvtier/kvtier.sock")
    info = conn.hello(block_bytes=16 << 20)     # the server's geometry and epoch
    handle, access = conn.register(fd, 0, 64 << 20)
    conn.get_into([(handle, 0, 16 << 20, "key-0")])   # [(16777216, 2)]: bytes, tier

Every op raises the :mod:`kvtier.errors` class of a request-wide failure (its
``local_code`` is the negative code) and :class:`~kvtier.KvtierConnectionError`
(``local_code`` -21) when the connection is gone; per-item results are codes.

The payloads are those of the Rust crate ``kvtier-local-proto``, the server's
own; the constants below come from it (no protocol constant is written here).
"""

from __future__ import annotations

import json
import os
from typing import Any

from .._native import CLIENT_NAME as CLIENT_NAME
from .._native import CLOSE_CONFIRM_S as CLOSE_CONFIRM_S
from .._native import HEADER_BYTES as HEADER_BYTES
from .._native import ITEM_BYTES as ITEM_BYTES
from .._native import MAGIC as MAGIC
from .._native import MAX_IN_FLIGHT as MAX_IN_FLIGHT
from .._native import MAX_ITEMS as MAX_ITEMS
from .._native import MAX_PARTS as MAX_PARTS
from .._native import MAX_PAYLOAD_BYTES as MAX_PAYLOAD_BYTES
from .._native import OP_DELETE as OP_DELETE
from .._native import OP_ERROR as OP_ERROR
from .._native import OP_EXISTS as OP_EXISTS
from .._native import OP_GET_INTO as OP_GET_INTO
from .._native import OP_GET_INTO_V as OP_GET_INTO_V
from .._native import OP_HELLO as OP_HELLO
from .._native import OP_LEASE as OP_LEASE
from .._native import OP_LOOKUP as OP_LOOKUP
from .._native import OP_MAP_ARENA as OP_MAP_ARENA
from .._native import OP_MAP_INDEX as OP_MAP_INDEX
from .._native import OP_NAMES as OP_NAMES
from .._native import OP_PREFETCH as OP_PREFETCH
from .._native import OP_PUT_FROM as OP_PUT_FROM
from .._native import OP_PUT_FROM_V as OP_PUT_FROM_V
from .._native import OP_REGISTER as OP_REGISTER
from .._native import OP_RELEASE as OP_RELEASE
from .._native import OP_UNREGISTER as OP_UNREGISTER
from .._native import PART_BYTES as PART_BYTES
from .._native import RESPONSE as RESPONSE
from .._native import VERSION_LEASES as VERSION_LEASES
from .._native import VERSION_TAGS as VERSION_TAGS
from .._native import VERSIONS as VERSIONS
from .._native import Connection, Ticket


class LocalConnection(Connection):
    """One connection to a kvtier Unix socket (docs/LOCAL.md). Thread-safe.

    Args:
        path: the socket's path (``local.socket`` of ``/v1/stats``).
        timeout_s: limit for each response unless a call names another. A
            request that times out gives up on the connection
            (:meth:`abandon`: its registrations go with it, and the server
            copies nothing more into or out of their memory).

    Raises:
        OSError: the socket cannot be connected (``FileNotFoundError``,
            ``ConnectionRefusedError``, ``PermissionError``, …).
    """

    def __init__(self, path: str, *, timeout_s: float = 30.0) -> None:
        self.info: dict[str, Any] = {}
        """The server's hello answer (after :meth:`hello`): ``epoch``, ``block_bytes``, …"""

    def hello(  # type: ignore[override]
        self,
        *,
        token: str | None = None,
        block_bytes: int | None = None,
        model: str | None = None,
        client: str = CLIENT_NAME,
    ) -> dict[str, Any]:
        """``HELLO``: the first request. Sends the versions this client speaks,
        and the token and expected geometry when given; returns the server's
        answer (``version``, ``epoch``, ``block_bytes``, ``model``,
        ``max_items``, …), also kept as :attr:`info`.

        Raises:
            UnauthorizedError: the peer is not allowed, or the token is wrong.
            GeometryMismatchError: ``block_bytes``/``model`` differ (both named).
            ProtocolError: no version in common, or an unreadable answer.
        """
        info = json.loads(super().hello(token=token, block_bytes=block_bytes, model=model, client=client))
        info["epoch"] = int(info["epoch"])
        self.info = info
        return dict(info)

    def call(self, op: int, payload: bytes, *, fd: int | None = None, timeout_s: float | None = None) -> bytes:
        """One request frame of ``op`` and ``payload`` (with ``fd`` in
        ``SCM_RIGHTS``) and its answer's body; a descriptor that comes with
        the answer is closed. Raises the answer's request-wide error."""
        body, _, fds = self.wait(self.request(op, payload, fd=fd), timeout_s)
        for got in fds:
            os.close(got)
        return bytes(body)

    def __enter__(self) -> LocalConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalConnection({self.path!r}, alive={self.alive})"


__all__ = ["LocalConnection", "Ticket"]
