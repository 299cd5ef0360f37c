"""Build a model on its device and stream its weights in, one tensor at a time.

Sources: an HF folder (*.safetensors, sharded or not; *.bin as a fallback; AWQ/GPTQ parts gathered into one
quantized weight per linear) or a GGUF file (renamed to HF names, Q/K rows un-permuted; quantized blocks
decoded to GroupQuantWeight and kept quantized, or dequantized to float32 with `--quantization none`).
With a quantization method the layers collect their pieces and pack them for their kernels at the end
(executor/model/quant/packing.py).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from pagedserve.common.config.engine_args import ModelConfig
from pagedserve.common.model.gguf_metadata import gguf_reader
from pagedserve.executor.model.layers.linear_method import use_batch_invariant_methods
from pagedserve.executor.model.layers.rotary import engine_max_model_len
from pagedserve.executor.model.models import get_model_class
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.executor.model.quant.awq_gptq import combine_quantized_tensors
from pagedserve.executor.model.quant.gguf_blocks import (GGUF_QUANT_TYPES, GGUFBlocks, decode_gguf_tensor,
                                                        reverse_permute_rows)
from pagedserve.executor.model.quant.kv_scales import apply_kv_scales, take_kv_scales
from pagedserve.executor.model.quant.loading import PACKED_METHODS, begin_packed, finish_packed, num_weights, weight_bytes

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Weights = Iterator[tuple[str, torch.Tensor]]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, tp: TPGroup, pp: PPGroup = PPGroup(),
               pooling: bool = False) -> nn.Module:
    """The model for this rank (its pipeline stage's layers), on model_config.device in model_config.dtype,
    weights loaded, eval mode. pooling (--runner pooling): the LM head is never used, so a checkpoint saved
    without one (an embedding model saved as its base model, Qwen3-Embedding / gte-Qwen2) loads too."""
    if model_config.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {model_config.dtype!r}")
    cls = get_model_class(model_config.arch_config)
    start = time.perf_counter()
    dtype = _DTYPES[model_config.dtype]
    # Parameters are allocated directly on the target device in the target dtype: no CPU fp32 detour.
    # (A quantized layer's dense weight is allocated but never written, so it never takes memory.)
    with torch.device(model_config.device), _default_dtype(dtype), \
            engine_max_model_len(model_config.max_model_len):       # hook: longrope picks its factors by it
        model = cls(model_config.arch_config, tp, pp) if pp.size > 1 else cls(model_config.arch_config, tp)
    method = model_config.quantization.method if model_config.quantization else None
    if method in PACKED_METHODS:
        begin_packed(model)
    kv_scales: dict[int, dict[str, float]] = {}
    weights, count = open_weights(model_config, kv_scales)
    expected = model.expected_weights()
    if pooling:
        weights = _base_model_names(weights, expected)
    progress = tqdm(weights, total=count or None, desc="Loading weights", unit="tensor",
                    disable=tp.rank != 0, leave=False)
    # Streamed, unchecked (load_weights would hold the whole checkpoint to check it first): a refused tensor
    # fails the load, and a model that never loaded is discarded, never served half-loaded.
    loaded = model.stream_weights(progress)
    missing = expected - loaded
    if pooling:
        missing = {n for n in missing if not n.startswith("lm_head.")}
    _check_complete(missing, model_config.source.path)
    apply_kv_scales(model.attention_layers(), kv_scales)
    if method in PACKED_METHODS:
        finish_packed(model, method, torch.device(model_config.device), dtype)
    if model_config.batch_invariant:        # the weights' final forms are known only now
        logger.info("batch invariant: %d dense CPU linears in fixed row blocks", use_batch_invariant_methods(model))
    nbytes, count = weight_bytes(model), num_weights(model)
    logger.info("loaded %s (%s, %s, %s) on rank %d in %.1f s: weights %.1f MiB, %.2f bits per weight",
                model_config.source.name, cls.__name__, model_config.dtype, method or "unquantized", tp.rank,
                time.perf_counter() - start, nbytes / 2**20, 8 * nbytes / max(count, 1))
    return model.eval()


def _base_model_names(weights: Weights, expected: set[str]) -> Weights:
    """A causal LM's base model saved on its own (AutoModel: `layers.0...`, no `model.` prefix), as embedding
    checkpoints are, named as the causal LM names it."""
    for name, tensor in weights:
        if f"model.{name}" in expected and name not in expected:
            name = f"model.{name}"
        yield name, tensor


def _check_complete(missing: set[str], path: str) -> None:
    if not missing:
        return
    names = sorted(missing)
    more = f" (+{len(names) - 10} more)" if len(names) > 10 else ""
    raise ValueError(f"checkpoint {path} lacks weights: {', '.join(names[:10])}{more}")


def open_weights(model_config: ModelConfig,
                 kv_scales: dict[int, dict[str, float]] | None = None) -> tuple[Weights, int]:
    """(iterator of (HF name, tensor), number of tensors or 0 if unknown) for the model's source.

    kv_scales: collects an HF checkpoint's per-layer KV-cache scales, taken out of the stream before the
    quantized weights are combined (quant/kv_scales.py)."""
    source = model_config.source
    if source.format == "gguf":
        keep = model_config.quantization is not None and model_config.quantization.method == "gguf"
        return gguf_weights(source.path, model_config.hf_config, keep_quantized=keep)
    weights, count = hf_weights(source.path)
    if kv_scales is not None:
        weights = take_kv_scales(weights, kv_scales)
    return combine_quantized_tensors(weights, model_config.quantization), count


def update_weights_stream(model_config: ModelConfig, weights: Iterable[tuple[str, Any]]) -> Weights:
    """A weight update's tensors, named and stored as the model's checkpoint holds them, through the mapping
    open_weights gives that checkpoint: a GGUF model's (GGUF name, GGUFBlocks or float tensor) decoded as
    its file is, AWQ/GPTQ parts gathered into their quantized weights, fp8 weights with their scales."""
    if model_config.source.format == "gguf":
        keep = model_config.quantization is not None and model_config.quantization.method == "gguf"
        records = (_gguf_update_tensor(name, value) for name, value in weights)
        return _gguf_iter(records, model_config.hf_config, keep)
    return combine_quantized_tensors(iter(weights), model_config.quantization)


# ---------------------------------------------------------------- HF folders


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    # Mistral repos ship consolidated.safetensors (original naming) next to the HF-named files.
    hf_named = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    return hf_named or files


def hf_weights(folder: str) -> tuple[Weights, int]:
    files = _safetensors_files(folder)
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
            with safe_open(path, framework="pt") as f:       # reads the header only
                total += len(f.keys())
        except Exception as exc:
            raise ValueError(f"cannot read weights file {path}: {exc}") from exc
    return total


def _safetensors_iter(files: list[str]) -> Weights:
    from safetensors import safe_open
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _bin_iter(files: list[str]) -> Weights:
    for path in files:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(f"cannot read weights file {path}: {exc}") from exc
        yield from state.items()
        del state


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = [
    (re.compile(r"^token_embd\.weight$"), "model.embed_tokens.weight"),
    (re.compile(r"^output_norm\.weight$"), "model.norm.weight"),
    (re.compile(r"^output\.weight$"), "lm_head.weight"),
    (re.compile(r"^blk\.(\d+)\.attn_norm\.weight$"), r"model.layers.\1.input_layernorm.weight"),
    (re.compile(r"^blk\.(\d+)\.ffn_norm\.weight$"), r"model.layers.\1.post_attention_layernorm.weight"),
    (re.compile(r"^blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)$"), r"model.layers.\1.self_attn.\2_proj.\3"),
    (re.compile(r"^blk\.(\d+)\.attn_output\.(weight|bias)$"), r"model.layers.\1.self_attn.o_proj.\2"),
    (re.compile(r"^blk\.(\d+)\.attn_(q|k)_norm\.weight$"), r"model.layers.\1.self_attn.\2_norm.weight"),
    (re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.weight$"), r"model.layers.\1.mlp.\2_proj.weight"),
]
# llama.cpp's converter permutes Q/K rows for these architectures only.
_PERMUTED_ARCHS = ("llama", "mistral")


def gguf_to_hf_name(name: str) -> str | None:
    for pattern, replacement in _GGUF_NAMES:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return None


def reverse_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves)."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


class _UpdateTensor(NamedTuple):
    """What _gguf_iter reads of a GGUFReader tensor, for a weight update's tensor."""
    name: str
    tensor_type: Any             # gguf.GGMLQuantizationType
    shape: np.ndarray            # innermost first, as GGUF lists it
    data: np.ndarray


def _gguf_update_tensor(name: str, value: Any) -> _UpdateTensor:
    from gguf import GGMLQuantizationType
    if gguf_to_hf_name(name) is None:
        raise ValueError(f"weight update: {name!r} is not a GGUF tensor name the loader maps (a GGUF model's "
                         "updates are named as its file names them, e.g. blk.0.attn_q.weight)")
    if isinstance(value, GGUFBlocks):
        if value.tensor_type not in GGUF_QUANT_TYPES or len(value.shape) != 2:
            raise ValueError(f"weight update: {name}: GGUF type {value.tensor_type!r} with shape "
                             f"{tuple(value.shape)}; a 2-D tensor of {', '.join(GGUF_QUANT_TYPES)} is needed")
        rows, cols = (int(d) for d in value.shape)
        return _UpdateTensor(name, GGMLQuantizationType[value.tensor_type], np.array([cols, rows]),
                             value.data.detach().cpu().contiguous().view(torch.uint8).numpy())
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        data = value.detach().to("cpu", torch.float32).contiguous().numpy()
        return _UpdateTensor(name, GGMLQuantizationType.F32, np.array(data.shape[::-1]), data)
    raise ValueError(f"weight update: {name}: a GGUF model's update takes GGUFBlocks (quantized blocks) or a "
                     f"float tensor, got {type(value).__name__}")


def gguf_weights(path: str, hf_config: Any, keep_quantized: bool = False) -> tuple[Weights, int]:
    reader = gguf_reader(path)        # memory-mapped: nothing is read until a tensor is touched
    return _gguf_iter(reader.tensors, hf_config, keep_quantized), len(reader.tensors)


def _gguf_iter(tensors: Iterable[Any], hf_config: Any, keep_quantized: bool) -> Weights:
    """GGUFReader tensors (or _UpdateTensor records) as (HF name, tensor or GroupQuantWeight)."""
    from gguf.quants import dequantize
    permuted = getattr(hf_config, "model_type", None) in _PERMUTED_ARCHS
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for tensor in tensors:
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            logger.debug("skipping GGUF tensor %s (no HF counterpart)", tensor.name)
            continue
        if keep_quantized and tensor.tensor_type.name in GGUF_QUANT_TYPES and len(tensor.shape) == 2:
            try:
                qweight = decode_gguf_tensor(tensor.data, tensor.tensor_type,
                                             (int(tensor.shape[1]), int(tensor.shape[0])))
            except ValueError as exc:
                raise ValueError(f"GGUF tensor {tensor.name}: {exc}") from exc
            if permuted and ".self_attn.q_proj." in name:
                qweight = reverse_permute_rows(qweight, heads)
            elif permuted and ".self_attn.k_proj." in name:
                qweight = reverse_permute_rows(qweight, kv_heads)
            yield name, qweight
            continue
        weight = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions innermost first; torch wants them outermost first.
        weight = weight.reshape(tuple(int(d) for d in np.flip(tensor.shape)))
        if permuted and ".self_attn.q_proj." in name:
            weight = reverse_permute(weight, heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = reverse_permute(weight, kv_heads)
        if not weight.flags.writeable:   # F32 tensors are read-only views of the mapped file
            weight = weight.copy()
        yield name, torch.from_numpy(weight)
