"""kvtier.Client against a real `kvtier serve` on loopback."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import BLOCK_BYTES, block, start_on_same_port

import kvtier
from kvtier import client as client_module
from kvtier.errors import error_from_response
from kvtier.testing import ServerProcess, free_port
from kvtier.transport import http as http_transport


def put_requests(client: kvtier.Client) -> int:
    return client.stats()["http"]["routes"]["put_block"]["requests"]


def test_round_trip_of_every_block_method(client):
    assert client.block_bytes == BLOCK_BYTES
    data = block(1)
    assert client.put("rt-1", data) is True
    assert client.put("rt-1", data) is False  # replaced
    assert client.get("rt-1") == data
    assert client.exists("rt-1")
    assert client.tier_of("rt-1") in ("ram", "nvme")
    buf = bytearray(BLOCK_BYTES)
    assert client.get_into("rt-1", buf) and buf == data
    assert client.delete("rt-1") is True
    assert client.delete("rt-1") is False
    assert client.get("rt-1") is None
    assert client.get_into("rt-1", buf) is False
    assert not client.exists("rt-1")


def test_put_takes_any_buffer(client):
    arr = np.frombuffer(block(2), dtype=np.uint16).reshape(64, -1)  # 2-D, not bytes
    assert client.put("buf-np", arr)
    assert client.get("buf-np") == block(2)
    assert client.put("buf-mv", memoryview(block(3)))
    assert client.get("buf-mv") == block(3)


def test_get_into_numpy_and_memoryview_slices(client):
    client.put("into-1", block(4))
    arr = np.zeros(BLOCK_BYTES // 4, dtype=np.float32)
    assert client.get_into("into-1", arr)
    assert arr.tobytes() == block(4)
    # A memoryview into the middle of a larger buffer: only its bytes change.
    big = bytearray(b"\xee" * (BLOCK_BYTES + 200))
    assert client.get_into("into-1", memoryview(big)[100 : 100 + BLOCK_BYTES])
    assert big[:100] == b"\xee" * 100 and big[-100:] == b"\xee" * 100
    assert big[100:-100] == block(4)
    # A larger buffer is fine: the block fills its head.
    larger = bytearray(BLOCK_BYTES * 2)
    assert client.get_into("into-1", larger) and larger[:BLOCK_BYTES] == block(4)


def test_get_into_refuses_bad_buffers_and_keeps_working(client):
    client.put("into-2", block(5))
    with pytest.raises(kvtier.BlockSizeError, match="too small") as info:
        client.get_into("into-2", bytearray(BLOCK_BYTES - 1))
    assert info.value.code == "buffer_too_small"
    with pytest.raises(TypeError, match="read-only"):
        client.get_into("into-2", bytes(BLOCK_BYTES))
    with pytest.raises(ValueError, match="contiguous"):
        client.get_into("into-2", np.zeros((BLOCK_BYTES, 2), dtype=np.uint8)[:, 0])
    with pytest.raises(TypeError, match="no buffer"):
        client.get_into("into-2", 42)
    # The connection the short buffer broke was dropped, not reused.
    for _ in range(client.connections + 1):
        assert client.get("into-2") == block(5)


def test_wrong_size_and_bad_keys_are_refused_before_sending(client):
    before = put_requests(client)
    with pytest.raises(kvtier.BlockSizeError, match=f"block_bytes is {BLOCK_BYTES}"):
        client.put("short", b"x" * 10)
    with pytest.raises(kvtier.BlockSizeError):
        client.put("long", bytes(BLOCK_BYTES + 1))
    for bad in ["bad/key", "", "..", "k" * 257, "sp ace"]:
        with pytest.raises(kvtier.InvalidKeyError):
            client.put(bad, block(0))
        with pytest.raises(kvtier.InvalidKeyError):
            client.get(bad)
    with pytest.raises(kvtier.InvalidKeyError, match=r"'/'"):
        client.lookup(["ok", "no/slash"])
    assert put_requests(client) == before  # nothing reached the server
    assert client.get("short") is None


def test_server_side_errors_map_to_their_classes(client):
    # Past the client's own checks, the server's answers carry code and message.
    answer = client._exchange("GET", "/v1/blocks/%25")
    err = answer.error()
    assert isinstance(err, kvtier.InvalidKeyError) and err.status == 400 and err.code == "invalid_key"
    answer = client._exchange("POST", "/v1/lookup", body=memoryview(b"not json"), json_body=True)
    err = answer.error()
    assert isinstance(err, kvtier.BadRequestError) and err.code == "bad_json"
    answer = client._exchange("PUT", "/v1/blocks/short", body=memoryview(b"tiny"))
    err = answer.error()
    assert isinstance(err, kvtier.BlockSizeError) and err.status == 422 and str(BLOCK_BYTES) in err.message


def test_error_table_by_status_and_code():
    cases = [
        (400, "invalid_key", kvtier.InvalidKeyError),
        (413, "body_too_large", kvtier.BlockSizeError),
        (411, "length_required", kvtier.BlockSizeError),
        (422, "wrong_block_size", kvtier.BlockSizeError),
        (401, "unauthorized", kvtier.UnauthorizedError),
        (507, "disk_full", kvtier.DiskFullError),
        (503, "shutting_down", kvtier.OverloadedError),
        (429, "over_share", kvtier.OverloadedError),
        (400, "bad_json", kvtier.BadRequestError),
        (500, "internal", kvtier.ServerError),
    ]
    for status, code, cls in cases:
        err = error_from_response(status, code, "m", retry_after_s=2.0)
        assert type(err) is cls and err.status == status and err.code == code
        assert isinstance(err, kvtier.KvtierError)
    err = error_from_response(503, "overloaded", "busy", retry_after_s=1.5)
    assert err.retry_after_s == 1.5
    answer = client_module._Answer(503, b'{"error":{"code":"overloaded","message":"busy"}}', 0, None, "3")
    assert answer.error().retry_after_s == 3.0 and answer.error().message == "busy"
    answer = client_module._Answer(502, b"<html>bad gateway</html>", 0, None, None)
    assert isinstance(answer.error(), kvtier.ServerError) and "bad gateway" in answer.error().message


def test_lookup_counts_leading_hits_and_prefetch_counts_stored(client):
    chain = kvtier.chain_keys(list(range(128 * 6)), 128)
    client.put_many([(k, block(i)) for i, k in enumerate(chain[:4])])
    assert client.lookup(chain) == 4
    assert client.lookup(chain[1:]) == 3
    assert client.lookup(chain[4:]) == 0
    assert client.lookup([]) == 0
    assert len(client.lookup_tiers(chain)) == 4
    assert client.prefetch(chain) == 4
    # Past the server's 4,096-key limit the client splits the chain.
    assert client.lookup(chain[:4] + [f"absent-{i}" for i in range(5000)]) == 4


def test_long_chains_are_split_and_stop_at_the_first_miss(client, monkeypatch):
    # The HTTP transport splits the chain (client.LOOKUP_KEYS_MAX re-exports the limit).
    monkeypatch.setattr(http_transport, "LOOKUP_KEYS_MAX", 3)
    keys = [f"split-{i}" for i in range(8)]
    client.put_many([(k, block(i)) for i, k in enumerate(keys[:7])])
    assert client.lookup(keys) == 7  # three requests: 3 + 3 + 1 of 2
    client.delete(keys[2])
    assert client.lookup(keys) == 2
    assert client.prefetch(keys) == 6


def test_batched_forms(client):
    keys = [f"batch-{i}" for i in range(12)]
    assert client.put_many([(k, block(i)) for i, k in enumerate(keys)]) == [True] * 12
    got = client.get_many([*keys, "batch-absent"])
    assert got[:12] == [block(i) for i in range(12)] and got[12] is None
    bufs = [np.empty(BLOCK_BYTES, dtype=np.uint8) for _ in range(13)]
    assert client.get_many_into([*keys, "batch-absent"], bufs) == [True] * 12 + [False]
    assert all(bufs[i].tobytes() == block(i) for i in range(12))
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        client.get_many_into(keys[:2], bufs[:1])
    with pytest.raises(kvtier.BlockSizeError):  # one bad item fails the batch; the running put finishes
        client.put_many([("batch-ok", block(1)), ("batch-bad", b"short")])
    assert client.get("batch-ok") == block(1)


def test_stats_and_ping(client):
    stats = client.stats()
    assert stats["geometry"]["block_bytes"] == BLOCK_BYTES
    assert stats["shards"] == 2
    assert client.ping()


def test_unreachable_server_raises_after_retries():
    c = kvtier.Client(f"http://127.0.0.1:{free_port()}", retries=2, timeout_s=2)
    started = time.monotonic()
    with pytest.raises(kvtier.KvtierConnectionError, match="failed 3 times") as info:
        c.get("k")
    assert info.value.code == "connection_failed"
    assert isinstance(info.value, ConnectionError)
    assert time.monotonic() - started < 2.0  # refused at once; backoff 50 + 100 ms
    assert c.ping() is False


def test_bad_client_settings():
    with pytest.raises(ValueError, match="http://"):
        kvtier.Client("https://127.0.0.1:1")
    with pytest.raises(ValueError, match="connections"):
        kvtier.Client(connections=0)
    with pytest.raises(ValueError, match="timeout_s"):
        kvtier.Client(timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        kvtier.Client(retries=-1)
    c = kvtier.Client()
    c.close()
    with pytest.raises(kvtier.KvtierError, match="closed"):
        c.get("k")


def test_auth_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with ServerProcess(block_bytes=BLOCK_BYTES, args=("--auth-token-file", str(token_file))) as s:
        anonymous = kvtier.Client(s.url)
        with pytest.raises(kvtier.UnauthorizedError) as info:
            anonymous.get("k")
        assert info.value.status == 401 and info.value.code == "unauthorized"
        wrong = kvtier.Client(s.url, token="nope")
        with pytest.raises(kvtier.UnauthorizedError):
            wrong.lookup(["k"])
        # The block size comes from the server, so an anonymous put fails on
        # the first request either way.
        with pytest.raises(kvtier.UnauthorizedError):
            anonymous.put("k", block(1))
        with kvtier.Client(s.url, token="s3cret-token") as authed:
            assert authed.put("k", block(1)) and authed.get("k") == block(1)
            assert authed.lookup(["k"]) == 1


def test_tenants_keep_their_keys_apart_over_http_and_the_socket(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[[tenant]]\nname = "a"\ntoken = "tok-a"\n'
        '[[tenant]]\nname = "b"\ntoken = "tok-b"\n'
        '[[namespace]]\nname = "sys"\nkey_prefix = "sys-"\nreaders = ["a", "b"]\nwriters = ["a"]\n'
    )
    with ServerProcess(block_bytes=BLOCK_BYTES, args=("--tenants", str(tenants))) as s:
        with pytest.raises(kvtier.UnauthorizedError):
            kvtier.Client(s.url, token="nope").lookup(["k"])
        a = kvtier.Client(s.url, token="tok-a")
        b = kvtier.Client(s.url, token="tok-b")
        assert a.put("k", block(1)) and b.put("k", block(2)), "one key, two tenants, two blocks"
        assert a.get("k") == block(1) and b.get("k") == block(2)
        a.put("only-a", block(3))
        a.put("sys-prompt", block(4))
        assert b.get("only-a") is None and b.lookup(["only-a"]) == 0
        assert b.get("sys-prompt") == block(4), "the namespace, read"
        with pytest.raises(kvtier.KvtierError) as info:
            b.put("sys-prompt", block(5))
        assert info.value.status == 403 and info.value.code == "namespace_read_only"
        assert b.stats()["tenant"] == "b"
        # The same tenants over the same-host socket.
        bl = kvtier.Client(s.url, token="tok-b", local="auto")
        assert bl.transport == "unix"
        buf = kvtier.SharedBuffer(2 * BLOCK_BYTES)
        assert bl.register_buffer(buf.ptr, buf.nbytes) == 0
        ptrs = [buf.ptr, buf.ptr + BLOCK_BYTES]
        assert bl.batch_get_into(["only-a", "k"], ptrs, [BLOCK_BYTES, BLOCK_BYTES]) == [-2, BLOCK_BYTES]
        assert bytes(buf.numpy()[BLOCK_BYTES:]) == block(2)
        assert bl.batch_is_exist(["only-a", "sys-prompt"]) == [0, 1]
        assert bl.batch_put_from(["sys-prompt"], [ptrs[0]], [BLOCK_BYTES]) == [-12], "UNAUTHORIZED: read-only namespace"
        assert a.get("only-a") == block(3)


def test_a_server_killed_mid_batch_fails_the_batch_and_the_client_recovers():
    with ServerProcess(block_bytes=BLOCK_BYTES) as s:
        c = kvtier.Client(s.url, connections=4, retries=1, timeout_s=5)
        c.put_many([(f"kill-{i}", block(i)) for i in range(8)])
        outcome: dict[str, object] = {}

        def reader() -> None:
            keys = [f"kill-{i % 8}" for i in range(200_000)]
            try:
                outcome["result"] = c.get_many(keys)
            except kvtier.KvtierError as e:
                outcome["error"] = e

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.3)
        s.kill()
        t.join(60)
        assert not t.is_alive()
        assert isinstance(outcome.get("error"), kvtier.KvtierConnectionError), outcome.keys()
        # Same port, same data: the client reconnects and the blocks are there.
        start_on_same_port(s)
        assert c.get_many([f"kill-{i}" for i in range(8)]) == [block(i) for i in range(8)]
        c.close()


def test_get_into_a_torch_tensor(client):
    torch = pytest.importorskip("torch")
    client.put("torch-1", block(9))
    t = torch.empty(BLOCK_BYTES // 2, dtype=torch.bfloat16)
    assert client.get_into("torch-1", t)
    assert t.view(torch.uint8).numpy().tobytes() == block(9)
    rows = torch.zeros(3, BLOCK_BYTES, dtype=torch.uint8)
    assert client.get_into("torch-1", rows[1])  # a row of a pool: only that row changes
    assert rows[1].numpy().tobytes() == block(9) and not rows[0].any() and not rows[2].any()
    assert client.put("torch-2", rows[1])
    with pytest.raises(ValueError, match="contiguous"):
        client.get_into("torch-1", rows[:, 0])


def _flip_payload_byte(data_dir, key: str, block_bytes: int, payload_offset: int) -> None:
    """Flips one payload byte of `key`'s slot in a stopped store: the slot
    header (docs/FORMAT.md) names the key at byte 64, its length at 44."""
    page = 4096
    slot_bytes = page + -(-block_bytes // page) * page
    for seg in sorted(data_dir.glob("shard-*/seg-*.kvt")):
        with open(seg, "r+b") as f:
            for slot in range((seg.stat().st_size - page) // slot_bytes):
                at = page + slot * slot_bytes
                f.seek(at)
                header = f.read(page)
                key_len = int.from_bytes(header[44:46], "little")
                if header[64 : 64 + key_len] == key.encode():
                    f.seek(at + page + payload_offset)
                    b = f.read(1)
                    f.seek(at + page + payload_offset)
                    f.write(bytes([b[0] ^ 0x5A]))
                    return
    raise AssertionError(f"no slot holds {key}")


def test_a_block_cut_off_mid_stream_is_a_miss_never_wrong_bytes(tmp_path):
    """A chunk failing its CRC-32 on the server ends the response short of
    its Content-Length after the chunks before it; the client retries, the
    server has dropped the block, and the answer is a miss."""
    block_bytes = 7 << 19  # 3.5 MiB: four CRC chunks of at most 1 MiB
    data = tmp_path / "data"
    # One shard: the GET is streamed by the shard that accepted it.
    s = ServerProcess(block_bytes=block_bytes, ram_gb=0, shards=1, data_dir=str(data), args=("--segment-mib", "16"))
    s.start()
    try:
        payloads = {
            k: np.random.default_rng(i).bytes(block_bytes) for i, k in enumerate(["cut-get", "cut-into", "intact"])
        }
        c = kvtier.Client(s.url)
        for k, v in payloads.items():
            c.put(k, v)
        c.close()
        s.stop()
        _flip_payload_byte(data, "cut-get", block_bytes, 2 * (1 << 20) + 5)
        _flip_payload_byte(data, "cut-into", block_bytes, block_bytes - 1)
        s.start()
        c = kvtier.Client(s.url, retries=1)
        assert c.get("cut-get") is None
        buf = bytearray(block_bytes)
        assert c.get_into("cut-into", buf) is False
        assert c.get("intact") == payloads["intact"]
        assert c.stats()["totals"]["corrupt_blocks"] == 2
        c.close()
    finally:
        s.stop()
