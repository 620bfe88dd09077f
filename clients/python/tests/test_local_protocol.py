"""The same-host socket op by op (docs/LOCAL.md) against a real `kvtier
serve`: frames, codes, the peer check and PUT backpressure, below the client."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import BLOCK_BYTES, block

import kvtier
from kvtier import codes
from kvtier.local import MAGIC, OP_HELLO, LocalConnection
from kvtier.testing import ServerProcess

BB = BLOCK_BYTES
#: The frame header as docs/LOCAL.md lays it out: u16 magic, u8 op, u8 flags,
#: u32 payload bytes, u64 request id.
HEADER = struct.Struct("<HBBIQ")


@pytest.fixture
def sb() -> Iterator[kvtier.SharedBuffer]:
    with kvtier.SharedBuffer(8 * BB) as buf:
        yield buf


def fill(view: np.ndarray, seed: int) -> None:
    view[:] = np.frombuffer(block(seed), dtype=np.uint8)


def raw_frame(op: int, payload: bytes, rid: int = 1, magic: int = MAGIC) -> bytes:
    return HEADER.pack(magic, op, 0, len(payload), rid) + payload


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(op, request_id, status, message or body) of the next frame."""
    head = b""
    while len(head) < 16:
        chunk = sock.recv(16 - len(head))
        assert chunk, "connection closed before a frame"
        head += chunk
    _, op, _, n, rid = HEADER.unpack(head)
    payload = b""
    while len(payload) < n:
        payload += sock.recv(n - len(payload))
    status = struct.unpack_from("<i", payload)[0]
    return op, rid, status, payload[8:]


def test_protocol_op_by_op(server, sb):
    with LocalConnection(server.socket_path, timeout_s=10) as conn:
        with pytest.raises(kvtier.UnauthorizedError, match="HELLO"):
            conn.exists(["x"])  # before the hello
    with LocalConnection(server.socket_path, timeout_s=10) as conn:
        info = conn.hello(block_bytes=BB)
        handle, access = conn.register(sb.fd, 0, sb.nbytes)
        assert access == 1
        fill(sb.numpy()[:BB], 80)
        assert conn.put_from([(handle, 0, BB, "proto-1")]) in ([(0, 1)], [(BB, 1)])
        assert conn.get_into([(handle, BB, BB, "proto-1")]) == [(BB, 2)]
        assert conn.get_into([(handle, BB, BB, "bad/key"), (handle, BB, BB - 1, "proto-1")]) == [
            (codes.INVALID_KEY, 0),
            (codes.WRONG_SIZE, 0),
        ]
        assert conn.get_into([(handle, 8 * BB, BB, "proto-1")]) == [(codes.OUT_OF_BOUNDS, 0)]
        assert conn.exists(["proto-1", "proto-none"]) == [2, 0]
        assert conn.lookup(["proto-1", "proto-none"]) == (1, [2])
        assert conn.prefetch(["proto-1", "proto-none"]) == (2, 1)
        conn.unregister(handle)
        assert conn.get_into([(handle, 0, BB, "proto-1")]) == [(codes.UNKNOWN_HANDLE, 0)]
        assert conn.delete(["proto-1", "proto-1"])[1] == codes.NOT_FOUND
        with pytest.raises(kvtier.ProtocolError) as e:
            conn.call(42, b"")
        assert e.value.local_code == codes.UNKNOWN_OP
        assert conn.exists(["proto-1"]) == [0]  # the connection stays open
        # A REGISTER without a descriptor: BAD_BUFFER.
        with pytest.raises(kvtier.KvtierError) as e:
            conn.call(2, struct.pack("<QQ", 0, BB))
        assert e.value.local_code == codes.BAD_BUFFER
        assert info["epoch"] == conn.info["epoch"]
    with LocalConnection(server.socket_path) as conn:
        with pytest.raises(kvtier.ProtocolError, match=r"UNSUPPORTED|version") as e:
            conn.call(OP_HELLO, json.dumps({"versions": [99]}).encode())
        assert e.value.local_code == codes.UNSUPPORTED_VERSION
    # A bad frame: one 0xFF frame, BAD_FRAME, closed; the server goes on.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(server.socket_path)
        s.sendall(raw_frame(OP_HELLO, b"{}", magic=0x1234))
        op, rid, status, _ = read_frame(s)
        assert (op, rid, status) == (0xFF, 0, codes.BAD_FRAME)
        assert s.recv(1) == b""
    with kvtier.Client(server.unix_url) as c:
        assert c.ping()


def hello_as_nobody(server: ServerProcess) -> dict[str, object]:
    """Runs a hello on ``server``'s socket as uid/gid 65534 (``setpriv``); the
    first frame back, as JSON."""
    os.chmod(server.data_dir, 0o755)
    assert server.socket_path is not None
    os.chmod(os.path.dirname(server.socket_path), 0o755)
    os.chmod(server.socket_path, 0o666)
    snippet = (
        "import socket,struct,sys,json\n"
        "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        "h=json.dumps({'versions':[1]}).encode()\n"
        "try: s.sendall(struct.pack('<HBBIQ',0x4B54,1,0,len(h),7)+h)\n"
        "except BrokenPipeError: pass  # refused at accept, before the hello\n"
        "b=b''\n"
        "while len(b)<16 or len(b)<16+struct.unpack_from('<I',b,4)[0]:  # one frame\n"
        "    try: c=s.recv(65536)\n"
        "    except ConnectionResetError: break  # closed with our hello unread\n"
        "    if not c: break\n"
        "    b+=c\n"
        "_,op,_,n,rid=struct.unpack_from('<HBBIQ',b)\n"
        "st=struct.unpack_from('<i',b,16)[0]\n"
        "print(json.dumps({'op':op,'rid':rid,'status':st,'msg':b[24:16+n].decode()}))\n"
    )
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            snippet,
            server.socket_path,
        ],
        capture_output=True,
        timeout=20,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    frame: dict[str, object] = json.loads(done.stdout)
    return frame


@pytest.fixture
def setpriv() -> None:
    """These tests run a peer as uid 65534 with setpriv: they fail, saying
    so, where they cannot (CI runs as root; util-linux has setpriv)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.fail("this test runs a peer as uid 65534: run it as root on a machine with setpriv (util-linux)")


def test_a_peer_of_another_uid_is_refused(server, setpriv):
    frame = hello_as_nobody(server)
    assert frame["op"] == 0xFF and frame["status"] == codes.UNAUTHORIZED, frame
    assert "65534" in frame["msg"], frame
    with kvtier.Client(server.url) as c:
        assert c.stats()["local"]["peers_refused"] >= 1


def test_a_peer_of_an_allowed_uid_gets_its_hello(setpriv):
    with ServerProcess(block_bytes=BB, args=("--local-allow-uid", "65534")) as s:
        frame = hello_as_nobody(s)
        assert frame["op"] == OP_HELLO | 0x80 and frame["status"] == 0, frame
        assert json.loads(str(frame["msg"]))["block_bytes"] == BB
    with ServerProcess(block_bytes=BB, args=("--local-allow-gid", "65534")) as s:
        frame = hello_as_nobody(s)
        assert frame["op"] == OP_HELLO | 0x80 and frame["status"] == 0, frame


def test_the_hello_carries_the_bearer_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with ServerProcess(block_bytes=BB, args=("--auth-token-file", str(token))) as s:
        with kvtier.Client(s.unix_url) as c:
            # A configuration error, not an item's: raised, naming the token.
            with pytest.raises(kvtier.KvtierError, match="token"):
                c.batch_is_exist(["k"])
        with kvtier.Client(s.unix_url, token="s3cret") as c:
            assert c.batch_is_exist(["k"]) == [0]
            assert c.server_info["block_bytes"] == BB


def test_put_backpressure_is_retried_until_stored():
    # A shard admits 1 MiB of PUTs at once (16 blocks): a batch of 256 is
    # refused item by item (OVERLOADED) beyond it, and the client sends the
    # refused ones again until all are stored.
    with ServerProcess(block_bytes=BB, args=("--put-inflight-mib", "1")) as s:
        with kvtier.Client(s.unix_url) as c, kvtier.SharedBuffer(256 * BB) as buf:
            assert c.register_buffer(buf) == 0
            keys = [f"bp-{i}" for i in range(256)]
            assert c.batch_put_from(keys, [buf.ptr + i * BB for i in range(256)], [BB] * 256) == [0] * 256
            assert c.local_stats()["retries_overloaded"] >= 1
            with LocalConnection(s.socket_path) as conn:
                conn.hello()
                handle, _ = conn.register(buf.fd, 0, buf.nbytes)
                results = conn.put_from([(handle, i * BB, BB, f"bp-raw-{i}") for i in range(256)])
            assert codes.OVERLOADED in {r for r, _ in results}
