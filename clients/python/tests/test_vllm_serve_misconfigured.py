"""One real misconfigured start: a ``vllm serve`` with KvtierConnector on a
kvtier whose blocks are not vLLM's exits at start, its log naming both
sizes and the flag that fixes it. (Both start-up refusals, this one and a
socket that refuses the engine's uid, are tested without an engine through
``register_kv_caches``: tests/test_vllm_connector_faults.py.) In
``make test-all``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_serve_support import BLOCK_BYTES, connector, vllm

from kvtier.testing import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def half() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=BLOCK_BYTES // 2, ram_gb=0.0625, disk_gb=0.25) as s:
        yield s


def test_a_kvtier_of_another_block_size_stops_vllm_at_start_with_one_clear_error(half):
    # Eager mode skips the compilation before it fails.
    engine = vllm(kv_transfer_config=connector(half.url), args=("--enforce-eager",))
    engine.launch()
    try:
        assert engine.wait_exit() != 0
    finally:
        engine.stop()
    log = engine.tail(20000)
    assert f"stores blocks of {BLOCK_BYTES // 2} bytes" in log and f"is {BLOCK_BYTES} bytes" in log, log
    assert f"--block-bytes {BLOCK_BYTES}" in log, log
