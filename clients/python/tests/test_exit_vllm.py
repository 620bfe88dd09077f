"""A vLLM worker process that exits with the connector's stores in flight
exits cleanly and without waiting on kvtier (docs/LOCAL.md, "When a client
process exits"); the engine-free exits are tests/test_exit.py's. In
``make test-all``: each run imports torch and the connector (about 20 s
here).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_exit import EXIT_S, exit_once, exit_server

from kvtier.testing import ServerProcess

pytestmark = pytest.mark.vllm

# vLLM's worker side: the connector's mover thread storing pages in the
# background (stores: async) while the process returns (tests/ on the path
# for the faults tests' engine-free connector).
MOVER_SCRIPT = """
import sys, time
sys.path.insert(0, "tests")
from test_vllm_connector_faults import SLOTS, bare, fill, hashes
from kvtier.connectors.vllm.plan import KvtierConnectorMetadata
from kvtier.connectors.vllm.transfer import Transfer
c = bare(sys.argv[1], local="on")
for b in range(SLOTS):
    fill(c, b, b)
stores = [Transfer(f"r{i}", 0, hashes(SLOTS, salt=i), list(range(SLOTS))) for i in range(4)]
if sys.argv[2] == "stores":
    c.bind_connector_metadata(KvtierConnectorMetadata(stores=stores))
    c.wait_for_save()  # the stores run on the mover thread from here
time.sleep(0.05)
print("main returns", time.monotonic(), flush=True)
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with exit_server() as s:
        yield s


def test_a_vllm_worker_exits_cleanly_with_its_stores_in_flight(server):
    """The connector's mover thread storing a step's blocks while the
    process returns. It is not a daemon: the exit waits for the stores
    already queued (copies of milliseconds each), then ends. Like with like:
    the same process with no store in flight, whose exit (torch's and the
    connector's own teardown) is the baseline."""
    rc, baseline, stderr = exit_once(server, MOVER_SCRIPT, "idle")
    assert rc == 0, stderr[-2000:]
    for run in range(2):
        rc, took, stderr = exit_once(server, MOVER_SCRIPT, "stores")
        assert rc == 0 and "FATAL" not in stderr, f"run {run}: exit status {rc}:\n{stderr[-2000:]}"
        assert took < baseline + EXIT_S, (
            f"run {run}: the exit took {took:.2f} s against {baseline:.2f} s with none in flight"
        )
