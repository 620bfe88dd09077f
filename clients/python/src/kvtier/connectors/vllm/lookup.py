"""The vLLM connector's lookups (scheduler side): one per request, started
on the client's pool the first time vLLM asks about the request (and again
after a preemption), never waited for by default (``lookup_timeout_ms`` 0)
and given up ``lookup_give_up_ms`` after it was sent to kvtier.

While a lookup has not answered, the connector tells vLLM to ask again
(``get_num_new_matched_tokens`` answers ``None``): vLLM sets the request
aside for this step and schedules the others, so a lookup costs the
scheduler a glance at a future per waiting request and step, never a wait
(a burst of new requests does not hold up the decoding ones), and a slow
answer costs the request a step, not its hit. The give-up clock starts
when a pool thread sends the lookup, not when it is queued: a burst queued
behind the pool's threads is not taken for a kvtier that does not answer.
Past the give-up the request is a miss and kvtier counts as down for
``down_s`` (its later requests, and those still queued, are misses at once).
In a step with nothing to compute the scheduler waits for the first lookup
in flight to end, at most ``IDLE_STEP_WAIT_S`` (:meth:`Lookups.wait_any`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..core import ConnectorCore

#: The scheduler's wait for a lookup per ask, milliseconds
#: (``lookup_timeout_ms``): 0, never (vLLM asks again next step).
LOOKUP_TIMEOUT_MS = 0.0
#: A lookup's time from its sending to kvtier to its give-up, milliseconds
#: (``lookup_give_up_ms``): past it a miss, and kvtier is down for ``down_s``.
LOOKUP_GIVE_UP_MS = 100.0


@dataclass
class PendingLookup:
    """One request's lookup: its answer (leading blocks held), once
    submitted, and when a pool thread sent it to kvtier
    (``time.monotonic()`` seconds; ``None`` while it waits for a thread)."""

    future: Future[int] = field(default_factory=Future)
    sent_s: float | None = None


class Lookups:
    """The deadlines of the scheduler's lookups.

    Args:
        core: the connector's client, counters and down window.
        timeout_ms: the wait per ask (>= 0; 0: never waits).
        give_up_ms: the time from sending to giving up (> 0); at least
            ``timeout_ms`` (a smaller value is raised to it).

    Raises:
        ValueError: ``timeout_ms`` negative or ``give_up_ms`` not positive, or
            either not a number.
    """

    def __init__(self, core: ConnectorCore, timeout_ms: object, give_up_ms: object) -> None:
        self._core = core
        self.timeout_s = _ms("lookup_timeout_ms", timeout_ms, zero=True) / 1000.0
        self.give_up_s = max(self.timeout_s, _ms("lookup_give_up_ms", give_up_ms, zero=False) / 1000.0)

    def start(self, lookup: Callable[[], int]) -> PendingLookup | None:
        """Starts ``lookup`` on the client's pool; ``None`` when kvtier is not
        known to answer (down, not probed yet) or the client is closed."""
        if not self._core.ready():
            return None
        pending = PendingLookup()

        def send() -> int:
            pending.sent_s = time.monotonic()
            return lookup()

        try:
            pending.future = self._core.client.executor().submit(send)
        except RuntimeError:  # the client is closed
            return None
        return pending

    def answer(self, pending: PendingLookup) -> int | None:
        """The lookup's answer if it has one (waited for at most
        ``lookup_timeout_ms``, by default not at all); else ``None`` ("ask
        again") until ``lookup_give_up_ms`` after it was sent, then 0
        (counted in ``lookup_timeouts``, kvtier down). 0 at once, uncounted,
        when kvtier was found down meanwhile (by another lookup, a copy or
        the probe) and this one has not answered."""
        future = pending.future
        if self.timeout_s > 0 and not future.done():
            try:
                future.result(timeout=self.timeout_s)
            except FutureTimeout:
                pass
        if future.done() and not future.cancelled():
            return int(future.result())
        sent = pending.sent_s
        if self._core.failures.down():
            future.cancel()
            return 0
        if sent is None or time.monotonic() - sent < self.give_up_s:
            self._core.count(lookup_retries=1)
            return None
        future.cancel()
        self._core.count(lookup_timeouts=1)
        self._core.mark_down("lookup", f"no lookup answer within lookup_give_up_ms {self.give_up_s * 1e3:g}")
        return 0

    @staticmethod
    def wait_any(lookups: Iterable[PendingLookup | None], timeout_s: float) -> None:
        """In a step with nothing to compute: waits at most ``timeout_s`` for
        the first of ``lookups`` still in flight to end (none: returns at
        once). Without it vLLM runs empty steps back to back while its
        waiting requests' lookups are in flight, taking the CPU kvtier
        answers with."""
        in_flight = [p.future for p in lookups if p is not None and not p.future.done()]
        if in_flight:
            wait(in_flight, timeout=timeout_s, return_when=FIRST_COMPLETED)


def _ms(name: str, value: object, *, zero: bool) -> float:
    try:
        ms = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of milliseconds, got {value!r}") from None
    if not (ms >= 0 if zero else ms > 0):
        raise ValueError(f"{name} must be {'zero or more' if zero else 'positive'}, got {value!r}")
    return ms
