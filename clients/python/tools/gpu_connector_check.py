"""The vLLM connector's worker data path on a GPU, with torch alone
(``make gpu-check``'s connector step; needs torch with CUDA and a ``kvtier``
in $KVTIER_BIN; no vLLM: the GPU machine may have none).

A :class:`kvtier.connectors.vllm.worker.KvtierWorker` over CUDA layer
tensors (``--layers`` x ``[--blocks, --page-bytes]`` uint8, as vLLM's GPU
build lays a page out) moves blocks to and from a real ``kvtier serve``,
the "forward" played by a CUDA stream of its own (``torch.cuda.Stream()``,
non-blocking, as vLLM 0.32 runs its forward) with each step's writes held
behind ``torch.cuda._sleep`` so that a copy not ordered after them reads
the page before it is written:

  stores        the forward zeroes, sleeps, then writes each block's pages;
                ``wait_for_save`` is called at once (as vLLM does, the
                forward enqueued, not run); every byte kvtier then holds is
                compared with what the forward wrote (digests on)
  layer_loads   ``loads: layer`` into pages the forward has just zeroed
                behind a sleep; a CUDA graph captured over every layer's
                pages (what attention reads) is replayed, one layer at a
                time, after ``wait_for_layer_load`` of that layer (the
                piecewise graphs ``requires_piecewise_for_cudagraph`` asks
                vLLM for); its sums against the bytes put
  async_loads   background loads (the default), read by the forward once
                the worker reports them

Each runs ``--trials`` times with the connector as built, then once more
with the forward's event taken out (``BlockMover._mark`` answering
``None``): that run must show wrong bytes, else the check could not see a
missing order and the step fails (``--sleep-ms`` too short for this GPU).
With ``--device cpu`` (no streams, no sleep, no graph) it checks the same
bytes on the CPU: what ``make test`` runs of it here. Writes
``--out``/gpu_connector.json; exits 1 on a wrong byte.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch

from kvtier.connectors.core import ConnectorCore
from kvtier.connectors.vllm.groups import Group
from kvtier.connectors.vllm.mover import BlockMover
from kvtier.connectors.vllm.transfer import STATS, StepPlan, Transfer, block_key
from kvtier.connectors.vllm.verify import Digests
from kvtier.connectors.vllm.worker import KvtierWorker
from kvtier.testing import ServerProcess

log = logging.getLogger("gpu-connector-check")
FINGERPRINT = "gpu-check"


class Rig:
    """One worker over CUDA (or CPU) layer caches and the forward's stream."""

    def __init__(self, url: str, device: torch.device, args: argparse.Namespace, loads: str) -> None:
        self.device, self.args = device, args
        self.names = [f"model.layers.{j}.self_attn" for j in range(args.layers)]
        self.caches = {
            n: torch.zeros((args.blocks, args.page_bytes), dtype=torch.uint8, device=device) for n in self.names
        }
        self.core = ConnectorCore({"url": url, "timeout_s": 30}, logger=log, stats=STATS, background_probe=False)
        self.worker = KvtierWorker(
            self.core,
            groups=[Group(0, tuple(self.names))],
            block_size=16,
            group_fingerprints=[FINGERPRINT],
            loads=loads,
            stores="async",
            digests=Digests(),
            oracle=None,
            local="auto",
            logger=log,
        )
        self.worker.register_kv_caches(self.caches)
        self.forward = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def on_forward(self) -> Any:
        """The forward stream as the current stream (a no-op on the CPU)."""
        return torch.cuda.stream(self.forward) if self.forward is not None else nullcontext()

    def hold(self) -> None:
        """Enqueues a sleep on the forward stream (the writes after it land late)."""
        if self.forward is not None:
            torch.cuda._sleep(int(self.args.sleep_ms * self.args.cycles_per_ms))

    def block_bytes(self, block: int) -> bytes:
        """Block ``block``'s pages, layer by layer, as kvtier stores them."""
        return b"".join(self.caches[n][block].cpu().numpy().tobytes() for n in self.names)

    def close(self) -> None:
        """Ends the worker (its lanes, its client, its buffers)."""
        self.worker.shutdown()


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    """Distinct bytes per (trial, block, layer): a stale or wrong page shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def hashes(trial: int, n: int, salt: int) -> list[bytes]:
    """Block hashes of one trial (new keys per trial: nothing is found from before)."""
    return [bytes([salt, trial % 256, trial // 256, i]) * 8 for i in range(n)]


def check_stores(rig: Rig, trial: int) -> int:
    """One step's stores of blocks written by the forward behind a sleep;
    the wrong blocks kvtier then holds."""
    n = rig.args.step_blocks
    blocks = list(range(n))
    want = {
        b: [pattern(trial * 1000 + b * 10 + j, rig.args.page_bytes) for j in range(rig.args.layers)] for b in blocks
    }
    with rig.on_forward():
        # The new pages are on the device before the hold: after it only
        # device-to-device copies, which the host does not wait for.
        src = {b: [page.to(rig.device) for page in want[b]] for b in blocks}
        for name in rig.names:
            rig.caches[name].zero_()
        rig.hold()
        for b in blocks:
            for j, name in enumerate(rig.names):
                rig.caches[name][b].copy_(src[b][j], non_blocking=True)
        hs = hashes(trial, n, 1)
        rig.worker.wait_for_save(StepPlan(stores=[Transfer(f"s{trial}", 0, hs, blocks)]))
    rig.worker.mover.drain()
    got = rig.core.client.get_many([block_key(FINGERPRINT, h) for h in hs])
    return sum(1 for b, data in zip(blocks, got, strict=True) if data != b"".join(p.numpy().tobytes() for p in want[b]))


def put_blocks(rig: Rig, trial: int, salt: int) -> tuple[list[bytes], list[bytes]]:
    """Puts one step's blocks straight into kvtier: their hashes and bytes."""
    n = rig.args.step_blocks
    hs = hashes(trial, n, salt)
    data = [
        pattern(trial * 7919 + salt * 131 + i, rig.args.page_bytes * rig.args.layers).numpy().tobytes()
        for i in range(n)
    ]
    rig.core.client.put_many([(block_key(FINGERPRINT, h), d) for h, d in zip(hs, data, strict=True)])
    return hs, data


def check_layer_loads(rig: Rig, trial: int, graph: Any) -> int:
    """``loads: layer`` into pages the forward zeroes behind a sleep, read
    per layer by a captured graph (replayed after that layer's wait): the
    layers whose sums are wrong."""
    hs, data = put_blocks(rig, trial, 2)
    n = len(hs)
    blocks = list(range(n))
    want = [
        sum(
            int(
                torch.frombuffer(bytearray(d), dtype=torch.uint8)[
                    j * rig.args.page_bytes : (j + 1) * rig.args.page_bytes
                ].sum()
            )
            for d in data
        )
        for j in range(rig.args.layers)
    ]
    wrong = 0
    with rig.on_forward():
        for name in rig.names:
            rig.caches[name][:n].zero_()
        rig.hold()
        rig.worker.start_load_kv(StepPlan(loads=[Transfer(f"l{trial}", 0, hs, blocks)]))
        for j, name in enumerate(rig.names):
            rig.worker.wait_for_layer_load(name)
            sums = graph(j)
            if int(sums.item()) != want[j]:
                wrong += 1
        rig.worker.wait_for_save(StepPlan())
    return wrong


def check_async_loads(rig: Rig, trial: int) -> int:
    """Background loads into pages the forward zeroes behind a sleep, read
    once the worker reports them: the wrong blocks."""
    hs, data = put_blocks(rig, trial, 3)
    n = len(hs)
    with rig.on_forward():
        for name in rig.names:
            rig.caches[name][:n].zero_()
        rig.hold()
        rig.worker.start_load_kv(StepPlan(loads=[Transfer(f"a{trial}", 0, hs, list(range(n)), background=True)]))
        rig.worker.wait_for_save(StepPlan())
    deadline = time.monotonic() + 60
    while not rig.worker.finished(StepPlan())[1]:
        if time.monotonic() > deadline:
            raise RuntimeError("the background load was never reported")
        time.sleep(0.001)
    failed = rig.worker.load_errors()
    with rig.on_forward():
        got = [rig.block_bytes(b) for b in range(n)]
    return len(failed) + sum(1 for g, d in zip(got, data, strict=True) if g != d)


def layer_graph(rig: Rig, n: int) -> Any:
    """``graph(j)``: layer ``j``'s sum over blocks ``0 .. n - 1``, each layer
    one CUDA graph captured on the forward stream (piecewise: the load
    waits run between them); on the CPU, eager."""
    if rig.forward is None:
        return lambda j: rig.caches[rig.names[j]][:n].to(torch.int64).sum()
    graphs, outs = [], []
    torch.cuda.synchronize(rig.device)
    for name in rig.names:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=rig.forward):
            out = rig.caches[name][:n].to(torch.int64).sum()
        graphs.append(g)
        outs.append(out)

    def replay(j: int) -> torch.Tensor:
        graphs[j].replay()
        return outs[j].cpu()

    return replay


def run(url: str, device: torch.device, args: argparse.Namespace, ordered: bool) -> dict[str, int]:
    """Every check, ``args.trials`` times (once when not ``ordered``): wrong counts per check."""
    original = BlockMover._mark
    if not ordered:
        BlockMover._mark = lambda self: None  # type: ignore[method-assign]
    trials = args.trials if ordered else 1
    wrong = {"stores": 0, "layer_loads": 0, "async_loads": 0}
    try:
        rig = Rig(url, device, args, "layer")
        graph = layer_graph(rig, args.step_blocks)
        for t in range(trials):
            wrong["stores"] += check_stores(rig, t + (0 if ordered else 500))
            wrong["layer_loads"] += check_layer_loads(rig, t + (0 if ordered else 500), graph)
        rig.close()
        rig = Rig(url, device, args, "async")
        for t in range(trials):
            wrong["async_loads"] += check_async_loads(rig, t + (0 if ordered else 500))
        rig.close()
    finally:
        BlockMover._mark = original  # type: ignore[method-assign]
    return wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="0", help="CUDA device index, or cpu")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--page-bytes", type=int, default=65536, help="bytes of one layer's page of one block")
    p.add_argument("--blocks", type=int, default=64, help="blocks in each layer's cache")
    p.add_argument("--step-blocks", type=int, default=8, help="blocks one step moves")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--sleep-ms", type=float, default=20.0, help="the forward's hold before its writes")
    p.add_argument("--cycles-per-ms", type=float, default=1.5e6, help="GPU clock cycles per ms for torch.cuda._sleep")
    p.add_argument("--out", default="target/bench/gpu-connector")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", int(args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_connector_check: torch sees no CUDA device (use --device cpu for the CPU check)", file=sys.stderr)
        return 2
    block_bytes = args.layers * args.page_bytes
    disk_gb = max(0.25, 4 * args.trials * args.step_blocks * block_bytes / 2**30)
    with ServerProcess(block_bytes=block_bytes, ram_gb=0.25, disk_gb=disk_gb) as server:
        ordered = run(server.url, device, args, ordered=True)
        unordered = run(server.url, device, args, ordered=False) if device.type == "cuda" else None
    result = {
        "device": str(device),
        "trials": args.trials,
        "sleep_ms": args.sleep_ms,
        "wrong": ordered,
        "wrong_without_order": unordered,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_connector.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))
    if any(ordered.values()):
        print(f"gpu_connector_check: wrong bytes with the connector as built: {ordered}", file=sys.stderr)
        return 1
    if unordered is not None and not unordered["stores"]:
        print(
            "gpu_connector_check: without the forward's event no store read a stale page: the check cannot see "
            "a missing order (raise --sleep-ms)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
