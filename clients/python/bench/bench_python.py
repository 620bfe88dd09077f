"""make bench-python: the Python client beside its references, in one run.

Part 1, transfer (per block size, concurrency, GET and PUT; pairs alternate
so a noisy disk or CPU hits every contender alike):
  kvtier      kvtier.Client: get_many_into preallocated buffers / put_many
  http.client a plain pool, one connection per thread, resp.read() / request()
              (GET allocates a new bytes object per block: the old column)
  http.client readinto  the same pool at its best (issue 43): each GET's
              body read with resp.readinto() into a buffer preallocated per
              thread, as kvtier reads into preallocated buffers (GET only;
              its PUT is the column above)
  loadgen     kvtier-loadgen blocks --http1 (the Rust instrument)
Each against the same release `kvtier serve`, RAM tier holding the working
set. Reported: bytes/s (median of pairs), client and server CPU seconds per
GB moved, client RSS growth over the kvtier GET runs.

Part 2, against one file per block (as vLLM's `fs` offloading tier stores
blocks: write a temp file and rename; read with plain buffered file I/O), the
same blocks at the same concurrency:
  warm: files just written (page cache hot) vs kvtier with its RAM tier hot;
  cold: page cache dropped between write and read phases (needs root), and
        a kvtier started with --ram-gb 0 so every GET reads NVMe.

Writes summary.json to --out and prints a table. Figures and the command are
quoted in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvtier
from kvtier.testing import ServerProcess

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_caches() -> bool:
    """Empties the page cache (root only); False where it cannot."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_threads(concurrency: int, seconds: float, step: Callable[[int, int], int]) -> tuple[int, float]:
    """`concurrency` threads call step(thread, i) for `seconds` (each returns
    bytes moved); returns (bytes, elapsed_s)."""
    stop = time.monotonic() + seconds
    moved = [0] * concurrency
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        i = 0
        try:
            while time.monotonic() < stop:
                moved[t] += step(t, i)
                i += 1
        except BaseException as e:
            errors.append(e)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return sum(moved), time.monotonic() - started


def run_batches(concurrency: int, seconds: float, batch: Callable[[int], int]) -> tuple[int, float]:
    """Calls batch(i) (a batched client call over `concurrency` connections)
    until `seconds` have passed; returns (bytes, elapsed_s)."""
    started, moved, i = time.monotonic(), 0, 0
    while time.monotonic() - started < seconds:
        moved += batch(i)
        i += 1
    return moved, time.monotonic() - started


class Measure:
    """CPU of this process and the server around one case."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def __enter__(self) -> Measure:
        self.client_cpu0 = time.process_time()
        self.server_cpu0 = proc_cpu_s(self.server_pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client_cpu_s = time.process_time() - self.client_cpu0
        self.server_cpu_s = proc_cpu_s(self.server_pid) - self.server_cpu0


def result(moved: int, elapsed_s: float, client_cpu_s: float, server_cpu_s: float) -> dict[str, float]:
    gb = max(moved, 1) / 1e9
    return {
        "bytes_per_s": moved / elapsed_s,
        "client_cpu_s_per_gb": client_cpu_s / gb,
        "server_cpu_s_per_gb": server_cpu_s / gb,
    }


# ------------------------------------------------------------------ part 1


def store_blocks(server: ServerProcess, keys: list[str], block_bytes: int) -> None:
    """Stores every key of the working set (zero blocks), 8 PUTs at a time."""
    with kvtier.Client(server.url, connections=8) as client:
        client.put_many((k, bytes(block_bytes)) for k in keys)


def bench_kvtier(server: ServerProcess, keys: list[str], block_bytes: int, op: str, c: int, seconds: float) -> dict:
    client = kvtier.Client(server.url, connections=c)
    pid = server.proc.pid
    bufs = [bytearray(block_bytes) for _ in range(c)]
    payload = bytes(block_bytes)
    rss0 = rss_bytes()
    with Measure(pid) as m:
        if op == "get":
            moved, elapsed = run_batches(
                c, seconds, lambda i: sum(client.get_many_into(_window(keys, i, c), bufs)) * block_bytes
            )
        else:
            moved, elapsed = run_batches(
                c, seconds, lambda i: len(client.put_many((k, payload) for k in _window(keys, i, c))) * block_bytes
            )
    out = result(moved, elapsed, m.client_cpu_s, m.server_cpu_s)
    out["client_rss_growth_bytes"] = rss_bytes() - rss0
    client.close()
    return out


def _window(keys: list[str], i: int, n: int) -> list[str]:
    start = (i * n) % len(keys)
    return [keys[(start + j) % len(keys)] for j in range(n)]


def bench_httpclient(server: ServerProcess, keys: list[str], block_bytes: int, op: str, c: int, seconds: float) -> dict:
    conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=30) for _ in range(c)]
    payload = bytes(block_bytes)

    def get(t: int, i: int) -> int:
        conns[t].request("GET", "/v1/blocks/" + keys[(t + i * c) % len(keys)])
        resp = conns[t].getresponse()
        body = resp.read()
        assert resp.status == 200, resp.status
        return len(body)

    def put(t: int, i: int) -> int:
        conns[t].request("PUT", "/v1/blocks/" + keys[(t + i * c) % len(keys)], body=payload)
        resp = conns[t].getresponse()
        resp.read()
        assert resp.status in (200, 201), resp.status
        return block_bytes

    with Measure(server.proc.pid) as m:
        moved, elapsed = run_threads(c, seconds, get if op == "get" else put)
    for conn in conns:
        conn.close()
    return result(moved, elapsed, m.client_cpu_s, m.server_cpu_s)


def bench_httpclient_readinto(server: ServerProcess, keys: list[str], block_bytes: int, c: int, seconds: float) -> dict:
    """GETs on the same pool as bench_httpclient, each body read into a
    buffer preallocated per thread (readinto until Content-Length is in)."""
    conns = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=30) for _ in range(c)]
    views = [memoryview(bytearray(block_bytes)) for _ in range(c)]

    def get(t: int, i: int) -> int:
        conns[t].request("GET", "/v1/blocks/" + keys[(t + i * c) % len(keys)])
        resp = conns[t].getresponse()
        assert resp.status == 200, resp.status
        view, got = views[t], 0
        while got < block_bytes:
            n = resp.readinto(view[got:])
            if not n:
                break
            got += n
        assert got == block_bytes and resp.read() == b"", "body of the block size"
        return got

    with Measure(server.proc.pid) as m:
        moved, elapsed = run_threads(c, seconds, get)
    for conn in conns:
        conn.close()
    return result(moved, elapsed, m.client_cpu_s, m.server_cpu_s)


def bench_loadgen(server: ServerProcess, block_bytes: int, op: str, c: int, seconds: float, out: Path) -> dict:
    loadgen = os.environ.get("LOADGEN_BIN") or shutil.which("kvtier-loadgen")
    if not loadgen:
        raise FileNotFoundError("set LOADGEN_BIN to target/release/kvtier-loadgen")
    out_dir = out / f"loadgen-{op}-{c}"
    argv = [loadgen, "blocks", "--target", server.url, "--op", op, "--concurrency", str(c)]
    argv += ["--duration-s", str(seconds), "--http1", "--out", str(out_dir)]
    server_cpu0 = proc_cpu_s(server.proc.pid)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    server_cpu_s = proc_cpu_s(server.proc.pid) - server_cpu0
    if status != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.read().decode()[-500:]}")
    measured = json.loads((out_dir / "results.json").read_text())
    moved = measured["bytes_per_s"] * measured["elapsed_s"]
    # The loadgen's CPU includes storing its GET working set; the server's
    # too. Both are small beside `seconds` of transfer.
    return result(moved, measured["elapsed_s"], usage.ru_utime + usage.ru_stime, server_cpu_s)


# ------------------------------------------------------------------ part 2


def write_files(root: Path, keys: list[str], block_bytes: int) -> None:
    """One file per block, written as vLLM's fs tier does: temp file, rename."""
    payload = bytes(block_bytes)
    for k in keys:
        tmp = root / (k + ".tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, root / k)


def read_files(root: Path, keys: list[str], block_bytes: int, c: int) -> tuple[int, float, float]:
    """Reads every file once with `c` threads into preallocated buffers.
    Returns (bytes, elapsed_s, cpu_s)."""
    bufs = [bytearray(block_bytes) for _ in range(c)]
    cursor = iter(range(len(keys)))
    lock = threading.Lock()
    moved = [0] * c

    def worker(t: int) -> None:
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            with open(root / keys[i], "rb") as f:
                moved[t] += f.readinto(bufs[t])

    cpu0, started = time.process_time(), time.monotonic()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(moved), time.monotonic() - started, time.process_time() - cpu0


def read_kvtier_once(server: ServerProcess, keys: list[str], block_bytes: int, c: int) -> tuple[int, float, float]:
    """Reads every key once with `c` connections (get_many_into)."""
    client = kvtier.Client(server.url, connections=c)
    bufs = [bytearray(block_bytes) for _ in range(c)]
    cpu0, started, moved = time.process_time(), time.monotonic(), 0
    for i in range(0, len(keys), c):
        batch = keys[i : i + c]
        found = client.get_many_into(batch, bufs[: len(batch)])
        assert all(found), "a stored block missed"
        moved += len(batch) * block_bytes
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu0
    client.close()
    return moved, elapsed, cpu


# -------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("target/bench/python"))
    ap.add_argument("--sizes", default="16777216,1228800", help="block sizes in bytes, comma-separated")
    ap.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per transfer case")
    ap.add_argument("--pairs", type=int, default=3, help="alternations of every contender (median reported)")
    ap.add_argument("--working-set-mib", type=int, default=1024, help="bytes of blocks read and written per size")
    ap.add_argument("--skip-files", action="store_true", help="part 1 only")
    ap.add_argument(
        "--keep-page-cache", action="store_true", help="cold case without dropping the page cache (tiny test runs)"
    )
    args = ap.parse_args()
    if args.pairs < 1 or args.seconds <= 0:
        ap.error("--pairs must be at least 1 and --seconds positive")
    sizes = [int(s) for s in args.sizes.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    data_root = Path(tempfile.mkdtemp(prefix="bench-python-", dir=args.out))
    summary: dict[str, Any] = {"sizes": sizes, "concurrency": levels, "pairs": args.pairs, "transfer": [], "files": []}
    try:
        for block_bytes in sizes:
            blocks = max(16, (args.working_set_mib << 20) // block_bytes)
            keys = [f"bench-{block_bytes}-{i}" for i in range(blocks)]
            ram_gb = blocks * block_bytes * 1.25 / (1 << 30) + 0.25
            disk_gb = blocks * block_bytes * 4 / (1 << 30) + 1
            with ServerProcess(
                block_bytes=block_bytes, ram_gb=ram_gb, disk_gb=disk_gb, data_dir=str(data_root / f"kv-{block_bytes}")
            ) as server:
                store_blocks(server, keys, block_bytes)
                for op in ("get", "put"):
                    for c in levels:
                        runs: dict[str, list[dict]] = {"kvtier": [], "http.client": [], "loadgen": []}
                        if op == "get":
                            runs["http.client readinto"] = []
                        for _ in range(args.pairs):
                            runs["kvtier"].append(bench_kvtier(server, keys, block_bytes, op, c, args.seconds))
                            runs["http.client"].append(bench_httpclient(server, keys, block_bytes, op, c, args.seconds))
                            if op == "get":
                                runs["http.client readinto"].append(
                                    bench_httpclient_readinto(server, keys, block_bytes, c, args.seconds)
                                )
                            runs["loadgen"].append(bench_loadgen(server, block_bytes, op, c, args.seconds, args.out))
                        row = {"block_bytes": block_bytes, "op": op, "concurrency": c}
                        for name, rs in runs.items():
                            row[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                            row[name]["bytes_per_s_runs"] = [r["bytes_per_s"] for r in rs]
                        # Best of every reference, the readinto form included
                        # (the old figure, best of http.client read() and the
                        # loadgen, kept beside it).
                        refs = [n for n in runs if n != "kvtier"]
                        best_ref = max(row[n]["bytes_per_s"] for n in refs)
                        row["kvtier_over_best_reference"] = row["kvtier"]["bytes_per_s"] / best_ref
                        old_best = max(row["http.client"]["bytes_per_s"], row["loadgen"]["bytes_per_s"])
                        row["kvtier_over_best_reference_without_readinto"] = row["kvtier"]["bytes_per_s"] / old_best
                        summary["transfer"].append(row)
                        print_transfer(row)
            if not args.skip_files:
                summary["files"] += bench_files(args, data_root, block_bytes, keys, levels)
    finally:
        shutil.rmtree(data_root, ignore_errors=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out / 'summary.json'}")
    return 0


def bench_files(args: argparse.Namespace, data_root: Path, block_bytes: int, keys: list[str], levels: list[int]):
    """Part 2 for one block size: file per block vs kvtier, warm and cold."""
    rows = []
    files = data_root / f"files-{block_bytes}"
    disk_gb = len(keys) * block_bytes * 4 / (1 << 30) + 1
    ram_gb = len(keys) * block_bytes * 1.25 / (1 << 30) + 0.25
    for temperature in ("warm", "cold"):
        # Cold: no RAM tier, so every GET reads the segment log (O_DIRECT).
        with ServerProcess(
            block_bytes=block_bytes,
            ram_gb=ram_gb if temperature == "warm" else 0,
            disk_gb=disk_gb,
            data_dir=str(data_root / f"kvfiles-{block_bytes}-{temperature}"),
        ) as server:
            store_blocks(server, keys, block_bytes)
            files.mkdir(exist_ok=True)
            write_files(files, keys, block_bytes)
            for c in levels:
                pair: dict[str, list[float]] = {"file": [], "kvtier": []}
                cpu_per_gb: dict[str, list[float]] = {"file": [], "kvtier": []}
                dropped = True
                for _ in range(args.pairs):
                    for name in ("file", "kvtier"):
                        if temperature == "cold":
                            dropped = (not args.keep_page_cache and drop_caches()) and dropped
                        if name == "file":
                            moved, elapsed, cpu = read_files(files, keys, block_bytes, c)
                        else:
                            moved, elapsed, cpu = read_kvtier_once(server, keys, block_bytes, c)
                        pair[name].append(moved / elapsed)
                        cpu_per_gb[name].append(cpu / (moved / 1e9))
                row = {
                    "block_bytes": block_bytes,
                    "temperature": temperature,
                    "page_cache_dropped": dropped if temperature == "cold" else None,
                    "concurrency": c,
                    "file_bytes_per_s": statistics.median(pair["file"]),
                    "kvtier_bytes_per_s": statistics.median(pair["kvtier"]),
                    "file_client_cpu_s_per_gb": statistics.median(cpu_per_gb["file"]),
                    "kvtier_client_cpu_s_per_gb": statistics.median(cpu_per_gb["kvtier"]),
                    "runs": pair,
                }
                row["kvtier_over_file"] = row["kvtier_bytes_per_s"] / row["file_bytes_per_s"]
                rows.append(row)
                print(
                    f"files {block_bytes:>9} B {temperature:4} c={c:<2} file {row['file_bytes_per_s'] / 1e9:6.2f} GB/s"
                    f"  kvtier {row['kvtier_bytes_per_s'] / 1e9:6.2f} GB/s  ratio {row['kvtier_over_file']:.2f}"
                    + ("" if dropped or temperature == "warm" else "  (page cache not dropped)"),
                    flush=True,
                )
            shutil.rmtree(files, ignore_errors=True)
    return rows


def print_transfer(row: dict) -> None:
    parts = [f"{row['op']:3} {row['block_bytes']:>9} B c={row['concurrency']:<2}"]
    for name in ("kvtier", "http.client", "http.client readinto", "loadgen"):
        if name not in row:
            continue
        r = row[name]
        parts.append(
            f"{name} {r['bytes_per_s'] / 1e9:5.2f} GB/s (cpu/GB client {r['client_cpu_s_per_gb']:.2f} s,"
            f" server {r['server_cpu_s_per_gb']:.2f} s)"
        )
    parts.append(
        f"rss +{row['kvtier']['client_rss_growth_bytes'] / 2**20:.0f} MiB  "
        f"kvtier/best {row['kvtier_over_best_reference']:.2f}"
        f" (without readinto {row['kvtier_over_best_reference_without_readinto']:.2f})"
    )
    print("  ".join(parts), flush=True)


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    sys.exit(main())
