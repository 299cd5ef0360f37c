"""The tokenizer a load generator counts and decodes with: --tokenizer, or the embedded model's."""
from __future__ import annotations

import os
from typing import Any

from pagedserve.common.model.model_files import resolve_model, tokenizer_folder
from pagedserve.frontend.client.tokenizer import load_tokenizer


def load_bench_tokenizer(spec: str | None) -> Any:
    """`spec`: a folder holding a tokenizer, a model folder, a .gguf file (its vocabulary converted once and
    cached, as the engine does) or a hub id; None: the embedded model's. ValueError if none of these."""
    if spec is not None and os.path.isdir(spec) and (os.path.isfile(os.path.join(spec, "tokenizer.json"))
                                                     or os.path.isfile(os.path.join(spec, "tokenizer_config.json"))):
        return load_tokenizer(spec)
    return load_tokenizer(tokenizer_folder(resolve_model(spec)))
