"""Turn a float HF folder (e.g. a tiny random model from tiny_models) into a real AWQ or GPTQ checkpoint
folder, as AutoAWQ / AutoGPTQ write them, plus its dequantized twin: the float folder HF transformers
loads as the oracle for the quantized one (same weights, bit for bit up to the float dtype)."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Any

import torch

from pagedserve.tests.helpers.models.quant_packers import pack_awq, pack_gptq

# The linears AutoAWQ / AutoGPTQ quantize in Llama/Qwen/Mistral decoder layers (not embeddings, lm_head).
_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# Linears reading the same input: GPTQ's act-order comes from that input's Hessian, so they share one order.
_SAME_INPUT = {"self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0, "self_attn.o_proj": 1,
               "mlp.gate_proj": 2, "mlp.up_proj": 2, "mlp.down_proj": 3}


def _act_order_seed(match: re.Match) -> int:
    return 4 * int(match.group(1)) + _SAME_INPUT[match.group(2)]


def _quantization_config(method: str, bits: int, group_size: int, sym: bool, checkpoint_format: str,
                         desc_act: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": checkpoint_format, "damp_percent": 0.01, "true_sequential": True}
    raise ValueError(f"method must be 'awq' or 'gptq', got {method!r}")


def _read_float_folder(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(path))
    if not tensors:
        raise ValueError(f"{folder} has no *.safetensors")
    return tensors


def _copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for path in glob.glob(os.path.join(src, "*")):
        name = os.path.basename(path)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(path, os.path.join(dst, name))


def _write_config(folder: str, update: dict[str, Any]) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config.update(update)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def _save_two_shards(tensors: dict[str, torch.Tensor], folder: str) -> None:
    """Alternate tensors between two shards, so one linear's qweight/qzeros/scales land in different files."""
    from safetensors.torch import save_file
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, (name, tensor) in enumerate(tensors.items()):
        shards[i % 2][name] = tensor.contiguous()
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-00002.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_quantized_checkpoint(float_dir: str, quant_dir: str, dequant_dir: str, method: str, bits: int = 4,
                               group_size: int = 32, sym: bool = False, checkpoint_format: str = "gptq",
                               desc_act: bool = False) -> None:
    """Write `quant_dir` (method's tensors + quantization_config, two shards) and `dequant_dir` (the same
    weights dequantized, in the float folder's dtype) from the float folder `float_dir`. desc_act (gptq):
    act-order, one random column order per input shared by the linears that read it."""
    from safetensors.torch import save_file
    tensors = _read_float_folder(float_dir)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _LINEAR.match(name)
        if not match:
            quantized[name] = dequantized[name] = tensor
            continue
        if method == "awq":
            parts, quant = pack_awq(tensor.float(), group_size)
        else:
            seed = _act_order_seed(match) if desc_act else None
            parts, quant = pack_gptq(tensor.float(), bits, group_size, sym, checkpoint_format, seed)
        prefix = name.removesuffix(".weight")
        quantized.update({f"{prefix}.{part}": value for part, value in parts.items()})
        dequantized[name] = quant.dequantize().to(tensor.dtype)
    for folder in (quant_dir, dequant_dir):
        _copy_side_files(float_dir, folder)
    _save_two_shards(quantized, quant_dir)
    _write_config(quant_dir, {"quantization_config": _quantization_config(method, bits, group_size, sym,
                                                                            checkpoint_format, desc_act)})
    save_file({n: t.contiguous() for n, t in dequantized.items()}, os.path.join(dequant_dir, "model.safetensors"),
              metadata={"format": "pt"})
    _write_config(dequant_dir, {})
