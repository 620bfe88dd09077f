"""Cancel means cancel (docs/LOCAL.md, "When a client gives up"), against a
real `kvtier serve` held still with SIGSTOP: a client that gave up on an
answer (its timeout) finds its memory its own again. The server, let go,
copies nothing into it (GET_INTO, GET_INTO_V) and stores nothing it reads
from it since (PUT_FROM, PUT_FROM_V); the client sends nothing again into
the same memory, and retires a staging area the server may still have
been copying into. Over HTTP the calls end before they return, the
asyncio client's cancelled ones included."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import block, wait_for

import kvtier
from kvtier import codes
from kvtier.testing import ServerProcess

#: Blocks of 1 MiB, 8 to a batch: the measurement of issue 53.
BB = 1 << 20
N = 8
#: The client's timeout, short: the server is frozen past it.
TIMEOUT_S = 1.0


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    """A server of its own per test (each one freezes it)."""
    with ServerProcess(block_bytes=BB, ram_gb=0.125, disk_gb=0.25) as s:
        yield s


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes that differ from every stored block (and from ``block``)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def local_stats(server: ServerProcess) -> dict:
    with kvtier.Client(server.url, local="off") as c:
        return c.stats()["local"]


def connections_open(server: ServerProcess) -> int:
    return sum(s["connections_open"] for s in local_stats(server)["per_shard"])


def changed(now: np.ndarray, want: np.ndarray) -> str:
    diff = np.flatnonzero(now != want)
    where = f", first at byte {diff[0]}, last at byte {diff[-1]}" if diff.size else ""
    return f"{diff.size} of {want.size} bytes changed after the call returned{where}"


def settle(server: ServerProcess) -> None:
    """After SIGCONT: time for whatever the server would still do."""
    time.sleep(2.0)
    assert state(server.pid) != "T"


def store(client: kvtier.Client, keys: list[str], seed: int) -> list[bytes]:
    blocks = [block(seed + i, BB) for i in range(len(keys))]
    client.put_many(zip(keys, blocks, strict=True))
    return blocks


def assert_cancelled_and_closed(server: ServerProcess, before: int) -> None:
    """The server counted the batch's items cancelled and closed the
    connection given up on (the client has no other one open)."""
    assert wait_for(lambda: local_stats(server).get("items_cancelled_total", 0) >= before + N, 10.0), local_stats(
        server
    )
    assert wait_for(lambda: connections_open(server) == 0, 10.0), local_stats(server)


def spans_of(buf: kvtier.SharedBuffer) -> tuple[list[list[int]], list[list[int]]]:
    """Each block's two halves, far apart: block i's first half in the
    buffer's first half, its second half in the second."""
    half = BB // 2
    ptrs = [[buf.ptr + i * half, buf.ptr + N * half + (N - 1 - i) * half] for i in range(N)]
    return ptrs, [[half, half] for _ in range(N)]


@pytest.mark.parametrize("vectored", [False, True], ids=["get_into", "get_into_multi_buffers"])
def test_a_get_given_up_on_writes_nothing_into_the_buffer_afterwards(server, vectored):
    keys = [f"cancel-get-{vectored:d}-{i}" for i in range(N)]
    with kvtier.Client(server.unix_url, timeout_s=TIMEOUT_S) as c, kvtier.SharedBuffer(N * BB) as buf:
        assert c.register_buffer(buf) == 0
        blocks = store(c, keys, 100)
        view = np.frombuffer(buf, dtype=np.uint8)
        view[:] = 0
        before = local_stats(server).get("items_cancelled_total", 0)
        ptrs, sizes = spans_of(buf)

        def get() -> list[int]:
            if vectored:
                return c.batch_get_into_multi_buffers(keys, ptrs, sizes)
            return c.batch_get_into(keys, [buf.ptr + i * BB for i in range(N)], [BB] * N)

        with server.paused():
            t0 = time.monotonic()
            assert get() == [codes.CONNECTION_LOST] * N
            assert time.monotonic() - t0 < TIMEOUT_S + 1.5, "not sent again on a new connection"
            mine = pattern(1, N * BB)
            view[:] = mine  # the client's memory again: its own bytes
        settle(server)
        assert np.array_equal(view, mine), changed(view, mine)
        assert_cancelled_and_closed(server, before)
        # Healthy: the same batch now reads every block.
        assert get() == [BB] * N
        got = [bytes(view[i * BB : (i + 1) * BB]) for i in range(N)]
        if vectored:
            half = BB // 2
            got = [
                bytes(view[i * half : (i + 1) * half]) + bytes(view[(2 * N - 1 - i) * half :][:half]) for i in range(N)
            ]
        assert got == blocks


@pytest.mark.parametrize("vectored", [False, True], ids=["put_from", "put_from_multi_buffers"])
def test_a_put_given_up_on_stores_nothing_written_afterwards(server, vectored):
    keys = [f"cancel-put-{vectored:d}-{i}" for i in range(N)]
    with kvtier.Client(server.unix_url, timeout_s=TIMEOUT_S) as c, kvtier.SharedBuffer(N * BB) as buf:
        assert c.register_buffer(buf) == 0
        view = np.frombuffer(buf, dtype=np.uint8)
        original = pattern(2, N * BB)
        view[:] = original
        before = local_stats(server).get("items_cancelled_total", 0)
        ptrs, sizes = spans_of(buf)
        half = BB // 2

        def block_at(v: np.ndarray, i: int) -> bytes:
            if vectored:
                return bytes(v[i * half : (i + 1) * half]) + bytes(v[(2 * N - 1 - i) * half :][:half])
            return bytes(v[i * BB : (i + 1) * BB])

        with server.paused():
            if vectored:
                answered = c.batch_put_from_multi_buffers(keys, ptrs, sizes)
            else:
                answered = c.batch_put_from(keys, [buf.ptr + i * BB for i in range(N)], [BB] * N)
            assert answered == [codes.CONNECTION_LOST] * N
            view[:] = pattern(3, N * BB)  # the client writes its memory again
        settle(server)
        rewritten = view.copy()
        with kvtier.Client(server.url, local="off") as http:  # opens no socket connection
            for i, key in enumerate(keys):
                stored = http.get(key)
                if stored is not None:
                    assert stored != block_at(rewritten, i), f"{key}: the server stored bytes written after the timeout"
                    assert stored == block_at(original, i), f"{key}: neither the original bytes nor absent (a mix)"
        assert_cancelled_and_closed(server, before)
        assert all(c.get(key) is None for key in keys), "a cancelled put stores nothing"
        assert c.batch_put_from(keys, [buf.ptr + i * BB for i in range(N)], [BB] * N) == [0] * N
        assert [c.get(key) for key in keys] == [bytes(rewritten[i * BB : (i + 1) * BB]) for i in range(N)]


def test_a_staging_area_the_server_may_still_copy_into_is_retired(server):
    """Memory outside every registered buffer goes through the client's
    staging area (``lease_reads=False``: the server's RAM tier is shared by
    default, and reads would take a lease copy): after a timeout the server
    did not confirm (frozen), the client leaves that area to the server and
    takes a new one."""
    keys = [f"cancel-staged-{i}" for i in range(N)]
    with kvtier.Client(server.unix_url, timeout_s=TIMEOUT_S, staging_blocks=N, lease_reads=False) as c:
        blocks = store(c, keys, 200)
        outs = [bytearray(BB) for _ in range(N)]
        assert c.batch_get_into(keys, outs) == [BB] * N  # through the staging area
        session = c._link.unix.session
        old = session._staging
        with server.paused():
            assert c.batch_get_into(keys, outs) == [codes.CONNECTION_LOST] * N
            assert session._staging is None and c.local_stats()["staging_retired"] == 1
            staged = np.frombuffer(old.buf, dtype=np.uint8)
            mine = pattern(4, staged.size)
            staged[:] = mine
        settle(server)
        assert np.array_equal(staged, mine), changed(staged, mine)
        assert c.batch_get_into(keys, outs) == [BB] * N and [bytes(o) for o in outs] == blocks
        assert session._staging is not old


def test_over_http_a_get_that_timed_out_has_ended_when_the_call_returns(server):
    keys = [f"cancel-http-{i}" for i in range(N)]
    with kvtier.Client(server.url, local="off", timeout_s=TIMEOUT_S, connections=N) as c:
        blocks = store(c, keys, 300)
        buf = np.zeros(N * BB, dtype=np.uint8)
        assert c.register_buffer(buf) == 0
        with server.paused():
            assert c.batch_get_into(keys, [buf[i * BB :] for i in range(N)], [BB] * N) == [codes.CONNECTION_LOST] * N
            mine = pattern(5, buf.size)
            buf[:] = mine
        settle(server)
        assert np.array_equal(buf, mine), changed(buf, mine)
        assert c.batch_get_into(keys, [buf[i * BB :] for i in range(N)], [BB] * N) == [BB] * N
        assert [bytes(buf[i * BB : (i + 1) * BB]) for i in range(N)] == blocks


def test_a_cancelled_asyncio_get_has_ended_when_the_coroutine_has(server):
    """``asyncio.wait_for`` gives up on ``get_many_into`` long before the
    client's own timeout: the coroutine ends only once the threads reading
    into the buffers have (their timeout, the server being frozen)."""
    keys = [f"cancel-aio-{i}" for i in range(N)]
    with kvtier.Client(server.url, local="off", timeout_s=TIMEOUT_S, connections=N) as sync:
        store(sync, keys, 400)
        bufs = [bytearray(BB) for _ in range(N)]
        aclient = kvtier.AsyncClient.over(sync)

        async def give_up() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(aclient.get_many_into(keys, bufs), 0.2)

        with server.paused():
            asyncio.run(give_up())
            mine = [pattern(6 + i, BB).tobytes() for i in range(N)]
            for b, m in zip(bufs, mine):
                b[:] = m
        settle(server)
        changed_bytes = sum(
            int(np.count_nonzero(np.frombuffer(b, np.uint8) != np.frombuffer(m, np.uint8))) for b, m in zip(bufs, mine)
        )
        assert changed_bytes == 0, f"{changed_bytes} of {N * BB} bytes changed after the coroutine ended"


def test_a_connection_given_up_on_is_settled_only_when_the_server_closes_it(server):
    """A server held still past the client's timeout may be in a copy; run
    again, it finishes that piece (up to 256 KiB) before it closes the
    connection. The client keeps the connection's reading side open, so
    ``local_settled`` turns true at that close, not before."""
    keys = [f"cancel-settled-{i}" for i in range(N)]
    with kvtier.Client(server.unix_url, timeout_s=TIMEOUT_S) as c, kvtier.SharedBuffer(N * BB) as buf:
        assert c.register_buffer(buf) == 0
        store(c, keys, 300)
        assert c.local_settled()
        with server.paused():
            assert c.batch_get_into(keys, [buf.ptr + i * BB for i in range(N)], [BB] * N) == [codes.CONNECTION_LOST] * N
            assert not c.local_settled(wait_s=0.5), "settled while the server, held still, had not closed"
            assert c.local_stats()["closes_unconfirmed"] == 1
        assert c.local_settled(wait_s=10), "the server's close after it ran again was not seen"
        assert connections_open(server) <= 1  # the given-up one closed; a probe may have opened another
    with kvtier.Client(server.url, local="off") as http:
        assert http.local_settled(), "over HTTP nothing is copied after a call returns"


def test_a_server_held_still_mid_copy_lands_at_most_the_piece_it_was_in():
    """A server held still (SIGSTOP) inside a batch of copies into the
    client's memory, run again once the client gave up: each copy under way
    lands at most the 256 KiB piece it was in (one per shard), never the
    rest of its block, and nothing once ``local_settled``. Each try stops
    the server at a random moment of the batch; two tries that find copies
    under way decide. Before each piece asked the socket, each copy went on
    to its block's end (up to 28 MB of a batch of 16 MiB blocks)."""
    bb, n, shards, piece = 16 << 20, 4, 2, 256 << 10
    keys = [f"cancel-piece-{i}" for i in range(n)]
    rng = np.random.default_rng(7)
    with (
        ServerProcess(block_bytes=bb, ram_gb=0.25, disk_gb=0.5, shards=shards) as s,
        kvtier.Client(s.unix_url, timeout_s=TIMEOUT_S, lease_reads=False) as c,
        kvtier.SharedBuffer(n * bb) as buf,
    ):
        assert c.register_buffer(buf) == 0
        c.put_many([(k, bytes([i + 1]) * bb) for i, k in enumerate(keys)])
        view = np.frombuffer(buf, dtype=np.uint8)
        ptrs = [buf.ptr + i * bb for i in range(n)]
        seen: list[int] = []
        for _ in range(10):
            assert c.batch_get_into(keys[:1], ptrs[:1], [bb]) == [bb]  # a live connection: the batch is sent at once
            results: list[list[int]] = []
            batch = threading.Thread(target=lambda out=results: out.append(c.batch_get_into(keys, ptrs, [bb] * n)))
            batch.start()
            time.sleep(float(rng.uniform(0.0, 0.015)))
            s.pause()
            batch.join()
            view[:] = 0xEE  # the client's memory again
            held = not c.local_settled()
            s.resume()
            assert c.local_settled(wait_s=10), "the server's close after it ran again was not seen"
            late = int(np.count_nonzero(view != 0xEE))
            time.sleep(0.2)
            assert int(np.count_nonzero(view != 0xEE)) == late, "bytes landed after local_settled"
            assert late <= shards * piece, f"{late} bytes landed after the client gave up: more than a piece a shard"
            if held and late:
                seen.append(late)
                if len(seen) == 2:
                    return
        pytest.skip(f"the server was held still inside a copy in {len(seen)} of 10 tries, not 2 (copies too fast here)")
