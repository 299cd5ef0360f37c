"""Results files: one JSON object per line, one line per run, only ever appended to.

Each line says what ran (the bench, its label, its settings), on what (commit, versions, machine) and what
came out, so a number quoted anywhere can be traced to the run and the command that made it.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

from pagedserve.common.json_file import parse_json_object
from pagedserve.common.version import __version__

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_metadata(bench: str, label: str, command: list[str] | None = None) -> dict[str, Any]:
    """What every line starts with; `command`: the command line that ran (default: this process's). Versions
    are those of the modules this process already imported (a bench serve client never imports torch, and
    its line should not pretend it ran with it)."""
    meta: dict[str, Any] = {
        "bench": bench, "label": label, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": _commit(), "pagedserve_version": __version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "command": shlex.join(sys.argv if command is None else command),
    }
    for name in ("torch", "triton", "transformers"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            meta[f"{name}_version"] = str(module.__version__)
    return meta


def _commit() -> str | None:
    """The checkout's commit, '+dirty' when it has uncommitted changes; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def append_result(path: str, record: dict[str, Any]) -> None:
    """Appends `record` as one line (the folder is made if missing)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_finite(record), allow_nan=False) + "\n")


def read_results(path: str) -> list[dict[str, Any]]:
    """Every line of a results file; ValueError naming the line that is not a JSON object."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            records.append(parse_json_object(line, f"{path}:{number}"))
    return records


def _finite(value: Any) -> Any:
    """JSON has no infinity: an infinite float (request rate inf) is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
