"""Leases (docs/LOCAL.md, "Leases"): reading blocks in kvtier's own RAM tier,
mapped read-only, against a real `kvtier serve` (`--ram-shared on`), and the
reader thread's descriptors against a scripted stand-in.

Sizes: 64 KiB blocks; `--ram-gb 0.01` is 162 slots (81 per shard), so a few
hundred PUTs push any block out of RAM, and the churn of a test stays small
on a debug build.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import BLOCK_BYTES, block, server_fds, start_on_same_port, wait_for

import kvtier
from kvtier import codes, local
from kvtier.local import LocalConnection
from kvtier.testing import ServerProcess

BB = BLOCK_BYTES
RAM_GB = 0.01
#: linux/fcntl.h; Python's fcntl module has no name for it.
F_SEAL_FUTURE_WRITE = 0x0010
SHARED = ("--ram-shared", "on")


def stats_leases(c: kvtier.Client) -> dict:
    """``/v1/stats`` ``local.leases``: open, granted_total, released_total,
    expired_total, dropped_at_close_total, arenas_mapped_total, lease_ms."""
    return c.stats()["local"]["leases"]


def ram_capacity(c: kvtier.Client) -> int:
    return next(t["capacity_blocks"] for t in c.stats()["tiers"] if t["tier"] == "ram")


def tiers(path: str, keys: list[str]) -> list[int]:
    """Each key's tier by EXISTS on a connection of its own (reads nothing)."""
    with LocalConnection(path, timeout_s=30) as conn:
        conn.hello(block_bytes=BB)
        return conn.exists(keys)


def churn(c: kvtier.Client, prefix: str, n: int, seed: int = 5000) -> None:
    """``n`` new blocks, 64 per batch."""
    for start in range(0, n, 64):
        c.put_many([(f"{prefix}-{i}", block(seed + i)) for i in range(start, min(n, start + 64))])


@pytest.fixture(scope="module")
def lserver() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=BB, ram_gb=RAM_GB, disk_gb=0.5, args=SHARED) as s:
        yield s


@pytest.fixture
def lclient(lserver: ServerProcess) -> Iterator[kvtier.Client]:
    with kvtier.Client(lserver.unix_url, timeout_s=30) as c:
        yield c


# The lease ops' payloads, their short or miscounted answers and the hello's
# leases offer are the native client's (kvtier-client): client/tests/vectors.rs
# serves it the server's frames, and its ops module checks the hello.


def test_new_codes_raise_their_classes():
    off = kvtier.errors.error_from_code(codes.LEASES_OFF, "no leases: --tenants")
    assert isinstance(off, kvtier.LeasesOffError) and off.local_code == -24 and off.code == "leases_off"
    assert isinstance(kvtier.errors.error_from_code(codes.NOT_IN_RAM, "s3"), kvtier.NotInRamError)
    old = kvtier.errors.error_from_code(codes.UNSUPPORTED_VERSION, "v1")
    assert isinstance(old, kvtier.UnsupportedVersionError) and isinstance(old, kvtier.ProtocolError)


# ------------------------------------- descriptors, against a stand-in


class Scripted:
    """A one-connection stand-in for the socket: ``answer(op, rid, payload,
    conn)`` sends whatever the test wants (frames, descriptors)."""

    def __init__(self, answer: Callable[[int, int, bytes, socket.socket], None]) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvtier-scripted-")
        self.path = os.path.join(self.dir, "kv.sock")
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind(self.path)
        self._sock.listen()
        self._answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._sock.accept()
        with conn:
            try:
                while True:
                    head = conn.recv(16, socket.MSG_WAITALL)
                    if len(head) < 16:
                        return
                    _, op, _, n, rid = struct.unpack("<HBBIQ", head)
                    payload = conn.recv(n, socket.MSG_WAITALL) if n else b""
                    if op == local.OP_HELLO:
                        offer = {"offered": True, "why_not": None, "lease_ms": 1000, "leases_max": 8}
                        hello = {"version": 3, "epoch": 5, "block_bytes": BB, "leases": offer}
                        conn.sendall(reply(op, rid, json.dumps(hello).encode()))
                    else:
                        self._answer(op, rid, payload, conn)
            except OSError:
                return

    def close(self) -> None:
        self._sock.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


def reply(op: int, rid: int, body: bytes, status: int = 0) -> bytes:
    payload = struct.pack("<iI", status, 0) + body
    return struct.pack("<HBBIQ", local.MAGIC, op | 0x80, 0, len(payload), rid) + payload


def memfd(name: str, nbytes: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd


def open_memfds(name: str) -> int:
    """This process's descriptors of memfds called ``name``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{name} (deleted)"
        except OSError:
            pass
    return n


def test_the_reader_hands_a_map_arena_answer_its_descriptor_and_closes_stray_ones():
    """An EXISTS answer and a MAP_ARENA answer sent back to back, each with a
    descriptor: the arena's reaches ``map_arena``; the one that came with the
    EXISTS answer (which takes none) is closed, as are those of a MAP_ARENA
    answer nobody waits for (``post``) or whose caller asked for the body
    only (``call``). A MAP_ARENA answer without one is refused."""
    layout = struct.pack("<QQIQ", 2 * BB + 4096, BB, 2, 2 * BB)
    names = {3: "kvtier-arena", 4: "kvtier-posted", 5: "kvtier-called"}

    def answer(op: int, rid: int, payload: bytes, conn: socket.socket) -> None:
        if op == local.OP_EXISTS:
            stray = memfd("kvtier-stray", 4096)
            socket.send_fds(conn, [reply(op, rid, struct.pack("<I", 0))], [stray])
            os.close(stray)
        elif op == local.OP_MAP_ARENA:
            (arena,) = struct.unpack("<I", payload)
            if arena not in names:
                conn.sendall(reply(op, rid, layout))
                return
            fd = memfd(names[arena], 2 * BB + 4096)
            socket.send_fds(conn, [reply(op, rid, layout)], [fd])
            os.close(fd)

    fake = Scripted(answer)
    try:
        with LocalConnection(fake.path, timeout_s=5) as conn:
            assert conn.hello()["leases"]["offered"] is True
            exists = conn.request(local.OP_EXISTS, struct.pack("<I", 0))
            fd, got = conn.map_arena(3)
            body, _, fds = conn.wait(exists)
            assert (body, fds) == (struct.pack("<I", 0), [])
            try:
                assert got == (2 * BB + 4096, BB, 2, 2 * BB)
                assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:kvtier-arena (deleted)"
                assert os.fstat(fd).st_size == 2 * BB + 4096
                assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            finally:
                os.close(fd)
            assert conn.post(local.OP_MAP_ARENA, struct.pack("<I", 4))
            assert struct.unpack("<QQIQ", conn.call(local.OP_MAP_ARENA, struct.pack("<I", 5))) == got
            with pytest.raises(kvtier.ProtocolError, match="MAP_ARENA 9 came with 0 descriptors"):
                conn.map_arena(9)
            assert conn.alive
            # The posted answer came before the last one (one stream, in order).
            for name in ("kvtier-stray", "kvtier-arena", "kvtier-posted", "kvtier-called"):
                assert open_memfds(name) == 0, f"a descriptor of {name} was left open"
    finally:
        fake.close()


# ------------------------------------------------------- a real server


def test_a_lease_is_the_put_bytes_from_ram_and_from_nvme_and_a_miss_is_none(lserver, lclient):
    c = lclient
    cap = ram_capacity(c)
    assert 150 <= cap <= 170, cap
    c.put("a-cold", block(2))
    churn(c, "a-fill", cap + cap // 2)
    c.put("a-warm", block(1))
    assert tiers(lserver.socket_path, ["a-warm", "a-cold"]) == [2, 3], "a-cold should be on NVMe only by now"
    before = stats_leases(c)
    with c.lease(["a-warm", "a-cold", "a-none"]) as leases:
        assert leases.results == [BB, BB, codes.NOT_FOUND]
        assert leases.tiers == ["ram", "nvme", None]
        assert leases.not_in_ram == [] and leases.views[2] is None
        assert bytes(leases.views[0]) == block(1) and bytes(leases.views[1]) == block(2)
        assert leases.views[0].readonly and leases.views[0].nbytes == BB
        assert [leases.valid(i) for i in range(3)] == [True, True, False]
        array = leases.numpy(1)
        assert array.dtype == np.uint8 and not array.flags.writeable and array.tobytes() == block(2)
        try:
            import torch
        except ImportError:
            pytest.fail("torch is not installed in this virtualenv (make test-python uses target/py-vllm)")
        tensor = leases.torch(0)
        assert tensor.dtype == torch.uint8 and tensor.numel() == BB
        assert tensor.numpy().tobytes() == block(1)
        with kvtier.SharedBuffer(BB) as sb:
            for dest in (bytearray(BB), np.zeros(BB, np.uint8), sb, torch.zeros(BB, dtype=torch.uint8)):
                assert leases.copy_into(1, dest) is True
                assert kvtier.byte_view(dest, writable=False).tobytes() == block(2), type(dest)
            assert leases.copy_into(2, sb) is False, "a miss holds no lease"
        with pytest.raises(kvtier.BlockSizeError):
            leases.copy_into(0, bytearray(BB - 1))
        with pytest.raises(ValueError, match="'a-none' holds no lease \\(NOT_FOUND\\)"):
            leases.numpy(2)
        assert stats_leases(c)["open"] == before["open"] + 2
        view = leases.views[0]
    # Released on leaving: the views go, and a view kept is released with them.
    assert leases.released and leases.views == [None, None, None] and not leases.valid(0)
    with pytest.raises(ValueError, match="released"):
        bytes(view)
    assert leases.release() == 0, "idempotent"
    after = stats_leases(c)
    assert after["open"] == before["open"] and after["released_total"] == before["released_total"] + 2
    # The NVMe block was read into RAM to be leased.
    assert tiers(lserver.socket_path, ["a-cold"]) == [2]


def test_leased_bytes_stay_while_the_key_is_replaced_deleted_and_ram_churns(lserver, lclient):
    """An eviction never reuses a leased slot, and a DELETE or newer PUT of
    the key takes the block out of the index but leaves the slot as leased."""
    c = lclient
    cap = ram_capacity(c)
    c.put_many([("b-0", block(10)), ("b-1", block(11))])
    with kvtier.Client(lserver.unix_url, timeout_s=30) as other, c.lease(["b-0", "b-1"]) as leases:
        assert leases.tiers == ["ram", "ram"]
        c.put("b-0", block(20))
        assert other.delete("b-1") is True
        churn(other, "b-other", 2 * cap, seed=7000)
        churn(c, "b-own", 2 * cap, seed=9000)
        assert bytes(leases.views[0]) == block(10) and bytes(leases.views[1]) == block(11)
        assert leases.valid(0) and leases.valid(1)
        assert c.get("b-0") == block(20) and c.get("b-1") is None
        with kvtier.SharedBuffer(BB) as sb:
            assert leases.copy_into(1, sb) and bytes(sb) == block(11)


def test_more_than_4096_keys_go_in_several_lease_requests(lserver, lclient):
    c = lclient
    keys = [f"many-{i}" for i in range(5000)]
    c.put_many([(keys[0], block(40)), (keys[4500], block(41))])
    before = c.stats()["local"]["routes"]["lease"]["requests"]
    with c.lease(keys) as leases:
        assert c.stats()["local"]["routes"]["lease"]["requests"] == before + 2
        hits = [i for i, r in enumerate(leases.results) if r == BB]
        assert hits == [0, 4500]
        assert set(leases.results) == {BB, codes.NOT_FOUND}
        assert bytes(leases.views[0]) == block(40) and bytes(leases.views[4500]) == block(41)


def test_the_arena_is_mapped_read_only_and_its_descriptor_cannot_write(lserver, lclient):
    lclient.put("d-0", block(50))
    with LocalConnection(lserver.socket_path, timeout_s=30) as conn:
        info = conn.hello(block_bytes=BB)
        assert info["version"] == 3 and info["leases"]["offered"] is True and info["leases"]["why_not"] is None
        [(result, tier, arena, offset, generation, lease)] = conn.lease(["d-0"])
        assert (result, tier) == (BB, 2) and lease != 0
        fd, (file_bytes, slot_bytes, slots, generations_offset) = conn.map_arena(arena)
        try:
            assert os.fstat(fd).st_size == file_bytes and generations_offset + 8 * slots <= file_bytes
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
            assert seals & want == want, hex(seals)
            mapped = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            assert mapped[offset : offset + BB] == block(50)
            slot = offset // slot_bytes
            assert struct.unpack_from("<Q", mapped, generations_offset + 8 * slot)[0] == generation
            mapped.close()
            with pytest.raises(OSError) as e:
                mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            assert e.value.errno in (errno.EACCES, errno.EPERM)
            with pytest.raises(OSError):
                os.write(fd, b"x")
            with pytest.raises(OSError):
                os.pwrite(fd, b"x", offset)
            with pytest.raises(OSError):
                os.ftruncate(fd, 0)
            with pytest.raises(OSError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            # Opened anew read-write through /proc, the file still refuses writes.
            try:
                rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            except OSError:
                pass
            else:
                try:
                    with pytest.raises(OSError) as e:
                        os.pwrite(rw, b"x", offset)
                    assert e.value.errno == errno.EPERM
                    with pytest.raises(OSError):
                        mmap.mmap(rw, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(rw)
        finally:
            os.close(fd)
        assert conn.release([lease, lease + 10**9]) == 1, "an id the connection does not hold is skipped"
        assert conn.release([lease]) == 0
    with lclient.lease(["d-0"]) as leases:
        with pytest.raises(TypeError):
            leases.views[0][0] = 1
        with pytest.raises(ValueError):
            leases.numpy(0)[0] = 1
        assert bytes(leases.views[0]) == block(50)


def test_a_lease_past_lease_ms_is_seen_ended_once_its_slot_is_written_again():
    with ServerProcess(block_bytes=BB, ram_gb=RAM_GB, args=(*SHARED, "--lease-ms", "300")) as s:
        with kvtier.Client(s.unix_url, timeout_s=30) as c:
            assert c.server_info["leases"]["lease_ms"] == 300
            cap = ram_capacity(c)
            c.put("c-0", block(60))
            leases = c.lease(["c-0"])
            assert leases.lease_ms == 300 and leases.valid(0)
            assert wait_for(lambda: stats_leases(c)["expired_total"] == 1 and stats_leases(c)["open"] == 0, 10)
            # Past the bound the slot may be reused: churn RAM until it is.
            for round_ in range(10):
                churn(c, f"c-fill-{round_}", cap, seed=100 * round_)
                if not leases.valid(0):
                    break
            else:
                pytest.fail(f"the slot of an expired lease was not written again after {10 * cap} PUTs")
            assert leases.copy_into(0, bytearray(BB)) is False
            assert leases.release() == 0, "the server no longer held it"
            assert stats_leases(c)["released_total"] == 0


def test_a_killed_client_s_1000_leases_end_with_its_connection():
    """A client holding 1,000 leases is killed (SIGKILL): the server drops
    them with the connection, its RAM slots are reused, and its descriptors
    are back to where they were."""
    with ServerProcess(block_bytes=BB, ram_gb=0.09, disk_gb=0.5, args=SHARED) as s:
        with kvtier.Client(s.unix_url, timeout_s=60) as c:
            cap = ram_capacity(c)
            assert cap >= 1400, cap
            keys = [f"e-{i}" for i in range(1000)]
            for start in range(0, 1000, 100):
                c.put_many([(k, block(i)) for i, k in enumerate(keys[start : start + 100], start)])
            before = stats_leases(c)
            fd0 = server_fds(s.pid)
            script = (
                "import sys, time, kvtier\n"
                "c = kvtier.Client(sys.argv[1], timeout_s=60)\n"
                "leases = c.lease([f'e-{i}' for i in range(1000)])\n"
                "print(sum(v is not None for v in leases.views), flush=True)\n"
                "time.sleep(600)\n"
            )
            child = subprocess.Popen([sys.executable, "-c", script, s.unix_url], stdout=subprocess.PIPE)
            try:
                assert child.stdout is not None
                assert child.stdout.readline().strip() == b"1000"
                held = stats_leases(c)
                assert held["open"] == before["open"] + 1000
                assert held["granted_total"] == before["granted_total"] + 1000
                assert server_fds(s.pid) > fd0
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait()
                child.stdout.close()
            assert wait_for(lambda: stats_leases(c)["open"] == before["open"])
            after = stats_leases(c)
            assert after["dropped_at_close_total"] == before["dropped_at_close_total"] + 1000
            assert wait_for(lambda: server_fds(s.pid) == fd0), (server_fds(s.pid), fd0)
            # Every slot is free to reuse: as many new blocks as RAM holds
            # land in RAM (with the 1,000 still pinned, at most cap - 1000 could).
            fresh = [f"e-new-{i}" for i in range(cap)]
            for start in range(0, cap, 100):
                c.put_many([(k, block(20000 + i)) for i, k in enumerate(fresh[start : start + 100], start)])
            in_ram = sum(t == 2 for t in tiers(s.socket_path, fresh))
            assert in_ram >= 0.8 * cap, (in_ram, cap)
            assert c.tier_of(fresh[-1]) == "ram" and c.get(fresh[-1]) == block(20000 + cap - 1)


def test_a_tenant_s_connection_cannot_lease(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "tok-a"\n')
    with ServerProcess(block_bytes=BB, ram_gb=RAM_GB, args=(*SHARED, "--tenants", str(tenants))) as s:
        with kvtier.Client(s.unix_url + f"?http=127.0.0.1:{s.port}", token="tok-a", timeout_s=30) as c:
            c.put("f-0", block(70))
            offer = c.server_info["leases"]
            assert offer["offered"] is False and "tenant" in offer["why_not"]
            with pytest.raises(kvtier.LeasesOffError, match="tenant") as e:
                c.lease(["f-0"])
            assert e.value.local_code == codes.LEASES_OFF
            assert c.get("f-0") == block(70)


def test_a_default_server_offers_leases_out_of_the_box():
    """No ``--ram-shared``: the RAM tier is shared memory even where shared
    memory gets no huge pages (``shmem_enabled`` ``never``, the kernel's
    default and this machine's), so Mooncake's ``get_buffer`` is a lease."""
    with ServerProcess(block_bytes=BB, ram_gb=RAM_GB) as s:
        assert "--ram-shared" not in s.argv
        with kvtier.Client(s.unix_url, timeout_s=30) as c:
            c.put("d-0", block(81))
            assert c.server_info["leases"]["offered"] is True, c.server_info["leases"]
            handle = c.get_buffer("d-0")
            assert handle is not None and handle.leased
            assert bytes(handle.memoryview) == block(81) and handle.valid()
            handle.release()
            assert next(t["shared"] for t in c.stats()["tiers"] if t["tier"] == "ram") is True


def test_ram_shared_off_offers_no_leases():
    with ServerProcess(block_bytes=BB, ram_gb=RAM_GB, args=("--ram-shared", "off")) as s:
        with kvtier.Client(s.unix_url, timeout_s=30) as c:
            c.put("g-0", block(80))
            assert "--ram-shared" in c.server_info["leases"]["why_not"]
            with pytest.raises(kvtier.LeasesOffError, match="--ram-shared") as e:
                c.lease(["g-0"])
            assert e.value.local_code == codes.LEASES_OFF
            with LocalConnection(s.socket_path, timeout_s=30) as conn:
                conn.hello(block_bytes=BB)
                with pytest.raises(kvtier.LeasesOffError, match="--ram-shared"):
                    conn.map_arena(0)
            # Mooncake's get_buffer copies where there is no lease.
            handle = c.get_buffer("g-0")
            assert handle is not None and not handle.leased and handle.valid()
            assert bytes(handle.memoryview) == block(80) and handle.size() == len(handle) == BB


def test_over_http_lease_says_it_needs_the_socket(lserver):
    with kvtier.Client(lserver.url, timeout_s=30) as c:
        with pytest.raises(kvtier.LeasesOffError, match="same-host socket") as e:
            c.lease(["x"])
        assert e.value.code == "leases_need_socket" and e.value.local_code is None


def test_an_older_server_raises_unsupported_version_before_sending():
    from test_local_retries import FakeServer  # speaks version 1

    root = tempfile.mkdtemp(prefix="kvtier-fake-")
    fake = FakeServer(os.path.join(root, "kv.sock"))
    try:
        with kvtier.Client(f"unix://{fake.path}", timeout_s=5) as c:
            assert c.server_info["version"] == 1
            with pytest.raises(kvtier.UnsupportedVersionError, match="version 1; leases need version 3") as e:
                c.lease(["a"])
            assert e.value.local_code == codes.UNSUPPORTED_VERSION
            assert local.OP_LEASE not in fake.seen and local.OP_MAP_ARENA not in fake.seen
    finally:
        fake.close()
        os.unlink(fake.path)
        os.rmdir(root)


def test_a_restarted_server_s_arenas_are_mapped_again():
    data_dir = tempfile.mkdtemp(prefix="kvtier-lease-restart-")
    s = ServerProcess(block_bytes=BB, ram_gb=RAM_GB, data_dir=data_dir, args=SHARED)
    try:
        s.start()
        with kvtier.Client(s.unix_url, timeout_s=30) as c:
            c.put("r-0", block(90))
            with c.lease(["r-0"]) as leases:
                assert bytes(leases.views[0]) == block(90)
            stats = c.local_stats()
            epoch, mapped = stats["epoch"], stats["arenas_mapped"]
            assert mapped >= 1
            with c.lease(["r-0"]) as leases:  # the same server: its arenas stay mapped
                assert leases.valid(0)
            assert c.local_stats()["arenas_mapped"] == mapped
            held = c.lease(["r-0"])
            s.kill()
            start_on_same_port(s)
            # The dead server's arena stays mapped while views of it live, and
            # no one writes it any more: the bytes are still the block's.
            assert bytes(held.views[0]) == block(90) and held.valid(0)
            assert held.release() == 0, "its connection is gone, and its leases with it"
            with c.lease(["r-0"]) as leases:
                assert leases.tiers == ["nvme"] and bytes(leases.views[0]) == block(90) and leases.valid(0)
            stats = c.local_stats()
            assert stats["epoch"] != epoch and stats["arenas_mapped"] > mapped and stats["reconnects"] == 1
    finally:
        s.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def test_mooncake_get_buffer_holds_a_lease_until_released_or_dropped(lserver, lclient):
    c = lclient
    c.put_many([("m-0", block(95)), ("m-1", block(96))])
    before = stats_leases(c)
    handle = c.get_buffer("m-0")
    assert handle is not None and handle.leased and handle.valid() and handle.size() == BB
    assert bytes(handle.memoryview) == block(95)
    assert kvtier.byte_view(handle.memoryview, writable=False).tobytes() == block(95)
    import ctypes

    assert ctypes.string_at(handle.ptr(), 16) == block(95)[:16]
    assert c.get_buffer("m-none") is None
    handles = c.batch_get_buffer(["m-1", "m-none", "bad key"])
    assert handles[1] is None and handles[2] is None and bytes(handles[0].memoryview) == block(96)
    assert stats_leases(c)["open"] == before["open"] + 2
    handle.release()
    assert not handle.valid()
    with pytest.raises(ValueError, match="released"):
        handle.ptr()
    assert stats_leases(c)["open"] == before["open"] + 1
    del handles  # dropped: released without waiting
    assert wait_for(lambda: stats_leases(c)["open"] == before["open"], 5)


def test_dropped_leases_are_released_and_bad_keys_are_refused_before_sending(lserver, lclient):
    c = lclient
    c.put("h-0", block(97))
    before = stats_leases(c)
    leases = c.lease(["h-0", "h-0"])
    assert leases.results == [BB, BB] and leases.ids[0] != leases.ids[1], "one lease per key asked"
    assert stats_leases(c)["open"] == before["open"] + 2
    del leases  # collected: its RELEASE goes from the connection's releaser thread
    assert wait_for(lambda: stats_leases(c)["open"] == before["open"], 5)
    assert stats_leases(c)["released_total"] == before["released_total"] + 2
    with pytest.raises(kvtier.InvalidKeyError):
        c.lease(["h-0", "bad key"])
    assert stats_leases(c)["granted_total"] == before["granted_total"] + 2


def test_a_connection_holds_at_most_leases_max(lserver, lclient):
    c = lclient
    c.put("l-0", block(98))
    most = c.server_info["leases"]["leases_max"]
    with c.lease(["l-0"] * (most + 1)) as leases:
        assert leases.results.count(BB) == most and leases.results.count(codes.LIMIT) == 1
        assert all(leases.valid(i) for i in range(most + 1) if leases.results[i] == BB)


def test_a_block_that_cannot_land_in_a_pinned_full_ram_tier_is_not_in_ram():
    """One shard whose RAM slots are all leased: a block on NVMe is read,
    but cannot land in RAM, so it is NOT_IN_RAM (tier nvme), to be read with
    get_into; Mooncake's get_buffer copies it."""
    with ServerProcess(block_bytes=BB, shards=1, ram_gb=4 * BB / 2**30, args=SHARED) as s:
        with kvtier.Client(s.unix_url, timeout_s=30) as c:
            cap = ram_capacity(c)
            keys = [f"n-{i}" for i in range(cap + 1)]
            # One at a time: concurrent PUTs past the RAM tier's size land in
            # RAM in no set order (a PUT takes its RAM slot before its log
            # write; one that finds every slot taken by writes in flight
            # goes to the log only).
            for i, k in enumerate(keys):
                assert c.put(k, block(300 + i))
            assert tiers(s.socket_path, keys) == [3] + [2] * cap
            with c.lease(keys[1:]) as pinned:
                assert pinned.results == [BB] * cap
                with c.lease(keys[:1]) as leases:
                    assert leases.results == [codes.NOT_IN_RAM] and leases.not_in_ram == [0]
                    assert leases.tiers == ["nvme"] and leases.views == [None] and not leases.valid(0)
                    assert leases.copy_into(0, bytearray(BB)) is False
                buf = bytearray(BB)
                assert c.get_into(keys[0], buf) and buf == block(300)
                handle = c.get_buffer(keys[0])
                assert handle is not None and not handle.leased and bytes(handle.memoryview) == block(300)
                assert all(pinned.valid(i) for i in range(cap))


def test_reads_into_unregistered_memory_copy_from_a_lease_or_through_staging(lserver: ServerProcess):
    """``get_many_into`` of buffers no registration holds: by default one
    copy from a lease (``lease_copies``), byte-exact; a key that is only on
    NVMe is read into RAM and leased too; ``lease_reads=False`` takes the
    staging area (``bounce_copies``); a miss stays a miss either way."""
    keys = [f"lr-{i}" for i in range(6)]
    with kvtier.Client(lserver.unix_url, timeout_s=30) as c:
        c.put_many([(k, block(7000 + i)) for i, k in enumerate(keys)])
        # Push the first keys out of RAM: NVMe only.
        churn(c, "lr-churn", ram_capacity(c) + 16, seed=7100)
        assert tiers(lserver.socket_path, keys[:1]) == [3], "the first key is on NVMe only"
        bufs = [np.zeros(BB, dtype=np.uint8) for _ in range(len(keys) + 1)]
        before = c.local_stats()
        found = c.get_many_into([*keys, "lr-missing"], bufs)
        after = c.local_stats()
        assert found == [True] * len(keys) + [False]
        for i, k in enumerate(keys):
            assert bufs[i].tobytes() == block(7000 + i), k
        assert after["lease_copies"] - before.get("lease_copies", 0) == len(keys)
        assert after.get("bounce_copies", 0) == before.get("bounce_copies", 0), "no staging copy"
        assert wait_for(lambda: stats_leases(c)["open"] == 0), "every lease released"
    with kvtier.Client(lserver.unix_url, timeout_s=30, lease_reads=False) as c:
        bufs = [np.zeros(BB, dtype=np.uint8) for _ in keys]
        before = c.local_stats()
        assert c.get_many_into(keys, bufs) == [True] * len(keys)
        after = c.local_stats()
        assert after["bounce_copies"] - before.get("bounce_copies", 0) == len(keys)
        assert after.get("lease_copies", 0) == before.get("lease_copies", 0)
        for i, k in enumerate(keys):
            assert bufs[i].tobytes() == block(7000 + i), k


def test_with_promotion_off_a_block_below_ram_is_not_in_ram_and_read_only_once():
    """``--promote off``: a read would not land an NVMe block in RAM, so the
    lease answers NOT_IN_RAM without reading it, and ``get_many_into`` of an
    unregistered buffer reads it once, through the staging area."""
    with ServerProcess(block_bytes=BB, ram_gb=RAM_GB, disk_gb=0.5, args=(*SHARED, "--promote", "off")) as s:
        with kvtier.Client(s.unix_url, timeout_s=30) as c:
            c.put("po-0", block(4242))
            churn(c, "po-churn", ram_capacity(c) + 16, seed=4300)
            assert tiers(s.socket_path or "", ["po-0"]) == [3], "on NVMe only"

            def nvme_hits() -> int:
                return next(t["hits"] for t in c.stats()["tiers"] if t["tier"] == "nvme")

            before = nvme_hits()
            with c.lease(["po-0"]) as leases:
                assert leases.results == [codes.NOT_IN_RAM] and leases.tiers == ["nvme"]
                assert leases.not_in_ram == [0]
            assert nvme_hits() == before, "the lease read nothing"
            buf = np.zeros(BB, dtype=np.uint8)
            assert c.get_many_into(["po-0"], [buf]) == [True]
            assert buf.tobytes() == block(4242)
            assert nvme_hits() == before + 1, "one read of the log"
