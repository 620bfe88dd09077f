"""kvtier.AsyncClient against a real `kvtier serve` on loopback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import BLOCK_BYTES, block

import kvtier
from kvtier.testing import ServerProcess, free_port


def run(coro):
    return asyncio.run(coro)


def test_every_method_as_a_coroutine(server):
    async def go():
        async with kvtier.AsyncClient(server.url, connections=4) as c:
            assert c.block_bytes == BLOCK_BYTES
            assert await c.get_block_bytes() == BLOCK_BYTES
            assert await c.put("a-1", block(1)) is True
            assert await c.put("a-1", block(1)) is False
            assert await c.get("a-1") == block(1)
            arr = np.empty(BLOCK_BYTES, dtype=np.uint8)
            assert await c.get_into("a-1", arr) and arr.tobytes() == block(1)
            assert await c.get_into("a-1", memoryview(bytearray(BLOCK_BYTES)))
            assert await c.exists("a-1")
            chain = ["a-1", "a-2"]
            assert await c.lookup(chain) == 1
            assert await c.lookup_tiers(chain) in (["ram"], ["nvme"])
            assert await c.prefetch(chain) == 1
            assert (await c.stats())["geometry"]["block_bytes"] == BLOCK_BYTES
            assert await c.ping()
            assert await c.delete("a-1") is True
            assert await c.get("a-1") is None
            assert await c.get_into("a-1", arr) is False
            assert not await c.exists("a-1")

    run(go())


def test_batched_forms_run_concurrently(server):
    async def go():
        async with kvtier.AsyncClient(server.url, connections=4) as c:
            keys = [f"ab-{i}" for i in range(16)]
            assert await c.put_many([(k, block(i)) for i, k in enumerate(keys)]) == [True] * 16
            got = await c.get_many([*keys, "ab-absent"])
            assert got == [*(block(i) for i in range(16)), None]
            bufs = [bytearray(BLOCK_BYTES) for _ in keys]
            assert await c.get_many_into(keys, bufs) == [True] * 16
            assert all(bufs[i] == block(i) for i in range(16))
            # Other coroutines run while transfers are in flight.
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            await c.get_many(keys * 4)
            t.cancel()
            assert ticks > 0
            with pytest.raises(ValueError, match="buffers"):
                await c.get_many_into(keys, bufs[:3])
            assert await c.put_many([]) == []

    run(go())


def test_errors_are_the_blocking_client_errors(server):
    async def go():
        async with kvtier.AsyncClient(server.url) as c:
            with pytest.raises(kvtier.InvalidKeyError):
                await c.get("no/slash")
            with pytest.raises(kvtier.BlockSizeError):
                await c.put("k", b"short")
            with pytest.raises(kvtier.BlockSizeError):
                await c.get_many_into(["ab-0"], [bytearray(10)])
            with pytest.raises(kvtier.BlockSizeError):
                await c.put_many([("ok", block(0)), ("bad", b"x")])
        dead = kvtier.AsyncClient(f"http://127.0.0.1:{free_port()}", retries=0)
        with pytest.raises(kvtier.KvtierConnectionError):
            await dead.get("k")
        assert await dead.ping() is False
        await dead.close()

    run(go())


def test_a_server_killed_mid_batch():
    with ServerProcess(block_bytes=BLOCK_BYTES) as s:

        async def go():
            c = kvtier.AsyncClient(s.url, connections=4, retries=1, timeout_s=5)
            await c.put_many([(f"ak-{i}", block(i)) for i in range(4)])
            batch = asyncio.ensure_future(c.get_many([f"ak-{i % 4}" for i in range(50_000)]))
            await asyncio.sleep(0.3)
            s.kill()
            with pytest.raises(kvtier.KvtierConnectionError):
                await asyncio.wait_for(batch, 60)
            await c.close()

        run(go())


def test_leases_as_coroutines(tmp_path):
    """``await client.lease(keys)`` and ``async with``: the views read the
    blocks in place, and leaving the block releases them."""
    from kvtier.testing import ServerProcess

    with ServerProcess(block_bytes=BLOCK_BYTES, ram_gb=0.01, args=("--ram-shared", "on")) as s:

        async def go() -> None:
            async with kvtier.AsyncClient(s.unix_url) as c:
                await c.put_many([("al-0", block(1)), ("al-1", block(2))])
                async with await c.lease(["al-0", "al-1", "al-none"]) as leases:
                    assert bytes(leases.views[0]) == block(1) and bytes(leases.views[1]) == block(2)
                    assert leases.views[2] is None and leases.valid(0)
                stats = await c.stats()
                deadline = asyncio.get_running_loop().time() + 10
                while stats["local"]["leases"]["open"] and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.05)
                    stats = await c.stats()
                assert stats["local"]["leases"]["open"] == 0, stats["local"]["leases"]

        run(go())
