"""LoRA adapters: vLLM's LoRARequest, and what an adapter is, read from its PEFT files without torch.

An adapter is checked here once, when it is added (the engine core does it, before any worker reads a weight):
the PEFT config and the safetensors header say its rank, its scaling and which projections of which layers it
changes. Anything we would not apply exactly is refused with the reason (vLLM's #34186: an adapter whose
module names matched nothing silently served the base model). Its identity for the prefix cache is the digest of
its files' bytes, not its name: an adapter reloaded under the same name with other weights never meets the old
one's cached KV.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

from pagedserve.common.json_file import read_json_object

# The projections an adapter may change, as PEFT names them in Llama-family checkpoints.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# How long a client waits for an add_lora: it reads and hashes the files, then every rank loads them.
LORA_LOAD_TIMEOUT_S = 300.0
# base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def parse_lora_key(key: str) -> tuple[int, str, str] | None:
    """(layer, projection, "A" or "B") of a PEFT LoRA tensor name, None for any other tensor (the one reading of
    the names, for the core's check and the ranks' load)."""
    m = _KEY.match(key)
    return (int(m.group(1)), m.group(2), m.group(3)) if m is not None else None


class LoRARequest(msgspec.Struct, frozen=True):
    """An adapter for a request (vLLM's shape): its name, a positive id the caller picks, and a local folder
    or Hugging Face Hub id holding adapter_config.json and adapter_model.safetensors."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """One checked adapter, as the core registers it and the workers load it."""
    name: str
    int_id: int
    path: str                       # the local folder (a Hub id resolved)
    rank: int
    scaling: float                  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (PEFT's rule)
    targets: tuple[str, ...]        # the projections it changes (any layer)
    digest: str                     # sha256 of its files: its identity in the prefix cache
    nbytes: int                     # its weights' size in the file


def check_lora_request(lora: Any) -> LoRARequest:
    """A LoRARequest from what a caller passed (a LoRARequest or vLLM-style fields); ValueError naming the field."""
    if not isinstance(lora, LoRARequest):
        raise ValueError(f"lora_request must be a pagedserve.LoRARequest, got {type(lora).__name__}")
    if not isinstance(lora.lora_name, str) or not lora.lora_name:
        raise ValueError("lora_request.lora_name must be a non-empty string")
    if isinstance(lora.lora_int_id, bool) or not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
        raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {lora.lora_int_id!r}")
    if not isinstance(lora.lora_path, str) or not lora.lora_path:
        raise ValueError("lora_request.lora_path must name the adapter's folder or Hub id")
    return lora


def inspect_adapter(name: str, int_id: int, folder: str, hf_config: Any, max_rank: int) -> AdapterInfo:
    """The adapter in `folder`, checked against the model; ValueError with the reason it cannot be served."""
    config = _read_config(folder)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in (("use_dora", "DoRA (use_dora)"), ("modules_to_save", "modules_to_save (embedding or head "
                      "weights)"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} trains biases, which is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json needs an integer r >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = os.path.join(folder, "adapter_model.safetensors")
    tensors = _safetensors_header(name, weights)
    targets = _check_tensors(name, tensors, rank, hf_config)
    digest = hashlib.sha256()
    for path in (os.path.join(folder, "adapter_config.json"), weights):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    nbytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values())
    return AdapterInfo(name, int_id, folder, rank, float(scaling), targets, digest.hexdigest(), nbytes)


def _read_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"LoRA adapter folder {folder!r} has no adapter_config.json")
    return read_json_object(path, "LoRA adapter")


def _safetensors_header(name: str, path: str) -> dict[str, dict[str, Any]]:
    if not os.path.isfile(path):
        bin_path = os.path.join(os.path.dirname(path), "adapter_model.bin")
        hint = " (adapter_model.bin is a pickle; save with safe_serialization=True)" if os.path.exists(bin_path) else ""
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors{hint}")
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors is not a safetensors file ({exc})") \
            from None
    header.pop("__metadata__", None)
    return header


def _expected_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection, full size (before any tensor-parallel split)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    inter = hf_config.intermediate_size
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def _check_tensors(name: str, tensors: dict[str, dict[str, Any]], rank: int, hf_config: Any) -> tuple[str, ...]:
    shapes = _expected_shapes(hf_config)
    layers = hf_config.num_hidden_layers
    pairs: dict[tuple[int, str], set[str]] = {}
    for key, meta in tensors.items():
        parsed = parse_lora_key(key)
        if parsed is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's "
                             f"projection (embedding, head, DoRA and bias weights are not supported)")
        layer, proj, side = parsed
        if proj not in LORA_TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: target module {proj!r} is not one of this model's "
                             f"projections ({', '.join(LORA_TARGETS)})")
        if layer >= layers:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} names layer {layer}; the model has {layers}")
        out_f, in_f = shapes[proj]
        want = [rank, in_f] if side == "A" else [out_f, rank]
        if list(meta.get("shape", [])) != want:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} has shape {meta.get('shape')}, expected {want} "
                             f"for this model and r={rank}")
        pairs.setdefault((layer, proj), set()).add(side)
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r} has no LoRA weight for any projection of this model: serving it "
                         "would serve the base model")
    half = [f"layer {layer} {proj}" for (layer, proj), sides in pairs.items() if sides != {"A", "B"}]
    if half:
        raise ValueError(f"LoRA adapter {name!r}: {half[0]} has only one of lora_A and lora_B")
    return tuple(p for p in LORA_TARGETS if any(proj == p for _, proj in pairs))
