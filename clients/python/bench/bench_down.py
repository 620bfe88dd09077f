"""What a kvtier that is down or stopped costs a real ``vllm serve``
(``KvtierConnector`` with its default settings: ``lookup_timeout_ms`` 0,
``lookup_give_up_ms`` 100, ``timeout_s`` 10, ``down_s`` 1), in one run:

- ``up``: kvtier serving (every prompt new to it: a lookup that misses, then
  the prompt's blocks stored);
- ``killed``: kvtier ``kill -9`` (its socket file left behind, its port
  closed), then started again for the next round;
- ``stopped``: kvtier held with SIGSTOP (its socket and port accept, nothing
  answers), then SIGCONT.

Each round runs the phases in turn (so a noisy moment hits each alike), each
phase the same ``--prompts`` ShareGPT prompts one at a time, each prompt a
miss in vLLM (its prefix cache emptied before each) and in kvtier (a salt
per round and phase in front). Reports per phase TTFT p50/p99/max, output
tokens/s, and against ``up``: the TTFT growth (median and worst request)
and the tokens/s ratio. The goal (issue 53): TTFT grows by at most the
lookup deadline plus 5 ms, tokens/s >= 0.9x. Writes ``--out``/down.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_engine import BLOCK_BYTES, pct, stream

from kvtier.testing import ServerProcess, VllmServer, free_port, sharegpt_conversations

PHASES = ("up", "killed", "stopped")


def prompts_of(path: Path, count: int, seed: int) -> list[str]:
    """``count`` ShareGPT conversations drawn by ``seed``, each cut at a word
    near 2,500 characters (about 5 blocks of the test model)."""
    texts = ["\n".join(t.get("value", "") for t in c) for c in sharegpt_conversations(path, 8_000_000)]
    texts = [t for t in texts if len(t) >= 3000]
    return [t[: t.rfind(" ", 0, 2500)] for t in random.Random(seed).sample(texts, count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model made by tools/make_model.py")
    parser.add_argument("--sharegpt", type=Path, required=True, help="ShareGPT V3's JSON")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("target/bench/down"))
    args = parser.parse_args()
    prompts = prompts_of(args.sharegpt, args.prompts, 53)
    port = free_port()
    store = ServerProcess(block_bytes=BLOCK_BYTES, ram_gb=0.25, disk_gb=2, port=port)
    config = {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"url": store.url},
    }
    engine = VllmServer(args.model, python=sys.executable, kv_transfer_config=config)
    samples: dict[str, list[dict[str, Any]]] = {p: [] for p in PHASES}
    wall: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    store.start()
    try:
        engine.start()
        for p in prompts[:2]:  # warm-up: the first requests of a vLLM are slower
            engine.complete(p, 4)
        for r in range(args.rounds):
            for phase in PHASES:
                if phase == "killed":
                    store.kill()
                elif phase == "stopped":
                    os.kill(store.pid, signal.SIGSTOP)
                started = time.perf_counter()
                for i, p in enumerate(prompts):
                    engine.reset_prefix_cache()
                    got = stream(engine.url, f"[{r}.{phase}.{i}] {p}", args.max_tokens)
                    samples[phase].append(got)
                wall[phase] += time.perf_counter() - started
                if phase == "killed":
                    store.start()
                elif phase == "stopped":
                    os.kill(store.pid, signal.SIGCONT)
                time.sleep(1.5)  # the connector's down window, then its probe
    finally:
        engine.stop()
        store.stop()
    result: dict[str, Any] = {"prompts": len(prompts), "rounds": args.rounds, "phases": {}}
    up_ttft = [s["ttft_s"] for s in samples["up"]]
    for phase in PHASES:
        ttft = [s["ttft_s"] for s in samples[phase]]
        tokens = sum(len(s["tokens"]) for s in samples[phase])
        growth = [t - u for t, u in zip(ttft, up_ttft, strict=True)]
        result["phases"][phase] = {
            "ttft_ms_p50": 1e3 * statistics.median(ttft),
            "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
            "ttft_ms_max": 1e3 * max(ttft),
            "ttft_growth_ms_p50": 1e3 * statistics.median(growth),
            "ttft_growth_ms_max": 1e3 * max(growth),
            "output_tokens_per_s": tokens / wall[phase],
            "output_tokens_ratio": (tokens / wall[phase]) / (sum(len(s["tokens"]) for s in samples["up"]) / wall["up"]),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "down.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
