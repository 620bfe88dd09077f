"""What a prefix load costs kvtier's side: ``--blocks`` blocks of
``--block-bytes`` (default 63 x 16 MiB, an 8K-token prefix of Llama-3-8B)
read from kvtier's log into registered memory over the same-host socket, the
page cache dropped before each round, beside ``dd iflag=direct`` reading the
same number of bytes from a file on the same disk (the reference).

Per round: the batch's wall time and GB/s, and the server's CPU seconds per
GiB (``/proc/PID/stat``). ``--fresh`` loads into pages never touched before
(each a fault and a zeroing in the server), as vLLM's KV cache was before the
connector wrote it at allocation (docs/BENCHMARKS.md, issue 54).

Run as root (``drop_caches``): ``make bench-load-path``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import time

from bench_serving import drop_caches, server_usage  # bench/ is on sys.path

from kvtier import Client
from kvtier.shm import SharedBuffer
from kvtier.testing import ServerProcess

SPANS = 32  # one page per layer, as vLLM's layer-major cache at Llama-3-8B's geometry


def dd_gbps(path: str, nbytes: int, block_bytes: int) -> float:
    drop_caches()
    started = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", f"bs={block_bytes}", f"count={nbytes // block_bytes}", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    return nbytes / (time.perf_counter() - started) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=63)
    ap.add_argument("--block-bytes", type=int, default=16 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="load into never-touched pages each round")
    ap.add_argument("--dir", default="target/bench", help="where dd's file lives (kvtier's log: a temporary dir)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench-load-path drops the page cache: run it as root")
    n, bb = args.blocks, args.block_bytes
    os.makedirs(args.dir, exist_ok=True)
    disk_gb = 2 * n * bb / 2**30 + 1
    with ServerProcess(block_bytes=bb, ram_gb=0.0625, disk_gb=disk_gb, shards=args.shards) as srv:
        source = SharedBuffer(n * bb)
        view = memoryview(source)
        for i in range(n):
            view[i * bb : (i + 1) * bb] = os.urandom(1 << 20) * (bb >> 20)
        rooms = SharedBuffer((args.rounds if args.fresh else 1) * n * bb)
        client = Client(srv.unix_url)
        for buf in (source, rooms):
            if client.register_buffer(buf) != 0:
                raise SystemExit("registering the buffers failed")
        src = ctypes.addressof(ctypes.c_char.from_buffer(source))
        dst = ctypes.addressof(ctypes.c_char.from_buffer(rooms))
        keys = [f"load-path-{i}" for i in range(n)]
        page = bb // SPANS
        sizes = [[page] * SPANS for _ in range(n)]
        put = client.batch_put_from_multi_buffers(
            keys, [[src + i * bb + j * page for j in range(SPANS)] for i in range(n)], sizes
        )
        if any(r < 0 for r in put):
            raise SystemExit(f"storing the blocks failed: {sorted(set(put))}")
        if not args.fresh:
            view_rooms = memoryview(rooms)
            view_rooms[:] = bytes(len(view_rooms))  # touched once: warm pages, as a running vLLM's
        ref_path = os.path.join(args.dir, "load-path.dd")
        with open(ref_path, "wb") as f:
            f.write(bytes(view[: n * bb]))
        gbps, cpu_per_gib, ref = [], [], []
        for rnd in range(args.rounds):
            base = dst + (rnd * n * bb if args.fresh else 0)
            ptrs = [[base + i * bb + j * page for j in range(SPANS)] for i in range(n)]
            ref.append(dd_gbps(ref_path, n * bb, bb))
            drop_caches()
            cpu0 = server_usage(srv.pid)[0]
            started = time.perf_counter()
            got = client.batch_get_into_multi_buffers(keys, ptrs, sizes)
            wall = time.perf_counter() - started
            if any(r != bb for r in got):
                raise SystemExit(f"loading the blocks failed: {sorted(set(got))}")
            gbps.append(n * bb / wall / 1e9)
            cpu_per_gib.append((server_usage(srv.pid)[0] - cpu0) / (n * bb / 2**30))
            print(
                f"round {rnd}: kvtier {gbps[-1]:.2f} GB/s, server {cpu_per_gib[-1]:.2f} CPU-s/GiB; "
                f"dd O_DIRECT {ref[-1]:.2f} GB/s",
                flush=True,
            )
        os.unlink(ref_path)
        client.close()
    print(
        f"median of {args.rounds}: kvtier {statistics.median(gbps):.2f} GB/s "
        f"({statistics.median(g / r for g, r in zip(gbps, ref, strict=True)):.2f}x dd), "
        f"server {statistics.median(cpu_per_gib):.2f} CPU-s/GiB ({'fresh' if args.fresh else 'warm'} pages)"
    )


if __name__ == "__main__":
    main()
