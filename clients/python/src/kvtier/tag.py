"""Block tags: what a client attaches to a block at PUT so that kvtier's KV
events name the block in the inference engine's hash space (its block
hashes, their parent, the tokens per engine block and the token ids), which
KV-aware routers index, instead of by kvtier's key::

    tag = kvtier.BlockTag(block_hashes=[bytes(range(8)), bytes(range(8, 16))],
                          parent_hash=bytes(range(0xF0, 0xF8)), block_size=2,
                          token_ids=[1, 2, 300, 70000])
    client.put("key", data, tag=tag)

The fields are those of vLLM's ``BlockStored`` event (``block_hashes``,
``parent_block_hash``, ``block_size``, ``token_ids``). One kvtier block may
hold several engine blocks (an LMCache chunk of 16-token vLLM blocks), hence
the list. Over HTTP a tag travels as four headers (:meth:`BlockTag.headers`,
docs/API.md "Block tags"); over the same-host socket as bytes in the PUT
item (:meth:`BlockTag.encode`, the engine's binary form, docs/FORMAT.md
"Block tags"). The rules are the server's; :meth:`BlockTag.validate` checks
them before anything is sent.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import InvalidTagError

TAG_VERSION = 1
"""Version of the binary form (its first byte)."""
TAG_HASH_BYTES_MAX = 32
"""Widest engine block hash, bytes (vLLM's sha256 block hashes are 32)."""
TAG_HASHES_MAX = 64
"""Most engine blocks in one kvtier block."""
TAG_TOKENS_MAX = 640
"""Most token ids in one tag."""
TAG_BYTES_MAX = 3072
"""Longest encoded tag, bytes (a store of very large blocks keeps less
room: the server then answers ``invalid_tag`` naming its limit)."""
BLOCK_SIZE_MAX = 65536
"""Most tokens per engine block."""

#: The HTTP headers a tag travels in (docs/API.md, "Block tags").
BLOCK_HASHES_HEADER = "x-kvtier-block-hashes"
PARENT_HASH_HEADER = "x-kvtier-parent-hash"
BLOCK_SIZE_HEADER = "x-kvtier-block-size"
TOKEN_IDS_HEADER = "x-kvtier-token-ids"

_U32 = struct.Struct("<I")
_SIZE_COUNT = struct.Struct("<IH")


def _bad(message: str) -> InvalidTagError:
    return InvalidTagError(f"block tag: {message}", code="invalid_tag")


@dataclass(kw_only=True)
class BlockTag:
    """The engine-side identity of one kvtier block.

    Args:
        block_hashes: the engine's block hashes (1 to 64, one width of 1 to
            32 bytes), in sequence order: one per engine block the kvtier
            block holds.
        parent_hash: the hash of the engine block before the first, or
            ``None`` when the first block starts a sequence. The same width.
        block_size: tokens per engine block (1 to 65,536).
        token_ids: the blocks' token ids, ``len(block_hashes) *
            block_size`` of them (at most 640), or none.

    Raises (from :meth:`validate`, :meth:`encode`, :meth:`headers`):
        InvalidTagError: a field breaks the rules; the message names it.
    """

    block_hashes: list[bytes]
    parent_hash: bytes | None = None
    block_size: int
    token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        """Checks the rules the server checks (engine/src/events/tag.rs),
        but for the room a store of very large blocks keeps (the server's
        answer names it).

        Raises:
            InvalidTagError: the first rule broken, named.
        """
        hashes = self.block_hashes
        if not isinstance(hashes, Sequence) or isinstance(hashes, (bytes, bytearray, str)):
            raise _bad(f"block_hashes is a list of bytes, got {type(hashes).__name__}")
        n = len(hashes)
        if not 1 <= n <= TAG_HASHES_MAX:
            raise _bad(f"a tag holds 1 to {TAG_HASHES_MAX} block hashes, got {n}")
        for i, h in enumerate(hashes):
            if not isinstance(h, (bytes, bytearray, memoryview)):
                raise _bad(f"block_hashes[{i}] is {type(h).__name__}, not bytes")
        width = len(hashes[0])
        if not 1 <= width <= TAG_HASH_BYTES_MAX:
            raise _bad(f"a block hash is 1 to {TAG_HASH_BYTES_MAX} bytes, got {width}")
        for i, h in enumerate(hashes):
            if len(h) != width:
                raise _bad(f"block hashes differ in width: block_hashes[0] is {width} bytes, [{i}] {len(h)}")
        parent = self.parent_hash
        if parent is not None:
            if not isinstance(parent, (bytes, bytearray, memoryview)):
                raise _bad(f"parent_hash is {type(parent).__name__}, not bytes or None")
            if len(parent) != width:
                raise _bad(f"the parent hash is {len(parent)} bytes, the block hashes {width}")
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= BLOCK_SIZE_MAX:
            raise _bad(f"block_size is 1 to {BLOCK_SIZE_MAX} tokens, got {size!r}")
        tokens = self.token_ids
        want = n * size
        if len(tokens) and len(tokens) != want:
            raise _bad(f"{len(tokens)} token ids for {n} block(s) of {size} tokens: send {want} or none")
        if len(tokens) > TAG_TOKENS_MAX:
            raise _bad(f"a tag holds at most {TAG_TOKENS_MAX} token ids, got {len(tokens)}")
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32:
                raise _bad(f"token_ids[{i}] is {t!r}, not a u32")
        if self.encoded_len > TAG_BYTES_MAX:
            raise _bad(f"the tag is {self.encoded_len} bytes encoded, over {TAG_BYTES_MAX}")

    @property
    def encoded_len(self) -> int:
        """Bytes :meth:`encode` writes."""
        width = len(self.block_hashes[0]) if self.block_hashes else 0
        parent = len(self.parent_hash) if self.parent_hash is not None else 0
        return 3 + width * len(self.block_hashes) + 1 + parent + 4 + 2 + 4 * len(self.token_ids)

    def encode(self) -> bytes:
        """The engine's binary form (docs/FORMAT.md, "Block tags"; integers
        little-endian): u8 version 1, u8 hash width, u8 hash count, the
        hashes, u8 parent width (0: none) and the parent, u32 block_size,
        u16 token count, u32 per token id. What a socket PUT item carries.

        Raises:
            InvalidTagError: the tag breaks a rule (:meth:`validate`).
        """
        self.validate()
        hashes = [bytes(h) for h in self.block_hashes]
        parent = b"" if self.parent_hash is None else bytes(self.parent_hash)
        return b"".join(
            (
                bytes((TAG_VERSION, len(hashes[0]), len(hashes))),
                *hashes,
                bytes((len(parent),)),
                parent,
                _SIZE_COUNT.pack(self.block_size, len(self.token_ids)),
                struct.pack(f"<{len(self.token_ids)}I", *self.token_ids),
            )
        )

    def headers(self) -> dict[str, str]:
        """The HTTP headers that carry this tag on ``PUT /v1/blocks/KEY``
        (docs/API.md, "Block tags"): hashes and parent as lower-case hex,
        block size and token ids in decimal; ``curl -H`` takes them as they are.

        Raises:
            InvalidTagError: the tag breaks a rule (:meth:`validate`).
        """
        self.validate()
        out = {
            BLOCK_HASHES_HEADER: ",".join(bytes(h).hex() for h in self.block_hashes),
            BLOCK_SIZE_HEADER: str(self.block_size),
        }
        if self.parent_hash is not None:
            out[PARENT_HASH_HEADER] = bytes(self.parent_hash).hex()
        if self.token_ids:
            out[TOKEN_IDS_HEADER] = ",".join(str(t) for t in self.token_ids)
        return out

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> BlockTag:
        """Reads :meth:`encode`'s form back.

        Raises:
            InvalidTagError: a short or long buffer, an unknown version, a
                field out of range.
        """
        raw = bytes(data)
        at = 0

        def take(n: int) -> bytes:
            nonlocal at
            if at + n > len(raw):
                raise _bad(f"the tag ends after {len(raw)} bytes, {n} more expected at byte {at}")
            at += n
            return raw[at - n : at]

        version, width, count = take(3)
        if version != TAG_VERSION:
            raise _bad(f"block tag version {version}; this client reads version {TAG_VERSION}")
        hashes = [take(width) for _ in range(count)]
        (parent_bytes,) = take(1)
        parent = take(parent_bytes) if parent_bytes else None
        block_size, tokens = _SIZE_COUNT.unpack(take(_SIZE_COUNT.size))
        if tokens > TAG_TOKENS_MAX:
            raise _bad(f"a tag holds at most {TAG_TOKENS_MAX} token ids, got {tokens}")
        token_ids = list(struct.unpack(f"<{tokens}I", take(4 * tokens)))
        if at != len(raw):
            raise _bad(f"{len(raw) - at} bytes after the tag's end")
        tag = cls(block_hashes=hashes, parent_hash=parent, block_size=block_size, token_ids=token_ids)
        tag.validate()
        return tag


def tags_for(tags: Sequence[BlockTag | None] | None, n: int) -> list[BlockTag | None]:
    """``tags`` as a list of ``n`` (all ``None`` when not given).

    Raises:
        ValueError: ``tags`` is given with another length than ``n``.
        TypeError: an entry is neither a :class:`BlockTag` nor ``None``.
    """
    if tags is None:
        return [None] * n
    out = list(tags)
    if len(out) != n:
        raise ValueError(f"{len(out)} tags for {n} blocks: give one per block (None for an untagged one)")
    for i, tag in enumerate(out):
        if tag is not None and not isinstance(tag, BlockTag):
            raise TypeError(f"tags[{i}] is {type(tag).__name__}, not a kvtier.BlockTag or None")
    return out


__all__ = [
    "BLOCK_HASHES_HEADER",
    "BLOCK_SIZE_HEADER",
    "BLOCK_SIZE_MAX",
    "PARENT_HASH_HEADER",
    "TAG_BYTES_MAX",
    "TAG_HASHES_MAX",
    "TAG_HASH_BYTES_MAX",
    "TAG_TOKENS_MAX",
    "TAG_VERSION",
    "TOKEN_IDS_HEADER",
    "BlockTag",
    "tags_for",
]
