"""End-to-end checks of the vLLM connector's bytes: the digest of each block
as vLLM holds it, checked after every load, and the byte oracle the tests
read (:class:`kvtier.vllm_connector.KvtierConnector`).

**Digest.** A block's digest is xxh3-64 over its layer pages in model order,
which is also the xxh3-64 of the kvtier block (the pages laid end to end),
so a digest taken from vLLM's pages and one taken from kvtier's bytes agree.
With ``digest`` on, the worker records the digest of every block it stores
(taken from vLLM's pages before the store) and, after a load, before vLLM is
told the block is ready, takes the digest of the pages it loaded into: a
mismatch is a failed load from that block on (vLLM recomputes) and is
counted (``digest_mismatch_blocks``). kvtier's CRCs prove the bytes are the
bytes stored; the digest proves they are the bytes this engine computed for
that key, which no CRC can (the wrong rank's slice, another block's bytes
under a real key, a late write into reused memory). The record is the
worker's own, in memory (:data:`DIGESTS_MAX` blocks, least recently stored
first out), so blocks another engine stored, or this one before a restart,
load unchecked (``digest_unknown_blocks``): carrying the digest with the
block would need the block's tag on reads, which the protocol does not
return today.

**Oracle** (``oracle_dir``, for tests): each worker appends one JSON line per
event to ``<oracle_dir>/rank-<tp>-<pp>.jsonl``: ``stored`` (the digest of the
pages it stored), ``replica`` (of its pages of a block another rank of its
replica set stores: an MLA model's), ``loaded`` (of the pages after a load), ``load_failed``
and ``store_skipped`` (a store not made because a load of the request failed
in the same step), ``digest_refused`` (a load the digest refused), each with
its wall-clock time, vLLM's block hash, the key, the request and the
block's index in it, the step, and for stores the block's token ids and its parent's hash (so a test
can find a prompt's blocks by walking its chain). A test compares ``loaded`` with
``stored`` byte digests, and with the digest of kvtier's own bytes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

#: Blocks whose digest a worker remembers (about 100 bytes each).
DIGESTS_MAX = 1 << 20


def digest_of(pages: Sequence[Any]) -> int:
    """xxh3-64 of ``pages`` (buffers, in order) as one byte string."""
    h = xxhash.xxh3_64()
    for page in pages:
        h.update(page)
    return int(h.intdigest())


class Digests:
    """The digests of the blocks one worker stored, by key (module docstring).

    Args:
        capacity: most blocks remembered; the least recently stored go first.
    """

    def __init__(self, capacity: int = DIGESTS_MAX) -> None:
        self.capacity = capacity
        self._known: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, key: str, digest: int) -> None:
        """Remembers ``digest`` as what ``key`` holds."""
        with self._lock:
            self._known[key] = digest
            self._known.move_to_end(key)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)

    def forget(self, key: str) -> None:
        """Forgets ``key`` (its store failed: what kvtier holds is unknown)."""
        with self._lock:
            self._known.pop(key, None)

    def check(self, key: str, digest: int) -> bool | None:
        """Whether ``digest`` is the one recorded for ``key``; ``None`` when
        none is recorded."""
        with self._lock:
            known = self._known.get(key)
        return None if known is None else known == digest


class Oracle:
    """The byte oracle's event log of one worker (module docstring).

    Args:
        directory: where ``rank-<tp>-<pp>.jsonl`` is appended to (made if missing).
        rank: the worker's ``(tp_rank, pp_rank)``.
    """

    def __init__(self, directory: str, rank: tuple[int, int]) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"rank-{rank[0]}-{rank[1]}.jsonl"
        self.rank = rank
        self.step = 0
        self._lock = threading.Lock()

    def event(
        self,
        kind: str,
        *,
        req_id: str,
        index: int,
        block_hash: bytes,
        key: str,
        digest: int | None,
        tokens: list[int] | None = None,
        parent: bytes | None = None,
        step: int | None = None,
    ) -> None:
        """Appends one event (``tokens``, ``parent``: the block's token ids
        and its parent's hash, where known: a store's; ``step``: the step
        that asked for the copy, default the current one)."""
        line = json.dumps(
            {
                "event": kind,
                "t": time.time(),
                "step": self.step if step is None else step,
                "rank": list(self.rank),
                "req": req_id,
                "index": index,
                "hash": block_hash.hex(),
                "key": key,
                "digest": None if digest is None else f"{digest:016x}",
                "tokens": tokens or [],
                "parent": parent.hex() if parent is not None else None,
            }
        )
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")  # closed at once: a test reads it while vLLM runs


def read_oracle(directory: str) -> list[dict[str, Any]]:
    """Every event of every rank under ``directory``, in file order per rank."""
    events: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        events.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return events
