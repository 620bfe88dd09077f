"""The vLLM connector's lookups never hold up the scheduler (issue 62),
against a real ``kvtier serve`` and the connector's own scheduler code, no
engine: a burst of 256 new requests is answered without one wait and
without taking a healthy kvtier for down; the give-up clock starts when a
lookup is sent, not while it waits for a pool thread; a request vLLM
preempted is looked up again when it resumes."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from conftest import block
from test_vllm_connector_completions import schedule
from test_vllm_connector_faults import BB, bare, hashes

from kvtier.connectors.vllm.lookup import LOOKUP_GIVE_UP_MS, LOOKUP_TIMEOUT_MS
from kvtier.testing import ServerProcess

pytestmark = pytest.mark.vllm

BLOCKS = 4  # blocks of each prompt kvtier may hold (``bare``: 4 tokens a block)


@pytest.fixture(scope="module")
def server():
    """One kvtier for the module (each test keys its own blocks)."""
    with ServerProcess(block_bytes=BB, ram_gb=0.2, disk_gb=0.25) as s:
        yield s


def prompt(req_id: str, salt: int) -> SimpleNamespace:
    """A request of ``BLOCKS`` full blocks and one more token."""
    return SimpleNamespace(request_id=req_id, block_hashes=hashes(BLOCKS, salt=salt), num_prompt_tokens=BLOCKS * 4 + 1)


def blocking_waits(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """Records each ``Future.result`` called on a future not done yet (a
    wait), with its timeout."""
    waits: list[float | None] = []
    result = Future.result

    def recorded(self: Future, timeout: float | None = None) -> object:  # type: ignore[type-arg]
        if not self.done():
            waits.append(timeout)
        return result(self, timeout)

    monkeypatch.setattr(Future, "result", recorded)
    return waits


def test_a_burst_of_256_new_requests_never_waits_and_marks_nothing_down(server, monkeypatch):
    c = bare(server.url, lookup_timeout_ms=LOOKUP_TIMEOUT_MS, lookup_give_up_ms=LOOKUP_GIVE_UP_MS)
    requests = [prompt(f"r{i}", salt=100 + i % 128) for i in range(256)]
    held = [r for i, r in enumerate(requests) if i % 2 == 0 and i < 128]  # 64 prompts, every block in kvtier
    c._core.client.put_many([(c.key_of(h), block(n, BB)) for r in held for n, h in enumerate(r.block_hashes)])
    expected = {r.request_id: BLOCKS * 4 if r.block_hashes in [h.block_hashes for h in held] else 0 for r in requests}
    waits = blocking_waits(monkeypatch)
    answers: dict[str, int] = {}
    step_ms: list[float] = []
    deadline = time.monotonic() + 30
    while len(answers) < len(requests):
        assert time.monotonic() < deadline, f"{len(requests) - len(answers)} lookups unanswered after 30 s"
        began = time.perf_counter()
        for r in requests:
            if r.request_id not in answers:
                tokens, _ = c.get_num_new_matched_tokens(r, 0)  # type: ignore[arg-type]
                if tokens is not None:
                    answers[r.request_id] = tokens
        step_ms.append((time.perf_counter() - began) * 1000)
        time.sleep(0.005)  # the rest of a step
    print(
        f"256 new requests: answered in {len(step_ms)} steps; the connector's time per step "
        f"{statistics.median(step_ms):.2f} ms median, {max(step_ms):.2f} ms max"
    )
    assert waits == [], f"the scheduler waited on a lookup {len(waits)} times (timeouts {sorted(set(waits))})"
    assert answers == expected
    assert c.stats["lookup_timeouts"] == 0 and not c._core.failures.down() and c._core.ready()
    c.shutdown()


def test_the_give_up_clock_starts_when_the_lookup_is_sent_not_while_it_is_queued(server):
    c = bare(server.url, lookup_timeout_ms=LOOKUP_TIMEOUT_MS, lookup_give_up_ms=200)
    r = prompt("q", salt=1)
    c._core.client.put_many([(c.key_of(h), block(n, BB)) for n, h in enumerate(r.block_hashes)])
    pool = c._core.client.executor()
    busy = threading.Event()
    for _ in range(pool._max_workers):  # every thread of the client's pool held 1 s by other calls
        pool.submit(busy.wait, 1.0)
    answer = None
    deadline = time.monotonic() + 10
    while answer is None:
        assert time.monotonic() < deadline, "the lookup was never answered"
        answer, _ = c.get_num_new_matched_tokens(r, 0)  # type: ignore[arg-type]
        time.sleep(0.005)
    assert answer == BLOCKS * 4, "the lookup queued behind busy threads was given up"
    assert c.stats["lookup_timeouts"] == 0 and not c._core.failures.down()
    c.shutdown()


def test_a_preempted_request_is_looked_up_again_when_vllm_resumes_it(server):
    c = bare(server.url, lookup_timeout_ms=LOOKUP_TIMEOUT_MS, lookup_give_up_ms=LOOKUP_GIVE_UP_MS)
    r = prompt("p", salt=2)
    keys = [c.key_of(h) for h in r.block_hashes]
    c._core.client.put_many([(k, block(n, BB)) for n, k in enumerate(keys)])

    def ask() -> int:
        deadline = time.monotonic() + 10
        while (tokens := c.get_num_new_matched_tokens(r, 0)[0]) is None:  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the lookup was never answered"
            time.sleep(0.005)
        return tokens

    assert ask() == BLOCKS * 4
    c._core.client.delete(keys[2])  # evicted while the request ran
    assert ask() == BLOCKS * 4  # the same request, not preempted: its answer stands
    output = schedule(c, preempted={"p"})
    assert output.preempted == ["p"]
    assert ask() == 2 * 4, "the resumed request was answered from its lookup before the preemption"
    c.shutdown()


def test_an_idle_steps_wait_ends_with_the_first_lookup_that_answers_and_never_for_answered_ones():
    """``Lookups.wait_any`` (the scheduler's wait in a step with nothing to
    compute): it returns as soon as one lookup in flight answers, not at its
    timeout, and at once when none is in flight (answered or absent)."""
    from kvtier.connectors.vllm.lookup import Lookups, PendingLookup

    answered, slow, late = PendingLookup(), PendingLookup(), PendingLookup()
    answered.future.set_result(3)
    order: list[str] = []
    Lookups.wait_any([answered, None], 60.0)  # nothing in flight: no wait
    order.append("idle returned")
    timer = threading.Timer(0.2, lambda: (order.append("answered"), late.future.set_result(1)))
    started = time.monotonic()
    timer.start()
    Lookups.wait_any([answered, slow, None, late], 60.0)
    order.append("wait returned")
    waited_s = time.monotonic() - started
    timer.join()
    assert order == ["idle returned", "answered", "wait returned"]
    assert waited_s < 30, f"it waited {waited_s:.1f} s: for its 60 s timeout or every lookup, not the first answer"
    assert not slow.future.done()  # it returned on `late`, while `slow` still waits
    # Deliberate fault's mirror: with no lookup able to answer, the wait is its timeout.
    Lookups.wait_any([slow], 0.05)
    assert not slow.future.done()
