"""The item batches of the same-host socket's ``GET_INTO``/``PUT_FROM`` ops
and their vectored forms (docs/LOCAL.md, "Operations"), as bytes: plain
items, and from protocol version 2 put items that end with a block tag.
:mod:`kvtier.local` re-exports them beside the other payloads."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

_ITEM = struct.Struct("<QQQH")
_PART = struct.Struct("<QQQ")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")

ITEM_BYTES = _ITEM.size
"""Payload bytes of one ``GET_INTO``/``PUT_FROM`` item, not counting its key."""

PART_BYTES = _PART.size
"""Payload bytes of one part of a ``GET_INTO_V``/``PUT_FROM_V`` item."""

#: One ``GET_INTO``/``PUT_FROM`` item: handle, offset and length in bytes within
#: the registered region, key.
Item = tuple[int, int, int, str]
#: One part of a ``GET_INTO_V``/``PUT_FROM_V`` item: handle, offset, length in bytes.
Part = tuple[int, int, int]
#: One version-2 ``PUT_FROM`` item: an :data:`Item` and its encoded block tag (``b""``: untagged).
TaggedItem = tuple[int, int, int, str, bytes]


def _str(key: str) -> bytes:
    raw = key.encode()
    return _U16.pack(len(raw)) + raw


def encode_items(items: Sequence[Item]) -> bytes:
    """``GET_INTO``/``PUT_FROM`` payload: u32 n, n × (u64 handle, u64 offset, u64 length, str key)."""
    parts = [_U32.pack(len(items))]
    for handle, offset, length, key in items:
        raw = key.encode()
        parts.append(_ITEM.pack(handle, offset, length, len(raw)))
        parts.append(raw)
    return b"".join(parts)


def encode_items_v(items: Sequence[tuple[Sequence[Part], str]]) -> bytes:
    """``GET_INTO_V``/``PUT_FROM_V`` payload: u32 n, n × (u16 parts, parts ×
    (u64 handle, u64 offset, u64 length), str key). The block's bytes are
    laid across an item's parts in order (docs/LOCAL.md)."""
    out = [_U32.pack(len(items))]
    for parts, key in items:
        out.append(_U16.pack(len(parts)))
        out.extend(_PART.pack(*part) for part in parts)
        out.append(_str(key))
    return b"".join(out)


def encode_tagged_items(items: Sequence[TaggedItem]) -> bytes:
    """Version-2 ``PUT_FROM`` payload (:data:`VERSION_TAGS`): each item as
    :func:`encode_items` writes it, then u16 ``tag_bytes`` and the tag."""
    out = [_U32.pack(len(items))]
    for handle, offset, length, key, tag in items:
        raw = key.encode()
        out.append(_ITEM.pack(handle, offset, length, len(raw)))
        out.append(raw)
        out.append(_U16.pack(len(tag)))
        out.append(tag)
    return b"".join(out)


def encode_tagged_items_v(items: Sequence[tuple[Sequence[Part], str, bytes]]) -> bytes:
    """Version-2 ``PUT_FROM_V`` payload: each item as :func:`encode_items_v`
    writes it, then u16 ``tag_bytes`` and the tag."""
    out = [_U32.pack(len(items))]
    for parts, key, tag in items:
        out.append(_U16.pack(len(parts)))
        out.extend(_PART.pack(*part) for part in parts)
        out.append(_str(key))
        out.append(_U16.pack(len(tag)))
        out.append(tag)
    return b"".join(out)


def encode_batch(vectored: bool, items: Sequence[Any], tags: Sequence[bytes] | None) -> bytes:
    """An item batch in the form its op and connection take: ``items`` of
    :data:`Item` (or, ``vectored``, ``(parts, key)``), each with
    ``tags[i]`` (the version-2 put form) when ``tags`` is given."""
    if tags is None:
        return encode_items_v(items) if vectored else encode_items(items)
    rows = [(*item, tag) for item, tag in zip(items, tags, strict=True)]
    return encode_tagged_items_v(rows) if vectored else encode_tagged_items(rows)


__all__ = [
    "ITEM_BYTES",
    "PART_BYTES",
    "Item",
    "Part",
    "TaggedItem",
    "encode_batch",
    "encode_items",
    "encode_items_v",
    "encode_tagged_items",
    "encode_tagged_items_v",
]
