"""The one way a peer benchmark runs an engine in a child process of its own: the child is
`python -m pagedserve.frontend.bench.peer.child MODULE PAYLOAD` on THREADS OpenMP threads, which calls
MODULE.child_main(PAYLOAD); that prints its result as one `RESULT {json}` line (report). A process of its own,
so that OMP_NUM_THREADS and the peak RSS (ru_maxrss) are that engine's alone."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

_MARK = "RESULT "
_THIS = "pagedserve.frontend.bench.peer.child"      # what `python -m` runs (__name__ is __main__ there)


def report(result: dict[str, Any]) -> None:
    """In the child: hand the result back to the parent."""
    print(_MARK + json.dumps(result), flush=True)


def run_child(module: str, payload: str, threads: int, what: str) -> dict[str, Any]:
    """In the parent: `module`.child_main(payload) in its own process; its result, or RuntimeError naming `what`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-m", _THIS, module, payload], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(_MARK):])


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(f"usage: python -m {_THIS} MODULE PAYLOAD")
    importlib.import_module(argv[0]).child_main(argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
