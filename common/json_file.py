"""Reading a JSON object, from a file the user pointed at or from a value (a flag, a setting, a results file's line),
with one error shape for every caller."""
from __future__ import annotations

import json
from typing import Any


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming `what` when the file is unreadable or holds no object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a JSON object")
    return data


def parse_json_object(value: str, what: str) -> dict[str, Any]:
    """`value` read as a JSON object; ValueError naming `what` (a setting, a file's line) otherwise."""
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what}: expected a JSON object such as '{{\"key\": 1}}', got a {type(obj).__name__}")
    return obj
