"""What the tests under a real ``vllm serve`` (tests/test_vllm_serve*.py)
start and read: engines, each started only by the tests that need it and
stopped after its module, with their logs checked for requests kvtier lost;
the connector's settings, prompts drawn from ShareGPT, kvtier's published
events, a block damaged in kvtier's log by key, and the byte oracle's
comparison."""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.testing import ServerProcess, VllmServer, free_port, note_stopped, sharegpt_conversations

#: vLLM's CPU backend: 128-token blocks; the model's KV is 16 KiB a token
#: (8 layers x K,V x 8 heads x 64 x bf16), so a block is 2 MiB.
BLOCK_TOKENS = 128
BLOCK_BYTES = 2 * 1024 * 1024
#: The sliding-window model's (tools/make_model.py gemma3-sw) block of one KV
#: cache group: 2 layers x 128 tokens x K,V x 2 heads x 128 x bf16.
GROUP_BLOCK_BYTES = 256 * 1024
#: Its layers: 10 sliding-window layers (window 256) in 5 groups, 2 global.
SW_LAYERS, SW_GROUPS, SW_WINDOW_BLOCKS = 12, 6, 2
#: A prompt's length in characters: about 3-4 blocks of the test model's
#: tokenizer (trained on ShareGPT).
PROMPT_CHARS = (1500, 2100)
#: The tests' ``lookup_give_up_ms``: a request's wait for its lookup in all.
LOOKUP_GIVE_UP_MS = 2000
#: Generated tokens compared per prompt.
MAX_TOKENS = 8
#: The seed prompts are drawn from ShareGPT by (not chosen to agree).
SEED = 53


def _model(variable: str = "KVTIER_VLLM_MODEL") -> str:
    model = os.environ.get(variable)
    if not model or not (Path(model) / "model.safetensors").exists():
        pytest.fail(
            f"{variable} does not name a model made by tools/make_model.py: run `make test-vllm-serve` "
            "(it makes target/models/kvtier-llama and target/models/kvtier-gemma3-sw)"
        )
    return model


def sharegpt_prompts(count: int, seed: int) -> list[str]:
    """``count`` prompts drawn by ``seed`` from ShareGPT V3 (the file
    ``$KVTIER_SHAREGPT`` names; ``make test-vllm-serve`` sets it): each a
    conversation's turns joined, cut at a word between
    :data:`PROMPT_CHARS` characters. Drawn, not chosen to agree."""
    path = os.environ.get("KVTIER_SHAREGPT")
    if not path or not Path(path).exists():
        pytest.fail("KVTIER_SHAREGPT does not name ShareGPT V3's JSON: run `make test-vllm-serve` (it sets it)")
    texts = []
    for conversation in sharegpt_conversations(Path(path), 8_000_000):
        text = "\n".join(turn.get("value", "") for turn in conversation)
        if len(text) >= PROMPT_CHARS[1]:
            texts.append(text)
    rng = random.Random(seed)
    prompts = []
    for text in rng.sample(texts, count):
        cut = rng.randrange(*PROMPT_CHARS)
        prompts.append(text[: text.rfind(" ", 0, cut)])
    return prompts


#: The connector's ``timeout_s`` in these tests: a call unanswered this long
#: fails with CONNECTION_LOST (and fails the test that sees it).
CLIENT_TIMEOUT_S = 20


def connector(url: str, **settings: object) -> dict[str, object]:
    """The ``--kv-transfer-config`` of KvtierConnector in these tests:
    failed loads recomputed, a short down window, the default lookup
    deadline per ask (10 ms: three vLLMs share this machine's two cores, so
    a lookup often outlasts it and vLLM asks again) given up after 2 s, and a
    call timeout of 20 s (a call can wait for a core; the default deadline's
    effect on TTFT is measured by ``clients/python/bench/bench_down.py``)."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "url": url,
            "down_s": 0.5,
            "timeout_s": CLIENT_TIMEOUT_S,
            "lookup_give_up_ms": LOOKUP_GIVE_UP_MS,
            **settings,
        },
    }


def vllm(model: str = "KVTIER_VLLM_MODEL", **kwargs: Any) -> VllmServer:
    """A vLLM of the tests serving the model the environment variable
    ``model`` names: OpenMP threads left to the kernel unless the caller
    binds them (vLLM would pin them to core 0), 10 nicer than the tests and
    kvtier (its process and its session's autogroup). On two cores a CPU
    vLLM's threads spin between steps (OpenMP, and its shared-memory queue's
    second of ``sched_yield`` after each message); kvtier, as a serving host
    would run it, comes first when it has work, so a shard's wait for a CPU
    is not what the tests measure (kvtier's stall log says when one happens
    anyway, docs/OPERATIONS.md)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", **kwargs.pop("env", {})}
    return VllmServer(_model(model), python=sys.executable, env=env, niceness=10, **kwargs)


def vllm_tp2(url: str, oracle: str, model: str = "KVTIER_VLLM_MODEL") -> VllmServer:
    """A vLLM of the tests with two tensor-parallel workers (vLLM's mp
    executor, one core each) serving ``model`` through kvtier at ``url``:
    loads and stores inside the step, the end-to-end digest on, and the byte
    oracle in ``oracle``."""
    return vllm(
        model,
        kv_transfer_config=connector(url, digest=True, oracle_dir=oracle, loads="sync", stores="sync"),
        args=("--enforce-eager", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        single_process=False,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )


#: What an engine's log says when a request to kvtier went unanswered
#: (the client's timeout) or its connection was lost: never tolerated
#: outside a test that kills or stops kvtier (``@pytest.mark.faults``).
LOST_REQUEST_MARKS = ("no answer to ", "CONNECTION_LOST")


def lost_requests(engine: VllmServer, since: int = 0, marks: tuple[str, ...] = LOST_REQUEST_MARKS) -> list[str]:
    """The lines of ``engine``'s log from byte ``since`` on that report a
    request to kvtier unanswered or its connection lost."""
    if not engine.log.exists():
        return []
    with open(engine.log, "rb") as f:
        f.seek(since)
        text = f.read().decode("utf-8", "replace")
    return [line for line in text.splitlines() if any(m in line for m in marks)]


def log_size(engine: VllmServer) -> int:
    """Where ``engine``'s log ends now (a mark for :func:`lost_requests`)."""
    return engine.log.stat().st_size if engine.log.exists() else 0


@contextmanager
def serving(engine: VllmServer) -> Iterator[VllmServer]:
    """``engine`` started and ready; stopped on the way out, whatever
    happened, and then its whole log checked: a request kvtier never
    answered (the client's timeout) fails the module, named, even in a
    test that killed or stopped kvtier (those end long before 20 s)."""
    try:
        engine.launch()
        engine.wait_ready()
        yield engine
    finally:
        engine.stop()
    unanswered = lost_requests(engine, marks=("no answer to ",))
    if unanswered:
        pytest.fail("kvtier left requests unanswered until the client's timeout:\n" + "\n".join(unanswered[:10]))


@contextmanager
def events_store(**kwargs: Any) -> Iterator[tuple[ServerProcess, int]]:
    """A kvtier that publishes KV events (docs/OPERATIONS.md), started; with
    the port of its replay socket, from which the blocks' tags are read."""
    pub, replay = free_port(), free_port()
    events = ("--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}")
    args = (*events, *kwargs.pop("args", ()))
    with ServerProcess(args=args, **kwargs) as server:
        yield server, replay


@contextmanager
def oracle_dir(name: str) -> Iterator[str]:
    """A byte oracle's directory (the connector's ``oracle_dir``), removed after."""
    path = tempfile.mkdtemp(prefix=f"kvtier-oracle-{name}-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def no_lost_requests(request: pytest.FixtureRequest, names: tuple[str, ...]) -> Iterator[None]:
    """The body of a module's autouse fixture: a test that uses one of the
    engine fixtures ``names`` fails if that engine's log reports a request
    to kvtier unanswered or lost while it ran, unless it is marked
    ``faults`` (it kills or stops kvtier on purpose)."""
    engines = [request.getfixturevalue(n) for n in names if n in request.fixturenames]
    marks = [log_size(e) for e in engines]
    yield
    if request.node.get_closest_marker("faults"):
        return
    for e, mark in zip(engines, marks, strict=True):
        lost = lost_requests(e, mark)
        if lost:
            pytest.fail(f"{len(lost)} requests to kvtier lost or unanswered during the test:\n" + "\n".join(lost[:10]))


def external_hit_tokens(engine: VllmServer) -> float:
    """vLLM's own count of prompt tokens loaded through the connector."""
    return engine.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def server_totals(server: ServerProcess) -> dict[str, int]:
    """kvtier's ``/v1/stats`` totals."""
    with kvtier.Client(server.url) as c:
        totals: dict[str, int] = c.stats()["totals"]
        return totals


def settled_puts(server: ServerProcess, quiet_s: float = 1.0, timeout_s: float = 30.0) -> int:
    """kvtier's puts once they stop growing for ``quiet_s``: the connector
    stores in the background, after vLLM has answered the request."""
    deadline = time.monotonic() + timeout_s
    last = server_totals(server)["puts"]
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = server_totals(server)["puts"]
        if now == last:
            return now
        last = now
    return last


def stored_events(replay_port: int) -> list[object]:
    """Every ``BlockStored`` kvtier published so far, replayed from its
    ROUTER socket from sequence 0 and decoded by vLLM's own classes."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[object] = []
        while True:
            assert dealer.poll(10_000), "no end of the replay within 10 s"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return [e for e in events if isinstance(e, BlockStored)]
            events.extend(decoder.decode(payload).events)
    finally:
        ctx.destroy(linger=0)


def damage_key(data_dir: str, key: str, block_bytes: int) -> int:
    """Flips one payload byte in the middle of every slot of kvtier's log
    that holds ``key`` (docs/FORMAT.md: a 4096-byte superblock, then slots of
    a 4096-byte header, whose key starts at byte 64, and the block rounded up
    to 4096). Returns the slots damaged."""
    slot_bytes = 4096 + (block_bytes + 4095) // 4096 * 4096
    name = key.encode() + b"\0"
    damaged = 0
    for segment in Path(data_dir).glob("shard-*/seg-*.kvt"):
        with open(segment, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            for slot in range(4096, size - slot_bytes + 1, slot_bytes):
                f.seek(slot + 64)
                if f.read(len(name)) != name:
                    continue
                f.seek(slot + 4096 + block_bytes // 2 + 123)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x5A]))
                damaged += 1
    return damaged


def oracle_mismatches(
    events: list[dict[str, Any]], since: float = 0.0, stored: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The ``loaded`` events (at or after wall-clock time ``since``) whose
    digest is not one kvtier can hold under their key: that of the block
    last stored under it before them, or, after a store whose answer was
    lost (``store_failed``: kvtier may or may not have written it), that
    one too. Every load is judged: a block loaded under a key nothing was
    stored under is a mismatch. ``stored`` seeds the record (another
    engine's stores). Each rank keys its own blocks, so one file's order is
    enough; the ranks of an MLA model share their keys, and each records
    the digest of the blocks another rank writes from its own pages
    (``replica``), which counts as stored here."""
    record: dict[str, set[str]] = {k: {v} for k, v in (stored or {}).items()}
    bad = []
    for e in events:
        if e["event"] in ("stored", "replica"):
            record[e["key"]] = {e["digest"]}
        elif e["event"] == "store_failed":
            record[e["key"]] = record.get(e["key"], set()) | {e["digest"]}
        elif e["event"] == "loaded" and e["t"] >= since and e["digest"] not in record.get(e["key"], set()):
            bad.append(e)
    return bad


def prompt_blocks(events: list[dict[str, Any]], engine: VllmServer, prompt: str, rank: int = 0) -> dict[int, str]:
    """Block index → key of each of ``prompt``'s full blocks that one rank
    stored (a prompt's last token is never in one), found by walking its
    chain in the oracle: block ``k``'s stored event holds the prompt's
    ``k``-th block of token ids and names block ``k - 1``'s hash as its
    parent (whichever request stored it: prompts can share a prefix)."""
    tokens = engine.tokenize(prompt)
    out: dict[int, str] = {}
    parent = None
    for k in range((len(tokens) - 1) // BLOCK_TOKENS):
        want = tokens[k * BLOCK_TOKENS : (k + 1) * BLOCK_TOKENS]
        hit = next(
            (
                e
                for e in events
                if e["event"] == "stored"
                and e["rank"][0] == rank
                and e["index"] == k
                and e["tokens"] == want
                and e["parent"] == parent
            ),
            None,
        )
        if hit is None:
            break
        out[k], parent = hit["key"], hit["hash"]
    return out


def answered_loads(store: ServerProcess) -> int:
    """Load requests kvtier has answered on its socket (counted as answered,
    before the answer is sent)."""
    with kvtier.Client(store.url) as c:
        routes = c.stats()["local"]["routes"]
    return sum(routes[r]["requests"] for r in ("get_into", "get_into_v", "lease"))


@contextmanager
def responses_held(store: ServerProcess, seconds: float) -> Iterator[None]:
    """Every answer kvtier sends on its socket held ``seconds`` in the
    kernel's entry to ``send`` (strace's fault injection; its HTTP door
    writes otherwise, so ``/v1/stats`` still answers). The shard sending
    stalls that long in the send: the hold is recorded
    (:func:`kvtier.testing.note_stopped`), so ``make test`` lists such a
    stall as the test's."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("this test holds kvtier's answers with strace: install it (make deps does)")
    log = tempfile.NamedTemporaryFile(prefix="kvtier-strace-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [
            strace,
            "-f",
            "-qq",
            "-p",
            str(store.pid),
            "-e",
            "trace=sendto",
            "-e",
            f"inject=sendto:delay_enter={int(seconds * 1e6)}",
            "-o",
            log.name,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    held_from = time.time()
    time.sleep(0.5)  # attached to the server's threads
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        note_stopped(store.pid, held_from, time.time() + seconds, sends_only=True)  # a send let go lasts its hold
        os.unlink(log.name)


def when_a_load_is_held(store: ServerProcess, before: int, fault) -> None:
    """Waits until kvtier has answered a load whose answer is still held
    (:func:`responses_held`), then runs ``fault()``: a load is in flight."""
    deadline = time.monotonic() + 60
    while answered_loads(store) == before:
        assert time.monotonic() < deadline, "no load was asked within 60 s"
        time.sleep(0.02)
    fault()


def abandoned(engine: VllmServer, prompt: str, go: threading.Event, max_tokens: int = 64) -> None:
    """Sends ``prompt`` as a streamed completion and closes the connection
    once ``go`` is set: the client disconnects, and vLLM's API server aborts
    the request (``request_finished`` in the connector while it loads)."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=60)
    body = {"model": "kvtier-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    go.wait(120)
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
