"""make bench-local: the same-host data plane (docs/LOCAL.md) beside its references, in one run.

Every contender runs against a release ``kvtier serve`` started here; pairs
alternate the contenders of a case, so a noisy disk or CPU hits each alike,
and the median of the pairs is reported. CPU seconds per GB moved are read
from /proc/PID/stat (utime + stime) of the server and of every client
process (fio reports its own).

1. RAM-tier GET, 16 MiB and 1.2 MB blocks, batches of 16, 1 and 8 client
   processes, each process for ``--seconds``:
     unix    kvtier.Client("unix://…"): batch_get_into a registered SharedBuffer
     copyto  numpy copyto of the same bytes between two arrays in the client
             process (sources over 256 MiB, beyond the CPU caches)
     files   one file per block, page cache warm, read with plain buffered
             file I/O (``make bench-python``'s file case; each process reads
             every file), ``--batch`` reads in flight per process: a thread
             pool of that many threads, each reading into its own
             preallocated buffer, as the socket has a batch of 16 in flight
             (until issue 43 one thread per process; the old column)
     http    kvtier.Client("http://…").get_many_into 16 preallocated buffers
   Goals: unix ≥ 0.8× copyto, ≥ 1.5× warm files, ≥ 3× HTTP.
2. NVMe-tier GET, cold (``--ram-gb 0``, so every GET reads the log with
   O_DIRECT), one process reading the working set once in batches of 16 in
   a shuffled order (the log holds the blocks in the order stored),
   against fio O_DIRECT (io_uring) random reads of the same block size at
   depth 16 over a file of the same size, and one file per block read once
   with 16 threads after ``echo 3 > /proc/sys/vm/drop_caches`` (root).
   Goals: ≥ 0.9× fio, ≥ 1.5× cold files.
3. PUT of 16 MiB blocks, write-through, one process, batches of 16: unix
   batch_put_from against fio O_DIRECT sequential writes at depth 16 (the
   log appends) and against HTTP put_many. Goal: client CPU per GB ≤ 1/3
   of HTTP's (the ratio to fio is shown, with no goal).
4. batch_is_exist of 64 stored keys over the socket: p50 and p99 of single
   calls (goal p50 ≤ 50 µs); the same EXISTS from a minimal raw-frame client
   (how much is the server's), and HTTP ``lookup`` of the same keys.
5. ``kvtier-loadgen replay`` over HTTP, then over the socket (a fresh server
   each, same settings): tokens/s and p50/p99 of lookup, GET and PUT.
6. Leases (``--ram-shared on``): LEASE + views in place against GET_INTO a
   registered buffer, and a copy from the lease into the consumer's own
   anonymous buffer against today's staged GET_INTO into it, with numpy
   copyto beside; 16 MiB and 1.2 MB, 1 and 8 processes. Goals: lease+view
   ≥ 10× GET_INTO, copy from lease ≥ 1.5× staged, server CPU per GB
   leased ≤ 0.01 s.

Writes summary.json and summary.md (the tables) to --out and prints the
goals with pass/fail. Figures and the command are quoted in
docs/BENCHMARKS.md ("Same-host data plane").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_python as bp

import kvtier
from kvtier.local import LocalConnection
from kvtier.testing import ServerProcess

MIB = 1 << 20
GB = 1e9
#: Bytes of numpy sources the copyto reference cycles through per process:
#: far beyond the 32 MiB L3 here, as the server's RAM tier is.
COPYTO_SOURCE_BYTES = 256 * MIB


# ------------------------------------------------------------ worker side


def _prepare(cmd: dict[str, Any], state: dict[str, Any]) -> tuple[Any, int]:
    """The step function of a case (one batch, or one pass over the files)
    and the bytes a step moves; objects are kept in ``state`` across pairs."""
    case, bs, batch, keys, w = cmd["case"], cmd["block_bytes"], cmd["batch"], cmd["keys"], cmd["worker"]
    cache_key = (case, cmd.get("url"), bs, cmd.get("threads"))
    if state.get("block_bytes") != bs:
        for obj in state.values():
            if hasattr(obj, "close"):
                obj.close()
        state.clear()
        state["block_bytes"] = bs
    if cache_key not in state:
        if case in ("unix_get", "unix_put"):
            client = kvtier.Client(cmd["url"])
            buf = kvtier.SharedBuffer(batch * bs)
            buf.numpy()[:] = 1
            assert client.register_buffer(buf.ptr, buf.nbytes) == 0, "register_buffer failed"
            state[cache_key] = (client, buf)
        elif case in ("lease_view", "lease_copy", "staged_get"):
            import numpy as np

            # staged: the client's staging area, as before leases (its
            # default reads such buffers from a lease, as lease_copy does).
            client = kvtier.Client(cmd["url"], lease_reads=case != "staged_get")
            # The consumer's own memory: anonymous, not registrable.
            state[cache_key] = (client, [np.empty(bs, dtype=np.uint8) for _ in range(batch)])
        elif case in ("http_get", "http_put"):
            state[cache_key] = (kvtier.Client(cmd["url"], connections=batch), [bytearray(bs) for _ in range(batch)])
        elif case == "files":
            from concurrent.futures import ThreadPoolExecutor

            threads = cmd.get("threads", batch)
            state[cache_key] = (ThreadPoolExecutor(threads), [bytearray(bs) for _ in range(threads)])
        elif case == "copyto":
            import numpy as np

            n = max(batch, COPYTO_SOURCE_BYTES // bs)
            srcs = [np.full(bs, i % 251, dtype=np.uint8) for i in range(n)]
            dsts = [np.empty(bs, dtype=np.uint8) for _ in range(batch)]
            state[cache_key] = (srcs, dsts)
        else:
            state[cache_key] = None
    held = state[cache_key]
    step_bytes = batch * bs
    if case == "unix_get":
        client, buf = held
        ptrs, sizes = [buf.ptr + j * bs for j in range(batch)], [bs] * batch

        def step(i: int) -> int:
            got = client.batch_get_into(bp._window(keys, i + 5 * w, batch), ptrs, sizes)
            if any(r != bs for r in got):
                raise RuntimeError(f"batch_get_into answered {got}")
            return step_bytes
    elif case == "unix_put":
        client, buf = held
        ptrs, sizes = [buf.ptr + j * bs for j in range(batch)], [bs] * batch

        def step(i: int) -> int:
            got = client.batch_put_from(bp._window(keys, i, batch), ptrs, sizes)
            if any(r != 0 for r in got):
                raise RuntimeError(f"batch_put_from answered {got}")
            return step_bytes
    elif case == "lease_view":
        client, _ = held

        def step(i: int) -> int:
            # Until the consumer holds every block as an array it can read.
            with client.lease(bp._window(keys, i + 5 * w, batch)) as leases:
                arrays = [leases.numpy(j) for j in range(batch)]
                if any(a is None or a.nbytes != bs for a in arrays):
                    raise RuntimeError(f"a stored block was not leased: {leases.results}")
            return step_bytes
    elif case == "lease_copy":
        client, dsts = held

        def step(i: int) -> int:
            # Into the consumer's own (unregistrable) buffers, one copy each,
            # checked against the generation afterwards.
            with client.lease(bp._window(keys, i + 5 * w, batch)) as leases:
                if not all(leases.copy_into(j, dsts[j]) for j in range(batch)):
                    raise RuntimeError(f"a lease ended before its copy: {leases.results}")
            return step_bytes
    elif case in ("staged_get", "http_get"):
        # staged_get: today's path for a buffer the server cannot be handed
        # (the client's staging buffer, then a copy into the consumer's).
        client, bufs = held
        over = "the socket" if case == "staged_get" else "HTTP"

        def step(i: int) -> int:
            found = client.get_many_into(bp._window(keys, i + 5 * w, batch), bufs)
            if not all(found):
                raise RuntimeError(f"a stored block missed over {over}")
            return step_bytes
    elif case == "http_put":
        client, bufs = held
        payload = bytes(bs)

        def step(i: int) -> int:
            client.put_many((k, payload) for k in bp._window(keys, i, batch))
            return step_bytes
    elif case == "copyto":
        import numpy as np

        srcs, dsts = held

        def step(i: int) -> int:
            for j in range(batch):
                np.copyto(dsts[j], srcs[(i * batch + j + w * 7) % len(srcs)])
            return step_bytes
    elif case == "files":
        import threading

        root = Path(cmd["files"])
        pool, bufs = held
        paths = [root / k for k in keys]

        def step(i: int) -> int:
            # One pass over the files, len(bufs) reads in flight: each
            # thread takes the next file until none is left.
            cursor, lock = iter(paths), threading.Lock()

            def reader(buf: bytearray) -> int:
                moved = 0
                while True:
                    with lock:
                        path = next(cursor, None)
                    if path is None:
                        return moved
                    with open(path, "rb") as f:
                        moved += f.readinto(buf)

            return sum(pool.map(reader, bufs))
    else:
        raise ValueError(f"unknown case {case}")
    return step, step_bytes


def _worker(conn: Any, index: int) -> None:
    """A client process: prepares the case it is sent, says ready, runs from
    the start time for the seconds given (or one pass over its keys), and
    sends back bytes, elapsed seconds and its own CPU seconds."""
    state: dict[str, Any] = {}
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        try:
            step, _ = _prepare({**cmd, "worker": index}, state)
            step(0)  # warm: connections, page faults, page cache
            conn.send(("ready", None))
            start_at, seconds = conn.recv()
            while time.monotonic() < start_at:
                time.sleep(0.0005)
            cpu0, t0, moved, i = bp.proc_cpu_s(os.getpid()), time.monotonic(), 0, 1
            steps_s: list[float] = []

            def timed(i: int, step: Any = step, steps_s: list[float] = steps_s) -> int:
                s0 = time.monotonic()
                got = step(i)
                steps_s.append(time.monotonic() - s0)
                return got

            if seconds is None:
                n = len(cmd["keys"])
                for i in range(0, n, cmd["batch"]):
                    moved += timed(i // cmd["batch"])
            else:
                while time.monotonic() - t0 < seconds:
                    moved += timed(i)
                    i += 1
            steps_s.sort()
            conn.send(
                (
                    "done",
                    {
                        "bytes": moved,
                        "elapsed_s": time.monotonic() - t0,
                        "cpu_s": bp.proc_cpu_s(os.getpid()) - cpu0,
                        "step_p50_ms": steps_s[len(steps_s) // 2] * 1e3,
                        "step_p99_ms": steps_s[min(len(steps_s) - 1, int(len(steps_s) * 0.99))] * 1e3,
                    },
                )
            )
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Workers:
    """Client processes (spawned once, reused by every case)."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, i), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, n: int, cmd: dict[str, Any], seconds: float | None, server_pid: int) -> dict[str, float]:
        """Runs ``cmd`` in ``n`` processes at once; bytes/s over the slowest
        process's time, client and server CPU seconds per GB."""
        conns = self.conns[:n]
        for c in conns:
            c.send(cmd)
        for c in conns:
            _check(c.recv())
        server_cpu0 = bp.proc_cpu_s(server_pid)
        start_at = time.monotonic() + 0.05
        for c in conns:
            c.send((start_at, seconds))
        results = [_check(c.recv()) for c in conns]
        server_cpu_s = bp.proc_cpu_s(server_pid) - server_cpu0
        moved = sum(r["bytes"] for r in results)
        elapsed = max(r["elapsed_s"] for r in results)
        out = bp.result(moved, elapsed, sum(r["cpu_s"] for r in results), server_cpu_s)
        out["bytes"] = moved
        # One step is one batch call (or one file, one copy): its latency.
        out["step_p50_ms"] = statistics.median(r["step_p50_ms"] for r in results)
        out["step_p99_ms"] = max(r["step_p99_ms"] for r in results)
        return out

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(10)


def _check(msg: tuple[str, Any]) -> Any:
    kind, body = msg
    if kind == "error":
        raise RuntimeError(f"a client process failed:\n{body}")
    return body


def _median(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["bytes_per_s_runs"] = [r["bytes_per_s"] for r in runs]
    return out


def _goal(name: str, value: float, op: str, target: float, unit: str = "×") -> dict[str, Any]:
    ok = value >= target if op == ">=" else value <= target
    return {"goal": name, "value": value, "op": op, "target": target, "unit": unit, "pass": ok}


# ------------------------------------------------------------------ parts


def part_ram_get(args: argparse.Namespace, workers: Workers, scratch: Path) -> tuple[list[dict], list[dict], dict]:
    """Part 1, and part 4 on the smallest size's server (its working set has the most keys)."""
    rows, goals, exists = [], [], {}
    for bs in args.sizes:
        blocks = max(4 * args.batch, args.ram_working_set_mib * MIB // bs)
        keys = [f"ram-{bs}-{i}" for i in range(blocks)]
        ws_gb = blocks * bs / (1 << 30)
        files = scratch / f"files-{bs}"
        files.mkdir()
        bp.write_files(files, keys, bs)
        with ServerProcess(
            block_bytes=bs, ram_gb=ws_gb * 1.25 + 0.25, disk_gb=ws_gb * 2 + 1, data_dir=str(scratch / f"kv-ram-{bs}")
        ) as server:
            bp.store_blocks(server, keys, bs)
            base = {"block_bytes": bs, "batch": args.batch, "keys": keys}
            cases = {
                "unix": {**base, "case": "unix_get", "url": server.unix_url},
                "copyto": {**base, "case": "copyto"},
                "files": {**base, "case": "files", "files": str(files)},
                # The old column: one thread per process.
                "files-1thread": {**base, "case": "files", "files": str(files), "threads": 1},
                "http": {**base, "case": "http_get", "url": server.url},
            }
            for procs in args.procs:
                runs: dict[str, list] = {name: [] for name in cases}
                for _ in range(args.pairs):
                    for name, cmd in cases.items():
                        runs[name].append(workers.run(procs, cmd, args.seconds, server.pid))
                row: dict[str, Any] = {
                    "block_bytes": bs,
                    "processes": procs,
                    "batch": args.batch,
                    "working_set_blocks": blocks,
                }
                for name, rs in runs.items():
                    row[name] = _median(rs)
                u = row["unix"]["bytes_per_s"]
                row["unix_over_copyto"] = u / row["copyto"]["bytes_per_s"]
                row["unix_over_files"] = u / row["files"]["bytes_per_s"]
                row["unix_over_files_1thread"] = u / row["files-1thread"]["bytes_per_s"]
                row["unix_over_http"] = u / row["http"]["bytes_per_s"]
                label = f"RAM GET {_size(bs)} ×{procs} proc"
                goals += [
                    _goal(f"{label}: unix / copyto", row["unix_over_copyto"], ">=", 0.8),
                    _goal(f"{label}: unix / warm files", row["unix_over_files"], ">=", 1.5),
                    _goal(f"{label}: unix / http", row["unix_over_http"], ">=", 3.0),
                ]
                rows.append(row)
                rates = "  ".join(f"{n} {_gbps(row[n]['bytes_per_s'])}" for n in cases)
                ratios = " / ".join(
                    f"{row[f'unix_over_{n}']:.2f}" for n in ("copyto", "files", "files_1thread", "http")
                )
                cpu = " ".join(
                    f"{n} {row[n]['client_cpu_s_per_gb']:.3f}·{row[n]['server_cpu_s_per_gb']:.3f}"
                    for n in ("unix", "http")
                )
                print(f"{label}: {rates} GB/s; ratios {ratios}; cpu s/GB client·server {cpu}", flush=True)
            if bs == min(args.sizes):
                exists = part_exists(server, keys)
        shutil.rmtree(files, ignore_errors=True)
    return rows, goals, exists


class RawSocket:
    """The least client of docs/LOCAL.md: one blocking socket, one request at
    a time, frames built with struct. Times the server's side of a call."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.next_id = 1
        assert self.call(1, json.dumps({"versions": [1]}).encode())[0] == 0, "HELLO failed"

    def call(self, op: int, payload: bytes) -> tuple[int, bytes]:
        """Sends one frame; returns the response's status and body."""
        self.next_id += 1
        self.sock.sendall(struct.pack("<HBBIQ", 0x4B54, op, 0, len(payload), self.next_id) + payload)
        head = self._read(16)
        _, _, _, n, _ = struct.unpack("<HBBIQ", head)
        body = self._read(n)
        return struct.unpack("<i", body[:4])[0], body[8:]

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the server closed the socket")
            out += chunk
        return bytes(out)


def part_lease(args: argparse.Namespace, workers: Workers) -> tuple[list[dict], list[dict]]:
    """Part 6: leases (docs/LOCAL.md, "Leases"), RAM tier, ``--ram-shared
    on``: the time until a consumer holds a batch of blocks it can read.

    lease_view  LEASE + a read-only numpy view of each block (in place)
    unix        GET_INTO a registered SharedBuffer (one copy, on the server)
    unix_private  the same from a server with ``--ram-shared off`` (the
                hidden cost of a shared arena: 4 KiB pages where shared memory
                gets no transparent huge pages)
    lease_copy  LEASE + ``copy_into`` the consumer's own anonymous buffer,
                then the generation check (one copy, in the client)
    staged      ``get_many_into`` the same anonymous buffers: GET_INTO the
                client's staging buffer, then a copy (today's path for a
                buffer that cannot be registered)
    copyto      numpy copyto between two arrays, the memory's reference
    """
    rows, goals = [], []
    for bs in args.sizes:
        blocks = max(4 * args.batch, args.ram_working_set_mib * MIB // bs)
        keys = [f"lease-{bs}-{i}" for i in range(blocks)]
        ws_gb = blocks * bs / (1 << 30)
        sized = {"block_bytes": bs, "ram_gb": ws_gb * 1.25 + 0.25, "disk_gb": ws_gb * 2 + 1}
        with (
            ServerProcess(**sized, args=("--ram-shared", "on")) as server,
            ServerProcess(**sized, args=("--ram-shared", "off")) as private,
        ):
            bp.store_blocks(server, keys, bs)
            bp.store_blocks(private, keys, bs)
            base = {"block_bytes": bs, "batch": args.batch, "keys": keys, "url": server.unix_url}
            cases = {
                "lease_view": {**base, "case": "lease_view"},
                "unix": {**base, "case": "unix_get"},
                # The hidden cost: GET_INTO from a RAM tier that is not a
                # shared file (anonymous memory, as --ram-shared auto makes
                # it where shared memory gets no huge pages).
                "unix_private": {**base, "case": "unix_get", "url": private.unix_url, "server": "private"},
                "lease_copy": {**base, "case": "lease_copy"},
                "staged": {**base, "case": "staged_get"},
                "copyto": {**base, "case": "copyto"},
            }
            for procs in args.procs:
                runs: dict[str, list] = {name: [] for name in cases}
                for _ in range(args.pairs):
                    for name, cmd in cases.items():
                        pid = private.pid if cmd.get("server") == "private" else server.pid
                        runs[name].append(workers.run(procs, cmd, args.seconds, pid))
                row: dict[str, Any] = {
                    "block_bytes": bs,
                    "processes": procs,
                    "batch": args.batch,
                    "working_set_blocks": blocks,
                }
                for name, rs in runs.items():
                    row[name] = _median(rs)
                rate = {n: row[n]["bytes_per_s"] for n in cases}
                row["shared_over_private"] = rate["unix"] / rate["unix_private"]
                row["lease_over_unix"] = rate["lease_view"] / rate["unix"]
                row["lease_copy_over_staged"] = rate["lease_copy"] / rate["staged"]
                row["lease_copy_over_copyto"] = rate["lease_copy"] / rate["copyto"]
                label = f"lease {_size(bs)} ×{procs} proc"
                goals += [
                    _goal(f"{label}: lease+view / GET_INTO", row["lease_over_unix"], ">=", 10.0),
                    _goal(f"{label}: copy from lease / staged GET_INTO", row["lease_copy_over_staged"], ">=", 1.5),
                    _goal(
                        f"{label}: server CPU s per GB leased",
                        row["lease_view"]["server_cpu_s_per_gb"],
                        "<=",
                        0.01,
                        unit=" s/GB",
                    ),
                ]
                rows.append(row)
                rates = "  ".join(f"{n} {_gbps(rate[n])}" for n in cases)
                cpu = " ".join(
                    f"{n} {row[n]['client_cpu_s_per_gb']:.3f}·{row[n]['server_cpu_s_per_gb']:.4f}" for n in cases
                )
                print(
                    f"{label}: {rates} GB/s; lease/unix {row['lease_over_unix']:.1f}, "
                    f"lease_copy/staged {row['lease_copy_over_staged']:.2f}, "
                    f"lease_copy/copyto {row['lease_copy_over_copyto']:.2f}, "
                    f"GET_INTO shared/private arena {row['shared_over_private']:.2f}; "
                    f"cpu s/GB client·server {cpu}",
                    flush=True,
                )
    return rows, goals


def _writer(url: str, block_bytes: int, stop: Any) -> None:
    """A concurrent writer for part 4: PUTs and DELETEs keys of its own over
    the socket until ``stop`` is set (the shards write the index tables
    the probes read)."""
    c = kvtier.Client(url)
    data = bytes(block_bytes)
    i = 0
    while not stop.is_set():
        c.put(f"writer-{i % 256}", data)
        if i % 3 == 0:
            c.delete(f"writer-{(i + 128) % 256}")
        i += 1
    c.close()


def part_exists(server: ServerProcess, keys: list[str]) -> dict[str, Any]:
    """batch_is_exist and lookup of 64 stored keys, single calls, over the
    socket, answered from the shared index (docs/LOCAL.md), with and without
    a concurrent writer in another process; the same EXISTS from a minimal
    raw-frame client (a round trip: the server's share), and HTTP lookup of
    the same keys beside it."""
    keys = keys[:64]
    client = kvtier.Client(server.unix_url)
    http = kvtier.Client(server.url, connections=1)
    assert client.batch_is_exist(keys) == [1] * len(keys)

    def timed(fn: Any, n: int) -> list[float]:
        for _ in range(50):
            fn()
        out = []
        for _ in range(n):
            t = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t) / 1e3)
        return sorted(out)

    raw = RawSocket(server.socket_path or "")
    exists_payload = struct.pack("<I", len(keys)) + b"".join(struct.pack("<H", len(k)) + k.encode() for k in keys)
    assert raw.call(6, exists_payload)[0] == 0, "EXISTS failed"
    probes = client.local_stats()["index_probes"]
    unix_us = timed(lambda: client.batch_is_exist(keys), 3000)
    lookup_us = timed(lambda: client.lookup(keys), 3000)
    indexed = client.local_stats()["index_probes"] > probes
    raw_us = timed(lambda: raw.call(6, exists_payload), 3000)
    # The round trip the index saves, from Python: EXISTS on the client's
    # own framing (kvtier.local), as batch_is_exist sent it before.
    conn = LocalConnection(server.socket_path or "", timeout_s=30)
    conn.hello()
    trip_us = timed(lambda: conn.exists(keys), 3000)
    conn.close()
    http_us = timed(lambda: http.lookup(keys), 500)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    writer = ctx.Process(target=_writer, args=(server.unix_url, server_block_bytes(server), stop), daemon=True)
    writer.start()
    time.sleep(0.5)
    busy_exist_us = timed(lambda: client.batch_is_exist(keys), 3000)
    busy_lookup_us = timed(lambda: client.lookup(keys), 3000)
    stop.set()
    writer.join(30)
    assert client.batch_is_exist(keys) == [1] * len(keys), "the probes' keys stayed stored"
    client.close()
    http.close()
    raw.sock.close()
    pct = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    out = {
        "keys": len(keys),
        "unix_p50_us": pct(unix_us, 0.5),
        "unix_p99_us": pct(unix_us, 0.99),
        "answered_from_index": indexed,
        "unix_lookup_p50_us": pct(lookup_us, 0.5),
        "unix_lookup_p99_us": pct(lookup_us, 0.99),
        "busy_exist_p50_us": pct(busy_exist_us, 0.5),
        "busy_exist_p99_us": pct(busy_exist_us, 0.99),
        "busy_lookup_p50_us": pct(busy_lookup_us, 0.5),
        "busy_lookup_p99_us": pct(busy_lookup_us, 0.99),
        "python_exists_p50_us": pct(trip_us, 0.5),
        "python_exists_p99_us": pct(trip_us, 0.99),
        "raw_exists_p50_us": pct(raw_us, 0.5),
        "raw_exists_p99_us": pct(raw_us, 0.99),
        "http_lookup_p50_us": pct(http_us, 0.5),
        "http_lookup_p99_us": pct(http_us, 0.99),
    }
    print(
        f"batch_is_exist of {len(keys)} keys ({'shared index' if indexed else 'round trips'}):"
        f" p50 {out['unix_p50_us']:.0f} µs, p99 {out['unix_p99_us']:.0f} µs;"
        f" lookup p50 {out['unix_lookup_p50_us']:.0f} µs;"
        f" with a writer: exist p50/p99 {out['busy_exist_p50_us']:.0f}/{out['busy_exist_p99_us']:.0f} µs,"
        f" lookup {out['busy_lookup_p50_us']:.0f}/{out['busy_lookup_p99_us']:.0f} µs"
        f" (EXISTS round trip from Python p50 {out['python_exists_p50_us']:.0f} µs,"
        f" raw-frame p50 {out['raw_exists_p50_us']:.0f} µs;"
        f" HTTP lookup p50 {out['http_lookup_p50_us']:.0f} µs)",
        flush=True,
    )
    return out


def server_block_bytes(server: ServerProcess) -> int:
    """The server's block size (from its command line)."""
    return int(server.argv[server.argv.index("--block-bytes") + 1])


def fio(path: Path, bs: int, size: int, rw: str, depth: int, runtime_s: float | None) -> dict[str, float]:
    """One fio job (O_DIRECT, io_uring); bytes/s and client CPU s per GB."""
    argv = [
        "fio",
        "--name=bench",
        f"--filename={path}",
        f"--size={size}",
        f"--bs={bs}",
        f"--iodepth={depth}",
        f"--rw={rw}",
    ]
    argv += ["--direct=1", "--ioengine=io_uring", "--output-format=json", "--numjobs=1"]
    if runtime_s is not None:
        argv += ["--time_based", f"--runtime={runtime_s}"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    side = job["read" if "read" in rw else "write"]
    secs = job["job_runtime"] / 1e3
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * secs
    return {
        "bytes_per_s": float(side["bw_bytes"]),
        "client_cpu_s_per_gb": cpu_s / max(side["io_bytes"] / GB, 1e-9),
        "bytes": side["io_bytes"],
    }


def part_nvme_get(args: argparse.Namespace, workers: Workers, scratch: Path) -> tuple[list[dict], list[dict]]:
    rows, goals = [], []
    for bs in args.sizes:
        blocks = max(4 * args.batch, args.nvme_working_set_mib * MIB // bs)
        keys = [f"nvme-{bs}-{i}" for i in range(blocks)]
        ws = blocks * bs
        files = scratch / f"cold-files-{bs}"
        files.mkdir()
        bp.write_files(files, keys, bs)
        fio_file = scratch / f"fio-{bs}"
        fio(fio_file, bs, ws, "write", 16, None)  # lays the file out
        # Read in a shuffled order, as fio's randread: the log holds the
        # blocks in the order they were stored.
        order = random.Random(bs).sample(keys, len(keys))
        with ServerProcess(
            block_bytes=bs, ram_gb=0, disk_gb=ws * 2 / (1 << 30) + 1, data_dir=str(scratch / f"kv-nvme-{bs}")
        ) as server:
            bp.store_blocks(server, keys, bs)
            cmd = {"block_bytes": bs, "batch": args.batch, "keys": order, "case": "unix_get", "url": server.unix_url}
            runs: dict[str, list] = {"unix": [], "fio": [], "files": []}
            dropped = True
            for _ in range(args.pairs):
                dropped = bp.drop_caches() and dropped
                runs["unix"].append(workers.run(1, cmd, None, server.pid))
                runs["fio"].append(fio(fio_file, bs, ws, "randread", args.batch, None))
                dropped = bp.drop_caches() and dropped
                moved, elapsed, cpu = bp.read_files(files, order, bs, args.batch)
                runs["files"].append(
                    {"bytes_per_s": moved / elapsed, "client_cpu_s_per_gb": cpu / (moved / GB), "bytes": moved}
                )
        shutil.rmtree(files, ignore_errors=True)
        fio_file.unlink(missing_ok=True)
        row: dict[str, Any] = {
            "block_bytes": bs,
            "depth": args.batch,
            "working_set_blocks": blocks,
            "page_cache_dropped": dropped,
        }
        for name, rs in runs.items():
            row[name] = _median(rs)
        u = row["unix"]["bytes_per_s"]
        row["unix_over_fio"] = u / row["fio"]["bytes_per_s"]
        row["unix_over_files"] = u / row["files"]["bytes_per_s"]
        label = f"NVMe GET cold {_size(bs)} depth {args.batch}"
        goals += [
            _goal(f"{label}: unix / fio", row["unix_over_fio"], ">=", 0.9),
            _goal(
                f"{label}: unix / cold files" + ("" if dropped else " (page cache NOT dropped)"),
                row["unix_over_files"],
                ">=",
                1.5,
            ),
        ]
        rows.append(row)
        rates = "  ".join(f"{n} {_gbps(row[n]['bytes_per_s'])}" for n in runs)
        ratios = f"{row['unix_over_fio']:.2f} / {row['unix_over_files']:.2f}"
        note = "" if dropped else " (page cache not dropped: not root?)"
        print(f"{label}: {rates} GB/s; ratios {ratios}{note}", flush=True)
    return rows, goals


def part_put(args: argparse.Namespace, workers: Workers, scratch: Path) -> tuple[dict, list[dict]]:
    """Part 3: 16 MiB PUTs written in place (``batch_put_from`` out of
    registered memory, write-through), beside fio O_DIRECT sequential writes
    at the same depth and HTTP PUTs, and an older kvtier (``--before``) on the
    same socket path, alternating in every pair."""
    bs = 16 * MIB
    keys = [f"put-{i}" for i in range(args.put_keys)]
    ws = len(keys) * bs
    fio_file = scratch / "fio-put"

    def server(name: str, binary: str | None) -> ServerProcess:
        s = ServerProcess(
            block_bytes=bs,
            ram_gb=0.5,
            disk_gb=ws * 3 / (1 << 30) + 2,
            data_dir=str(scratch / f"kv-put-{name}"),
            args=("--write-policy", "through"),
        )
        if binary:
            s.argv[0] = binary
        return s

    with contextlib.ExitStack() as stack:
        now = stack.enter_context(server("now", None))
        before = stack.enter_context(server("before", args.before)) if args.before else None
        base = {"block_bytes": bs, "batch": args.batch, "keys": keys}
        runs: dict[str, list] = {"unix": [], "fio": [], "http": []}
        if before:
            runs["before"] = []
        for _ in range(args.pairs):
            runs["unix"].append(
                workers.run(1, {**base, "case": "unix_put", "url": now.unix_url}, args.seconds, now.pid)
            )
            if before:
                runs["before"].append(
                    workers.run(1, {**base, "case": "unix_put", "url": before.unix_url}, args.seconds, before.pid)
                )
            runs["fio"].append(fio(fio_file, bs, ws, "write", args.batch, args.seconds))
            runs["http"].append(workers.run(1, {**base, "case": "http_put", "url": now.url}, args.seconds, now.pid))
        with kvtier.Client(now.url) as c:
            from_ram = c.stats()["totals"].get("writes_from_ram", 0)
    fio_file.unlink(missing_ok=True)
    row: dict[str, Any] = {"block_bytes": bs, "depth": args.batch, "write_policy": "through"}
    row["writes_from_ram"] = from_ram
    for name, rs in runs.items():
        row[name] = _median(rs)
    row["unix_over_fio"] = row["unix"]["bytes_per_s"] / row["fio"]["bytes_per_s"]
    row["unix_over_http"] = row["unix"]["bytes_per_s"] / row["http"]["bytes_per_s"]
    row["client_cpu_unix_over_http"] = row["unix"]["client_cpu_s_per_gb"] / row["http"]["client_cpu_s_per_gb"]
    goals = [
        _goal("PUT 16 MiB: client CPU per GB, unix / http", row["client_cpu_unix_over_http"], "<=", 1 / 3),
        _goal("PUT 16 MiB in place: unix / fio write", row["unix_over_fio"], ">=", 0.9),
        _goal("PUT 16 MiB in place: unix / http", row["unix_over_http"], ">=", 1.0),
    ]
    if before:
        row["unix_over_before"] = row["unix"]["bytes_per_s"] / row["before"]["bytes_per_s"]
        row["server_cpu_unix_over_before"] = row["unix"]["server_cpu_s_per_gb"] / row["before"]["server_cpu_s_per_gb"]
        goals += [
            _goal("PUT 16 MiB in place: unix / the older build", row["unix_over_before"], ">=", 1.5),
            _goal("PUT 16 MiB: server CPU per GB / the older build", row["server_cpu_unix_over_before"], "<=", 0.5),
        ]
    rates = "  ".join(f"{n} {_gbps(row[n]['bytes_per_s'])}" for n in runs)
    cpu = " ".join(f"{n} {row[n]['client_cpu_s_per_gb']:.3f}" for n in ("unix", "http"))
    server_cpu = " ".join(f"{n} {row[n]['server_cpu_s_per_gb']:.3f}" for n in runs if n != "fio")
    p99 = " ".join(f"{n} {row[n]['step_p99_ms']:.1f}" for n in runs if n != "fio")
    ratio = row["client_cpu_unix_over_http"]
    print(
        f"PUT 16 MiB depth {args.batch}: {rates} GB/s; client cpu s/GB {cpu} (ratio {ratio:.2f}); "
        f"server cpu s/GB {server_cpu}; batch p99 ms {p99}; {from_ram} log writes from RAM",
        flush=True,
    )
    return row, goals


def part_replay(args: argparse.Namespace, scratch: Path) -> list[dict]:
    loadgen = os.environ.get("LOADGEN_BIN") or shutil.which("kvtier-loadgen")
    if not loadgen:
        raise FileNotFoundError("set LOADGEN_BIN to target/release/kvtier-loadgen")
    rows = []
    for transport in ("http", "unix"):
        with ServerProcess(
            block_bytes=args.replay_block_bytes, ram_gb=2, disk_gb=16, data_dir=str(scratch / f"kv-replay-{transport}")
        ) as server:
            url = server.url if transport == "http" else f"{server.unix_url}?http={server.url[len('http://') :]}"
            out = args.out / f"replay-{transport}"
            argv = [
                loadgen,
                "replay",
                "--target",
                url,
                "--users",
                str(args.replay_users),
                "--duration-s",
                str(args.replay_seconds),
            ]
            argv += ["--out", str(out), *args.replay_args]
            server_cpu0 = bp.proc_cpu_s(server.pid)
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            _, status, usage = os.wait4(proc.pid, 0)
            server_cpu_s = bp.proc_cpu_s(server.pid) - server_cpu0
            stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()  # type: ignore[union-attr]
            if status != 0:
                raise RuntimeError(f"{' '.join(argv)} failed:\n{stderr[-2000:]}")
            r = json.loads((out / "results.json").read_text())
            row = {
                "transport": r["transport"],
                "users": r["users"],
                "elapsed_s": r["elapsed_s"],
                "turns": r["turns"],
                "tokens_per_s": r["tokens_per_s"],
                "prefix_hit_rate": r["prefix_hit_rate"],
                "errors": r["errors"],
                "wrong_bytes": r["wrong_bytes"],
                "client_cpu_s": usage.ru_utime + usage.ru_stime,
                "server_cpu_s": server_cpu_s,
            }
            for op in ("lookup", "get", "put"):
                row[f"{op}_p50_us"] = r[f"{op}_latency"]["p50_us"]
                row[f"{op}_p99_us"] = r[f"{op}_latency"]["p99_us"]
            rows.append(row)
            print(stdout.strip().splitlines()[0], flush=True)
    return rows


# ------------------------------------------------------------------ report


def _size(bs: int) -> str:
    return f"{bs // MIB} MiB" if bs % MIB == 0 else f"{bs / 1e6:.1f} MB"


def _gbps(x: float) -> str:
    return f"{x / GB:.2f}"


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _cpu(r: dict[str, Any], *names: str, side: str = "client") -> str:
    return " · ".join(f"{r[n][f'{side}_cpu_s_per_gb']:.3f}" for n in names)


def markdown(summary: dict[str, Any]) -> str:
    """The tables of summary.md (docs/BENCHMARKS.md quotes them)."""
    out = [
        f"`make bench-local`: {summary['pairs']} pairs, {summary['seconds']} s per timed run, medians;"
        " GB/s, CPU seconds per GB moved.",
        "",
        "RAM-tier GET, batches of 16:",
        "",
        _row(
            "block", "procs", "unix", "copyto", "warm files (16 threads)", "warm files (1 thread, old)", "http",
            "unix/copyto", "unix/files", "unix/files (1 thread, old)", "unix/http",
            "client CPU/GB unix · http", "server CPU/GB unix · http",
        ),
        _row("---", *["---:"] * 12),
    ]  # fmt: skip
    for r in summary["ram_get"]:
        rates = [_gbps(r[n]["bytes_per_s"]) for n in ("unix", "copyto", "files", "files-1thread", "http")]
        ratios = [f"{r[f'unix_over_{n}']:.2f}" for n in ("copyto", "files", "files_1thread", "http")]
        cpu = [_cpu(r, "unix", "http"), _cpu(r, "unix", "http", side="server")]
        out.append(_row(_size(r["block_bytes"]), r["processes"], *rates, *ratios, *cpu))
    out += [
        "",
        "NVMe-tier GET, cold (`--ram-gb 0`), depth 16, the working set read once per run in a shuffled order:",
        "",
        _row(
            "block", "working set", "unix", "fio randread", "cold files", "unix/fio", "unix/files",
            "client CPU/GB unix · fio · files", "server CPU/GB",
        ),
        _row("---", *["---:"] * 8),
    ]  # fmt: skip
    for r in summary["nvme_get"]:
        files = _gbps(r["files"]["bytes_per_s"]) + ("" if r["page_cache_dropped"] else " (cache not dropped)")
        out.append(
            _row(
                _size(r["block_bytes"]),
                f"{r['working_set_blocks']} blocks",
                _gbps(r["unix"]["bytes_per_s"]),
                _gbps(r["fio"]["bytes_per_s"]),
                files,
                f"{r['unix_over_fio']:.2f}",
                f"{r['unix_over_files']:.2f}",
                _cpu(r, "unix", "fio", "files"),
                f"{r['unix']['server_cpu_s_per_gb']:.3f}",
            )
        )
    p = summary["put"]
    if p:
        names = [n for n in ("unix", "before", "fio", "http") if n in p]
        heads = {"unix": "unix", "before": "unix, older build", "fio": "fio write", "http": "http"}
        ratios = [("unix_over_fio", "unix/fio"), ("unix_over_http", "unix/http"), ("unix_over_before", "unix/older")]
        ratios = [(k, h) for k, h in ratios if k in p]
        out += [
            "",
            f"PUT 16 MiB written in place, write-through, depth {p['depth']}"
            f" ({p.get('writes_from_ram', 0)} log writes straight from RAM slots):",
            "",
            _row("", *[heads[n] for n in names], *[h for _, h in ratios]),
            _row("---", *["---:"] * (len(names) + len(ratios))),
            _row("GB/s", *[_gbps(p[n]["bytes_per_s"]) for n in names], *[f"{p[k]:.2f}" for k, _ in ratios]),
            _row("client CPU s/GB", *[f"{p[n]['client_cpu_s_per_gb']:.3f}" for n in names], *[""] * len(ratios)),
            _row(
                "server CPU s/GB",
                *["" if n == "fio" else f"{p[n]['server_cpu_s_per_gb']:.3f}" for n in names],
                *[""] * len(ratios),
            ),
            _row(
                "batch p50 / p99 ms",
                *["" if n == "fio" else f"{p[n]['step_p50_ms']:.1f} / {p[n]['step_p99_ms']:.1f}" for n in names],
                *[""] * len(ratios),
            ),
        ]
    e = summary["exists"] or {}
    how = "shared index" if e.get("answered_from_index") else "round trips"
    out += [
        "",
    ]
    if e:
        out.append(
            f"batch_is_exist of {e['keys']} stored keys (single calls, {how}): p50 {e['unix_p50_us']:.0f} µs,"
            f" p99 {e['unix_p99_us']:.0f} µs; lookup p50"
            f" {e.get('unix_lookup_p50_us', math.nan):.0f} µs; with a concurrent writer: batch_is_exist p50/p99"
            f" {e.get('busy_exist_p50_us', math.nan):.0f}/{e.get('busy_exist_p99_us', math.nan):.0f} µs, lookup"
            f" {e.get('busy_lookup_p50_us', math.nan):.0f}/{e.get('busy_lookup_p99_us', math.nan):.0f} µs;"
            f" EXISTS as a round trip from Python p50 {e.get('python_exists_p50_us', math.nan):.0f} µs;"
            f" the same EXISTS from a minimal raw-frame client (the server's share)"
            f" p50 {e.get('raw_exists_p50_us', math.nan):.0f} µs, p99 {e.get('raw_exists_p99_us', math.nan):.0f} µs;"
            f" HTTP `lookup` of the same keys p50 {e['http_lookup_p50_us']:.0f} µs,"
            f" p99 {e['http_lookup_p99_us']:.0f} µs."
        )
    out += [
        "",
        "Replay (`kvtier-loadgen replay`, a fresh server each, one after the other):",
        "",
        _row(
            "transport", "users", "tokens/s", "hit rate", "lookup p50/p99 µs", "GET p50/p99 µs", "PUT p50/p99 µs",
            "errors", "client CPU s", "server CPU s",
        ),
        _row("---", *["---:"] * 9),
    ]  # fmt: skip
    for r in summary["replay"]:
        lat = [f"{r[f'{op}_p50_us']}/{r[f'{op}_p99_us']}" for op in ("lookup", "get", "put")]
        out.append(
            _row(
                r["transport"],
                r["users"],
                f"{r['tokens_per_s']:,.0f}",
                f"{r['prefix_hit_rate'] * 100:.1f} %",
                *lat,
                r["errors"] + r["wrong_bytes"],
                f"{r['client_cpu_s']:.1f}",
                f"{r['server_cpu_s']:.1f}",
            )
        )
    out += [
        "",
        "Leases (`--ram-shared on`), RAM tier, batches of 16: until the consumer holds every block readable",
        "(lease_view: LEASE + numpy views in place; unix: GET_INTO a registered buffer; lease_copy: LEASE +",
        "copy into the consumer's anonymous buffer + generation check; staged: get_many_into those buffers",
        "through the client's staging):",
        "",
        _row(
            "block", "procs", "lease_view", "unix", "unix (private arena)", "lease_copy", "staged", "copyto",
            "lease_view/unix", "lease_copy/staged", "lease_copy/copyto", "unix shared/private",
            "server CPU/GB lease_view · unix",
        ),
        _row("---", *["---:"] * 12),
    ]  # fmt: skip
    for r in summary["lease"]:
        names = ("lease_view", "unix", "unix_private", "lease_copy", "staged", "copyto")
        rates = [_gbps(r[n]["bytes_per_s"]) for n in names]
        ratios = [
            f"{r[k]:.2f}"
            for k in ("lease_over_unix", "lease_copy_over_staged", "lease_copy_over_copyto", "shared_over_private")
        ]
        cpu = f"{r['lease_view']['server_cpu_s_per_gb']:.4f} · {r['unix']['server_cpu_s_per_gb']:.4f}"
        out.append(_row(_size(r["block_bytes"]), r["processes"], *rates, *ratios, cpu))
    out += ["", "Goals:", "", _row("goal", "measured", "target", ""), _row("---", "---:", "---:", "---")]
    for g in summary["goals"]:
        op = g["op"].replace(">=", "≥").replace("<=", "≤")
        if g["unit"] == "×":
            value, target = f"{g['value']:.2f}×", f"{op} {g['target']:.2f}×"
        else:
            value, target = f"{g['value']:.3g} {g['unit'].strip()}", f"{op} {g['target']:.3g} {g['unit'].strip()}"
        out.append(_row(g["goal"], value, target, "pass" if g["pass"] else "**FAIL**"))
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("target/bench/local"))
    ap.add_argument("--sizes", default="16777216,1228800", help="block sizes in bytes, comma-separated")
    ap.add_argument("--procs", default="1,8", help="client processes for the RAM-tier GETs, comma-separated")
    ap.add_argument("--batch", type=int, default=16, help="items per batch call (and fio's depth)")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per timed run")
    ap.add_argument("--pairs", type=int, default=3, help="alternations of every contender (median reported)")
    ap.add_argument(
        "--ram-working-set-mib", type=int, default=512, help="blocks stored for the RAM-tier GETs, per size"
    )
    ap.add_argument(
        "--nvme-working-set-mib", type=int, default=1024, help="blocks read once per run for the cold GETs, per size"
    )
    ap.add_argument("--put-keys", type=int, default=64, help="keys the PUTs cycle through")
    ap.add_argument("--replay-users", type=int, default=8)
    ap.add_argument("--replay-seconds", type=float, default=20.0)
    ap.add_argument("--replay-block-bytes", type=int, default=16 * MIB)
    ap.add_argument(
        "--replay-args",
        default="",
        help="more kvtier-loadgen replay flags, e.g. '--dataset-path tests/data/sharegpt_sample.json'",
    )
    ap.add_argument("--skip", default="", help="parts to skip, comma-separated: ram,nvme,put,lease,replay")
    ap.add_argument(
        "--before", default=None, help="an older kvtier binary whose socket PUTs run beside this one's (the PUT part)"
    )
    args = ap.parse_args()
    if args.pairs < 1 or args.seconds <= 0 or args.batch < 1:
        ap.error("--pairs and --batch must be at least 1 and --seconds positive")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.procs = [int(p) for p in args.procs.split(",")]
    args.replay_args = args.replay_args.split()
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=args.out))
    started = time.monotonic()
    summary: dict[str, Any] = {
        "pairs": args.pairs,
        "seconds": args.seconds,
        "batch": args.batch,
        "sizes": args.sizes,
        "processes": args.procs,
        "cpus": os.cpu_count(),
        "goals": [],
        "ram_get": [],
        "nvme_get": [],
        "put": None,
        "exists": None,
        "replay": [],
        "lease": [],
    }
    workers = Workers(max(args.procs))
    try:
        if "ram" not in skip:
            summary["ram_get"], goals, summary["exists"] = part_ram_get(args, workers, scratch)
            summary["goals"] += goals
            e = summary["exists"]
            summary["goals"] += [
                _goal("batch_is_exist of 64 keys: p50", e["unix_p50_us"], "<=", 50, "µs"),
                _goal("batch_is_exist of 64 keys, a writer busy: p50", e["busy_exist_p50_us"], "<=", 20, "µs"),
                _goal("batch_is_exist of 64 keys, a writer busy: p99", e["busy_exist_p99_us"], "<=", 100, "µs"),
                _goal("lookup of 64 keys, a writer busy: p50", e["busy_lookup_p50_us"], "<=", 20, "µs"),
                _goal("lookup of 64 keys, a writer busy: p99", e["busy_lookup_p99_us"], "<=", 100, "µs"),
            ]
        if "nvme" not in skip:
            summary["nvme_get"], goals = part_nvme_get(args, workers, scratch)
            summary["goals"] += goals
        if "put" not in skip:
            summary["put"], goals = part_put(args, workers, scratch)
            summary["goals"] += goals
        if "lease" not in skip:
            summary["lease"], goals = part_lease(args, workers)
            summary["goals"] += goals
        if "replay" not in skip:
            summary["replay"] = part_replay(args, scratch)
    finally:
        workers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    summary["elapsed_s"] = time.monotonic() - started
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not skip:
        (args.out / "summary.md").write_text(markdown(summary))
    print("\ngoals:")
    for g in summary["goals"]:
        print(
            f"  {'pass' if g['pass'] else 'FAIL'}  {g['goal']}: {g['value']:.2f} (target {g['op']} {g['target']:.2f})"
        )
    print(
        f"wrote {args.out / 'summary.json'}"
        + ("" if skip else f" and {args.out / 'summary.md'}")
        + f" in {summary['elapsed_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    sys.exit(main())
