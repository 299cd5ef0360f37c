"""Reading a JSON object from a file the user pointed at, with one error shape for every caller."""
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
