"""The disk tier's files: where a block lives and the header it starts with. Shared by the core (which lists,
counts and evicts files) and the worker (which writes and reads them); no tensors here.

    <path>/<namespace>/<key[:2]>/<key hex>.<depth>.kvb

key: the block's chained hash (core/block_hash.py: its tokens, every token before it, the adapter digest and
the multimodal items); depth: its index in its prefix chain (eviction takes deep blocks first after a restart).
A file is MAGIC, a little-endian u32 header length, the header (JSON), then the payload: the block's K and V
from every layer, one cache after the other, each [2, kv_heads, block_size, head_dim] in the cache dtype.
"""
from __future__ import annotations

import json
import os
import struct

FORMAT_VERSION = 1
MAGIC = b"PSKVBLK\x00"
SUFFIX = ".kvb"
# Temporary files a writer renames into place (os.replace): readers never open them; a crashed writer's are
# removed by the next start once older than this.
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


class CorruptBlock(ValueError):
    """A file that is not what its name promises: truncated, damaged, foreign or of another format."""


def block_path(namespace_dir: str, key: bytes, depth: int) -> str:
    name = key.hex()
    return os.path.join(namespace_dir, name[:2], f"{name}.{depth}{SUFFIX}")


def parse_block_name(name: str) -> tuple[bytes, int] | None:
    """(key, depth) of a block file's name; None for anything else (temporary files, strangers)."""
    if not name.endswith(SUFFIX):
        return None
    stem, _, depth = name[:-len(SUFFIX)].rpartition(".")
    try:
        return bytes.fromhex(stem), int(depth)
    except ValueError:
        return None


def pack_header(fields: dict) -> bytes:
    body = json.dumps({"version": FORMAT_VERSION, **fields}, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(body)) + body


def header_size(prefix: bytes) -> int:
    """The whole header's size from a file's first len(MAGIC) + 4 bytes."""
    if len(prefix) < len(MAGIC) + _LEN.size or prefix[:len(MAGIC)] != MAGIC:
        raise CorruptBlock("not a KV block file")
    (n,) = _LEN.unpack_from(prefix, len(MAGIC))
    if n > MAX_HEADER:
        raise CorruptBlock(f"header of {n} bytes")
    return len(MAGIC) + _LEN.size + n


def unpack_header(data: bytes) -> dict:
    start = len(MAGIC) + _LEN.size
    try:
        fields = json.loads(data[start:header_size(data)])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from None
    if not isinstance(fields, dict) or fields.get("version") != FORMAT_VERSION:
        raise CorruptBlock(f"format version {fields.get('version') if isinstance(fields, dict) else None}")
    return fields


HEADER_PREFIX = len(MAGIC) + _LEN.size


def read_parent(path: str) -> bytes | None:
    """The parent key a block file's header names (b"": a chain's first block); None when the header is
    unreadable or older than the field (the index then knows the block's chain only once a request uses it)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(HEADER_PREFIX)
            fields = unpack_header(prefix + f.read(header_size(prefix) - HEADER_PREFIX))
        return bytes.fromhex(fields["parent"])
    except (OSError, CorruptBlock, KeyError, TypeError, ValueError):
        return None
