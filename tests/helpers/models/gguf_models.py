"""Tiny GGUF model files for tests: a float HF Llama folder (tiny_models.make_tiny_model) written as
llama.cpp's converter and quantizer would (GGUF names, Q/K rows permuted, blocks from gguf's own quantizer),
with each tensor's type chosen by the test. Plus the file's tensors as a weight update of a GGUF model takes
them (GGUF names; GGUFBlocks for quantized ones)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np
import torch

from pagedserve.executor.model.quant.gguf_blocks import GGUFBlocks

_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row permutation."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of a float [rows, cols] (cols a multiple of 256), which gguf-py cannot write: per 16 weights an
    int8 scale of the block's float16 d, codes q - 32 in -32..31, laid out as gguf's dequantize_blocks reads them
    (ql: the low nibbles, two 64-code runs a 128-code half; qh: the high two bits, four 32-code runs a half)."""
    rows, cols = w.shape
    v = w.astype(np.float32).reshape(-1, 256)
    sub = np.abs(v.reshape(-1, 16, 16)).max(-1) / 31                          # [blocks, 16]
    d = (sub.max(-1, keepdims=True) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.round(sub / d.astype(np.float32)), 0).clip(-128, 127).astype(np.int8)
        step = (d.astype(np.float32) * sc).repeat(16, 1)                       # [blocks, 256]
        q = np.where(step > 0, np.round(v / step), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8)
    low, high = (q & 15).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = sum(high[:, :, i] << (2 * i) for i in range(4)).astype(np.uint8).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], -1)
    return blocks.reshape(rows, cols // 256 * 210)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks of a float [rows, cols] (cols a multiple of 256) as llama.cpp's reference quantizer lays them
    out, which gguf-py cannot write: per 32 weights a 6-bit scale and min of the block's float16 d and dmin (the
    largest of each gets code 63), codes 0..15, w = d * sc * q - dmin * m."""
    rows, cols = w.shape
    v = w.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(v.min(-1), 0)                                              # [blocks, 8], <= 0
    scale = (v.max(-1) - low) / 15
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (-low.min(-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.round(scale / d.astype(np.float32)), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin > 0, np.round(-low / dmin.astype(np.float32)), 0).clip(0, 63).astype(np.uint8)
        step = (d.astype(np.float32) * sc)[..., None]
        q = np.where(step > 0, np.round((v + (dmin.astype(np.float32) * m)[..., None]) / step), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)                  # 64-weight runs: low, high nibbles
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], -1)   # ggml's get_scale_min_k4, inverted
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], -1)
    return blocks.reshape(rows, cols // 256 * 144)


def write_tiny_gguf(hf_dir: str, path: str, types: dict[str, str], default: str = "Q4_0") -> str:
    """hf_dir's float Llama as a GGUF file at path. types: GGUF name suffix ("ffn_down.weight",
    "token_embd.weight") -> ggml type; other 2-D tensors take `default`, 1-D ones stay F32."""
    import gguf
    from safetensors.torch import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        tensors.update(load_file(file))
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]), ("vocab_size", cfg["vocab_size"])):
        writer.add_uint32(f"llama.{key}", int(value))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    writer.add_float32("llama.rope.freq_base", float(cfg.get("rope_theta", 10000.0)))
    writer.add_uint32("tokenizer.ggml.bos_token_id", int(cfg["bos_token_id"]))
    writer.add_uint32("tokenizer.ggml.eos_token_id", int(cfg["eos_token_id"]))
    for hf, tensor in tensors.items():
        name, w = gguf_name(hf), tensor.float().numpy()
        if ".attn_q." in name:
            w = _llama_cpp_permute(w, cfg["num_attention_heads"])
        elif ".attn_k." in name:
            w = _llama_cpp_permute(w, cfg["num_key_value_heads"])
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), default) if w.ndim == 2 else "F32"
        if qtype == "F32":
            writer.add_tensor(name, np.ascontiguousarray(w))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            own = {"Q6_K": quantize_q6_k, "Q4_K": quantize_q4_k}.get(qtype)
            blocks = own(w) if own is not None else gguf.quants.quantize(w, kind)
            writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_update(path: str) -> list[tuple[str, Any]]:
    """Every tensor of a GGUF file as an update takes it: (GGUF name, GGUFBlocks or float tensor)."""
    from gguf import GGUFReader
    out: list[tuple[str, Any]] = []
    for t in GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type.name == "F32":
            out.append((t.name, torch.from_numpy(np.array(t.data)).reshape(shape)))
        else:
            out.append((t.name, GGUFBlocks(t.tensor_type.name, shape, torch.from_numpy(np.array(t.data)).flatten())))
    return out
