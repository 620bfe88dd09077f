#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora from a real kvtier run (make fuzz-seeds).

What it does, in order:

1. Captures the HTTP/1.1 request heads that curl sends for the README's
   commands (PUT, GET, HEAD, DELETE, lookup, prefetch, stats, metrics, with
   and without a bearer token), on a loopback listener that records each
   head and answers 204: seeds of ``http_route``.
2. Starts a real ``kvtier serve`` (4 KiB blocks, one shard, the local
   socket on, and the shared tier on a real moto_server when
   ``target/py-s3`` has one), and drives it with the Python client: PUTs
   over HTTP, then a same-host session (HELLO, REGISTER of a memfd,
   PUT_FROM, GET_INTO, the vectored forms, EXISTS, LOOKUP, PREFETCH, DELETE,
   UNREGISTER) whose bytes on the socket are recorded: seeds of
   ``local_frames``; the lookup bodies sent: seeds of ``key_list``.
3. Stops the server with SIGTERM (so it writes its index snapshot) and cuts
   its files up: ``store.json`` (``store_json``), the snapshot, raw and as
   an rkyv body (``index_snapshot``), each slot's header page
   (``slot_header``) and whole slot (``slot``); the block objects the
   server uploaded to moto (``s3_object``); the keys (``key``).

The inputs are named by content hash, so a rerun adds only what is new
(the on-disk records carry write times: a rerun adds a run's worth).
``store_ops`` seeds are operation sequences: their bytes are made here from
the target's own input layout (fuzz/src/store_ops.rs), not from a run.

Usage: fuzz/seeds.py [--kvtier target/debug/kvtier] [--out fuzz/corpus]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "clients/python/src"))

BLOCK_BYTES = 4096
PAGE = 4096


def save(out: Path, target: str, data: bytes) -> None:
    """Writes ``data`` as an input of ``target``, named by its SHA-1 (as libFuzzer names inputs)."""
    d = out / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()).write_bytes(data)


def capture_curl_heads(out: Path) -> None:
    """Records the request heads curl sends (mode byte 0: no token; 1: the server has one)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    heads: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head = data.split(b"\r\n\r\n")[0] + b"\r\n\r\n"
                # The listener's port, as the README's: the same head on every run.
                heads.append(head.replace(f"127.0.0.1:{port}".encode(), b"127.0.0.1:8085"))
                conn.sendall(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{port}"
    body = Path(tempfile.mkstemp()[1])
    body.write_bytes(b"x" * 100)
    keys = json.dumps({"keys": ["k-0", "k-1", "k-2"]})
    calls = [
        ["-X", "PUT", "--data-binary", f"@{body}", f"{base}/v1/blocks/k-0"],
        [f"{base}/v1/blocks/k-0"],
        ["-I", f"{base}/v1/blocks/k-0"],
        ["-X", "DELETE", f"{base}/v1/blocks/k-0"],
        ["-X", "POST", "-H", "content-type: application/json", "-d", keys, f"{base}/v1/lookup"],
        ["-X", "POST", "-H", "content-type: application/json", "-d", keys, f"{base}/v1/prefetch"],
        [f"{base}/v1/stats"],
        [f"{base}/metrics"],
        [f"{base}/healthz"],
        [f"{base}/readyz"],
        ["-H", "Authorization: Bearer fuzz-token-0123456789", f"{base}/v1/blocks/k-1"],
        ["-X", "PATCH", f"{base}/v1/blocks/k-1"],
        [f"{base}/v1/nothing"],
    ]
    for args in calls:
        subprocess.run(["curl", "-s", "-o", "/dev/null", "--max-time", "5", *args], check=False)
    body.unlink()
    time.sleep(0.2)
    listener.close()
    for head in heads:
        save(out, "http_route", b"\x00" + head)
        save(out, "http_route", b"\x01" + head)
        save(out, "http_route", b"\x05" + head)


class Recording:
    """A socket whose sends are recorded: what the Python client writes on the local socket."""

    def __init__(self, sock: socket.socket, sink: list[bytes]) -> None:
        self._sock = sock
        self._sink = sink

    def sendall(self, data: bytes) -> None:
        self._sink.append(bytes(data))
        self._sock.sendall(data)

    def sendmsg(self, buffers, ancdata=(), flags=0, address=None):  # noqa: ANN001, ANN201
        sent = (
            self._sock.sendmsg(buffers, ancdata, flags)
            if address is None
            else self._sock.sendmsg(buffers, ancdata, flags, address)
        )
        self._sink.append(b"".join(bytes(b) for b in buffers)[:sent])
        return sent

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._sock, name)


def start_moto(port: int) -> subprocess.Popen | None:
    moto = ROOT / "target/py-s3/bin/moto_server"
    if not moto.exists():
        print("seeds: no target/py-s3/bin/moto_server (make python-env): no S3 object seeds this time")
        return None
    p = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for _ in range(300):
        try:
            s3_request(port, "PUT", "/seeds")
            return p
        except OSError:
            time.sleep(0.1)
    p.kill()
    raise SystemExit("moto_server did not start")


def s3_request(port: int, method: str, path: str) -> bytes:
    # moto checks no signature but treats a request without one as anonymous.
    auth = (
        "AWS4-HMAC-SHA256 Credential=kvtier-test/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00"
    )
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers={"Authorization": auth})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read()


def real_run(kvtier: str, out: Path) -> None:
    from kvtier import Client, local
    from kvtier.local import LocalConnection
    from kvtier.testing import ServerProcess, free_port

    os.environ["KVTIER_BIN"] = kvtier
    data_dir = Path(tempfile.mkdtemp(prefix="kvtier-seeds-"))
    moto_port = free_port()
    moto = start_moto(moto_port)
    args = ("--segment-mib", "1", "--io-memory-mib", "64")
    if moto:
        args += (
            "--s3-url",
            "s3://seeds",
            "--s3-endpoint",
            f"http://127.0.0.1:{moto_port}",
            "--s3-write-policy",
            "through",
        )
        os.environ.update(AWS_ACCESS_KEY_ID="kvtier-test", AWS_SECRET_ACCESS_KEY="kvtier-test", AWS_REGION="us-east-1")
    server = ServerProcess(block_bytes=BLOCK_BYTES, ram_gb=0, disk_gb=0.01, shards=1, data_dir=str(data_dir), args=args)
    server.start()
    try:
        url = server.url
        keys = [f"seed-{i}" for i in range(6)]
        with Client(url) as c:
            for i, k in enumerate(keys):
                c.put(k, bytes([i]) * BLOCK_BYTES)
            c.put(keys[0], b"\xa5" * BLOCK_BYTES)  # an overwrite: two records of one key
            c.delete(keys[5])  # a tombstone
            c.get(keys[1])
        for i in range(1, 4):
            body = json.dumps({"keys": [*keys[:i], "missing"]}).encode()
            save(out, "key_list", body)
            urllib.request.urlopen(
                urllib.request.Request(url + "/v1/lookup", data=body, method="POST"), timeout=5
            ).read()
        for k in [*keys, "a", "k" * 256, "x.y_z~-0"]:
            save(out, "key", k.encode())

        sent: list[bytes] = []
        conn = LocalConnection(str(server.socket_path))
        conn._sock = Recording(conn._sock, sent)  # recording what the real client sends
        conn.hello(block_bytes=BLOCK_BYTES)
        fd = os.memfd_create("kvtier-seeds")
        os.ftruncate(fd, 4 * BLOCK_BYTES)
        handle, _ = conn.register(fd, 0, 4 * BLOCK_BYTES)
        conn.put_from([(handle, 0, BLOCK_BYTES, "local-0"), (handle, BLOCK_BYTES, BLOCK_BYTES, "local-1")])
        conn.get_into([(handle, 2 * BLOCK_BYTES, BLOCK_BYTES, "local-0")])
        half = BLOCK_BYTES // 2
        vectored = [([(handle, 0, half), (handle, 3 * BLOCK_BYTES, half)], "local-2")]
        conn.call(local.OP_PUT_FROM_V, local.encode_items_v(vectored))
        conn.call(local.OP_GET_INTO_V, local.encode_items_v(vectored))
        conn.exists(["local-0", "local-9"])
        conn.lookup(["local-0", "local-1", "local-9"])
        conn.prefetch(["local-1"])
        conn.delete(["local-1"])
        conn.unregister(handle)
        conn.close()
        os.close(fd)
        stream = b"".join(sent)
        save(out, "local_frames", stream)
        # Each request alone too, so the fuzzer starts from every op.
        at = 0
        while at + 16 <= len(stream):
            n = 16 + int.from_bytes(stream[at + 4 : at + 8], "little")
            save(out, "local_frames", stream[at : at + n])
            at += n

        if moto:
            listing = s3_request(moto_port, "GET", "/seeds?list-type=2")
            ns = {"s3": "http://s3.amazonaws.com/doc/2006-03-01/"}
            for key in ET.fromstring(listing).iterfind(".//s3:Contents/s3:Key", ns):
                obj = s3_request(moto_port, "GET", f"/seeds/{key.text}")
                name = key.text.rsplit("/", 1)[-1]
                # s3_object's layout: mode, block size (u16 LE), key length (u8),
                # the key, then the object.
                if len(name) <= 255 and len(obj) < 16 << 10:
                    head = b"\x00" + BLOCK_BYTES.to_bytes(2, "little") + len(name).to_bytes(1, "little") + name.encode()
                    save(out, "s3_object", head + obj)
    finally:
        server.terminate(timeout_s=60)  # SIGTERM: the index snapshot is written
        if moto:
            moto.kill()
            moto.wait()

    save(out, "store_json", (data_dir / "store.json").read_bytes())
    for snap in data_dir.glob("shard-*/index.snapshot"):
        raw = snap.read_bytes()
        save(out, "index_snapshot", b"\x00" + raw)
        save(out, "index_snapshot", b"\x01" + raw[16:])
    for seg in sorted(data_dir.glob("shard-*/*.kvt")):
        raw = seg.read_bytes()
        slot = PAGE + BLOCK_BYTES
        for at in range(PAGE, len(raw) - slot + 1, slot):
            page = raw[at : at + PAGE]
            if not any(page):
                continue
            save(out, "slot_header", b"\x00" + page)
            save(out, "slot", b"\x00" + raw[at : at + slot])
    print(f"seeds: a real run in {data_dir} (log {server.log})")


def store_ops_seeds(out: Path) -> None:
    """Operation sequences in store_ops' layout (arbitrary's: a setup of 6
    bytes, then per op a u32 variant index and its fields)."""

    def op(variant: int, *fields: int) -> bytes:
        # arbitrary picks variant (u32 × 9) >> 32 of an enum of 9.
        index = ((variant << 32) + 8) // 9
        return index.to_bytes(4, "little") + bytes(fields)

    put = lambda k, s: op(0, k, s)  # noqa: E731
    get = lambda k: op(2, k)  # noqa: E731
    # The last byte is flags: bit 0 promote, bit 1 two devices (one per
    # shard with two shards; with one, its segments rotating over both).
    setups = [
        bytes([0, 0, 0, 0, 0, 0]),
        bytes([1, 0, 1, 1, 2, 1]),
        bytes([0, 1, 0, 0, 0, 0]),
        bytes([1, 0, 1, 1, 2, 3]),
        bytes([0, 0, 1, 1, 2, 2]),
    ]
    for setup in setups:
        save(out, "store_ops", setup + put(0, 1) + put(1, 2) + get(0) + op(6) + get(0) + get(1))
        save(out, "store_ops", setup + put(0, 1) + op(1, 0, 2, 3) + op(3, 0) + op(4, 0) + get(0) + op(6) + get(0))
        save(out, "store_ops", setup + put(0, 1) + put(2, 5) + op(5) + get(0) + get(2) + op(6) + get(2))
        save(out, "store_ops", setup + put(0, 1) + put(1, 3) + op(7, 1, 2) + get(0) + get(1) + get(2))
        save(out, "store_ops", setup + put(0, 1) + put(1, 3) + op(8, 1, 0, 0x20, 0, 0, 0x40) + get(0) + get(1))
        # A corrupt of no byte (xor 0): a two-device store loses device 1 (file 1), then writes on.
        puts = b"".join(put(k, k + 1) for k in range(6))
        save(out, "store_ops", setup + puts + op(8, 1, 0, 0, 0, 0, 0) + get(0) + get(3) + put(3, 9) + op(6) + get(3))
        # Offset 1 (mod 4): device 1 is absent for a life (reads miss, writes
        # are refused), then back with its blocks.
        absent = op(8, 1, 1, 0, 0, 0, 0) + get(0) + get(3) + put(3, 9) + op(4, 3) + op(3, 3) + op(5) + op(6)
        save(out, "store_ops", setup + puts + absent + get(0) + get(3) + op(8, 0, 1, 0, 0, 0, 0) + get(1) + put(1, 7))
        # Offset 3 + 4 j: device 1 fails in the next life from its operation
        # j (here 2) on: writes refused, reads may miss, then back as it was.
        every = b"".join(get(k) for k in range(6))
        failing = op(8, 1, 11, 0, 0, 0, 0) + get(0) + get(3) + every + put(3, 9) + put(0, 8) + op(4, 3) + op(3, 3) + op(5) + op(6)
        save(out, "store_ops", setup + puts + failing + every + put(3, 7) + get(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvtier", default=str(ROOT / "target/debug/kvtier"), help="the kvtier binary to run")
    ap.add_argument("--out", default=str(ROOT / "fuzz/corpus"), help="corpus root: one folder per target")
    a = ap.parse_args()
    out = Path(a.out)
    capture_curl_heads(out)
    real_run(a.kvtier, out)
    store_ops_seeds(out)
    for d in sorted(out.iterdir()):
        print(f"seeds: {d.name}: {len(list(d.iterdir()))} inputs")


if __name__ == "__main__":
    main()
