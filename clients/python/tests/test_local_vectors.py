"""The same-host socket's frames (docs/LOCAL.md) as this client makes and
reads them, against the frames the server's own framing crate makes.

The vectors live in tests/data/local_frame_vectors.json at the repository
root, written and checked by local-proto/tests/frame_vectors.rs (crate
``kvtier-local-proto``, which the server and the load generator frame with):
the constants, every op and code, and for representative requests and
replies of every op the exact frame in hex beside its fields. Requests are
encoded here with the client's encoders (``kvtier.local``) and must come out
byte for byte; replies are decoded with the client's decoders and must give
the fields. No server and no socket: a framing slip on either side shows
here, not as a mirrored bug in a fake.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier import codes, local
from kvtier.errors import KvtierError, OverloadedError, ProtocolError, error_from_code

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[3] / "tests" / "data" / "local_frame_vectors.json").read_text(encoding="utf-8")
)
#: Codes only this client uses (docs/LOCAL.md, "Codes"): never on the wire.
CLIENT_ONLY = {codes.NOT_REGISTERED: "NOT_REGISTERED", codes.CONNECTION_LOST: "CONNECTION_LOST"}


def frame_of(vector: dict[str, Any]) -> bytes:
    return bytes.fromhex(vector["frame_hex"])


def client_payload(vector: dict[str, Any]) -> bytes:
    """A request vector's payload, made by the client's encoders from its fields."""
    op, fields = vector["op"], vector["fields"]
    if op == local.OP_HELLO:
        hello = fields["hello"]
        return local.encode_hello(
            token=hello.get("token"),
            block_bytes=hello.get("block_bytes"),
            model=hello.get("model"),
            client=hello["client"],
            versions=hello["versions"],
        )
    if op == local.OP_REGISTER:
        return local.encode_register(fields["offset"], fields["length"])
    if op == local.OP_UNREGISTER:
        return local.encode_unregister(fields["handle"])
    if op == local.OP_PUT_FROM and fields.get("version", 1) >= local.VERSION_TAGS:
        items = [(h, o, n, k, bytes.fromhex(t)) for h, o, n, k, t in fields["items"]]
        return local.encode_tagged_items(items)
    if op == local.OP_PUT_FROM_V and fields.get("version", 1) >= local.VERSION_TAGS:
        items_v = [([tuple(p) for p in it["parts"]], it["key"], bytes.fromhex(it["tag_hex"])) for it in fields["items"]]
        return local.encode_tagged_items_v(items_v)
    if op in (local.OP_GET_INTO, local.OP_PUT_FROM):
        return local.encode_items([tuple(item) for item in fields["items"]])
    if op in (local.OP_GET_INTO_V, local.OP_PUT_FROM_V):
        return local.encode_items_v([([tuple(p) for p in it["parts"]], it["key"]) for it in fields["items"]])
    if op in (local.OP_EXISTS, local.OP_LOOKUP, local.OP_DELETE, local.OP_PREFETCH, local.OP_LEASE):
        return local.encode_keys(fields["keys"])
    if op == local.OP_MAP_ARENA:
        return local.encode_map_arena(fields["arena"])
    if op == local.OP_MAP_INDEX:
        return local.encode_map_arena(fields["shard"])
    if op == local.OP_RELEASE:
        return local.encode_release(fields["leases"])
    assert op not in local.OP_NAMES, f"no encoder here for {local.OP_NAMES[op]}"
    assert fields == {}
    return b""


def client_body(op: int, body: memoryview, fields: dict[str, Any]) -> dict[str, Any]:
    """A reply body decoded by the client's decoders, as the vectors' fields."""
    if op == local.OP_HELLO:
        return {"hello": local.decode_hello(body)}
    if op == local.OP_REGISTER:
        handle, access = local.decode_registered(body)
        return {"handle": handle, "access": access}
    if op == local.OP_UNREGISTER:
        assert len(body) == 0
        return {}
    if op in (local.OP_GET_INTO, local.OP_PUT_FROM, local.OP_GET_INTO_V, local.OP_PUT_FROM_V):
        results = local.decode_results(body, len(fields["results"]))
        return {"results": [list(r) for r in results]}
    if op == local.OP_EXISTS:
        return {"tiers": local.decode_tiers(body, len(fields["tiers"]))}
    if op == local.OP_LOOKUP:
        hits, tiers = local.decode_lookup(body)
        return {"prefix_hits": hits, "tiers": tiers}
    if op == local.OP_DELETE:
        return {"results": local.decode_deleted(body, len(fields["results"]))}
    if op == local.OP_PREFETCH:
        requested, found = local.decode_prefetched(body)
        return {"requested": requested, "found": found}
    if op == local.OP_MAP_ARENA:
        return dict(zip(("file_bytes", "slot_bytes", "slots", "generations_offset"), local.decode_arena(body)))
    if op == local.OP_LEASE:
        names = ("result", "tier", "arena", "offset", "generation", "lease")
        return {"items": [dict(zip(names, item)) for item in local.decode_leases(body, len(fields["items"]))]}
    if op == local.OP_RELEASE:
        return {"released": local.decode_released(body)}
    if op == local.OP_MAP_INDEX:
        return dict(zip(("file_bytes", "buckets", "shards"), local.decode_index(body)))
    raise AssertionError(f"no decoder here for op {op}")


# ------------------------------------------------------------ the tables


def test_constants_ops_and_tiers_are_the_rust_crates():
    c = VECTORS["constants"]
    assert local.MAGIC == c["magic"] and local.HEADER.size == c["header_bytes"]
    assert local.encode_frame(0, 0, b"")[:2].hex() == c["magic_hex"] == b"TK".hex()
    assert (local.MAX_PAYLOAD_BYTES, local.MAX_ITEMS, local.MAX_PARTS) == (
        c["payload_bytes_max"],
        c["items_max"],
        c["parts_max"],
    )
    assert list(local.VERSIONS) == c["versions"]
    assert json.loads(local.encode_hello())["versions"] == c["versions"]
    assert local.VERSION_TAGS == c["version_tags"]
    assert local.VERSION_LEASES == c["version_leases"]
    assert local.LEASE_ITEM.size == c["lease_item_bytes"]
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


# ------------------------------------------------------------- requests


@pytest.mark.parametrize("vector", VECTORS["requests"], ids=lambda v: v["name"])
def test_a_request_encodes_to_the_rust_frame(vector):
    want = frame_of(vector)
    got = local.encode_frame(vector["op"], vector["request_id"], client_payload(vector))
    if vector["op"] == local.OP_HELLO:
        # JSON: the same object (key order is free), in a header of the same length.
        assert got[: local.HEADER.size] == want[: local.HEADER.size]
        assert json.loads(got[local.HEADER.size :]) == json.loads(want[local.HEADER.size :])
        assert json.loads(want[local.HEADER.size :]) == vector["fields"]["hello"]
    else:
        assert got.hex() == want.hex()
    assert local.decode_header(got[: local.HEADER.size]) == (vector["op"], len(got) - 16, vector["request_id"])


# -------------------------------------------------------------- replies


@pytest.mark.parametrize("vector", VECTORS["replies"], ids=lambda v: v["name"])
def test_a_reply_decodes_to_the_rust_fields(vector):
    data = frame_of(vector)
    op, nbytes, rid = local.decode_header(data[: local.HEADER.size])
    payload = data[local.HEADER.size :]
    assert (op, nbytes, rid) == (vector["op"], len(payload), vector["request_id"])
    assert codes.name_of(vector["status"]) == vector["status_name"]
    fields = vector["fields"]
    if op == local.OP_ERROR:
        assert vector["request_op"] is None
        assert local.decode_connection_error(payload) == (vector["status"], fields["message"])
        return
    request_op = vector["request_op"]
    assert op == request_op | local.RESPONSE
    assert local.OP_NAMES.get(request_op) == vector["request_op_name"]
    if vector["status"] != 0:
        with pytest.raises(KvtierError) as e:
            local.decode_response(request_op, op, payload)
        assert e.value.local_code == vector["status"]
        assert e.value.message.endswith(fields["message"])
        if isinstance(e.value, OverloadedError):
            assert e.value.retry_after_s == vector["retry_after_ms"] / 1000
        return
    body, retry_after_ms = local.decode_response(request_op, op, payload)
    assert retry_after_ms == vector["retry_after_ms"]
    if request_op == local.OP_HELLO:
        assert client_body(request_op, body, fields) == {"hello": json.loads(json.dumps(fields["hello"]))}
    else:
        assert client_body(request_op, body, fields) == fields


def test_a_reply_to_another_op_or_too_short_is_refused():
    ok = next(v for v in VECTORS["replies"] if v["request_op"] == local.OP_EXISTS and v["status"] == 0)
    payload = frame_of(ok)[local.HEADER.size :]
    with pytest.raises(ProtocolError, match="answer to GET_INTO has op 0x86"):
        local.decode_response(local.OP_GET_INTO, ok["op"], payload)
    with pytest.raises(ProtocolError, match="7 bytes"):
        local.decode_response(local.OP_EXISTS, ok["op"], payload[:7])
    with pytest.raises(ProtocolError, match="3 items"):
        local.decode_tiers(local.decode_response(local.OP_EXISTS, ok["op"], payload)[0], 2)
    with pytest.raises(ProtocolError, match="no item count"):
        local.decode_tiers(b"\x01", 1)
    with pytest.raises(ProtocolError, match="REGISTER answered 8 bytes"):
        local.decode_registered(bytes(8))
    with pytest.raises(ProtocolError, match="PREFETCH answered 4 bytes"):
        local.decode_prefetched(bytes(4))
    with pytest.raises(ProtocolError, match="LOOKUP answered 2 hits with 1 tiers"):
        local.decode_lookup(b"\x02\x00\x00\x00\x01\x00\x00\x00\x01")


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


def test_a_bad_header_is_a_framing_error():
    good = frame_of(VECTORS["requests"][0])[: local.HEADER.size]
    assert local.decode_header(good)[0] == local.OP_HELLO
    bad_magic, bad_flags, too_big = bytearray(good), bytearray(good), bytearray(good)
    bad_magic[:2] = b"GE"
    bad_flags[3] = 1
    too_big[4:8] = (local.MAX_PAYLOAD_BYTES + 1).to_bytes(4, "little")
    for head, why in (
        (bad_magic, "magic 0x4547"),
        (bad_flags, "flags 1"),
        (too_big, "1048577 bytes"),
        (good[:15], "15"),
    ):
        with pytest.raises(ProtocolError, match=why) as e:
            local.decode_header(head)
        assert e.value.local_code == codes.BAD_FRAME
