"""What the vLLM connector's end-to-end digest costs (``digest``,
``kvtier.connectors.vllm.verify``): the xxh3-64 of each loaded block's layer pages,
beside the load itself, in one run.

One ``kvtier serve`` ($KVTIER_BIN) holds ``--blocks`` blocks; a CPU paged
cache in shared memory (as vLLM's CPU build allocates it with
``kv_cache_shared``) is registered over the same-host socket, and each round
alternates:

  load     the connector's block mover (``PagedBlocks.move``) loading every
           block zero-copy into the layers' pages (from kvtier's RAM tier;
           with ``--from-log`` a server with no RAM tier, so from its log)
  digest   ``digest_of`` over every block's pages, as the connector checks
           them after a load

and reports the median GB/s of each and the digest's time as a share of the
load's. Writes ``--out``/digest.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from kvtier.connectors.core import ConnectorCore
from kvtier.connectors.vllm.blocks import PagedBlocks
from kvtier.connectors.vllm.shared_cache import SharedAllocation
from kvtier.connectors.vllm.verify import digest_of
from kvtier.shm import SharedBuffer
from kvtier.testing import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-mib", type=int, default=16, help="block size in MiB (16: Llama-3-8B's 128 tokens)")
    parser.add_argument("--layers", type=int, default=32, help="layer pages per block")
    parser.add_argument("--blocks", type=int, default=32, help="blocks loaded per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--from-log", action="store_true", help="a server with no RAM tier: loads read the log")
    parser.add_argument("--out", type=Path, default=Path("target/bench/digest"))
    args = parser.parse_args()
    bb = args.block_mib << 20
    ram_gb = 0.0 if args.from_log else (args.blocks + 4) * bb / 2**30
    disk_gb = max(1.0, 2 * args.blocks * bb / 2**30)
    log = logging.getLogger("bench")
    with ServerProcess(block_bytes=bb, ram_gb=ram_gb, disk_gb=disk_gb, shards=2) as server:
        core = ConnectorCore({"url": server.url, "timeout_s": 60}, logger=log, stats=("zero_copy_blocks",))
        core.start(bb)
        shared: list[SharedBuffer] = []
        with SharedAllocation(shared):
            cache = torch.zeros((args.layers, args.blocks, bb // args.layers), dtype=torch.int8)
        layers = {f"layer.{i}": cache[i].view(torch.uint8) for i in range(args.layers)}
        mover = PagedBlocks(core, layers, shared, log)
        assert mover.ready() and mover.zero_copy, "the cache was not registered"
        keys = [f"digest-bench-{i}" for i in range(args.blocks)]
        cache.random_(-128, 127)
        assert min(mover.move(keys, list(range(args.blocks)), load=False)) >= 0
        loads, digests = [], []
        for _ in range(args.rounds):
            cache.zero_()
            started = time.perf_counter()
            assert min(mover.move(keys, list(range(args.blocks)), load=True)) >= 0
            loads.append(time.perf_counter() - started)
            started = time.perf_counter()
            for b in range(args.blocks):
                digest_of(mover.pages(b))
            digests.append(time.perf_counter() - started)
        core.close()
    nbytes = args.blocks * bb
    load_s, digest_s = statistics.median(loads), statistics.median(digests)
    result = {
        "block_bytes": bb,
        "layers": args.layers,
        "blocks": args.blocks,
        "from": "log" if args.from_log else "ram",
        "load_gb_s": nbytes / load_s / 1e9,
        "load_gb_s_range": [nbytes / max(loads) / 1e9, nbytes / min(loads) / 1e9],
        "digest_gb_s": nbytes / digest_s / 1e9,
        "digest_gb_s_range": [nbytes / max(digests) / 1e9, nbytes / min(digests) / 1e9],
        "digest_share_of_load": digest_s / load_s,
        "digest_ms_per_gb": digest_s / nbytes * 1e9 * 1e3,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "digest.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
