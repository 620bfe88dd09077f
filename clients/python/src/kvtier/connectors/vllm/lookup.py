"""The vLLM connector's lookups (scheduler side): one per request, started
on the client's pool the first time vLLM asks about the request, waited for
at most ``lookup_timeout_ms`` per ask and at most ``lookup_give_up_ms`` in
all.

While a lookup has not answered, the connector tells vLLM to ask again
(``get_num_new_matched_tokens`` answers ``None``): vLLM sets the request
aside for this step and schedules the others, so a slow answer (the first
lookup of a cold process, a busy machine: 13 ms against a 10 ms deadline in
docs/BENCHMARKS.md, issue 54) costs the request a step, not its hit. Past
the give-up the request is a miss and kvtier counts as down for ``down_s``
(its later requests are misses at once, without waiting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from ..core import ConnectorCore

#: The scheduler's wait for a lookup per ask, milliseconds (``lookup_timeout_ms``).
LOOKUP_TIMEOUT_MS = 10.0
#: A request's wait for its lookup in all, milliseconds (``lookup_give_up_ms``):
#: past it a miss, and kvtier is down for ``down_s``.
LOOKUP_GIVE_UP_MS = 100.0


@dataclass
class PendingLookup:
    """One request's lookup in flight: its answer (leading blocks held) and
    when it was asked (``time.monotonic()`` seconds)."""

    future: Future[int]
    started_s: float


class Lookups:
    """The deadlines of the scheduler's lookups.

    Args:
        core: the connector's client, counters and down window.
        timeout_ms: the wait per ask (> 0).
        give_up_ms: the wait in all; at least ``timeout_ms`` (a smaller value
            is raised to it).

    Raises:
        ValueError: ``timeout_ms`` or ``give_up_ms`` not a positive number.
    """

    def __init__(self, core: ConnectorCore, timeout_ms: object, give_up_ms: object) -> None:
        self._core = core
        self.timeout_s = _positive_ms("lookup_timeout_ms", timeout_ms) / 1000.0
        self.give_up_s = max(self.timeout_s, _positive_ms("lookup_give_up_ms", give_up_ms) / 1000.0)

    def start(self, lookup: Callable[[], int]) -> PendingLookup | None:
        """Starts ``lookup`` on the client's pool; ``None`` when kvtier is not
        known to answer (down, not probed yet) or the client is closed."""
        if not self._core.ready():
            return None
        try:
            future = self._core.client.executor().submit(lookup)
        except RuntimeError:  # the client is closed
            return None
        return PendingLookup(future, time.monotonic())

    def answer(self, pending: PendingLookup) -> int | None:
        """The lookup's answer, waited for at most ``timeout_ms``; ``None``
        ("ask again") while it is in flight and the give-up is not reached;
        0 past the give-up (counted in ``lookup_timeouts``, kvtier down)."""
        try:
            return int(pending.future.result(timeout=self.timeout_s))
        except FutureTimeout:
            if time.monotonic() - pending.started_s < self.give_up_s:
                self._core.count(lookup_retries=1)
                return None
        pending.future.cancel()
        self._core.count(lookup_timeouts=1)
        self._core.mark_down("lookup", f"no lookup answer within lookup_give_up_ms {self.give_up_s * 1e3:g}")
        return 0


def _positive_ms(name: str, value: object) -> float:
    try:
        ms = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of milliseconds, got {value!r}") from None
    if not ms > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return ms
