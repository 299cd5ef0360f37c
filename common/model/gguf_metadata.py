"""Reading a GGUF file's header fast: gguf-py's reader with its metadata arrays stepped over.

The stock GGUFReader builds numpy views for each element of every metadata array, and a model's tokenizer
arrays hold ~50k strings each (the embedded SmolLM2: ~3 s a read on the 2-core CPU, paid by the config, the
frontend and each worker at every start). Neither the config nor the weights need those strings (the tokenizer
is converted once by transformers and cached, model_files.tokenizer_folder), so an array field keeps its raw
bytes, and its length is read from them."""
from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

# GGUFValueType ids: scalar byte sizes, string, array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _skip_value(buf: memoryview, offs: int, value_type: int) -> int:
    """Offset just past a little-endian GGUF metadata value of value_type starting at offs."""
    if value_type == _STRING:
        return offs + 8 + struct.unpack_from("<Q", buf, offs)[0]
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        if item_type in _SCALAR_SIZES:
            return offs + count * _SCALAR_SIZES[item_type]
        for _ in range(count):
            offs = _skip_value(buf, offs, item_type)
        return offs
    if value_type not in _SCALAR_SIZES:
        raise ValueError(f"GGUF metadata: unknown value type {value_type}")
    return offs + _SCALAR_SIZES[value_type]


def gguf_reader(path: str) -> Any:
    """A GGUFReader of `path` whose array fields hold their raw bytes (gguf_array_length reads their length);
    the scalar and string fields and the tensors are the stock reader's."""
    from gguf import GGUFReader

    class HeaderReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
            if raw_type != _ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            size = _skip_value(memoryview(self.data), orig_offs, raw_type) - orig_offs
            return size, [self._get(orig_offs, np.uint8, size)], [], [raw_type]

    return HeaderReader(path)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar or string field's value, `default` when absent; ValueError for an array (read its length with
    gguf_array_length: gguf_reader does not parse arrays)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types and field.types[0] == _ARRAY:
        raise ValueError(f"GGUF metadata: {key} is an array")
    return field.contents()


def gguf_array_length(reader: Any, key: str) -> int | None:
    """How many items the array field `key` holds (None when absent), read from its header."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if not field.types or field.types[0] != _ARRAY:
        raise ValueError(f"GGUF metadata: {key} is not an array")
    if len(field.parts) == 4:         # gguf_reader's raw bytes: item type (u32), count (u64), items
        return int(struct.unpack_from("<Q", field.parts[3][:12].tobytes(), 4)[0])
    return int(field.parts[4][0])     # the stock reader's (a big-endian file): item type, count, ...
