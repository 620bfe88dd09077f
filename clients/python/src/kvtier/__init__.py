"""kvtier: client of the kvtier KV-cache block store, and its engine connectors.

    >>> import kvtier
    >>> client = kvtier.Client("http://127.0.0.1:8085")
    >>> client.put("demo-0", bytes(client.block_bytes))

:class:`Client` (blocking, thread-safe) and :class:`AsyncClient` (asyncio)
speak the block API of docs/API.md over a pool of HTTP/1.1 connections;
:mod:`kvtier.keys` builds keys as docs/KEYS.md specifies; :mod:`kvtier.lmcache`
is the LMCache remote-storage plugin.
"""

from .aio import AsyncClient
from .client import Client, byte_view
from .errors import (
    BadRequestError,
    BlockSizeError,
    DiskFullError,
    InvalidKeyError,
    KvtierConnectionError,
    KvtierError,
    OverloadedError,
    ServerError,
    UnauthorizedError,
)
from .keys import Namespace, block_key, chain_keys, check_key

__all__ = [
    "AsyncClient",
    "BadRequestError",
    "BlockSizeError",
    "Client",
    "DiskFullError",
    "InvalidKeyError",
    "KvtierConnectionError",
    "KvtierError",
    "Namespace",
    "OverloadedError",
    "ServerError",
    "UnauthorizedError",
    "block_key",
    "byte_view",
    "chain_keys",
    "check_key",
]

__version__ = "0.1.0"
