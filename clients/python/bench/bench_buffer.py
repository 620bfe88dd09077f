"""Mooncake's ``batch_get_buffer`` against ``batch_get_into`` on a default
``kvtier serve``, beside the same server with the previous default
(``--ram-shared auto``, which shares the RAM tier only where shared memory
gets huge pages) and with ``--ram-shared off``, in one run.

Each server holds ``--blocks`` blocks of ``--block-bytes`` (default 32 of
16 MiB, in a 1 GiB RAM tier: every read is a RAM hit) and is read over the
same-host socket in batches of ``--batch`` keys, the two calls alternated for
``--rounds`` rounds of ``--seconds`` each:

- ``batch_get_buffer``: the handles, then each released (a lease, or a copy
  where the server offers none); GB/s is block bytes made readable per second;
- ``batch_get_into``: the blocks copied by the server into one registered
  ``SharedBuffer`` (the one-copy path).

Prints per server the medians, their ratio, and whether the handles were
leases. Then, on a default server of one shard pinned to CPU 0 and this
process held to the last CPU (so the server's copies take no CPU from it),
whether a call holds the GIL while it waits: a second Python thread counts
in a pure-Python loop for ``--seconds``, alone and while the first thread
runs ``batch_get_into`` of 16 blocks back to back; its count against its
count alone, median of ``--rounds``: ``make bench-buffer``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from kvtier import Client
from kvtier.shm import SharedBuffer
from kvtier.testing import ServerProcess

SERVERS = {
    "default": (),
    "auto (previous default)": ("--ram-shared", "auto"),
    "off": ("--ram-shared", "off"),
}


def rate(call: object, nbytes: int, seconds: float) -> float:
    """GB/s of ``call()`` run back to back for ``seconds``, each moving ``nbytes``."""
    done, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or done == 0:
        call()  # type: ignore[operator]
        done += 1
    return done * nbytes / elapsed / 1e9


def counted(seconds: float) -> int:
    """Iterations of a pure-Python loop in ``seconds`` (holds the GIL whenever it runs)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def beside(call: object, seconds: float) -> int:
    """:func:`counted` on this thread while another runs ``call()`` back to back."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            call()  # type: ignore[operator]

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.05)
    try:
        return counted(seconds)
    finally:
        stop.set()
        t.join()


def filled(client: Client, prefix: str, args: argparse.Namespace) -> tuple[list[str], SharedBuffer, list[int]]:
    """``--blocks`` blocks stored under ``prefix``, and a registered buffer
    of one batch with each block's address in it: (keys, buffer, ptrs)."""
    bb = args.block_bytes
    keys = [f"{prefix}-{i}" for i in range(args.blocks)]
    for i, key in enumerate(keys):
        client.put(key, bytes([i % 251]) * bb)
    room = SharedBuffer(args.batch * bb)
    if client.register_buffer(room) != 0:
        raise SystemExit("registering the buffer failed")
    return keys, room, [room.ptr + j * bb for j in range(args.batch)]


def gil(args: argparse.Namespace) -> None:
    """The second thread's speed beside the first's calls (module docs)."""
    bb = args.block_bytes
    cpus = os.sched_getaffinity(0)
    srv = ServerProcess(
        block_bytes=bb, ram_gb=args.ram_gb, disk_gb=2 * args.blocks * bb / 2**30 + 1, shards=1, pin_cpus=True
    )
    with srv:
        os.sched_setaffinity(0, {max(cpus)})  # this thread, and the threads it starts (the client's)
        try:
            client = Client(srv.unix_url, timeout_s=60)
            keys, room, ptrs = filled(client, "gil", args)
            batch, sizes = keys[: args.batch], [bb] * args.batch
            name = f"batch_get_into {args.batch} x {bb} B"
            ratios = []
            for _ in range(args.rounds):
                alone = counted(args.seconds)
                ratios.append(beside(lambda: client.batch_get_into(batch, ptrs, sizes), args.seconds) / alone)
            client.unregister_buffer(room)
            client.close()
        finally:
            os.sched_setaffinity(0, cpus)
    print(f"\nthe GIL: a second thread's pure-Python loop beside the call, against alone (medians of {args.rounds})")
    print(f"- {name}: **{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})")


def measure(args: argparse.Namespace, name: str, extra: tuple[str, ...]) -> dict[str, object]:
    bb, n = args.block_bytes, args.blocks
    with ServerProcess(block_bytes=bb, ram_gb=args.ram_gb, disk_gb=2 * n * bb / 2**30 + 1, args=extra) as srv:
        with Client(srv.unix_url, timeout_s=60) as client:
            keys, room, ptrs = filled(client, "buffer", args)
            batches = [keys[i : i + args.batch] for i in range(0, n - args.batch + 1, args.batch)]
            sizes = [bb] * args.batch
            turn = [0]

            def batch() -> list[str]:
                turn[0] += 1
                return batches[turn[0] % len(batches)]

            def get_buffer() -> None:
                handles = client.batch_get_buffer(batch())
                if any(h is None for h in handles):
                    raise SystemExit(f"{name}: batch_get_buffer missed a block")
                for h in handles:
                    h.release()  # type: ignore[union-attr]

            def get_into() -> None:
                got = client.batch_get_into(batch(), ptrs, sizes)
                if any(r != bb for r in got):
                    raise SystemExit(f"{name}: batch_get_into failed: {sorted(set(got))}")

            leased = all(h is not None and h.leased for h in client.batch_get_buffer(batches[0]))
            nbytes = args.batch * bb
            buffer_gbps, into_gbps = [], []
            for _ in range(args.rounds):
                buffer_gbps.append(rate(get_buffer, nbytes, args.seconds))
                into_gbps.append(rate(get_into, nbytes, args.seconds))
            client.unregister_buffer(room)
    b, i = statistics.median(buffer_gbps), statistics.median(into_gbps)
    row = {"server": name, "leased": leased, "buffer": b, "into": i, "ratio": b / i}
    row["ratios"] = [x / y for x, y in zip(buffer_gbps, into_gbps, strict=True)]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-bytes", type=int, default=16 << 20)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ram-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    rows = [measure(args, name, extra) for name, extra in SERVERS.items()]
    print(f"\n{args.batch} x {args.block_bytes} B per batch, same-host socket, RAM tier hits, medians of {args.rounds}")
    print("| server | handles | batch_get_buffer GB/s | batch_get_into GB/s | buffer/into (range) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        lo, hi = min(r["ratios"]), max(r["ratios"])  # type: ignore[type-var, arg-type]
        print(
            f"| {r['server']} | {'leases' if r['leased'] else 'copies'} | {r['buffer']:.2f} | {r['into']:.2f} "
            f"| **{r['ratio']:.2f}x** ({lo:.2f}-{hi:.2f}) |"
        )
    gil(args)


if __name__ == "__main__":
    main()
