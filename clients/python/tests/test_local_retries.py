"""The socket client's retries (docs/LOCAL.md), against a scripted stand-in
for kvtier's socket: OVERLOADED answered with a hint, a connection dropped
under a batch. (tests/test_local.py covers the real server.)

The stand-in frames with its own code, not the client's constants: its
header layout and magic are those of the Rust crate's frames in
tests/data/local_frame_vectors.json, which
``test_the_fake_frames_as_the_rust_crate_does`` holds it to, so a framing
slip in the client is not mirrored here."""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier
from kvtier import codes

BB = 4096
EPOCH = 77

VECTORS = json.loads(
    (Path(__file__).resolve().parents[3] / "tests" / "data" / "local_frame_vectors.json").read_text(encoding="utf-8")
)
#: The frame magic as the Rust crate writes it (b"TK").
WIRE_MAGIC = bytes.fromhex(VECTORS["constants"]["magic_hex"])
HEADER_BYTES = VECTORS["constants"]["header_bytes"]


def frame(op: int, rid: int, payload: bytes) -> bytes:
    """magic, op, flags 0, u32 payload bytes, u64 request id (little-endian), payload."""
    return WIRE_MAGIC + bytes([op, 0]) + len(payload).to_bytes(4, "little") + rid.to_bytes(8, "little") + payload


def reply(op: int, rid: int, status: int, retry_after_ms: int, body: bytes) -> bytes:
    """The response to a request of ``op``: i32 status, u32 retry_after_ms, body."""
    head = status.to_bytes(4, "little", signed=True) + retry_after_ms.to_bytes(4, "little")
    return frame(op | 0x80, rid, head + body)


def parse_header(head: bytes) -> tuple[int, int, int] | None:
    """``(op, payload bytes, request id)``, or ``None`` for a header that is
    not one (wrong magic, nonzero flags, over 1 MiB)."""
    n = int.from_bytes(head[4:8], "little")
    if head[:2] != WIRE_MAGIC or head[3] != 0 or n > VECTORS["constants"]["payload_bytes_max"]:
        return None
    return head[2], n, int.from_bytes(head[8:16], "little")


class FakeServer:
    """Speaks HELLO, REGISTER, UNREGISTER, PUT_FROM, GET_INTO and EXISTS.
    ``plan[op]`` is a list of what to do with each request of ``op`` in turn:
    ``"ok"``, ``("status", code, retry_after_ms)`` for a whole-request
    failure, ``("items", code[, retry_after_ms])`` for every item, ``"drop"`` (close the
    connection unanswered) or ``"hang"`` (never answer); once it is empty, ``"ok"``.
    At the end of a client's stream it closes the connection, as the server
    does, after ``hold_s`` (a server too slow to confirm in time)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.plan: dict[int, list] = {}
        self.accepted = 0
        self.registered = 0
        self.seen: list[int] = []
        self.bad_frames = 0
        self.hold_s = 0.0
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind(path)
        self._sock.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _recv(conn: socket.socket, n: int, fds: list[int]) -> bytes:
        data = b""
        while len(data) < n:
            chunk, got, _, _ = socket.recv_fds(conn, n - len(data), 4)
            if not chunk:
                raise EOFError
            fds += got
            data += chunk
        return data

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    fds: list[int] = []
                    head = self._recv(conn, HEADER_BYTES, fds)
                    parsed = parse_header(head)
                    if parsed is None:  # as the server: one 0xFF frame, then close
                        self.bad_frames += 1
                        conn.sendall(frame(0xFF, 0, struct.pack("<iI", codes.BAD_FRAME, 0) + b"bad header " + head))
                        return
                    op, n, rid = parsed
                    payload = self._recv(conn, n, fds) if n else b""
                    for fd in fds:
                        os.close(fd)
                    self.seen.append(op)
                    step = self.plan.get(op, [])
                    action = step.pop(0) if step else "ok"
                    if action == "drop":
                        return
                    if action == "hang":
                        continue
                    conn.sendall(self._answer(op, rid, payload, action))
            except EOFError:
                time.sleep(self.hold_s)
            except OSError:
                return

    def _answer(self, op: int, rid: int, payload: bytes, action: object) -> bytes:
        status, body = 0, b""
        retry = action[2] if isinstance(action, tuple) and len(action) > 2 else 0
        if isinstance(action, tuple) and action[0] == "status":
            status, body = action[1], b"scripted failure"
        elif op == 1:
            body = json.dumps({"version": 1, "epoch": EPOCH, "block_bytes": BB, "model": "fake"}).encode()
        elif op == 2:
            self.registered += 1
            body = struct.pack("<QB", self.registered, 1)
        elif op in (4, 5):
            (count,) = struct.unpack_from("<I", payload)
            code = action[1] if isinstance(action, tuple) else (BB if op == 4 else 0)
            body = struct.pack("<I", count) + struct.pack("<qB", code, 2 if op == 4 else 1) * count
        elif op == 6:
            (count,) = struct.unpack_from("<I", payload)
            body = struct.pack("<I", count) + bytes([2]) * count
        return reply(op, rid, status, retry, body)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    root = tempfile.mkdtemp(prefix="kvtier-fake-")
    server = FakeServer(os.path.join(root, "kv.sock"))
    yield server
    server.close()
    os.unlink(server.path)
    os.rmdir(root)
    assert server.bad_frames == 0, "the client sent a frame whose header the Rust crate's framing refuses"


def test_the_fake_frames_as_the_rust_crate_does():
    for v in VECTORS["requests"]:
        data = bytes.fromhex(v["frame_hex"])
        assert parse_header(data[:HEADER_BYTES]) == (v["op"], len(data) - HEADER_BYTES, v["request_id"]), v["name"]
    for v in VECTORS["replies"]:
        data = bytes.fromhex(v["frame_hex"])
        body = data[HEADER_BYTES + 8 :]
        if v["request_op"] is None:  # a connection error
            made = frame(0xFF, v["request_id"], data[HEADER_BYTES:])
        else:
            made = reply(v["request_op"], v["request_id"], v["status"], v["retry_after_ms"], body)
        assert made.hex() == v["frame_hex"], v["name"]
    bad = bytearray(bytes.fromhex(VECTORS["requests"][0]["frame_hex"])[:HEADER_BYTES])
    bad[3] = 1
    assert parse_header(bytes(bad)) is None


def test_a_frame_the_rust_crate_refuses_is_caught(fake):
    # The check the fixture ends with, shown to fail: a bad magic is counted.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(fake.path)
        s.sendall(b"GE" + bytes(14))
        answer = s.recv(64)
    assert (
        answer[:3] == WIRE_MAGIC + b"\xff" and int.from_bytes(answer[16:20], "little", signed=True) == codes.BAD_FRAME
    )
    assert fake.bad_frames == 1
    fake.bad_frames = 0


def test_overloaded_is_retried_after_the_hint(fake):
    fake.plan[5] = [("status", codes.OVERLOADED, 60), ("items", codes.OVERLOADED, 90), "ok"]
    with kvtier.Client(f"unix://{fake.path}", timeout_s=5) as c, kvtier.SharedBuffer(2 * BB) as buf:
        assert c.register_buffer(buf) == 0
        t0 = time.monotonic()
        assert c.batch_put_from(["a", "b"], [buf.ptr, buf.ptr + BB], [BB, BB]) == [0, 0]
        assert time.monotonic() - t0 >= 0.15  # both hints were waited for
        assert c.local_stats()["retries_overloaded"] == 2
        assert fake.seen.count(5) == 3


def test_overloaded_for_good_is_answered_or_raised(fake):
    fake.plan[5] = [("status", codes.OVERLOADED, 1)] * 100
    with kvtier.Client(f"unix://{fake.path}", timeout_s=5) as c, kvtier.SharedBuffer(BB) as buf:
        assert c.register_buffer(buf) == 0
        assert c.batch_put_from(["a"], [buf.ptr], [BB]) == [codes.OVERLOADED]
        with pytest.raises(kvtier.OverloadedError) as e:
            c.put("a", bytes(BB))
        assert e.value.local_code == codes.OVERLOADED


def test_a_batch_cut_off_is_sent_again_once_after_registering_again(fake):
    fake.plan[4] = ["drop"]
    with kvtier.Client(f"unix://{fake.path}", timeout_s=5) as c, kvtier.SharedBuffer(BB) as buf:
        assert c.register_buffer(buf) == 0
        assert c.batch_get_into(["a"], [buf.ptr], [BB]) == [BB]
        stats = c.local_stats()
        assert stats["retries_after_loss"] == 1 and stats["reconnects"] == 1
        assert stats["registrations_renewed"] == 1 and stats["epoch"] == EPOCH
        assert fake.accepted == 2 and fake.registered == 2
        # Cut off twice: the one retry is spent, the item says so.
        fake.plan[4] = ["drop", "drop"]
        assert c.batch_get_into(["a"], [buf.ptr], [BB]) == [codes.CONNECTION_LOST]
        assert c.batch_get_into(["a"], [buf.ptr], [BB]) == [BB]


def test_a_keys_request_cut_off_is_sent_again(fake):
    fake.plan[6] = ["drop"]
    with kvtier.Client(f"unix://{fake.path}", timeout_s=2) as c:
        assert c.batch_is_exist(["a", "b"]) == [1, 1]
        assert fake.accepted == 2


def test_an_unanswered_batch_times_out_and_is_not_sent_again(fake):
    """No answer within the timeout: the client gives up on the connection
    (the server copies nothing more into the memory named) and does not send
    the batch again, which could race the first in the same memory; the next
    call goes on a new connection."""
    fake.plan[4] = ["hang"]
    with kvtier.Client(f"unix://{fake.path}", timeout_s=1) as c, kvtier.SharedBuffer(BB) as buf:
        assert c.register_buffer(buf) == 0
        t0 = time.monotonic()
        assert c.batch_get_into(["a"], [buf.ptr], [BB]) == [codes.CONNECTION_LOST]
        assert 1.0 <= time.monotonic() - t0 < 2.0
        assert c.local_stats()["retries_after_loss"] == 0 and fake.accepted == 1 and fake.seen.count(4) == 1
        assert c.batch_get_into(["a"], [buf.ptr], [BB]) == [BB]
        assert fake.accepted == 2


@pytest.mark.parametrize("hold_s", [0.0, 1.0], ids=["confirmed", "unconfirmed"])
def test_a_staging_area_is_retired_unless_the_close_was_confirmed(fake, hold_s):
    """Memory in no registered buffer goes through the staging area. After a
    timeout, the server's close (within ``CLOSE_CONFIRM_S``) confirms that
    no copy into the area runs any more, and it is kept; without it the area
    is left to the server and the next call registers a new one."""
    fake.plan[4] = ["ok", "hang"]
    fake.hold_s = hold_s
    with kvtier.Client(f"unix://{fake.path}", timeout_s=1) as c:
        out = bytearray(BB)
        assert c.batch_get_into(["a"], [out]) == [BB]
        session = c._link.unix.session
        old = session._staging
        assert c.batch_get_into(["a"], [out]) == [codes.CONNECTION_LOST]
        retired = hold_s > 0
        assert c.local_stats()["staging_retired"] == int(retired) and fake.registered == 1
        assert (session._staging is None) == retired
        assert c.batch_get_into(["a"], [out]) == [BB]
        assert fake.registered == 2, "registered again on the new connection (the old area, or its successor)"
        assert (session._staging is not old) == retired


def test_tags_for_a_version_1_server_fail_clearly_and_untagged_puts_still_go(fake):
    """The stand-in speaks version 1 (no block tags): a tagged put raises
    UNSUPPORTED_VERSION naming the way out before anything is sent, a batch
    fails only its tagged items (-14), and untagged puts go as before."""
    tag = kvtier.BlockTag(block_hashes=[b"\x01" * 8], block_size=4)
    with kvtier.Client(f"unix://{fake.path}", timeout_s=5) as c, kvtier.SharedBuffer(2 * BB) as buf:
        assert c.server_info["version"] == 1
        with pytest.raises(kvtier.ProtocolError, match="version 1, whose PUT_FROM carries no block tags") as e:
            c.put("tagged", bytes(BB), tag=tag)
        assert e.value.local_code == codes.UNSUPPORTED_VERSION
        assert 5 not in fake.seen
        assert c.register_buffer(buf) == 0
        got = c.batch_put_from(["tagged", "plain"], [buf.ptr, buf.ptr + BB], [BB, BB], [tag, None])
        assert got == [codes.UNSUPPORTED_VERSION, 0]
        assert c.put("plain-2", bytes(BB)) is True


def test_a_socket_that_is_gone_fails_at_once_with_connect_timeout_0():
    """``connect_timeout_s=0`` (the engine connectors): a socket file that is
    not there fails the call at once; by default the call keeps trying to
    connect for ``timeout_s``."""
    path = os.path.join(tempfile.mkdtemp(prefix="kvtier-gone-"), "kvtier.sock")
    for connect_timeout_s, at_least_s, at_most_s in ((0.0, 0.0, 0.5), (None, 1.0, 5.0)):
        client = kvtier.Client(f"unix://{path}", timeout_s=1.0, connect_timeout_s=connect_timeout_s)
        started = time.monotonic()
        with pytest.raises(kvtier.KvtierConnectionError):
            client.exists("k")
        assert at_least_s <= time.monotonic() - started < at_most_s
        client.close()
    with pytest.raises(ValueError, match="connect_timeout_s"):
        kvtier.Client(f"unix://{path}", connect_timeout_s=-1)
