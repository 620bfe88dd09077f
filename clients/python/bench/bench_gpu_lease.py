"""Loads into GPU memory from kvtier's RAM tier, on a GPU (``make gpu-check``'s
lease step; needs torch with CUDA and a release ``kvtier`` in $KVTIER_BIN).

One ``kvtier serve --ram-shared on`` holds ``--blocks`` blocks in its RAM
tier; each round moves all of them into one CUDA tensor, each case in turn
(alternating, so a noisy moment hits each alike), and reports per case the
median GB/s over the rounds and the ratios in one run:

  lease_pinned    Client.pin_arenas, then lease + one non_blocking copy per
                  block from the lease's view + synchronize + valid(): the
                  GPU's DMA reads kvtier's pages (no host copy)
  lease_pageable  the same from a client that did not pin: the driver
                  copies through its own pinned bounce buffer
  staged_pinned   what a GPU connector did before: GET_INTO a registered,
                  page-locked staging buffer (kvtier copies), then one
                  non_blocking copy per block from staging
  memcpy_pinned   the DMA ceiling: one copy per block from a torch
                  pin_memory() tensor holding the same bytes

then the vLLM connector's own block mover (``kvtier.connectors.vllm.blocks.PagedBlocks``
over CUDA layer tensors, as vLLM's GPU build lays them out) loading every
block with its leased path against its staged path.

Every case's bytes are checked on the GPU against the blocks PUT (one
digest per block, computed on the device), and the run fails on a
mismatch, a stale lease, or a load that is not answered in full.
Writes ``--out``/gpu_lease.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any

import torch

import kvtier
from kvtier.connectors.core import ConnectorCore
from kvtier.connectors.vllm.blocks import PagedBlocks
from kvtier.testing import ServerProcess


def make_block(i: int, nbytes: int) -> bytes:
    """Block ``i``: distinct bytes per block (a wrong block is caught)."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()


def digest(t: torch.Tensor) -> torch.Tensor:
    """A per-row checksum on the device: position-weighted sums (int64)."""
    w = torch.arange(1, t.shape[1] + 1, device=t.device, dtype=torch.int64)
    return (t.to(torch.int64) * w).sum(dim=1)


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-bytes", type=int, default=16 << 20)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32, help="layers of the connector case (block = layers x page)")
    ap.add_argument("--out", default="target/bench/gpu-lease")
    a = ap.parse_args()
    bb, n = a.block_bytes, a.blocks
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    os.makedirs(a.out, exist_ok=True)
    ram_gb = n * bb * 1.5 / (1 << 30) + 0.25
    keys = [f"gpu-{i}" for i in range(n)]
    blocks = [make_block(i, bb) for i in range(n)]
    host = torch.empty((n, bb), dtype=torch.uint8).pin_memory()
    for i, b in enumerate(blocks):
        host[i].copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
    want = digest(host.to(dev))
    dst = torch.empty((n, bb), dtype=torch.uint8, device=dev)
    failures: list[str] = []

    def check(case: str) -> None:
        bad = (digest(dst) != want).nonzero().flatten().tolist()
        if bad:
            failures.append(f"{case}: blocks {bad[:8]} differ from what was PUT")
        dst.zero_()

    disk_gb = n * bb * 2 / (1 << 30) + 1
    with ServerProcess(block_bytes=bb, ram_gb=ram_gb, disk_gb=disk_gb, args=("--ram-shared", "on")) as s:
        with kvtier.Client(s.unix_url, timeout_s=120) as c:
            for start in range(0, n, 16):
                c.put_many(list(zip(keys[start : start + 16], blocks[start : start + 16], strict=True)))
        pinned = kvtier.Client(s.unix_url, timeout_s=120)
        pageable = kvtier.Client(s.unix_url, timeout_s=120)
        staged_client = kvtier.Client(s.unix_url, timeout_s=120)
        pinned_bytes = pinned.pin_arenas(a.device)
        staging = kvtier.SharedBuffer(n * bb)
        torch.cuda.cudart().cudaHostRegister(staging.ptr, staging.nbytes, 0)
        staged_client.register_buffer(staging.ptr, staging.nbytes)
        stage_rows = staging.torch().view(n, bb)

        def lease_case(client: kvtier.Client, case: str) -> None:
            with client.lease(keys) as leases:
                for i in range(n):
                    dst[i].copy_(leases.torch(i), non_blocking=True)
                torch.cuda.current_stream().synchronize()
                stale = [i for i in range(n) if not leases.valid(i)]
            if stale:
                failures.append(f"{case}: {len(stale)} leases had ended")

        def staged_case() -> None:
            results = staged_client.batch_get_into(keys, [staging.ptr + i * bb for i in range(n)], [bb] * n)
            if any(r != bb for r in results):
                failures.append(f"staged_pinned: GET_INTO answered {results[:8]}")
            for i in range(n):
                dst[i].copy_(stage_rows[i], non_blocking=True)

        def memcpy_case() -> None:
            for i in range(n):
                dst[i].copy_(host[i], non_blocking=True)

        cases = {
            "lease_pinned": lambda: lease_case(pinned, "lease_pinned"),
            "lease_pageable": lambda: lease_case(pageable, "lease_pageable"),
            "staged_pinned": staged_case,
            "memcpy_pinned": memcpy_case,
        }
        rates: dict[str, list[float]] = {k: [] for k in cases}
        for k, fn in cases.items():  # warm-up and correctness, once each
            fn()
            torch.cuda.synchronize()
            check(k)
        for _ in range(a.rounds):
            for k, fn in cases.items():
                rates[k].append(n * bb / timed(fn) / 1e9)
                check(k)

        # The vLLM connector's mover over CUDA layers: leased against staged.
        layers = a.layers if bb % a.layers == 0 else 1
        page = bb // layers
        caches = {f"layer.{j}": torch.zeros((n, page), dtype=torch.uint8, device=dev) for j in range(layers)}
        movers: dict[str, PagedBlocks] = {}
        for mode in ("leased", "staged"):
            core = ConnectorCore(
                {"url": s.url, "local": "on", "timeout_s": 120},
                logger=logging.getLogger(f"bench.{mode}"),
                stats=("leased_blocks", "staged_blocks", "zero_copy_blocks"),
            )
            core.start(bb)
            mover = PagedBlocks(core, caches, [], logging.getLogger(f"bench.{mode}"))
            if not mover.ready():
                failures.append(f"connector_{mode}: the connector never got ready")
                continue
            if mode == "staged":
                mover.leased_loads = False
            movers[mode] = mover
        connector: dict[str, list[float]] = {f"connector_{m}": [] for m in movers}
        ids = list(range(n))

        def load(mode: str) -> None:
            out = movers[mode].move(keys, ids, load=True)
            if out != [bb] * n:
                failures.append(f"connector_{mode}: load answered {out[:8]}")

        def check_layers(mode: str) -> None:
            got = torch.cat([caches[f"layer.{j}"] for j in range(layers)], dim=1)
            if not torch.equal(digest(got), want):
                failures.append(f"connector_{mode}: the layers' pages differ from what was PUT")
            for t in caches.values():
                t.zero_()

        for _ in range(a.rounds + 1):
            for mode in movers:
                rate = n * bb / timed(lambda mode=mode: load(mode)) / 1e9
                connector[f"connector_{mode}"].append(rate)
                check_layers(mode)
        for r in connector.values():
            r.pop(0)  # the first is a warm-up
        counts = {m: dict(movers[m].core.stats) for m in movers}
        for m in movers.values():
            m.close()
            m.core.client.close()
        pinned_stats = pinned.local_stats()
        for c in (pinned, pageable, staged_client):
            c.close()
        torch.cuda.cudart().cudaHostUnregister(staging.ptr)
        staging.close()

    rates.update(connector)
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    ratios = {
        "lease_pinned/staged_pinned": med["lease_pinned"] / med["staged_pinned"],
        "lease_pinned/lease_pageable": med["lease_pinned"] / med["lease_pageable"],
        "lease_pinned/memcpy_pinned": med["lease_pinned"] / med["memcpy_pinned"],
    }
    if "connector_leased" in med and "connector_staged" in med:
        ratios["connector_leased/connector_staged"] = med["connector_leased"] / med["connector_staged"]
    report = {
        "device": torch.cuda.get_device_name(dev),
        "block_bytes": bb,
        "blocks": n,
        "rounds": a.rounds,
        "connector_layers": layers,
        "pinned_bytes": pinned_bytes,
        "arenas_pinned": pinned_stats.get("arenas_pinned"),
        "gb_per_s": rates,
        "median_gb_per_s": med,
        "ratios": ratios,
        "connector_counters": counts,
        "failures": failures,
    }
    with open(os.path.join(a.out, "gpu_lease.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"loads into {report['device']}: {n} blocks of {bb} bytes, {a.rounds} rounds, median GB/s")
    for k, v in med.items():
        lo, hi = min(rates[k]), max(rates[k])
        print(f"  {k:18s} {v:7.2f}   ({lo:.2f}-{hi:.2f})")
    for k, v in ratios.items():
        print(f"  {k:34s} {v:5.2f}x")
    print(f"  arenas pinned: {report['arenas_pinned']} ({pinned_bytes} bytes); connector counters: {counts}")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
