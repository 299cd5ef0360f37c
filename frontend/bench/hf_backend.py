"""HF transformers as the offline baseline: its own model for a checkpoint, run in static batches.

Static batches are how a plain `model.generate` serves many requests: left-padded, each batch as long as its
longest output, every request in it forced to its full length (ignore_eos), no continuous batching.
"""
from __future__ import annotations

import os
from typing import Any

from pagedserve.common.model.model_files import resolve_model


def load_hf_model(model_path: str | None, dtype_name: str, device_arg: str) -> tuple[Any, str]:
    """HF's model for `model_path` (a .gguf is dequantized by transformers) in eval mode, EOS turned off so
    every generate runs its full length. dtype "auto" is bfloat16. Returns (model, device)."""
    import torch
    from transformers import AutoModelForCausalLM

    source = resolve_model(model_path)
    dtype = torch.bfloat16 if dtype_name == "auto" else getattr(torch, dtype_name)
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                     gguf_file=os.path.basename(source.path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    device = "cuda" if device_arg != "cpu" and torch.cuda.is_available() else "cpu"
    model.to(device)
    model.eval()
    model.generation_config.eos_token_id = None
    return model, device


def hf_static_generate(model: Any, device: str, reqs: list[tuple[list[int], int]], batch_size: int) -> int:
    """Runs (prompt ids, max_tokens) requests in static batches of `batch_size`; returns the requested output
    tokens, the only ones that count (a batch's shorter requests generate padding past their own length)."""
    import torch
    pad = 0
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
            longest = max(m for _, m in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
            tokens += sum(m for _, m in batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return tokens
