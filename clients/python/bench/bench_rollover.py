"""What a segment rollover costs a shard's other requests (issue 61):
RAM-tier GETs' and PUTs' p99 while a writer rolls the log over new segment
files, against the same with no rollover, and what the stall detector
costs, in one run.

Two configurations of one release build (2 shards, 1 MiB blocks, a 256 MiB
RAM tier holding a hot set of 32 blocks): ``rollover`` with 8 MiB segments
(a new segment file, made with two fsyncs, every 7 blocks a shard writes)
and ``steady`` with 1 GiB segments (no rollover while measured). In each, a
writer PUTs new blocks at full speed from 2 threads while a reader GETs the
hot set from 2 threads, for ``--seconds``; per operation p50 and p99 (ms),
and the stall detector's reports. A third configuration, ``no-detector``,
is ``rollover`` with ``--stall-threshold-ms 0``: its throughput beside
``rollover``'s is the detector's cost. Configurations alternate within a
round, the order flips each round; medians over rounds are printed with
the ratios, and written to OUT/results.json.

    python bench_rollover.py --kvtier target/release/kvtier --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kvtier
from kvtier.testing import ServerProcess

BLOCK_BYTES = 1 << 20
HOT = 32
CONFIGS: dict[str, tuple[str, ...]] = {
    "rollover": ("--segment-mib", "8"),
    "steady": ("--segment-mib", "1024"),
    "no-detector": ("--segment-mib", "8", "--stall-threshold-ms", "0"),
}


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def measure(name: str, seconds: float) -> dict[str, Any]:
    """One configuration on a fresh data directory: latencies and counts."""
    with tempfile.TemporaryDirectory(prefix="kvtier-rollover-") as data:
        server = ServerProcess(
            block_bytes=BLOCK_BYTES,
            ram_gb=0.25,
            disk_gb=4,
            data_dir=data,
            args=(*CONFIGS[name], "--stall-log", f"{data}.stalls.jsonl"),
        )
        with server:
            hot = [f"hot-{i}" for i in range(HOT)]
            payload = bytes(range(256)) * (BLOCK_BYTES // 256)
            with kvtier.Client(server.url, connections=8, timeout_s=30) as c:
                for k in hot:
                    c.put(k, payload)
                stop = threading.Event()
                gets: list[float] = []
                puts: list[float] = []

                def reader(n: int) -> None:
                    buf = bytearray(BLOCK_BYTES)
                    i = n
                    while not stop.is_set():
                        started = time.perf_counter()
                        assert c.get_into(hot[i % HOT], buf)
                        gets.append((time.perf_counter() - started) * 1e3)
                        i += 1

                def writer(n: int) -> None:
                    i = 0
                    while not stop.is_set():
                        started = time.perf_counter()
                        c.put(f"w{n}-{i}", payload)
                        puts.append((time.perf_counter() - started) * 1e3)
                        i += 1

                threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
                threads += [threading.Thread(target=writer, args=(n,)) for n in range(2)]
                for t in threads:
                    t.start()
                time.sleep(seconds)
                stop.set()
                for t in threads:
                    t.join()
                stats = c.stats()
        stalls_log = Path(f"{data}.stalls.jsonl")
        stalls = [json.loads(line) for line in stalls_log.read_text().splitlines()] if stalls_log.exists() else []
        stalls_log.unlink(missing_ok=True)
    segments = sum(s["segments"] for s in stats["per_shard"])
    return {
        "get_ms_p50": percentile(gets, 0.5),
        "get_ms_p99": percentile(gets, 0.99),
        "put_ms_p50": percentile(puts, 0.5),
        "put_ms_p99": percentile(puts, 0.99),
        "gets": len(gets),
        "puts": len(puts),
        "segments": segments,
        "stalls": len(stalls),
        "stall_ms_max": max((s["duration_ms"] for s in stalls), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvtier", default="target/release/kvtier")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("target/bench/rollover"))
    args = parser.parse_args()
    os.environ["KVTIER_BIN"] = str(Path(args.kvtier).resolve())  # the build ServerProcess starts
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            result = measure(name, args.seconds)
            runs[name].append(result)
            print(f"round {r + 1} {name:<12} {json.dumps(result)}", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    ratios = {
        "get_p99_rollover_over_steady": med["rollover"]["get_ms_p99"] / med["steady"]["get_ms_p99"],
        "put_p99_rollover_over_steady": med["rollover"]["put_ms_p99"] / med["steady"]["put_ms_p99"],
        "gets_detector_over_none": med["rollover"]["gets"] / med["no-detector"]["gets"],
        "puts_detector_over_none": med["rollover"]["puts"] / med["no-detector"]["puts"],
    }
    print("\nmedians over rounds:")
    for name, m in med.items():
        print(
            f"  {name:<12} GET p50 {m['get_ms_p50']:.2f} p99 {m['get_ms_p99']:.2f} ms ({m['gets']:.0f}); "
            f"PUT p50 {m['put_ms_p50']:.2f} p99 {m['put_ms_p99']:.2f} ms ({m['puts']:.0f}); "
            f"segments {m['segments']:.0f}; stalls {m['stalls']:.0f} (longest {m['stall_ms_max']:.0f} ms)"
        )
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"runs": runs, "medians": med, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
