"""The key spec (docs/KEYS.md): rules, chained keys, namespace fingerprints.

The vectors live in tests/data/key_vectors.json at the repository root and
are asserted by the Rust loadgen too (loadgen/src/keys.rs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier import InvalidKeyError, Namespace, block_key, chain_keys, check_key
from kvtier.keys import block_id_hex

VECTORS = json.loads((Path(__file__).resolve().parents[3] / "tests" / "data" / "key_vectors.json").read_text())


@pytest.mark.parametrize("case", VECTORS["chains"], ids=lambda c: f"{c['first_token']}+{c['tokens']}")
def test_chain_matches_shared_vectors(case):
    tokens = list(range(case["first_token"], case["first_token"] + case["tokens"]))
    assert chain_keys(tokens, case["block_tokens"]) == case["keys"]


@pytest.mark.parametrize("case", VECTORS["namespaces"], ids=lambda c: c["fingerprint"])
def test_namespace_matches_shared_vectors(case):
    ns = Namespace(**case["namespace"])
    assert ns.canonical() == case["canonical"]
    assert ns.fingerprint == case["fingerprint"]
    assert ns.key(bytes.fromhex(case["block_id_hex"])) == case["key"]


def test_chain_shares_prefixes_and_drops_partial_blocks():
    a = list(range(300))
    b = list(a)
    b[200] = 7
    ka, kb = chain_keys(a), chain_keys(b)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]
    assert block_key("", a[:128]) == ka[0]
    with pytest.raises(ValueError):
        chain_keys(a, 0)


def test_namespaces_differ_in_every_field():
    base = Namespace("m", "bfloat16", 0, 2, 0, 1, 128)
    variants = [
        Namespace("m2", "bfloat16", 0, 2, 0, 1, 128),
        Namespace("m", "float16", 0, 2, 0, 1, 128),
        Namespace("m", "bfloat16", 1, 2, 0, 1, 128),
        Namespace("m", "bfloat16", 0, 4, 0, 1, 128),
        Namespace("m", "bfloat16", 0, 2, 0, 2, 128),
        Namespace("m", "bfloat16", 0, 2, 0, 1, 256),
        Namespace("m", "bfloat16", 0, 2, 0, 1, 128, extra="fp8-e4m3"),
    ]
    prints = {base.fingerprint} | {v.fingerprint for v in variants}
    assert len(prints) == 1 + len(variants)
    assert len(base.fingerprint) == 16
    assert base.chain(list(range(256)))[0].startswith(base.fingerprint + "-")


def test_namespace_refuses_impossible_layouts():
    with pytest.raises(ValueError, match="tp_rank"):
        Namespace("m", "bf16", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="pp_rank"):
        Namespace("m", "bf16", pp_rank=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        Namespace("m", "bf16", block_tokens=0)


def test_block_ids_of_every_kind():
    assert block_id_hex(b"\x00\xff") == "00ff"
    assert block_id_hex(255) == "00000000000000ff"
    assert block_id_hex(-1) == "ffffffffffffffff"
    assert block_id_hex(1 << 64) == "00000000000000010000000000000000"
    assert block_id_hex(-(1 << 64)) == "ffffffffffffffff0000000000000000"
    assert block_id_hex("abc-1") == "abc-1"
    assert len(block_id_hex("a/b")) == 32  # hashed: not key characters
    assert len(block_id_hex(b"x" * 100)) == 32  # 200 hex digits: hashed
    with pytest.raises(TypeError):
        block_id_hex(True)
    with pytest.raises(TypeError):
        block_id_hex(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "message"),
    [("", "empty"), ("a/b", "'/' at index 1"), ("..", "reserved"), ("é", "'é'"), ("k" * 257, "at most 256")],
)
def test_bad_keys_are_refused_with_the_reason(key, message):
    with pytest.raises(InvalidKeyError, match=message) as info:
        check_key(key)
    assert info.value.code == "invalid_key"


def test_good_keys_pass():
    for key in ["a", "k" * 256, "A-z_0.9~", "..."]:
        assert check_key(key) == key
    with pytest.raises(TypeError):
        check_key(b"bytes")  # type: ignore[arg-type]


def test_a_batch_is_valid_only_when_every_key_is():
    from kvtier.keys import all_keys_valid

    assert all_keys_valid(["a", "b-1", "k" * 256])
    for bad in (["a", "b/c"], ["a/b"], ["a", ""], ["a", "."], [".."], ["a", "k" * 257], ["a", "é"], []):
        assert not all_keys_valid(bad), bad
    assert not all_keys_valid(["a", 3])  # type: ignore[list-item]
