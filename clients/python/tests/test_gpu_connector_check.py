"""``make gpu-check``'s connector step (tools/gpu_connector_check.py) on this
machine's CPU: the vLLM connector's worker data path driven with torch alone,
vLLM made unimportable as on a GPU machine that has none, every byte stored
and loaded (per layer through the graph's reads, and in the background)
checked against a real ``kvtier serve``. On a GPU the same script also
holds the forward's writes behind a sleep and proves it can see a missing
stream order; that part needs CUDA and runs in ``make gpu-check``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_connector_check.py"


def test_the_gpu_check_of_the_connectors_data_path_runs_without_vllm_and_checks_every_byte(tmp_path):
    code = (
        "import runpy, sys; sys.modules['vllm'] = None\n"
        f"sys.argv = ['gpu_connector_check', '--device', 'cpu', '--trials', '2', '--out', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(TOOL)!r}, run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu_connector.json").read_text())
    assert result["wrong"] == {"stores": 0, "layer_loads": 0, "async_loads": 0}, result
    assert result["wrong_without_order"] is None  # no streams on the CPU
