"""Block keys: the rules the server enforces, the chained block keys the Rust
loadgen builds, and the namespace fingerprint every connector puts in front
of its keys. The whole spec, with test vectors, is docs/KEYS.md.

A kvtier key is 1 to 256 bytes of ``[A-Za-z0-9._~-]``, not ``.`` or ``..``.
A connector's key is ``<fingerprint>-<block id>``: the fingerprint (16 hex
digits) names the model, dtype, parallel layout, block tokens and key format,
so two models or two layouts never read each other's blocks; the block id is
the engine's own block hash, written in hex.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from .errors import InvalidKeyError

#: Longest key the server accepts, in bytes (it fits the slot header).
KEY_BYTES_MAX = 256
#: Version of the key format below; part of every fingerprint, so a change of
#: format never reads blocks written under the old one.
FORMAT_VERSION = 1
#: Block ids longer than this (in hex digits) are hashed to 32 digits, so a
#: fingerprinted key stays far below KEY_BYTES_MAX.
BLOCK_ID_CHARS_MAX = 128

_KEY_RE = re.compile(r"[A-Za-z0-9._~-]{1,256}")
_BAD_BYTE_RE = re.compile(r"[^A-Za-z0-9._~-]")
# Keys joined by "/" (a byte no key has): one match checks a whole batch.
_KEYS_RE = re.compile(r"[A-Za-z0-9._~-]{1,256}(?:/[A-Za-z0-9._~-]{1,256})*")


def all_keys_valid(keys: Sequence[str]) -> bool:
    """Whether :func:`check_key` accepts every key of ``keys``, in one
    regular-expression match (a batch's fast path; on ``False`` check the
    keys one by one to learn which and why)."""
    if not keys or not all(isinstance(k, str) for k in keys):
        return False
    joined = "/".join(keys)
    # A "/" inside a key would pass for a separator: count them.
    return (
        joined.count("/") == len(keys) - 1
        and _KEYS_RE.fullmatch(joined) is not None
        and "." not in keys
        and ".." not in keys
    )


def check_key(key: str) -> str:
    """Returns ``key`` if the server would accept it.

    Raises:
        InvalidKeyError: empty, over 256 bytes, ``.``/``..``, or a character
            outside ``[A-Za-z0-9._~-]`` (the message names the first one).
        TypeError: ``key`` is not a ``str``.
    """
    if not isinstance(key, str):
        raise TypeError(f"a key is a str, not {type(key).__name__}")
    if _KEY_RE.fullmatch(key) and key not in (".", ".."):
        return key
    if not key:
        raise InvalidKeyError("key is empty", code="invalid_key")
    if len(key.encode()) > KEY_BYTES_MAX:
        raise InvalidKeyError(f"key is {len(key.encode())} bytes; at most {KEY_BYTES_MAX}", code="invalid_key")
    bad = _BAD_BYTE_RE.search(key)
    if bad is not None:
        raise InvalidKeyError(
            f"key has {bad.group()!r} at index {bad.start()}; keys are [A-Za-z0-9._~-]", code="invalid_key"
        )
    raise InvalidKeyError(f"key {key!r} is reserved", code="invalid_key")


def block_key(parent: str, tokens: Sequence[int]) -> str:
    """The chained key of one block: ``hex(xxh3_128(ascii(parent) ‖ le32(tokens)))``.

    Args:
        parent: the previous block's key, ``""`` for the first block.
        tokens: this block's token ids, each 0 ≤ id < 2**32.

    Returns:
        32 lowercase hex digits, most significant first — the same as
        ``kvtier_loadgen::keys::block_key`` (docs/LOADGEN.md, docs/KEYS.md).
    """
    data = parent.encode("ascii") + struct.pack(f"<{len(tokens)}I", *tokens)
    return xxhash.xxh3_128_hexdigest(data)


def chain_keys(tokens: Sequence[int], block_tokens: int = 128) -> list[str]:
    """Keys of every full ``block_tokens`` block of ``tokens``; a trailing
    partial block has no key. Equal prefixes give equal leading keys."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    keys: list[str] = []
    for i in range(len(tokens) // block_tokens):
        keys.append(block_key(keys[-1] if keys else "", tokens[i * block_tokens : (i + 1) * block_tokens]))
    return keys


BlockId = str | bytes | int


def block_id_hex(block_id: BlockId) -> str:
    """An engine's block hash written as key characters.

    - ``bytes``: lowercase hex (vLLM's block hashes, SGLang's digests).
    - ``int``: lowercase hex of its two's-complement form over the fewest
      whole 64-bit words that hold it (LMCache's chunk hashes, which Python's
      ``hash`` can make negative): ``-1`` → ``ffffffffffffffff``.
    - ``str``: kept if it is already made of key characters, else hashed.

    Ids longer than ``BLOCK_ID_CHARS_MAX`` hex digits, and ``str`` ids with
    other characters, become ``xxh3_128`` hex of their bytes (32 digits).
    """
    if isinstance(block_id, bool):
        raise TypeError("a block id is bytes, int or str, not bool")
    if isinstance(block_id, int):
        words = max(1, (block_id.bit_length() + 1 + 63) // 64)
        text = format(block_id % (1 << (64 * words)), f"0{16 * words}x")
    elif isinstance(block_id, (bytes, bytearray, memoryview)):
        text = bytes(block_id).hex()
    elif isinstance(block_id, str):
        text = block_id if _KEY_RE.fullmatch(block_id) else xxhash.xxh3_128_hexdigest(block_id.encode())
    else:
        raise TypeError(f"a block id is bytes, int or str, not {type(block_id).__name__}")
    if not text or len(text) > BLOCK_ID_CHARS_MAX:
        text = xxhash.xxh3_128_hexdigest(text.encode())
    return text


@dataclass(frozen=True)
class Namespace:
    """Who wrote a block: the fingerprint in front of every connector key.

    Two engines share blocks only if every field is equal: the KV bytes of a
    block depend on the model, its dtype, which slice of the heads/layers a
    rank holds, and how many tokens a block has.

    Attributes:
        model: model name as the engine knows it (``"meta-llama/Llama-3.1-8B"``).
        dtype: KV dtype (``"bfloat16"``, ``"float16"``, ``"fp8"``).
        tp_rank, tp_size: tensor-parallel rank and world size of the writer
            (0 and 1 for engines that store whole blocks from one place).
        pp_rank, pp_size: pipeline-parallel rank and size.
        block_tokens: tokens per block (the engine's chunk or page size).
        extra: anything else that changes the bytes (a KV layout name, a
            quantization scheme); empty by default.
    """

    model: str
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    block_tokens: int = 128
    extra: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is not in [0, pp_size={self.pp_size})")
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")

    def canonical(self) -> str:
        """The text the fingerprint hashes (docs/KEYS.md): one ``name=value``
        field a line, in this order, after a versioned first line."""
        return "\n".join(
            [
                f"kvtier-namespace-v{FORMAT_VERSION}",
                f"model={self.model}",
                f"dtype={self.dtype}",
                f"tp={self.tp_rank}/{self.tp_size}",
                f"pp={self.pp_rank}/{self.pp_size}",
                f"block_tokens={self.block_tokens}",
                f"extra={self.extra}",
            ]
        )

    @property
    def fingerprint(self) -> str:
        """16 lowercase hex digits: ``xxh3_64`` of :meth:`canonical` in UTF-8."""
        return xxhash.xxh3_64_hexdigest(self.canonical().encode("utf-8"))

    def key(self, block_id: BlockId) -> str:
        """The kvtier key of one block: ``<fingerprint>-<block_id_hex(block_id)>``."""
        return check_key(f"{self.fingerprint}-{block_id_hex(block_id)}")

    def chain(self, tokens: Sequence[int]) -> list[str]:
        """Fingerprinted chained keys of every full block of ``tokens``
        (:func:`chain_keys` with this namespace's ``block_tokens``)."""
        return [self.key(k) for k in chain_keys(tokens, self.block_tokens)]
