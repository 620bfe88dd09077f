"""kvtier's KV events fed to a real KV-aware router's index: NVIDIA Dynamo's
KV indexer (ai-dynamo-runtime 1.6.1, ``python -m dynamo.indexer``, from
target/py-router) follows a real ``kvtier serve``'s event stream over ZMQ,
and its longest-prefix match for a prompt names the tiers kvtier holds that
prompt's blocks in: the RAM tier and the log after the PUTs, the log alone
once newer blocks pushed them out of RAM, nothing after a DELETE.

Dynamo reads ``medium`` ``CPU`` as its host tier and ``STORAGE`` as its disk
tier; its ``instances`` answer counts, per worker, the longest prefix in the
GPU tier, then in GPU + host, then in GPU + host + disk (in tokens). Dynamo
1.6.1 drops events whose ``ownership`` is set, so kvtier runs with
``--kv-events-ownership ""`` here (docs/OPERATIONS.md, "KV events for
routers").
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import block

import kvtier
from kvtier.testing import ServerProcess, free_port

BLOCK_BYTES = 65536
#: Tokens per engine block, as the indexer is told (`--block-size`).
BLOCK_TOKENS = 16
#: RAM-tier blocks of the one shard.
RAM_BLOCKS = 8


def chain(tokens: list[int]) -> list[bytes]:
    """vLLM-style chained block hashes (sha256 of the parent and the
    block's tokens), one per full block of `tokens`."""
    out: list[bytes] = []
    parent = b"\0" * 32
    for i in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
        parent = hashlib.sha256(parent + json.dumps(tokens[i : i + BLOCK_TOKENS]).encode()).digest()
        out.append(parent)
    return out


class Indexer:
    """`python -m dynamo.indexer` following one kvtier node as worker 1."""

    def __init__(self, python: str, events: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                python,
                "-m",
                "dynamo.indexer",
                "--port",
                str(self.port),
                "--block-size",
                str(BLOCK_TOKENS),
                *self.rest(events),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.http("/health")
                return
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"dynamo.indexer did not come up: {self.output()}") from None
                time.sleep(0.1)

    @staticmethod
    def rest(events: str) -> list[str]:
        """One indexer thread; worker 1 is the node publishing at `events`."""
        return ["--threads", "1", "--workers", f"1={events}"]

    def http(self, path: str, body: object = None) -> dict:
        """GET `path`, or POST `body` as JSON to it; the JSON answer."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read() or b"null")

    def tiers(self, tokens: list[int]) -> dict[str, int]:
        """Worker 1's longest prefix of `tokens` per Dynamo tier (GPU, GPU +
        host, GPU + host + disk), in tokens; zeros when it knows none."""
        answer = self.http("/query", {"token_ids": tokens, "model_name": "default"})
        mine = answer.get("instances", {}).get("1", {})
        return {t: int(mine.get(t, 0)) for t in ("gpu", "cpu", "disk")}

    def output(self) -> str:
        """What the indexer printed (once it exited)."""
        if self.proc.stdout is None or self.proc.poll() is None:
            return ""
        return self.proc.stdout.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        """Stops the indexer."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def node() -> Iterator[tuple[ServerProcess, str]]:
    """One kvtier node with a small RAM tier publishing KV events."""
    events = f"tcp://127.0.0.1:{free_port()}"
    args = ("--kv-events", events, "--kv-events-ownership", "")
    with ServerProcess(block_bytes=BLOCK_BYTES, shards=1, ram_gb=RAM_BLOCKS * BLOCK_BYTES / 2**30, args=args) as s:
        yield s, events


def until(check, what: str, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    """Polls `check()` until it returns something truthy (the events reach
    the indexer asynchronously); fails naming `what` and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            assert got, f"{what}: still {got!r} after {timeout_s} s"
            return got
        time.sleep(0.1)


def test_dynamos_indexer_names_the_tiers_kvtier_holds_a_prompts_blocks_in(
    router_python: str, node: tuple[ServerProcess, str]
) -> None:
    server, events = node
    indexer = Indexer(router_python, events)
    try:
        # ZMQ's SUB joins a moment after it connects: wait until a probe
        # block's events arrive before the prompt's.
        prompt = list(range(1000, 1000 + 3 * BLOCK_TOKENS))
        hashes = chain(prompt)
        with kvtier.Client(server.url, timeout_s=10) as c:
            probe = list(range(5000, 5000 + BLOCK_TOKENS))
            probe_tag = kvtier.BlockTag(
                block_hashes=chain(probe), parent_hash=None, block_size=BLOCK_TOKENS, token_ids=probe
            )

            def probe_seen() -> bool:
                c.put("probe", block(99), tag=probe_tag)
                time.sleep(0.2)
                return indexer.tiers(probe)["disk"] == BLOCK_TOKENS

            until(probe_seen, "the indexer never saw the probe block", timeout_s=20)
            c.delete("probe")

            for i, h in enumerate(hashes):
                tag = kvtier.BlockTag(
                    block_hashes=[h],
                    parent_hash=hashes[i - 1] if i else None,
                    block_size=BLOCK_TOKENS,
                    token_ids=prompt[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS],
                )
                c.put(f"prompt-{i}", block(i), tag=tag)
            # In RAM and in the log: the whole prompt in Dynamo's host and
            # disk tiers, none in its GPU tier.
            full = len(prompt)
            until(lambda: indexer.tiers(prompt) == {"gpu": 0, "cpu": full, "disk": full}, "prompt in RAM and log")
            assert c.lookup_tiers([f"prompt-{i}" for i in range(3)]) == ["ram"] * 3

            # Newer blocks push the prompt out of RAM; the log keeps it.
            for j in range(RAM_BLOCKS + 2):
                c.put(f"filler-{j}", block(100 + j))
            until(lambda: indexer.tiers(prompt) == {"gpu": 0, "cpu": 0, "disk": full}, "prompt in the log only")
            assert c.lookup_tiers([f"prompt-{i}" for i in range(3)]) == ["nvme"] * 3

            # A GET promotes the first block back into RAM: one block's
            # prefix in the host tier again.
            c.get("prompt-0")
            until(
                lambda: indexer.tiers(prompt) == {"gpu": 0, "cpu": BLOCK_TOKENS, "disk": full},
                "first block promoted to RAM",
            )

            # Deleting the middle block cuts the prefix at it in every tier.
            c.delete("prompt-1")
            until(
                lambda: indexer.tiers(prompt) == {"gpu": 0, "cpu": BLOCK_TOKENS, "disk": BLOCK_TOKENS},
                "prefix cut at the deleted block",
            )
    finally:
        indexer.close()
