"""`pagedserve bench`: serving (serve.py, any OpenAI-compatible server over HTTP), offline throughput
(throughput.py) and per-batch latency (latency.py), shaped like `vllm bench`; pagedserve against llama.cpp's
llama-server on CPU (peer/: `bench peer`, `ladder`, `spec-decode`), image requests against HF transformers and
over HTTP (mm.py, mm_http.py: `bench mm`) and GPU kernels against their floors
(gpu/: `bench kernels`). Every run appends one JSON line to a results file (results.py) and can draw a PNG
(plot.py)."""
from __future__ import annotations

import importlib
from typing import Any


def require(module: str, who: str) -> Any:
    """`module` imported, or SystemExit saying which extra brings it (the bench extras are optional)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"{who} needs the {module} package: pip install 'pagedserve[bench]'") from None
