"""A tiny run of `make bench-python`, so the benchmark never rots: every
contender runs, and the summary has every case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_python.py"


def test_bench_python_tiny_run(tmp_path):
    if not os.environ.get("LOADGEN_BIN"):
        pytest.skip("LOADGEN_BIN is not set (make test-python sets it)")
    out = tmp_path / "out"
    argv = [sys.executable, str(BENCH), "--out", str(out), "--sizes", "65536", "--concurrency", "1,2"]
    argv += ["--seconds", "0.3", "--pairs", "1", "--working-set-mib", "1", "--keep-page-cache"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    cases = [(r["op"], r["concurrency"]) for r in summary["transfer"]]
    assert cases == [("get", 1), ("get", 2), ("put", 1), ("put", 2)]
    for row in summary["transfer"]:
        for name in ("kvtier", "http.client", "loadgen"):
            assert row[name]["bytes_per_s"] > 0, (name, row)
        assert row["kvtier_over_best_reference"] > 0
    temps = [(r["temperature"], r["concurrency"]) for r in summary["files"]]
    assert temps == [("warm", 1), ("warm", 2), ("cold", 1), ("cold", 2)]
    assert all(r["kvtier_bytes_per_s"] > 0 and r["file_bytes_per_s"] > 0 for r in summary["files"])


def test_bench_python_refuses_bad_arguments(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(tmp_path), "--pairs", "0"], capture_output=True, text=True
    )
    assert run.returncode == 2 and "--pairs must be at least 1" in run.stderr
