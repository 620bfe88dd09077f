"""What every engine connector (lmcache, vllm, sglang) does when kvtier
fails: a miss for the engine, a warning for the operator — at most one per
kind per ``WARN_INTERVAL_S``, with how many were held back, so a down server
cannot flood the log — and, after a connection failure, ``down_s`` seconds in
which calls answer at once without trying, so a down server costs the engine
recomputation, not latency."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import KvtierConnectionError

#: At most one warning of each kind per this many seconds.
WARN_INTERVAL_S = 10.0


def client_options(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~kvtier.Client` arguments of a connector's settings, with
    the defaults every connector documents: ``url``
    (``http://127.0.0.1:8085``), ``token_file`` (read and stripped; none),
    ``connections`` (8), ``timeout_s`` (10), ``retries`` (1).

    Raises:
        OSError: ``token_file`` cannot be read.
        ValueError: a number that does not parse.
    """
    token_file = settings.get("token_file")
    return {
        "url": str(settings.get("url") or "http://127.0.0.1:8085"),
        "token": Path(str(token_file)).read_text().strip() if token_file else None,
        "connections": int(settings.get("connections", 8)),
        "timeout_s": float(settings.get("timeout_s", 10.0)),
        "retries": int(settings.get("retries", 1)),
    }


class Failures:
    """Rate-limited warnings and the down window of one connector.

    Args:
        logger: where warnings go (the connector's own logger).
        down_s: seconds after a connection failure in which :meth:`down`
            answers ``True``.
    """

    def __init__(self, logger: logging.Logger, down_s: float) -> None:
        self.logger = logger
        self.down_s = down_s
        self._down_until = 0.0
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def down(self) -> bool:
        """Whether a connection failure happened less than ``down_s`` ago."""
        return time.monotonic() < self._down_until

    def record(self, kind: str, message: str, error: BaseException) -> None:
        """Warns (rate-limited); a connection failure (other than the
        connector's own "marked down" refusal) opens the down window."""
        if isinstance(error, KvtierConnectionError) and error.code != "server_down":
            self._down_until = time.monotonic() + self.down_s
        self.warn(kind, message)

    def warn(self, kind: str, message: str) -> None:
        """Logs ``message`` unless a warning of ``kind`` was logged less than
        ``WARN_INTERVAL_S`` ago (then it is counted and told with the next)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -WARN_INTERVAL_S) < WARN_INTERVAL_S:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        suffix = f" ({held} more like it since the last warning)" if held else ""
        self.logger.warning("kvtier %s: %s%s", kind, message, suffix)
