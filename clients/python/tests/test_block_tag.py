"""Block tags (kvtier.BlockTag; docs/API.md "Block tags", docs/LOCAL.md):
the engine's binary form byte for byte, the HTTP headers, the rules checked
before sending, and puts with tags over HTTP and the same-host socket
against a real server, whose refusals (HTTP 400 ``invalid_tag``, the
socket's ``INVALID_TAG``) raise :class:`kvtier.InvalidTagError` and store
nothing."""

from __future__ import annotations

import asyncio

import pytest
from conftest import BLOCK_BYTES, block

import kvtier
from kvtier import codes
from kvtier.local import LocalConnection
from kvtier.tag import BlockTag

#: The tag pinned in tests/data/local_frame_vectors.json and in the server's
#: server/tests/block_tags.rs and server/src/http/tag.rs (where these
#: headers are turned into these bytes by the engine's encoder).
PINNED_HEX = "010802000102030405060708090a0b0c0d0e0f08f0f1f2f3f4f5f6f702000000040001000000020000002c01000070110100"
PINNED_HEADERS = {
    "x-kvtier-block-hashes": "0001020304050607,08090a0b0c0d0e0f",
    "x-kvtier-parent-hash": "f0f1f2f3f4f5f6f7",
    "x-kvtier-block-size": "2",
    "x-kvtier-token-ids": "1,2,300,70000",
}


def pinned() -> BlockTag:
    return BlockTag(
        block_hashes=[bytes(range(8)), bytes(range(8, 16))],
        parent_hash=bytes(range(0xF0, 0xF8)),
        block_size=2,
        token_ids=[1, 2, 300, 70000],
    )


def vllm_like(n: int = 1) -> BlockTag:
    """A tag as the vLLM connector makes one: 32-byte hashes, 16 tokens each."""
    return BlockTag(
        block_hashes=[bytes([i + 1]) * 32 for i in range(n)],
        parent_hash=bytes(32),
        block_size=16,
        token_ids=list(range(16 * n)),
    )


# ------------------------------------------------------------ the bytes


def test_the_encoding_is_the_engines_byte_for_byte():
    tag = pinned()
    assert tag.encode().hex() == PINNED_HEX
    assert tag.encoded_len == len(tag.encode()) == 50
    assert BlockTag.decode(bytes.fromhex(PINNED_HEX)) == tag
    bare = BlockTag(block_hashes=[b"\x07" * 8], block_size=16)
    assert bare.encode() == bytes([1, 8, 1]) + b"\x07" * 8 + bytes([0]) + (16).to_bytes(4, "little") + bytes(2)
    assert BlockTag.decode(bare.encode()) == bare


def test_the_headers_are_the_ones_the_server_reads():
    assert pinned().headers() == PINNED_HEADERS
    assert BlockTag(block_hashes=[b"\xab"], block_size=16).headers() == {
        "x-kvtier-block-hashes": "ab",
        "x-kvtier-block-size": "16",
    }


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"block_hashes": []}, "1 to 64 block hashes, got 0"),
        ({"block_hashes": [b"\x01"] * 65, "token_ids": []}, "1 to 64 block hashes, got 65"),
        ({"block_hashes": [b"\x01" * 33], "parent_hash": None, "token_ids": []}, "1 to 32 bytes, got 33"),
        ({"block_hashes": [b"\x01" * 8, b"\x02" * 4]}, "differ in width: block_hashes[0] is 8 bytes, [1] 4"),
        ({"block_hashes": ["00ff"]}, "block_hashes[0] is str, not bytes"),
        ({"block_hashes": b"\x01" * 8}, "block_hashes is a list of bytes"),
        ({"parent_hash": b"\x01" * 4}, "the parent hash is 4 bytes, the block hashes 8"),
        ({"block_size": 0}, "block_size is 1 to 65536 tokens, got 0"),
        ({"block_size": 65537}, "got 65537"),
        ({"token_ids": [1, 2, 3]}, "3 token ids for 2 block(s) of 2 tokens: send 4 or none"),
        ({"token_ids": [1, 2, -3, 4]}, "token_ids[2] is -3, not a u32"),
        ({"token_ids": [1, 2, 1 << 32, 4]}, "not a u32"),
        ({"block_hashes": [b"\x01" * 8] * 2, "block_size": 512, "token_ids": [0] * 1024}, "at most 640 token ids"),
        (
            {"block_hashes": [b"\x01" * 32] * 64, "parent_hash": None, "block_size": 10, "token_ids": [7] * 640},
            "4618 bytes encoded, over 3072",
        ),
    ],
)
def test_a_bad_tag_is_refused_before_sending_naming_the_field(fields, says):
    tag = pinned()
    for name, value in fields.items():
        setattr(tag, name, value)
    for check in (tag.validate, tag.encode, tag.headers):
        with pytest.raises(kvtier.InvalidTagError, match="block tag: ") as e:
            check()
        assert says in e.value.message and e.value.code == "invalid_tag"
        assert isinstance(e.value, ValueError)


def test_bad_bytes_do_not_decode():
    good = bytes.fromhex(PINNED_HEX)
    for data, says in (
        (good[:-1], "the tag ends after 49 bytes"),
        (good + b"\x00", "1 bytes after the tag's end"),
        (b"\x02" + good[1:], "version 2"),
        (b"", "ends after 0 bytes"),
    ):
        with pytest.raises(kvtier.InvalidTagError, match=says):
            BlockTag.decode(data)


def test_tags_must_be_one_per_block():
    with kvtier.Client("http://127.0.0.1:1") as c, pytest.raises(ValueError, match="2 tags for 1 blocks"):
        c.put_many([("k", b"")], tags=[None, None])
    with pytest.raises(TypeError, match=r"not a kvtier\.BlockTag"):
        kvtier.tag.tags_for([b"raw"], 1)  # type: ignore[list-item]


# -------------------------------------------------- against the server


@pytest.fixture(params=["http", "unix"])
def either(request, server) -> kvtier.Client:
    url = server.url if request.param == "http" else server.unix_url
    with kvtier.Client(url, connections=4, timeout_s=10) as c:
        assert c.transport == request.param
        yield c


def test_a_tagged_put_is_stored_over_either_transport(either):
    c = either
    key = f"tagged-{c.transport}"
    assert c.put(key, block(1), tag=pinned()) is True
    assert c.put(key, block(2), tag=vllm_like()) is False
    assert c.get(key) == block(2)
    keys = [f"{key}-many-{i}" for i in range(3)]
    assert c.put_many([(k, block(i)) for i, k in enumerate(keys)], tags=[vllm_like(), None, pinned()]) == [True] * 3
    assert c.get_many(keys) == [block(i) for i in range(3)]


def test_the_servers_refusal_raises_invalid_tag_and_stores_nothing(either, monkeypatch):
    """A tag the client's check would refuse, sent anyway (the check
    switched off): the server refuses it, the client raises
    InvalidTagError, and neither a new key nor an old block is touched."""
    c = either
    assert c.put(f"kept-{c.transport}", block(7)) is True
    monkeypatch.setattr(BlockTag, "validate", lambda self: None)
    bad = pinned()
    bad.token_ids = [1, 2, 3]
    for key in (f"never-{c.transport}", f"kept-{c.transport}"):
        with pytest.raises(kvtier.InvalidTagError) as e:
            c.put(key, block(8), tag=bad)
        if c.transport == "http":
            assert e.value.status == 400 and e.value.code == "invalid_tag"
            assert "x-kvtier-token-ids holds 3 ids for 2 block(s) of 2 tokens" in e.value.message
        else:
            assert e.value.local_code == codes.INVALID_TAG and e.value.code == "invalid_tag"
    assert not c.exists(f"never-{c.transport}")
    assert c.get(f"kept-{c.transport}") == block(7)


def test_a_bad_tag_fails_only_its_item_in_the_batch_calls(either):
    c = either
    bad = pinned()
    bad.block_size = 0
    with kvtier.SharedBuffer(2 * BLOCK_BYTES) as buf:
        assert c.register_buffer(buf) == 0
        view = memoryview(buf)
        view[:BLOCK_BYTES] = block(3)
        view[BLOCK_BYTES:] = block(4)
        keys = [f"batch-{c.transport}-{i}" for i in range(3)]
        got = c.batch_put_from(
            keys, [buf.ptr, buf.ptr + BLOCK_BYTES, buf.ptr], [BLOCK_BYTES] * 3, [pinned(), bad, None]
        )
        assert got == [0, codes.INVALID_TAG, 0]
        assert [c.exists(k) for k in keys] == [True, False, True]
        half = BLOCK_BYTES // 2
        multi = [f"multi-{c.transport}-{i}" for i in range(2)]
        ptrs = [[buf.ptr + BLOCK_BYTES, buf.ptr + BLOCK_BYTES + half]] * 2
        got = c.batch_put_from_multi_buffers(multi, ptrs, [[half, half]] * 2, [bad, vllm_like(2)])
        assert got == [codes.INVALID_TAG, 0]
        assert c.get(multi[1]) == block(4) and not c.exists(multi[0])
        # A buffer object outside every registered one goes through the
        # staging area, its tag with it.
        assert c.batch_put_from([f"staged-{c.transport}"], [bytearray(block(5))], None, [pinned()]) == [0]
        assert c.get(f"staged-{c.transport}") == block(5)
        assert c.unregister_buffer(buf) == 0


def test_the_socket_speaks_the_newest_version_and_a_raw_connection_sends_tags(server):
    with LocalConnection(server.socket_path, timeout_s=10) as conn, kvtier.SharedBuffer(BLOCK_BYTES) as buf:
        assert conn.hello(block_bytes=BLOCK_BYTES)["version"] == 3 == conn.version
        fd_handle, _ = conn.register(buf.fd, 0, BLOCK_BYTES)
        memoryview(buf)[:] = block(6)
        items = [(fd_handle, 0, BLOCK_BYTES, "raw-tagged"), (fd_handle, 0, BLOCK_BYTES, "raw-bad")]
        tags = [bytes.fromhex(PINNED_HEX), bytes.fromhex(PINNED_HEX)[:-1]]
        assert conn.put_from(items, tags=tags) == [(0, 1), (codes.INVALID_TAG, 0)]
        assert conn.exists(["raw-tagged", "raw-bad"])[1] == 0


def test_the_async_client_passes_tags(server):
    async def run() -> None:
        async with kvtier.AsyncClient(server.url) as c:
            assert await c.put("async-tagged", block(9), tag=pinned()) is True
            assert await c.put_many([("async-many", block(10))], tags=[vllm_like()]) == [True]
            with pytest.raises(kvtier.InvalidTagError):
                await c.put("async-bad", block(9), tag=BlockTag(block_hashes=[], block_size=1))

    asyncio.run(run())
