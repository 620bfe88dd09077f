"""kvtier's KV events (``--kv-events``; docs/OPERATIONS.md, "KV events for
routers") read as a router reads vLLM's: pyzmq SUB and DEALER sockets on a
real ``kvtier serve``, every payload decoded by vLLM 0.32.0's own
``msgspec.msgpack.Decoder(KVEventBatch)``.

Blocks are PUT over HTTP with their engine block tags (``x-kvtier-block-hashes``,
``x-kvtier-parent-hash``, ``x-kvtier-block-size``, ``x-kvtier-token-ids``); a
PUT lands in the RAM tier and the log (write-through), so it is published as
stored in ``CPU`` and ``STORAGE``, and a DELETE as removed from both.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from conftest import BLOCK_BYTES, block

from kvtier.testing import ServerProcess, free_port

msgspec = pytest.importorskip("msgspec")
kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM's event classes (target/py-vllm)")

#: How long a test waits for an event it expects.
WAIT_S = 10.0
#: The replay answer's end marker: sequence number -1, 8 bytes big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Batch = tuple[int, object]


def as_int(h: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` (the default, int hashes)."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class Node:
    """A kvtier server publishing events on ``pub`` (replay on ``replay``)."""

    def __init__(self, *extra: str, shards: int = 2, ram_gb: float = 0.0625) -> None:
        self.pub, self.replay = free_port(), free_port()
        args = ("--kv-events", f"tcp://127.0.0.1:{self.pub}", "--kv-events-replay", f"tcp://127.0.0.1:{self.replay}")
        self.server = ServerProcess(block_bytes=BLOCK_BYTES, shards=shards, ram_gb=ram_gb, args=(*args, *extra)).start()
        self.http = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        self.ctx = zmq.Context()
        self.decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        self.probes = 0

    def close(self) -> None:
        self.http.close()
        self.ctx.destroy(linger=0)
        self.server.stop()

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> int:
        self.http.request(method, path, body=body, headers=headers or {})
        answer = self.http.getresponse()
        answer.read()
        return answer.status

    def put(self, key: str, hashes: list[bytes], parent: bytes | None, block_size: int, tokens: list[int]) -> None:
        headers = {"x-kvtier-block-hashes": ",".join(h.hex() for h in hashes), "x-kvtier-block-size": str(block_size)}
        if parent is not None:
            headers["x-kvtier-parent-hash"] = parent.hex()
        if tokens:
            headers["x-kvtier-token-ids"] = ",".join(map(str, tokens))
        assert self.call("PUT", f"/v1/blocks/{key}", block(len(key)), headers) in (200, 201)

    def get(self, key: str) -> str:
        """GETs ``key``; returns the tier that served it (``x-kvtier-tier``)."""
        self.http.request("GET", f"/v1/blocks/{key}")
        answer = self.http.getresponse()
        answer.read()
        assert answer.status == 200, answer.status
        return answer.getheader("x-kvtier-tier") or ""

    def delete(self, key: str) -> None:
        assert self.call("DELETE", f"/v1/blocks/{key}") == 204

    def stats(self) -> dict:
        self.http.request("GET", "/v1/stats")
        return json.loads(self.http.getresponse().read())["kv_events"]

    def tier_names(self) -> list[str]:
        """The store's tiers, fastest first (``/v1/stats`` ``tiers``)."""
        self.http.request("GET", "/v1/stats")
        return [t["tier"] for t in json.loads(self.http.getresponse().read())["tiers"]]

    def subscribe(self) -> zmq.Socket:
        """A SUB socket that receives events: probe blocks are PUT until one
        shows up (the subscription reaches the PUB socket after the
        connection), and what came before is drained."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{self.pub}")
        deadline = time.monotonic() + WAIT_S
        while True:
            self.probes += 1
            probe = (0xFEED0000 + self.probes).to_bytes(8, "big")
            self.put(f"probe-{self.probes}", [probe], None, 1, [])
            if batches(sub, lambda evs, probe=probe: any(stored(e, probe) for e in evs), self.decoder, 0.3):
                return sub
            assert time.monotonic() < deadline, "no event reached a new subscriber"


def stored(event: object, first_hash: bytes) -> bool:
    return isinstance(event, kv_events.BlockStored) and event.block_hashes[0] == as_int(first_hash)


def batches(
    sub: zmq.Socket, done: Callable[[list], bool], decoder: msgspec.msgpack.Decoder, wait_s: float = WAIT_S
) -> list[Batch]:
    """(seq, batch) received on ``sub`` until ``done`` holds for all their
    events; [] when it does not within ``wait_s``."""
    got: list[Batch] = []
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if not sub.poll(int(left * 1000) + 1):
            break
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        if done([e for _, b in got for e in b.events]):
            return got
    return []


def replay(node: Node, start: int) -> list[Batch]:
    """Asks the replay socket for every batch from ``start`` (a DEALER
    sends the empty delimiter frame itself), up to the end marker."""
    dealer = node.ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{node.replay}")
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: list[Batch] = []
    while True:
        assert dealer.poll(int(WAIT_S * 1000)), f"no end marker after {len(got)} batches"
        frames = dealer.recv_multipart()
        assert len(frames) == 4 and frames[0] == b"", frames
        if frames[2] == END_SEQ:
            assert frames[1] == b"" and frames[3] == b"", frames
            dealer.close(linger=0)
            return got
        got.append((int.from_bytes(frames[2], "big"), node.decoder.decode(frames[3])))


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def test_batch_0_is_all_blocks_cleared(node: Node) -> None:
    got = replay(node, 0)
    seq, first = got[0]
    assert seq == 0
    assert first.events == [kv_events.AllBlocksCleared()]
    assert first.data_parallel_rank == 0
    assert abs(first.ts - time.time()) < 3600


def test_a_put_is_stored_in_ram_and_the_log_and_a_delete_removes_it(node: Node) -> None:
    sub = node.subscribe()
    hashes = [bytes([0xA1] * 31 + [i]) for i in (1, 2)]
    parent = bytes([0xB0] * 32)
    tokens = [1, 2, 300, 70000, 5, 6, 7, 4_000_000_000]
    node.put("tagged", hashes, parent, 4, tokens)
    got = batches(sub, lambda evs: {e.medium for e in evs if stored(e, hashes[0])} == {"CPU", "STORAGE"}, node.decoder)
    assert got, "no BlockStored for the tagged block in CPU and STORAGE"
    events = [e for _, b in got for e in b.events if stored(e, hashes[0])]
    for e in events:
        assert e.block_hashes == [as_int(h) for h in hashes]
        assert e.parent_block_hash == as_int(parent)
        assert (e.token_ids, e.block_size, e.lora_id, e.lora_name) == (tokens, 4, None, None)
        assert e.ownership == "kvtier"
    assert [b.data_parallel_rank for _, b in got] == [0] * len(got)

    node.delete("tagged")
    ids = [as_int(h) for h in hashes]
    removed = batches(
        sub,
        lambda evs: (
            {e.medium for e in evs if isinstance(e, kv_events.BlockRemoved) and e.block_hashes == ids}
            == {"CPU", "STORAGE"}
        ),
        node.decoder,
    )
    assert removed, "no BlockRemoved from CPU and STORAGE after the DELETE"
    sub.close(linger=0)


def test_replay_after_a_gap_returns_the_missed_batches_then_the_end_marker(node: Node) -> None:
    sub = node.subscribe()
    first = bytes([0xC1] * 8)
    node.put("before-gap", [first], None, 2, [10, 11])
    seen = batches(sub, lambda evs: any(stored(e, first) for e in evs), node.decoder)
    last_seen = max(seq for seq, _ in seen)
    sub.close(linger=0)

    missed = [bytes([0xC2] * 8), bytes([0xC3] * 8)]
    published = node.stats()["events_published"]
    for i, h in enumerate(missed):
        node.put(f"in-gap-{i}", [h], None, 2, [20 + i, 21 + i])
    deadline = time.monotonic() + WAIT_S
    while node.stats()["events_published"] < published + 2 * len(missed):
        assert time.monotonic() < deadline, node.stats()
        time.sleep(0.02)

    got = replay(node, last_seen + 1)
    seqs = [seq for seq, _ in got]
    # Nothing was dropped, so the batches after the last one seen are all there.
    assert seqs == list(range(last_seen + 1, node.stats()["last_seq"] + 1))
    events = [e for _, b in got for e in b.events]
    for h in missed:
        assert {e.medium for e in events if stored(e, h)} == {"CPU", "STORAGE"}, h.hex()
    assert not any(stored(e, first) for e in events), "the batch already seen is not replayed"
    assert node.stats()["replay_requests"] >= 1


def test_a_subscriber_that_stops_reading_does_not_slow_the_server(node: Node) -> None:
    stalled = node.ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(f"tcp://127.0.0.1:{node.pub}")
    # A reader subscribed after it proves the stalled one's subscription has arrived too.
    node.subscribe().close(linger=0)

    # 200 blocks of 40 engine blocks of 16 tokens: ~3.6 KB per BlockStored,
    # two per PUT, ~1.4 MB the stalled subscriber never reads.
    hashes = [i.to_bytes(8, "big") for i in range(1, 41)]
    started = time.monotonic()
    for i in range(200):
        tokens = [4_000_000_000 + i * 640 + j for j in range(640)]
        node.put(f"stall-{i}", [bytes([0xD0, i]) + h[2:] for h in hashes], None, 16, tokens)
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"200 PUTs took {elapsed:.1f} s with a subscriber not reading"

    # The stalled connection really holds unsent bytes on the server's side.
    assert max(send_queue_bytes(node.pub)) > 64 << 10, send_queue_bytes(node.pub)
    # Others still get events at once, and nothing was dropped.
    reader = node.subscribe()
    reader.close(linger=0)
    stats = node.stats()
    assert stats["events_dropped"] == 0 and stats["batches_unsent"] == 0, stats
    stalled.close(linger=0)


def send_queue_bytes(port: int) -> list[int]:
    """Bytes waiting in the kernel's send queue of each IPv4 TCP connection
    whose local port is ``port`` (/proc/net/tcp's tx_queue)."""
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
                out.append(int(fields[4].split(":")[0], 16))
    return out or [0]


def test_bytes_hashes_and_no_ownership_for_dynamo() -> None:
    node = Node("--kv-events-hash", "bytes", "--kv-events-ownership", "")
    try:
        sub = node.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{node.pub}")
        h = bytes(range(32))
        deadline = time.monotonic() + WAIT_S
        got: list[Batch] = []
        # Re-PUT under new keys until the subscription has arrived.
        while not got:
            assert time.monotonic() < deadline, "no event reached the subscriber"
            node.probes += 1
            node.put(f"b-{node.probes}", [h], None, 16, [])
            got = batches(sub, lambda evs: any(isinstance(e, kv_events.BlockStored) for e in evs), node.decoder, 0.3)
        e = next(e for _, b in got for e in b.events if isinstance(e, kv_events.BlockStored))
        assert e.block_hashes == [h]
        assert e.ownership is None
        sub.close(linger=0)
    finally:
        node.close()


def test_dynamo_replays_what_it_missed_from_the_replay_socket(router_python: str) -> None:
    """A real router's replay client on kvtier's ROUTER socket: Dynamo's
    indexer, registered after a block was published, sees the sequence
    start past 0, asks for batches 0 on, and indexes the block it missed."""
    node = Node("--kv-events-ownership", "")
    port = free_port()
    indexer = subprocess.Popen(
        [router_python, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def call(path: str, body: object = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read() or b"null")

    def matched(tokens: list[int]) -> dict:
        return call("/query", {"token_ids": tokens, "model_name": "default"}).get("instances", {}).get("1", {})

    try:
        missed = list(range(5000, 5016))
        node.put("missed", [bytes([0xE1] * 32)], None, 16, missed)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                call("/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and indexer.poll() is None, "dynamo.indexer did not come up"
                time.sleep(0.1)
        endpoints = {"endpoint": f"tcp://127.0.0.1:{node.pub}", "replay_endpoint": f"tcp://127.0.0.1:{node.replay}"}
        call("/register", {"instance_id": 1, "block_size": 16, "model_name": "default", **endpoints})
        # Later blocks until one reaches it live: its sequence number then
        # shows Dynamo the gap, which it fills from the replay socket.
        for i in range(int(WAIT_S * 5)):
            node.put(f"live-{i}", [bytes([0xE2, i] + [0] * 30)], None, 16, list(range(7000 + 16 * i, 7016 + 16 * i)))
            time.sleep(0.2)
            if matched(missed).get("disk") == 16:
                break
        # Published before the indexer existed: only the replay could bring it.
        m = matched(missed)
        assert (m.get("gpu"), m.get("cpu"), m.get("disk")) == (0, 16, 16), m
        assert node.stats()["replay_requests"] >= 1
    finally:
        indexer.terminate()
        indexer.wait(10)
        node.close()


#: The fake CUDA driver (server/tests/fake-cuda/fake_cuda.c) that
#: ``make fake-cuda`` (and the Rust GPU tests) build.
FAKE_CUDA = Path(__file__).resolve().parents[3] / "target" / "fake-cuda"


def test_the_gpu_tier_publishes_arrivals_demotions_and_promotions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU tier (on the fake CUDA driver, as in CI) in vLLM's medium
    ``GPU``: a PUT lands on the GPU and in the log; two newer blocks push it
    down to RAM (removed from ``GPU``, stored in ``CPU``), two more out of
    RAM (the log keeps it); a read from the log promotes it to the GPU."""
    if not (FAKE_CUDA / "libcuda.so.1").exists():
        pytest.fail(f"the fake CUDA driver is not built: {FAKE_CUDA}/libcuda.so.1 is missing (run `make fake-cuda`)")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(FAKE_CUDA))
    two_blocks_gb = str(2 * BLOCK_BYTES / (1 << 30))
    node = Node("--gpu-mem-gb", two_blocks_gb, shards=1, ram_gb=2 * BLOCK_BYTES / (1 << 30))
    try:
        assert node.tier_names() == ["gpu", "ram", "nvme"], node.tier_names()
        sub = node.subscribe()
        a = bytes([0x6A] * 8)
        ida = as_int(a)

        def media(kind: type, evs: list) -> set[str]:
            return {e.medium for e in evs if isinstance(e, kind) and e.block_hashes == [ida]}

        def expect(what: str, done: Callable[[list], bool]) -> None:
            assert batches(sub, done, node.decoder), f"no events for: {what}"

        node.put("gpu-a", [a], None, 16, [])
        expect("A on the GPU and in the log", lambda evs: media(kv_events.BlockStored, evs) == {"GPU", "STORAGE"})
        for i in range(2):
            node.put(f"gpu-b{i}", [bytes([0x6B, i] * 4)], None, 16, [])
        expect(
            "A demoted from the GPU to RAM",
            lambda evs: media(kv_events.BlockRemoved, evs) == {"GPU"} and media(kv_events.BlockStored, evs) == {"CPU"},
        )
        for i in range(2):
            node.put(f"gpu-c{i}", [bytes([0x6C, i] * 4)], None, 16, [])
        expect("A out of RAM, kept by the log", lambda evs: media(kv_events.BlockRemoved, evs) == {"CPU"})
        assert node.get("gpu-a") == "nvme"
        expect("A promoted to the GPU", lambda evs: media(kv_events.BlockStored, evs) == {"GPU"})
        sub.close(linger=0)
    finally:
        node.close()
