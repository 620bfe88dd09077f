"""The shared index (docs/LOCAL.md, "The shared index") against a real
``kvtier serve``: existence and prefix lookups answered in the client from
the shards' index tables, right after writes, deletes and RAM churn,
under a concurrent writer, across a restart, with a remote tier (keys the
index does not list asked of the server); off with tenants and with
``--shared-index off``; the tables mapped read-only."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterator

import pytest
import xxhash
from conftest import BLOCK_BYTES, MOTO_BUCKET, block, start_on_same_port

import kvtier
from kvtier.local import LocalConnection
from kvtier.testing import ServerProcess

BB = BLOCK_BYTES


@pytest.fixture(scope="module")
def iserver() -> Iterator[ServerProcess]:
    with ServerProcess(block_bytes=BB, ram_gb=0.01, disk_gb=0.5) as s:
        yield s


def server_exists(path: str, keys: list[str]) -> list[int]:
    """Each key's tier by EXISTS: a round trip, the server's own answer."""
    with LocalConnection(path, timeout_s=30) as conn:
        conn.hello(block_bytes=BB)
        return conn.exists(keys)


def route_requests(c: kvtier.Client, route: str) -> int:
    return int(c.stats()["local"]["routes"][route]["requests"])


def test_existence_and_prefix_lookups_come_from_the_index_and_match_the_server(iserver: ServerProcess):
    keys = [f"si-{i}" for i in range(40)]
    with kvtier.Client(iserver.unix_url, timeout_s=30) as c:
        c.put_many([(k, block(100 + i)) for i, k in enumerate(keys)])
        # Push the first keys out of RAM (NVMe only), delete a few.
        ram = next(t["capacity_blocks"] for t in c.stats()["tiers"] if t["tier"] == "ram")
        c.put_many([(f"si-churn-{i}", block(900 + i)) for i in range(ram + 8)])
        for k in keys[5:8]:
            assert c.delete(k)
        probe = [*keys, "si-never"]
        exists_before, lookups_before = route_requests(c, "exists"), route_requests(c, "lookup")
        probes_before = c.local_stats()["index_probes"]
        got = c.batch_is_exist(probe)
        chain = c.lookup_tiers(keys)
        assert c.local_stats()["index_probes"] - probes_before == len(probe) + len(keys)
        assert (route_requests(c, "exists"), route_requests(c, "lookup")) == (exists_before, lookups_before), (
            "no round trip"
        )
        truth = server_exists(iserver.socket_path or "", probe)
        assert got == [1 if t else 0 for t in truth]
        assert got[5:8] == [0, 0, 0] and got[-1] == 0
        assert len(chain) == 5, "the chain stops at the first deleted key"
        # Fastest tier listed, as EXISTS answers it (1 gpu, 2 ram, 3 nvme).
        assert chain == [kvtier.codes.TIER_NAMES[t] for t in truth[:5]]
        assert "nvme" in chain or "ram" in chain
        assert c.exists(keys[0]) and not c.exists(keys[5])
        # Keys the server would refuse answer -1 from the index, with no round trip.
        exists_before = route_requests(c, "exists")
        assert c.batch_is_exist([keys[10], "a/b", "..", "x" * 257, "si-never"]) == [1, -1, -1, -1, 0]
        assert route_requests(c, "exists") == exists_before


def test_with_a_remote_tier_keys_the_index_does_not_list_are_asked_of_the_server(moto: str):
    """Node B shares node A's bucket: a block A stored is in B's S3 tier but
    in none of B's local tiers, so B's index does not list it. One EXISTS
    asks B for the keys its index does not list (not for the listed or the
    refused ones), and a key stored nowhere stays absent."""
    args = ("--s3-url", f"s3://{MOTO_BUCKET}/index", "--s3-endpoint", moto, "--s3-write-policy", "through")
    node = {"block_bytes": BB, "shards": 1, "args": args}
    with ServerProcess(**node) as a, ServerProcess(**node) as b:  # type: ignore[arg-type]
        with kvtier.Client(a.unix_url, timeout_s=30) as ca:
            ca.put("remote-0", block(61))
        with kvtier.Client(b.unix_url, timeout_s=30) as cb:
            cb.put("local-0", block(62))
            assert cb._link.unix.session.connection()[0].info["shared_index"]["remote_tier"] is True
            exists_before, probes_before = route_requests(cb, "exists"), cb.local_stats()["index_probes"]
            assert cb.batch_is_exist(["local-0", "remote-0", "a/b", "nowhere-0"]) == [1, 1, -1, 0]
            assert route_requests(cb, "exists") == exists_before + 1
            assert cb.local_stats()["index_probes"] - probes_before == 4


def test_the_index_never_lists_a_block_that_a_read_then_misses_or_serves_wrong(iserver: ServerProcess):
    """A writer PUTs and DELETEs while a reader probes: a key the index says
    present is read back with its own bytes, or is a miss only because the
    writer deleted it since; a key never written is never present."""
    keys = [f"cw-{i}" for i in range(32)]
    stop = threading.Event()
    errors: list[str] = []

    def writer() -> None:
        with kvtier.Client(iserver.unix_url, timeout_s=30) as w:
            i = 0
            while not stop.is_set():
                k = keys[i % len(keys)]
                w.put(k, block(hash(k) & 0xFFFF))
                if i % 3 == 0:
                    w.delete(keys[(i + 7) % len(keys)])
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        with kvtier.Client(iserver.unix_url, timeout_s=30) as r:
            buf = bytearray(BB)
            for _ in range(200):
                present = r.batch_is_exist([*keys, "cw-never-written"])
                if present[-1] != 0:
                    errors.append("a key never written was listed")
                for k, p in zip(keys, present, strict=False):
                    if p == 1 and r.get_into(k, buf) and bytes(buf) != block(hash(k) & 0xFFFF):
                        errors.append(f"{k}: listed, then read with the wrong bytes")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[:5]


def test_after_a_restart_the_index_lists_the_recovered_blocks(tmp_path):
    keys = [f"rs-{i}" for i in range(24)]
    with ServerProcess(block_bytes=BB, ram_gb=0.01, disk_gb=0.5, data_dir=str(tmp_path / "data")) as s:
        # connect_timeout_s=0, as the engine connectors: a call to the dead
        # server fails at its first refused connect instead of retrying the
        # socket for the whole call timeout (30 s here).
        with kvtier.Client(s.unix_url, timeout_s=30, connect_timeout_s=0) as c:
            c.put_many([(k, block(i)) for i, k in enumerate(keys)])
            assert c.delete(keys[3])
            epoch = c.server_info["epoch"]
            s.kill()  # kill -9: the restart rebuilds the index from the log
            # The dead server's tables are still mapped here, frozen: they
            # must not answer (its socket may still accept for a second).
            probes = c.local_stats()["index_probes"]
            assert c.batch_is_exist(keys[:4]) == [-1] * 4
            assert c.local_stats()["index_probes"] == probes
            start_on_same_port(s)
            got = c.batch_is_exist(keys)
            assert c.server_info["epoch"] != epoch, "a new server, its tables mapped again"
            want = [0 if i == 3 else 1 for i in range(len(keys))]
            assert got == want
            assert got == [1 if t else 0 for t in server_exists(s.socket_path or "", keys)]


def test_the_tables_map_only_to_read(iserver: ServerProcess):
    with LocalConnection(iserver.socket_path or "", timeout_s=30) as conn:
        info = conn.hello(block_bytes=BB)
        assert info["shared_index"]["offered"], info["shared_index"]
        fd, (file_bytes, buckets, shards) = conn.map_index(0)
        try:
            assert (shards, buckets & (buckets - 1)) == (2, 0)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.write(fd, b"x")
            m = mmap.mmap(fd, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            assert m[:4] == b"KVPX" and struct.unpack_from("<III", m, 4) == (1, buckets, 0)
            # A key's shard and bucket are the client's to compute: the hash
            # the server lists is xxh3-128 of the key.
            with kvtier.Client(iserver.unix_url, timeout_s=30) as c:
                c.put("mi-probe", block(1))
            h = xxhash.xxh3_128_intdigest(b"mi-probe")
            table = m
            if h % 2:
                fd1, _ = conn.map_index(1)
                table = mmap.mmap(fd1, file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
                os.close(fd1)
            i = (h & ((1 << 64) - 1)) & (buckets - 1)
            found = False
            for _ in range(buckets):
                _seq, tiers, lo, hi = struct.unpack_from("<IB3xQQ", table, 4096 + 32 * i)
                if tiers == 0 and lo == 0 and hi == 0:
                    break
                if (lo, hi) == (h & ((1 << 64) - 1), h >> 64):
                    found = True
                    break
                i = (i + 1) & (buckets - 1)
            assert found, "the block's hash is in its shard's table"
        finally:
            os.close(fd)


def test_no_index_with_tenants_or_when_turned_off(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntoken = "tok-a"\n')
    for args, why in ((("--tenants", str(tenants)), "--tenants"), (("--shared-index", "off"), "--shared-index off")):
        with ServerProcess(block_bytes=BB, ram_gb=0.01, disk_gb=0.5, args=args) as s:
            token = "tok-a" if "--tenants" in args else None
            with LocalConnection(s.socket_path or "", timeout_s=30) as conn:
                info = conn.hello(block_bytes=BB, token=token)
                assert not info["shared_index"]["offered"] and why in info["shared_index"]["why_not"]
                with pytest.raises(kvtier.LeasesOffError, match=why):
                    conn.map_index(0)
            with kvtier.Client(s.unix_url, timeout_s=30, token=token) as c:
                c.put("k1", block(1))
                assert c.batch_is_exist(["k1", "k2"]) == [1, 0], "answered by the server"
                assert c.local_stats()["index_probes"] == 0
