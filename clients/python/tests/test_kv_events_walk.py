"""One block's whole life as KV events (docs/OPERATIONS.md, "KV events for
routers"), decoded with vLLM 0.32.0's own classes: on node A, PUT (RAM, log,
S3 written through), pushed out of RAM by a newer block, ``kill -9`` and
restart (a new stream: ``AllBlocksCleared``, then the block as found in the
log); on node B, sharing A's bucket, a GET installing it from S3 (shared
tier, RAM, log), then a DELETE removing it from each. Real ``kvtier serve``
processes, a real S3-compatible server (moto, target/py-s3).
"""

from __future__ import annotations

import time
import types

import zmq
from conftest import BLOCK_BYTES, MOTO_BUCKET, block
from test_kv_events import as_int, batches, kv_events, msgspec, replay

import kvtier
from kvtier.testing import ServerProcess, free_port

TAG = kvtier.BlockTag(block_hashes=[bytes(range(32))], parent_hash=None, block_size=4, token_ids=[1, 2, 3, 4])


def node(endpoint: str) -> tuple[ServerProcess, int, int]:
    """A one-shard node with a 2-block RAM tier, S3 written through, events
    and their replay on ports of their own (without ownership, as Dynamo
    needs)."""
    pub, again = free_port(), free_port()
    args = ("--s3-url", f"s3://{MOTO_BUCKET}/walk", "--s3-endpoint", endpoint, "--s3-write-policy", "through")
    args += ("--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-replay", f"tcp://127.0.0.1:{again}")
    args += ("--kv-events-ownership", "")
    ram_gb = 2 * BLOCK_BYTES / 2**30
    return ServerProcess(block_bytes=BLOCK_BYTES, shards=1, ram_gb=ram_gb, args=args), pub, again


def subscribe(ctx: zmq.Context, pub: int) -> zmq.Socket:
    """A SUB socket on `pub`, given time to join (ZMQ's slow joiner)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    time.sleep(0.5)
    return sub


def moves(sub: zmq.Socket, want: int) -> list[str]:
    """The next `want` events of the walked block, as ``+MEDIUM`` (stored)
    and ``-MEDIUM`` (removed), in the order published."""
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    ours = as_int(TAG.block_hashes[0])

    def mine(events: list) -> list[str]:
        out = []
        for e in events:
            if isinstance(e, kv_events.BlockStored | kv_events.BlockRemoved) and e.block_hashes == [ours]:
                out.append(("+" if isinstance(e, kv_events.BlockStored) else "-") + str(e.medium))
            if isinstance(e, kv_events.BlockStored) and e.block_hashes == [ours]:
                assert (e.token_ids, e.block_size, e.parent_block_hash) == ([1, 2, 3, 4], 4, None)
        return out

    got = batches(sub, lambda evs: len(mine(evs)) >= want, decoder)
    events = [e for _, b in got for e in b.events]
    assert got, "the expected events did not arrive"
    return mine(events)


def test_a_blocks_life_across_tiers_a_restart_and_a_second_node(moto: str) -> None:
    ctx = zmq.Context()
    a, pub_a, replay_a = node(moto)
    try:
        a.start()
        sub = subscribe(ctx, pub_a)
        with kvtier.Client(a.url, timeout_s=10) as c:
            c.put("walk", block(1), tag=TAG)
            assert moves(sub, 3) == ["+CPU", "+STORAGE", "+EXTERNAL"]
            # Two newer blocks push it out of the 2-block RAM tier.
            c.put("newer-1", block(2))
            c.put("newer-2", block(3))
            assert moves(sub, 1) == ["-CPU"]
            assert c.lookup_tiers(["walk"]) == ["nvme"]
        # kill -9, restart: a new stream; the block is found in the log (its
        # S3 copy is not known to the restarted node, so not claimed).
        a.kill()
        time.sleep(1.2)
        a.start()
        # What the restarted node published before anyone listened, from its
        # replay ring: batch 0 clears what the old stream said; the block is
        # published as found in the log, nothing else of it.
        decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
        ours = as_int(TAG.block_hashes[0])
        deadline = time.monotonic() + 10
        while True:
            got = replay(types.SimpleNamespace(ctx=ctx, replay=replay_a, decoder=decoder), 0)
            events = [e for _, b in got for e in b.events]
            if any(isinstance(e, kv_events.BlockStored) for e in events) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [s for s, _ in got] == list(range(len(got))) and isinstance(events[0], kv_events.AllBlocksCleared), got
        walk = [(type(e).__name__, e.medium) for e in events[1:] if getattr(e, "block_hashes", None) == [ours]]
        assert walk == [("BlockStored", "STORAGE")], events
        b, pub_b, _ = node(moto)
        try:
            b.start()
            sub_b = subscribe(ctx, pub_b)
            with kvtier.Client(b.url, timeout_s=10) as c:
                assert c.get("walk") == block(1)
                # Installed from the shared tier: known there, then in RAM
                # and the log, fastest first within one interval.
                assert sorted(moves(sub_b, 3)) == sorted(["+EXTERNAL", "+CPU", "+STORAGE"])
                assert c.delete("walk")
                assert sorted(moves(sub_b, 3)) == sorted(["-CPU", "-STORAGE", "-EXTERNAL"])
        finally:
            b.stop()
    finally:
        a.stop()
        ctx.destroy(linger=0)
