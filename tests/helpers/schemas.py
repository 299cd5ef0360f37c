"""Ten JSON Schemas of varied shape (nesting, enums, bounded arrays, numeric bounds, nullable fields), with
strings bounded so that a small model cannot wander in one until max_tokens."""
from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"nick": {"anyOf": [_NAME, {"type": "null"}]},
                                      "ok": {"type": "boolean"}}, "required": ["nick", "ok"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"], "additionalProperties": False}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "integer", "minimum": -5, "maximum": 5}],
        "items": False, "minItems": 2}}, "required": ["point"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "day": {"type": "integer", "minimum": 1,
                                                                         "maximum": 31},
                                      "note": {"type": ["string", "null"], "maxLength": 6}},
     "required": ["kind", "day", "note"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
]
