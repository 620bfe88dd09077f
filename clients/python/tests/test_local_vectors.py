"""The same-host socket's tables (docs/LOCAL.md) as this package knows
them, against the vectors the server's framing crate writes.

The vectors live in tests/data/local_frame_vectors.json at the repository
root, written and checked by local-proto/tests/frame_vectors.rs (crate
``kvtier-local-proto``, which the server, the load generator and this
package's native client frame with). The frames themselves are made and
read in Rust: client/tests/vectors.rs serves every reply vector to the
native client. Here: the constants the native module exports, every code's
number, name and error class, and the pinned block tag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvtier
from kvtier import codes, local
from kvtier.errors import KvtierError, error_from_code

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[3] / "tests" / "data" / "local_frame_vectors.json").read_text(encoding="utf-8")
)
#: Codes only this client uses (docs/LOCAL.md, "Codes"): never on the wire.
CLIENT_ONLY = {codes.NOT_REGISTERED: "NOT_REGISTERED", codes.CONNECTION_LOST: "CONNECTION_LOST"}


# ------------------------------------------------------------ the tables


def test_constants_ops_and_tiers_are_the_rust_crates():
    c = VECTORS["constants"]
    assert local.MAGIC == c["magic"] and local.HEADER_BYTES == c["header_bytes"]
    assert local.MAGIC.to_bytes(2, "little").hex() == c["magic_hex"] == b"TK".hex()
    assert (local.MAX_PAYLOAD_BYTES, local.MAX_ITEMS, local.MAX_PARTS) == (
        c["payload_bytes_max"],
        c["items_max"],
        c["parts_max"],
    )
    assert list(local.VERSIONS) == c["versions"]
    assert local.VERSION_TAGS == c["version_tags"]
    assert local.VERSION_LEASES == c["version_leases"]
    assert (local.RESPONSE, local.OP_ERROR) == (c["response_bit"], c["op_connection_error"])
    assert local.OP_NAMES == {o["op"]: o["name"] for o in VECTORS["ops"]}
    for o in VECTORS["ops"]:
        assert getattr(local, f"OP_{o['name']}") == o["op"], o
    assert codes.TIER_NAMES == {t["tier"]: t["name"] for t in VECTORS["tiers"] if t["tier"] != 0}
    assert VECTORS["tiers"][0] == {"tier": 0, "name": "none"}


def test_every_code_is_known_to_the_client_by_the_same_number_and_name():
    wire = {c["code"]: c["name"] for c in VECTORS["codes"]}
    assert wire[0] == "OK" and len(wire) == len(VECTORS["codes"]) == 24
    for code, name in wire.items():
        assert codes.name_of(code) == name and getattr(codes, name) == code, (code, name)
    # The client knows no server code the crate does not, and its own two
    # are numbers the server never sends.
    assert {c: n for c, n in codes.NAMES.items() if c not in CLIENT_ONLY} == wire
    assert all(codes.NAMES[c] == n and c not in wire for c, n in CLIENT_ONLY.items())
    for code in wire:
        if code != 0:
            err = error_from_code(code, "why")
            assert isinstance(err, KvtierError) and err.local_code == code and err.code == wire[code].lower()


def test_every_op_has_a_request_and_a_reply_vector():
    ops = set(local.OP_NAMES)
    assert {v["op"] for v in VECTORS["requests"]} >= ops
    assert {v["request_op"] for v in VECTORS["replies"] if v["status"] == 0} >= ops
    assert any(v["op"] == local.OP_ERROR for v in VECTORS["replies"])


def test_the_pinned_block_tag_is_what_the_client_encodes():
    """The tagged PUT_FROM vector carries the tag pinned in
    tests/test_block_tag.py and server/tests/block_tags.rs: the client's
    encoder makes the same bytes the Rust crate framed."""
    vector = next(v for v in VECTORS["requests"] if v["op"] == local.OP_PUT_FROM and v["fields"].get("version") == 2)
    tag = kvtier.BlockTag(
        block_hashes=[bytes(range(8)), bytes(range(8, 16))],
        parent_hash=bytes(range(0xF0, 0xF8)),
        block_size=2,
        token_ids=[1, 2, 300, 70000],
    )
    assert vector["fields"]["items"][0][4] == tag.encode().hex()
    assert vector["fields"]["items"][1][4] == ""
