#!/usr/bin/env python3
"""Runs test suites (make targets) one after another, keeps going past a
failure, and ends with one summary: each suite's result and time, every
shard stall of a second or more that any server of the run reported (one
that kvtier's own thread accounts for fails the run; one spent waiting for
the machine, memory being reclaimed or a CPU other processes held, or
held by a test that stopped the server with SIGSTOP or held its sends
with strace (``kvtier.testing.note_stopped``), is listed, not counted),
every kvtier process the kernel logged as killed by a fault (a segfault:
its clients saw only the connection end) since the run began, which fails
the run, and an exit status that is non-zero if anything failed.

``make test`` and ``make test-all`` call it (docs/TESTING.md). Each suite's
output goes to the terminal and to ``LOG_DIR/SUITE.log``; every kvtier
server a test starts appends its stalls to ``LOG_DIR/stalls.jsonl``
(``KVTIER_STALL_LOG``, read by ``kvtier serve --stall-log``), and the test
servers' and engines' logs are kept under ``LOG_DIR/servers/``
(``KVTIER_TEST_LOG_DIR``, read by ``kvtier.testing``).

Usage: run_suites.py [--log-dir DIR] [--first A+B] SUITE [SUITE ...]

``--first A+B`` runs make targets A and B at once before the suites (the
test environments' installs beside the debug build); a failure there
stops the run, since every suite needs both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: A stall this long fails the run (docs/TESTING.md).
STALL_FAIL_MS = 1000.0


#: A kernel log line of a kvtier process (any thread: ``kvtier``,
#: ``kvtier-shard-0-``) killed by a fault: ``kvtier-shard-0-[21844]: segfault
#: at ...``, ``traps: kvtier[123] general protection ...``.
CRASH = re.compile(r"\b(kvtier[\w-]*)\[(\d+)\]:? (segfault|general protection|trap|invalid opcode)")


def kernel_log() -> list[str] | None:
    """The kernel's log (``dmesg``), or None where it cannot be read."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def crashes(before: list[str] | None) -> list[str] | None:
    """The kernel's lines on kvtier processes killed by a fault since
    ``before`` was read (a server a test started died where no test meant
    it to: its client saw only EOF), or None where the log cannot be read."""
    after = kernel_log()
    if before is None or after is None:
        return None
    seen = set(before)
    return [line for line in after if line not in seen and CRASH.search(line)]


def run(target: str, log_dir: Path) -> tuple[int, float]:
    """``make TARGET``, its output to the terminal and its log; (status, seconds)."""
    started = time.monotonic()
    with open(log_dir / f"{target}.log", "wb") as log:
        proc = subprocess.Popen(
            [os.environ.get("MAKE", "make"), "--no-print-directory", target],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
            log.write(line)
        status = proc.wait()
    return status, time.monotonic() - started


def first(targets: list[str], log_dir: Path) -> tuple[int, float]:
    """``make`` of each target at once, each to its own log; (worst status, seconds)."""
    started = time.monotonic()
    procs = []
    for target in targets:
        log = open(log_dir / f"{target}.log", "wb")  # noqa: SIM115 (closed below, once its make ends)
        print(f"run_suites: {target} (log: {log_dir / (target + '.log')})", flush=True)
        procs.append(
            (
                target,
                log,
                subprocess.Popen(
                    [os.environ.get("MAKE", "make"), "--no-print-directory", target],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    worst = 0
    for target, log, proc in procs:
        status = proc.wait()
        log.close()
        if status:
            print(f"run_suites: {target} failed (exit {status}); its log ends:", flush=True)
            sys.stdout.write(Path(log.name).read_text(errors="replace")[-4000:])
        worst = worst or status
    return worst, time.monotonic() - started


def own_ms(stall: dict[str, object]) -> float:
    """How much of a stall kvtier's own thread accounts for (engine/src/stall.rs,
    ``StallRecord::own_ms``): all of it when it computed or blocked in a call
    that can block, its CPU time when it waited for the machine (memory
    being reclaimed, a CPU other processes held)."""
    if stall.get("cause") in ("computing", "blocked"):
        return float(stall.get("duration_ms", 0.0))  # type: ignore[arg-type]
    return float(stall.get("cpu_ms", 0.0))  # type: ignore[arg-type]


def window(stall: dict[str, object]) -> tuple[float, float]:
    """When ``stall`` began and ended (Unix seconds; the end as the shard's
    thread read it)."""
    end = float(stall.get("unix_s", 0.0))  # type: ignore[arg-type]
    return end - float(stall.get("duration_ms", 0.0)) / 1000, end  # type: ignore[arg-type]


def held_by_tests_ms(stall: dict[str, object], stops: list[dict[str, object]]) -> float:
    """How much of ``stall`` a test's own hold of that server covered
    (``kvtier.testing.note_stopped``): a SIGSTOP (``held`` "process": the
    server's threads stop wherever they are, so the shard's run that was
    going on lasts the stop), or its sends delayed by strace (``held``
    "sends": a stall whose innermost frame is a send)."""
    start, end = window(stall)
    frames = stall.get("frames") or [""]
    in_send = "send" in str(frames[0])  # type: ignore[index]
    spans = sorted(
        (max(start, float(s["from_unix_s"])), min(end, float(s["to_unix_s"])))  # type: ignore[arg-type]
        for s in stops
        if s.get("pid") == stall.get("pid") and not (s.get("held") == "sends" and not in_send)
    )
    held, reached = 0.0, start  # the union of the holds within the stall: overlapping ones count once
    for a, b in spans:
        if b > max(a, reached):
            held += b - max(a, reached)
            reached = b
    return held * 1000


def hold_kind(stall: dict[str, object], stops: list[dict[str, object]]) -> str:
    """How the test held the server during ``stall``, for the summary."""
    start, end = window(stall)
    kinds = {
        str(s.get("held", "process"))
        for s in stops
        if s.get("pid") == stall.get("pid") and float(s["from_unix_s"]) < end and float(s["to_unix_s"]) > start  # type: ignore[arg-type]
    }
    return " and ".join(
        {"process": "stopped by a test (SIGSTOP)", "sends": "its sends held by a test (strace)"}[k]
        for k in sorted(kinds)
    )


def stalls(path: Path) -> list[dict[str, object]]:
    """Every stall recorded in ``path`` (JSON lines), none when absent."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-dir", type=Path, default=Path("target/test-logs"))
    parser.add_argument("--first", default="", help="make targets to run at once first, joined by +")
    parser.add_argument("suites", nargs="+")
    args = parser.parse_args()
    log_dir: Path = args.log_dir.resolve()
    shutil.rmtree(log_dir, ignore_errors=True)
    (log_dir / "servers").mkdir(parents=True)
    stall_log = log_dir / "stalls.jsonl"
    # Servers a test runs as another user (uid 65534) append to it too.
    stall_log.touch()
    stall_log.chmod(0o666)
    os.environ["KVTIER_STALL_LOG"] = str(stall_log)
    os.environ["KVTIER_TEST_LOG_DIR"] = str(log_dir / "servers")
    results: list[tuple[str, int, float]] = []
    kernel_before = kernel_log()
    started = time.monotonic()
    if args.first:
        status, seconds = first(args.first.split("+"), log_dir)
        results.append((args.first, status, seconds))
    if not results or results[0][1] == 0:
        for suite in args.suites:
            print(f"\nrun_suites: {suite}", flush=True)
            status, seconds = run(suite, log_dir)
            results.append((suite, status, seconds))
    total = time.monotonic() - started
    found = stalls(stall_log)
    stops = stalls(log_dir / "servers" / "stopped.jsonl")  # a test's own SIGSTOPs (kvtier.testing)
    held = {id(s): held_by_tests_ms(s, stops) for s in found}  # type: ignore[arg-type]
    long = [s for s in found if own_ms(s) - held[id(s)] >= STALL_FAIL_MS]
    starved = [s for s in found if s not in long and float(s["duration_ms"]) >= STALL_FAIL_MS]  # type: ignore[arg-type]
    print("\nrun_suites: summary")
    for suite, status, seconds in results:
        print(f"  {'ok  ' if status == 0 else 'FAIL'} {suite:<28} {seconds:7.1f} s")
    skipped = [s for s in args.suites if s not in {r[0] for r in results}]
    for suite in skipped:
        print(f"  skip {suite:<28}  (not run: the set-up above failed)")
    print(f"  total {total:.1f} s ({total / 60:.1f} min); logs in {log_dir}")
    print(
        f"  shard stalls reported by the test servers: {len(found)}; {len(long)} of kvtier's own of "
        f"{STALL_FAIL_MS:.0f} ms or more; {len(starved)} that long waiting for the machine (memory, a CPU: not counted)"
    )
    for s in long + starved:
        frames = " <- ".join(s.get("frames", []))  # type: ignore[arg-type]
        verdict = "FAIL" if s in long else "note"
        stopped = f", {held[id(s)]:.0f} ms of it {hold_kind(s, stops)}" if held[id(s)] else ""
        print(
            f"    {verdict} stall of {s['duration_ms']:.0f} ms on shard {s['shard']} (pid {s['pid']}), "
            f"{s.get('cause')}, {s.get('cpu_ms', 0):.0f} ms on a CPU{stopped}: {frames}"
        )
    died = crashes(kernel_before)
    if died is None:
        print("  kvtier processes killed by a fault: not checked (the kernel log, dmesg, cannot be read here)")
    else:
        print(f"  kvtier processes killed by a fault (the kernel log): {len(died)}")
        for line in died:
            print(f"    FAIL {line.strip()}")
    died = died or []
    failed = [r for r in results if r[1] != 0]
    if failed or long or skipped or died:
        print(
            f"run_suites: FAILED ({len(failed)} suites failed, {len(long)} long stalls, "
            f"{len(died)} kvtier processes killed by a fault)"
        )
        return 1
    print("run_suites: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
