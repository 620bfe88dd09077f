"""Latency of two kvtier builds, alternated in one run: what replacing the
engine's and the server's timed polling with named waits (issue 44) did.

Per round and build, on a fresh data directory (2 shards): PUT p50 at
concurrency 1 (h2c), GET p50 at concurrency 1 from the RAM tier and from
the NVMe log (`--ram-gb 0`), each over h2c and the same-host socket
(`kvtier-loadgen blocks`); `batch_is_exist` of 64 stored keys over the
socket (the Python client, p50 of 2,000 calls); and a clean stop
(SIGTERM to exit) with 8 idle same-host connections open. Builds
alternate within each round, first one then the other, and the order
flips each round; medians over rounds are printed with the ratio
after/before.

    python bench_waits.py --before OLD/kvtier --after NEW/kvtier \
        --loadgen target/release/kvtier-loadgen --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import kvtier
from kvtier.testing import free_port

BLOCK_BYTES = 1 << 20


def start(binary: str, data: Path, ram_gb: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """A server on a free port: (process, http url, unix url)."""
    port = free_port()
    args = [binary, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", str(data), "--shards", "2"]
    args += ["--block-bytes", str(BLOCK_BYTES), "--disk-gb", "2", "--ram-gb", ram_gb, "--log-level", "warn"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if "listening" not in line:
        raise RuntimeError(f"{binary} did not start: {line!r}")
    return proc, f"http://127.0.0.1:{port}", f"unix://{data / 'kvtier.sock'}"


def loadgen(tool: str, target: str, op: str, seconds: float, out: Path) -> float:
    """p50 in µs of `kvtier-loadgen blocks` at concurrency 1."""
    subprocess.run(
        [
            tool,
            "blocks",
            "--target",
            target,
            "--op",
            op,
            "--concurrency",
            "1",
            "--duration-s",
            str(seconds),
            "--out",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result = json.loads((out / "results.json").read_text())
    return float(find_p50(result))


def find_p50(doc: Any) -> float:
    """The first `p50_us` (or `latency_us.p50`) in a results.json."""
    if isinstance(doc, dict):
        for key in ("p50_us", "latency_us_p50"):
            if key in doc:
                return float(doc[key])
        if "latency_us" in doc and isinstance(doc["latency_us"], dict) and "p50" in doc["latency_us"]:
            return float(doc["latency_us"]["p50"])
        for v in doc.values():
            try:
                return find_p50(v)
            except KeyError:
                pass
    if isinstance(doc, list):
        for v in doc:
            try:
                return find_p50(v)
            except KeyError:
                pass
    raise KeyError("p50")


def exists_p50_us(unix_url: str, http_url: str) -> float:
    """p50 of batch_is_exist over 64 stored keys, 2,000 calls."""
    keys = [f"exists-{i}" for i in range(64)]
    with kvtier.Client(http_url, connections=1) as http:
        for k in keys:
            http.put(k, bytes(BLOCK_BYTES))
    client = kvtier.Client(unix_url)
    assert client.batch_is_exist(keys) == [1] * len(keys)
    for _ in range(100):
        client.batch_is_exist(keys)
    times = []
    for _ in range(2000):
        t = time.perf_counter_ns()
        client.batch_is_exist(keys)
        times.append((time.perf_counter_ns() - t) / 1e3)
    client.close()
    return statistics.median(times)


def stop_ms_with_idle_sockets(proc: subprocess.Popen[bytes], unix_url: str) -> float:
    """SIGTERM to exit, in ms, with 8 idle same-host connections open."""
    idle = [kvtier.Client(unix_url) for _ in range(8)]
    for c in idle:
        c.batch_is_exist(["warm"])
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    elapsed = (time.perf_counter() - t) * 1e3
    for c in idle:
        try:
            c.close()
        except Exception:
            pass
    return elapsed


def one(binary: str, tool: str, seconds: float, work: Path) -> dict[str, float]:
    """Every figure of one build, one round."""
    out: dict[str, float] = {}
    for tier, ram_gb in (("ram", "0.5"), ("nvme", "0")):
        with tempfile.TemporaryDirectory(dir=work) as d:
            proc, http_url, unix_url = start(binary, Path(d) / "data", ram_gb)
            try:
                if tier == "ram":
                    out["put_h2c"] = loadgen(tool, http_url, "put", seconds, Path(d) / "put")
                else:
                    loadgen(tool, http_url, "put", seconds, Path(d) / "put")
                out[f"get_{tier}_h2c"] = loadgen(tool, http_url, "get", seconds, Path(d) / "get-h2c")
                out[f"get_{tier}_unix"] = loadgen(tool, unix_url, "get", seconds, Path(d) / "get-unix")
                if tier == "ram":
                    out["exists64_unix"] = exists_p50_us(unix_url, http_url)
                    out["stop_ms_idle_sockets"] = stop_ms_with_idle_sockets(proc, unix_url)
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
    return out


def main() -> None:
    """Runs the rounds and prints the medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="kvtier binary before the change")
    ap.add_argument("--after", required=True, help="kvtier binary after the change")
    ap.add_argument("--loadgen", required=True, help="kvtier-loadgen binary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per loadgen run")
    ap.add_argument("--out", default="target/bench/waits", help="directory for results.json")
    args = ap.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = [("before", args.before), ("after", args.after)]
        for name, binary in order if r % 2 == 0 else order[::-1]:
            runs[name].append(one(binary, args.loadgen, args.seconds, work))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    figures = sorted(runs["before"][0])
    summary = {}
    print(f"\n{'figure':24} {'before':>10} {'after':>10} {'after/before':>13}")
    for f in figures:
        b = statistics.median(x[f] for x in runs["before"])
        a = statistics.median(x[f] for x in runs["after"])
        summary[f] = {"before": b, "after": a, "ratio": a / b if b else None}
        print(f"{f:24} {b:10.1f} {a:10.1f} {a / b:13.2f}")
    (work / "results.json").write_text(
        json.dumps({"runs": runs, "medians": summary, "machine_cpus": os.cpu_count()}, indent=2)
    )


if __name__ == "__main__":
    main()
