"""No store over a failed load, anywhere (issue 62): in a step whose loads
ran on the forward path, a load that failed on one tensor-parallel rank
stops every rank's stores of that step, for every request in it (another
request may have taken the loaded blocks as a prefix hit of vLLM's own, and
every rank's slice went through the all-reduce with the failed one). Two
worker processes of the connector's own code joined by a real gloo group,
against a real ``kvtier serve``, no engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import block
from test_vllm_connector_faults import BB, hashes

from kvtier import Client
from kvtier.keys import Namespace
from kvtier.testing import ServerProcess

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parent

#: One TP rank's worker, two steps: request "a" loads blocks 0-1 on the
#: forward path (block 1 is missing in rank 0's namespace only), then the
#: step stores a's block 2 and request "b"'s block 0; the first step with the
#: ranks agreeing, the second (other keys) each rank alone. Prints its
#: counters after each.
RANK = """
import json, sys
import torch
import torch.distributed as dist
from test_vllm_connector_faults import bare, fill, hashes
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata
from kvtier.connectors.vllm.transfer import Transfer

url, rank, init = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)

def any_rank(flag):
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())

c = bare(url, loads="sync", rank=rank, ranks=2)
for salt, agree in ((50, any_rank), (60, None)):
    c.worker.mover.register([c.worker.blocks], list(c.caches), agree)
    fill(c, 2, 30 + rank)
    fill(c, 3, 40 + rank)
    loads = [Transfer("a", 0, hashes(2, salt=salt), [0, 1])]
    stores = [Transfer("a", 2, hashes(1, salt=salt + 1), [2]), Transfer("b", 0, hashes(1, salt=salt + 2), [3])]
    before = dict(c.stats)
    c.bind_connector_metadata(KvtierConnectorMetadata(loads=loads, stores=stores))
    c.start_load_kv(None)
    c.wait_for_save()
    errors = c.get_block_ids_with_load_errors()
    c.clear_connector_metadata()
    c.worker.mover.drain()
    counts = {k: c.stats[k] - before[k] for k in ("stored_blocks", "stores_skipped_after_failed_load")}
    print(json.dumps({"load_errors": sorted(errors), **counts}), flush=True)
c.shutdown()
dist.destroy_process_group()
"""


def key(rank: int, block_hash: bytes) -> str:
    fingerprint = Namespace(model="m", dtype="bfloat16", tp_rank=rank, tp_size=2).fingerprint
    return f"{fingerprint}-{block_hash.hex()}"


def two_ranks(url: str, tmp_path: Path) -> list[list[dict[str, object]]]:
    """Both ranks' two steps, run at once; per step, each rank's counters."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, url, str(r), init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    out = []
    for r, p in enumerate(ranks):
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{stderr[-3000:]}"
        out.append([json.loads(line) for line in stdout.strip().splitlines()[-2:]])
    return [[out[0][step], out[1][step]] for step in (0, 1)]


def test_a_load_failing_on_one_rank_stops_every_ranks_stores_of_that_step(tmp_path):
    with ServerProcess(block_bytes=BB, ram_gb=0.05, disk_gb=0.25) as s:
        client = Client(s.url)
        for salt in (50, 60):
            loaded = hashes(2, salt=salt)
            client.put_many([(key(0, loaded[0]), block(0, BB))])  # rank 0: block 1 missing
            client.put_many([(key(1, h), block(i, BB)) for i, h in enumerate(loaded)])
        agreed, alone = two_ranks(s.url, tmp_path)

        stored = [hashes(1, salt=51)[0], hashes(1, salt=52)[0]]
        assert agreed[0]["load_errors"] == [1] and agreed[1]["load_errors"] == []
        assert [r["stored_blocks"] for r in agreed] == [0, 0]
        assert [r["stores_skipped_after_failed_load"] for r in agreed] == [2, 2]
        assert client.batch_is_exist([key(r, h) for r in (0, 1) for h in stored]) == [0, 0, 0, 0]

        # Deliberate fault: the ranks do not agree. Rank 1, which saw no
        # failure, stores its slices, computed over rank 0's failed pages.
        stored = [hashes(1, salt=61)[0], hashes(1, salt=62)[0]]
        assert [r["stored_blocks"] for r in alone] == [0, 2]
        assert client.batch_is_exist([key(r, h) for r in (0, 1) for h in stored]) == [0, 0, 1, 1]
        client.close()
