"""The one way a benchmark script runs an engine in a child process of its own: the child is the same script
with `--child PAYLOAD` on THREADS OpenMP threads, and prints its result as one `RESULT {json}` line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

_MARK = "RESULT "


def report(result: dict[str, Any]) -> None:
    """In the child: hand the result back to the parent."""
    print(_MARK + json.dumps(result), flush=True)


def run_child(script: str, payload: str, threads: int, what: str) -> dict[str, Any]:
    """In the parent: `script --child payload` in its own process; its result, or RuntimeError naming `what`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--child", payload],
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(_MARK):])


def emit(result: dict[str, Any], result_file: str | None) -> None:
    """In the parent: print one result line, and append it to result_file when one is given."""
    print(json.dumps(result), flush=True)
    if result_file:
        with open(result_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
