"""Retry with backoff, written once for the whole client: how long to wait
before each retry (:class:`Backoff`) and the loop that tries a call again
(:func:`retrying`).

Every place that tries again uses them: the HTTP exchange (a new connection
after a refused, reset or cut-off one), connecting to the same-host socket
(until ``timeout_s``), registering a buffer, and the socket's key requests
(once after a lost connection; after ``OVERLOADED`` up to
:data:`OVERLOAD_RETRIES` times, waiting at least the server's hint). The
socket's batches retry item by item (only the failed items go again), so
they run their own loop and take only the :class:`Backoff`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``first_s`` before the first retry, doubling with
    each further one, never more than ``max_s``."""

    first_s: float
    max_s: float

    def delay(self, retry: int, hint_s: float = 0.0) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first; 0
        or less waits nothing): at least ``hint_s`` (the server's
        ``Retry-After``/``retry_after_ms``), at most ``max_s``."""
        if retry < 1:
            return 0.0
        return min(max(hint_s, self.first_s * 2 ** (retry - 1)), self.max_s)


#: HTTP: a new connection after a refused, reset or cut-off one.
HTTP_BACKOFF = Backoff(0.05, 1.0)
#: The socket: connecting again to a server that is (re)starting.
CONNECT_BACKOFF = Backoff(0.02, 0.5)
#: Tries after ``OVERLOADED`` that store nothing (each after the server's
#: ``retry_after_ms``, at least 10 ms doubling per try), before the code is
#: answered; a try that stores some items does not count.
OVERLOAD_RETRIES = 6
#: The longest single wait on an ``OVERLOADED`` hint, in seconds.
OVERLOAD_WAIT_MAX_S = 2.0
#: The socket: a batch or key request again after ``OVERLOADED``.
OVERLOAD_BACKOFF = Backoff(0.01, OVERLOAD_WAIT_MAX_S)


def retrying(
    call: Callable[[], T], wait: Callable[[Exception, int], float | None], *, deadline: float | None = None
) -> T:
    """``call()``, tried again after each exception for which ``wait(error,
    retry)`` (``retry`` counting from 1) answers the seconds to wait first.

    Raises:
        Exception: the last one ``call`` raised, once ``wait`` answers
            ``None`` for it or ``deadline`` (a :func:`time.monotonic`
            instant; waits are cut short at it) has passed.
    """
    retry = 0
    while True:
        try:
            return call()
        except Exception as e:
            retry += 1
            pause = wait(e, retry)
            if pause is None:
                raise
            if deadline is not None:
                pause = min(pause, max(deadline - time.monotonic(), 0.0))
            if pause > 0:
                time.sleep(pause)
            if deadline is not None and time.monotonic() >= deadline:
                raise


__all__ = [
    "CONNECT_BACKOFF",
    "HTTP_BACKOFF",
    "OVERLOAD_BACKOFF",
    "OVERLOAD_RETRIES",
    "OVERLOAD_WAIT_MAX_S",
    "Backoff",
    "retrying",
]
