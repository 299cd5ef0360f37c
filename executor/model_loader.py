"""Build a model on its device and stream its weights in, one tensor at a time."""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from pagedserve.core.config import ModelConfig
from pagedserve.executor.models import get_model_class
from pagedserve.executor.parallel_state import TPGroup

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, tp: TPGroup) -> nn.Module:
    cls = get_model_class(model_config.hf_config)
    device = torch.device(model_config.device)
    with torch.device(device), _default_dtype(_DTYPES[model_config.dtype]):
        model = cls(model_config.hf_config, tp)
    source = model_config.source
    weights, count = (_gguf_weights(source.path, model_config.hf_config) if source.format == "gguf"
                      else _hf_weights(source.path))
    bar = tqdm(weights, total=count, desc="Loading weights", unit="tensor", disable=tp.rank != 0)
    loaded = model.load_weights(bar)
    missing = model.expected_parameters() - loaded
    if missing:
        raise ValueError(f"the checkpoint at {source.path} lacks weights for: {', '.join(sorted(missing)[:10])}"
                         + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    return model.eval()


# ---------------------------------------------------------------- HF folders


def _hf_weights(folder: str) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, s) for s in shards]
    if files:
        return _safetensors_iter(files), _safetensors_count(files)
    bins = sorted(glob.glob(os.path.join(folder, "*.bin")))
    if bins:
        return _bin_iter(bins), 0
    raise ValueError(f"model folder {folder} has no *.safetensors or *.bin weights")


def _safetensors_count(files: list[str]) -> int:
    from safetensors import safe_open
    total = 0
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                total += len(f.keys())
        except Exception as exc:
            raise ValueError(f"cannot read weights file {path}: {exc}") from exc
    return total


def _safetensors_iter(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _bin_iter(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()
        del state


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)$", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.attn_(q|k)_norm\.weight$", r"model.layers.\1.self_attn.\2_norm.weight"),
    (r"^blk\.(\d+)\.ffn_(gate|up|down)\.weight$", r"model.layers.\1.mlp.\2_proj.weight"),
]


def gguf_to_hf_name(name: str) -> str | None:
    for pattern, repl in _GGUF_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time permutation of Q/K rows (interleaved -> rotate-half order)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(path: str, hf_config) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    from gguf import GGUFReader
    reader = GGUFReader(path)
    return _gguf_iter(reader, hf_config), len(reader.tensors)


def _gguf_iter(reader, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize
    permuted = hf_config.model_type in ("llama", "mistral")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        w = dequantize(tensor.data, tensor.tensor_type)
        if permuted and ".self_attn.q_proj." in name:
            w = _unpermute(w, heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = _unpermute(w, kv_heads)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
