"""kvtier: client of the kvtier KV-cache block store, and its engine connectors.

    >>> import kvtier
    >>> client = kvtier.Client("http://127.0.0.1:8085")
    >>> client.put("demo-0", bytes(client.block_bytes))

:class:`Client` (blocking, thread-safe) and :class:`AsyncClient` (asyncio)
speak the block API of docs/API.md over a pool of HTTP/1.1 connections, or
over the same-host socket of docs/LOCAL.md (``unix://`` urls, ``local="auto"``),
where Mooncake Store's buffer calls (``register_buffer``, ``batch_get_into``,
``batch_put_from``, ``batch_is_exist``) move blocks in and out of a
:class:`SharedBuffer` without copies (:mod:`kvtier.mooncake`, :mod:`kvtier.codes`)
and ``Client.lease`` reads blocks in place in the server's RAM tier
(:mod:`kvtier.leases`);
:mod:`kvtier.keys` builds keys as docs/KEYS.md specifies; a
:class:`BlockTag` (``put(key, data, tag=...)``) names a block in the
inference engine's hash space for kvtier's KV events; the engine
connectors are :mod:`kvtier.lmcache` (an LMCache remote-storage plugin),
:mod:`kvtier.vllm` (a vLLM offloading tier) and :mod:`kvtier.sglang` (an
SGLang HiCache storage backend), each the shared core of
``kvtier.connectors.core`` plus its engine's translation. The package is laid
out as ``transport/`` (how blocks travel), ``memory/`` (memory handed to the
server or read in place) and ``connectors/``; the old module paths above are
the moved modules under their old names. A connector raises :class:`GeometryError` (or
the engine's own configuration error caused by it) when the store's
``block_bytes`` is not the engine's chunk size.
"""

# The engine-free old module paths, bound here as they were when the modules
# lived at the top (``kvtier.shm.buffer_address`` after ``import kvtier``).
from . import codes
from . import leases as leases
from . import local as local
from . import mooncake as mooncake
from . import shm as shm
from .aio import AsyncClient
from .client import Client, byte_view
from .connectors.core import GeometryError
from .errors import (
    BadRequestError,
    BlockSizeError,
    CudaError,
    DiskFullError,
    GeometryMismatchError,
    InvalidKeyError,
    InvalidTagError,
    KvtierConnectionError,
    KvtierError,
    LeasesOffError,
    NotInRamError,
    OverloadedError,
    ProtocolError,
    ServerError,
    UnauthorizedError,
    UnsupportedVersionError,
)
from .keys import Namespace, block_key, chain_keys, check_key
from .memory.leases import Leases
from .memory.shm import SharedBuffer
from .tag import BlockTag

__all__ = [
    "AsyncClient",
    "BadRequestError",
    "BlockSizeError",
    "BlockTag",
    "Client",
    "CudaError",
    "DiskFullError",
    "GeometryError",
    "GeometryMismatchError",
    "InvalidKeyError",
    "InvalidTagError",
    "KvtierConnectionError",
    "KvtierError",
    "Leases",
    "LeasesOffError",
    "Namespace",
    "NotInRamError",
    "OverloadedError",
    "ProtocolError",
    "ServerError",
    "SharedBuffer",
    "UnauthorizedError",
    "UnsupportedVersionError",
    "block_key",
    "byte_view",
    "chain_keys",
    "check_key",
    "codes",
]

__version__ = "0.1.0"
