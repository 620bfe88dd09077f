"""``batch_is_exist`` and ``lookup`` of 64 keys from the shared index, from
Python, beside a previous build of the package in one run.

Each measurement is ``bench_local.py``'s part 4 (single calls, 3,000 each;
then with a writer process PUTting and DELETEing beside them; the
``EXISTS`` round trip and HTTP ``lookup`` as references) on a fresh release
``kvtier serve`` (2 shards, ``--block-bytes``), in a process of its own
whose ``kvtier`` package is this tree's or, with ``--previous SRC``, the
``clients/python/src`` of another checkout (``git worktree add /tmp/prev
COMMIT``), alternated for ``--rounds`` rounds: ``make bench-index``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FIELDS = {
    "unix_p50_us": "batch_is_exist p50",
    "unix_p99_us": "batch_is_exist p99",
    "unix_lookup_p50_us": "lookup p50",
    "busy_exist_p50_us": "batch_is_exist p50, a writer busy",
    "busy_exist_p99_us": "batch_is_exist p99, a writer busy",
    "busy_lookup_p99_us": "lookup p99, a writer busy",
    "python_exists_p50_us": "EXISTS round trip from Python p50",
    "raw_exists_p50_us": "EXISTS from a raw-frame client p50",
}


def one(block_bytes: int) -> None:
    """One measurement with the ``kvtier`` on ``sys.path``; prints its JSON."""
    import bench_local  # bench/ is on sys.path

    import kvtier
    from kvtier.testing import ServerProcess

    with ServerProcess(block_bytes=block_bytes, ram_gb=0.5, disk_gb=1) as server:
        keys = [f"exist-{i}" for i in range(64)]
        with kvtier.Client(server.unix_url) as c:
            for k in keys:
                c.put(k, os.urandom(64) * (block_bytes // 64))
        out = bench_local.part_exists(server, keys)
    out["package"] = str(Path(kvtier.__file__).parent)
    print("RESULT " + json.dumps(out), flush=True)


def run_with(script: str, src: str | None, *args: str) -> dict[str, float]:
    """``script --one *args`` in a process of its own whose ``kvtier`` is
    ``src`` (a ``clients/python/src``) or, without one, this tree's: the
    JSON of its ``RESULT`` line. Raises ``RuntimeError`` with the end of its
    stderr when it fails."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    argv = [sys.executable, script, "--one", *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run(src: str | None, block_bytes: int) -> dict[str, float]:
    return run_with(__file__, src, "--block-bytes", str(block_bytes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--previous", help="clients/python/src of the build to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-bytes", type=int, default=1228800)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args.block_bytes)
        return
    builds = {"this build": None} if not args.previous else {"previous": args.previous, "this build": None}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, src in builds.items():
            runs[name].append(run(src, args.block_bytes))
            print(f"{name}: {runs[name][-1]['package']}", file=sys.stderr, flush=True)
    print(f"\n64 keys, same-host socket, release server, {args.rounds} alternated rounds (range over rounds), µs")
    print("| call | " + " | ".join(builds) + " |")
    print("|---|" + "---:|" * len(builds))
    for field, label in FIELDS.items():
        cells = []
        for name in builds:
            xs = [r[field] for r in runs[name]]
            cells.append(f"{min(xs):.1f}" if len(xs) == 1 else f"{min(xs):.1f}–{max(xs):.1f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
