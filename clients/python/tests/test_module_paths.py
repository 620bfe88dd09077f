"""The package's layout (``transport/``, ``memory/``, ``connectors/``) keeps
every documented path: each old module path imports the moved module itself
(one module under two names, so settings, imports and monkeypatches reach
the same objects), and each documented engine setting (docs/INTEGRATIONS.md)
finds its class there. An engine's module needs that engine installed: where
it is not, its case is reported skipped (the engine's own suite runs it).
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

#: Old path → (new path, engine package it needs or None, documented class or None).
PATHS = {
    "kvtier.local": ("kvtier.transport.local", None, "LocalConnection"),
    "kvtier.shm": ("kvtier.memory.shm", None, "SharedBuffer"),
    "kvtier.leases": ("kvtier.memory.leases", None, "Leases"),
    "kvtier.mooncake": ("kvtier.connectors.mooncake", None, "MooncakeStore"),
    "kvtier.lmcache": ("kvtier.connectors.lmcache", "lmcache", "KvtierConnector"),
    "kvtier.vllm": ("kvtier.connectors.vllm.offloading", "vllm", "KvtierTier"),
    "kvtier.vllm_connector": ("kvtier.connectors.vllm.connector", "vllm", "KvtierConnector"),
    "kvtier.sglang": ("kvtier.connectors.sglang", "sglang", "KvtierHiCacheStorage"),
}


@pytest.mark.parametrize("old", sorted(PATHS))
def test_an_old_path_is_the_moved_module(old):
    new, engine, cls = PATHS[old]
    if engine is not None and importlib.util.find_spec(engine) is None:
        pytest.skip(f"{old} needs {engine}, not installed in this virtualenv")
    moved = importlib.import_module(new)
    assert importlib.import_module(old) is moved
    # The way engines load a setting: the module path, then the class by name.
    assert getattr(importlib.import_module(old), cls).__module__ == new


def test_the_engine_free_old_modules_are_attributes_of_the_package():
    """``import kvtier`` then ``kvtier.shm.buffer_address``: the attribute
    paths of the modules that lived at the top still resolve."""
    code = "import kvtier; print([getattr(kvtier, m).__name__ for m in ('local', 'shm', 'leases', 'mooncake')])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names = ["kvtier.transport.local", "kvtier.memory.shm", "kvtier.memory.leases", "kvtier.connectors.mooncake"]
    assert done.stdout.strip() == repr(names), done.stdout


def test_importing_the_package_and_its_subpackages_imports_no_engine():
    """``import kvtier`` (and each subpackage) must not pull vLLM, SGLang or
    LMCache in: a client-only process loads none of them."""
    code = (
        "import sys, kvtier, kvtier.transport, kvtier.memory, kvtier.connectors, kvtier.connectors.vllm; "
        "print(sorted(m for m in ('vllm', 'sglang', 'lmcache', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_the_vllm_connectors_worker_data_path_imports_without_vllm():
    """The worker side of the vLLM connector (worker, mover, copies, digest,
    the step's plan) runs with torch alone: ``make gpu-check`` drives it on a
    GPU machine that has no vLLM. Imported with ``vllm`` made unimportable."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the vLLM worker's data path needs torch, not installed in this virtualenv")
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvtier.connectors.vllm.worker, kvtier.connectors.vllm.transfer\n"
        "assert not [m for m in sys.modules if m.startswith('vllm.')], 'vllm imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
