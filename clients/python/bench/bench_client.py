"""The same-host client's own cost, from Python, beside a previous build of
the package in one run: ``get_many_into`` of 64 × 64 KiB and 16 × 16 MiB
RAM-tier hits into a registered ``SharedBuffer``, and a ``lease`` of 16
blocks of 1.2 MB (``LEASE``, the arenas mapped, ``RELEASE`` posted) as one
round trip.

Each build runs in a process of its own whose ``kvtier`` package is this
tree's or, with ``--previous SRC``, the ``clients/python/src`` of another
checkout (``git worktree add /tmp/prev COMMIT``; its native module is this
tree's, copied in, which serves a build older than the native connection
with the same shared-index class), against fresh release ``kvtier serve``
processes (one per block size, RAM tier only), alternated for ``--rounds``
rounds: ``make bench-client``. Medians of each call's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

FIELDS = {
    "get_64x64k_us": "get_many_into 64 × 64 KiB, µs",
    "get_16x16m_ms": "get_many_into 16 × 16 MiB, ms",
    "get_16x16m_gbps": "get_many_into 16 × 16 MiB, GB/s",
    "lease_16_us": "lease of 16 × 1.2 MB (LEASE, RELEASE posted), µs",
}


def _gets(block_bytes: int, blocks: int, calls: int) -> list[float]:
    """Seconds per ``get_many_into`` of ``blocks`` RAM hits of ``block_bytes``."""
    import kvtier
    from kvtier.testing import ServerProcess

    ram_gb = max(0.5, 3 * blocks * block_bytes / (1 << 30))
    with ServerProcess(block_bytes=block_bytes, ram_gb=ram_gb, disk_gb=2) as server:
        keys = [f"b-{block_bytes}-{i}" for i in range(blocks)]
        with kvtier.Client(server.unix_url) as c, kvtier.SharedBuffer(blocks * block_bytes) as buf:
            for k in keys:
                c.put(k, os.urandom(64) * (block_bytes // 64))
            assert c.register_buffer(buf.ptr, buf.nbytes) == 0, "register_buffer failed"
            arr = buf.numpy()
            views = [arr[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)]
            assert all(c.get_many_into(keys, views))
            before = c.local_stats()
            out = []
            for _ in range(calls):
                t = time.perf_counter()
                c.get_many_into(keys, views)
                out.append(time.perf_counter() - t)
            stats = c.local_stats()
            copied_here = {k: stats[k] - before[k] for k in ("bounce_copies", "lease_copies")}
            assert not any(copied_here.values()), f"not copied by the server: {copied_here}"
            return out


def _leases(calls: int) -> list[float]:
    import kvtier
    from kvtier.testing import ServerProcess

    bb = 1228800
    with ServerProcess(block_bytes=bb, ram_gb=0.5, disk_gb=1, args=("--ram-shared", "on")) as server:
        keys = [f"l-{i}" for i in range(16)]
        with kvtier.Client(server.unix_url) as c:
            for k in keys:
                c.put(k, os.urandom(64) * (bb // 64))
            out = []
            for _ in range(calls):
                t = time.perf_counter()
                with c.lease(keys) as leases:
                    assert leases.results[0] == bb, leases.results
                out.append(time.perf_counter() - t)
            return out


def one() -> None:
    """One measurement with the ``kvtier`` on ``sys.path``; prints its JSON."""
    import kvtier

    small = _gets(64 << 10, 64, 400)
    big = _gets(16 << 20, 16, 40)
    lease = _leases(1000)
    out = {
        "get_64x64k_us": statistics.median(small) * 1e6,
        "get_16x16m_ms": statistics.median(big) * 1e3,
        "get_16x16m_gbps": 16 * (16 << 20) / statistics.median(big) / 1e9,
        "lease_16_us": statistics.median(lease) * 1e6,
        "package": str(Path(kvtier.__file__).parent),
    }
    print("RESULT " + json.dumps(out), flush=True)


def run(src: str | None) -> dict[str, float]:
    from bench_index import run_with  # bench/ is on sys.path

    return run_with(__file__, src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--previous", help="clients/python/src of the build to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one()
        return
    builds = {"this build": None} if not args.previous else {"previous": args.previous, "this build": None}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, src in builds.items():
            runs[name].append(run(src))
            print(f"{name}: {runs[name][-1]['package']}", file=sys.stderr, flush=True)
    print(f"\nsame-host socket, RAM tier, release server, {args.rounds} alternated rounds (range of medians)")
    print("| call | " + " | ".join(builds) + (" | this / previous |" if len(builds) == 2 else " |"))
    print("|---|" + "---:|" * (len(builds) + (len(builds) == 2)))
    for field, label in FIELDS.items():
        cells = []
        for name in builds:
            xs = [r[field] for r in runs[name]]
            cells.append(f"{min(xs):.1f}" if len(xs) == 1 else f"{min(xs):.1f}–{max(xs):.1f}")
        if len(builds) == 2:
            prev = statistics.median(r[field] for r in runs["previous"])
            this = statistics.median(r[field] for r in runs["this build"])
            cells.append(f"{this / prev:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
