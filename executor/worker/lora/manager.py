"""A rank's LoRA adapters: loaded from their PEFT safetensors (this rank's shard, scaling folded in), placed in
the layers' slots for the steps that use them, and each step's token -> slot grouping.

The engine core decides which adapters exist (it checked each one: common/lora.py) and keeps at most
max_loras of them in any batch; this side only loads, evicts the slot least recently used by a batch, and maps
tokens. Projections follow the Llama family's merged layers: q/k/v are pieces of qkv_proj, gate/up of
gate_up_proj; o_proj and down_proj are row-parallel.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from operator import attrgetter

import torch
from torch import nn

from pagedserve.common.config.engine_config import LoRAConfig
from pagedserve.common.lora import parse_lora_key
from pagedserve.executor.model.layers.linear import LinearBase, RowParallelLinear
from pagedserve.executor.model.layers.lora import LoRAContext, LoRASlots, pack_pieces
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.kernels.cpu import lora as cpu_lora
from pagedserve.kernels.weights.weight_split import WeightOnly

logger = logging.getLogger(__name__)

# PEFT projection -> (the layer's linear, its shard id in that linear, its piece index)
_PROJECTIONS = {"q_proj": ("self_attn.qkv_proj", "q", 0), "k_proj": ("self_attn.qkv_proj", "k", 1),
                "v_proj": ("self_attn.qkv_proj", "v", 2), "o_proj": ("self_attn.o_proj", None, 0),
                "gate_proj": ("mlp.gate_up_proj", 0, 0), "up_proj": ("mlp.gate_up_proj", 1, 1),
                "down_proj": ("mlp.down_proj", None, 0)}
_PIECES = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}

Packed = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]     # (layer, linear) -> (A, B) for its slot


def pool_dtype(linears: list[LinearBase], dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapter slots' dtype: the model's, but bfloat16 over a float32 CPU model whose every LoRA linear is
    weight-only int4/int5/int6/int8. There, with few tokens a step, each adapter's float32 A and B in the batch are read
    every step and outweigh the base's 4-bit codes (8 rank-16 all-linear adapters on the embedded model: twice
    its bytes); bfloat16 halves them, and its rounding of the weights (2^-9 relative; the C kernels keep x and
    the sums in float32) is far below the base's own (4-bit weights, rounded inputs)."""
    if device.type == "cpu" and dtype == torch.float32 \
            and all(isinstance(linear.packed, WeightOnly) for linear in linears):
        return torch.bfloat16
    return dtype


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.linears: dict[tuple[int, str], LinearBase] = {(index, path): attrgetter(path)(layer)
                                                           for index, layer in enumerate(model.model.layers)
                                                           for path in _PIECES}
        self.dtype = pool_dtype(list(self.linears.values()), dtype, device)
        # The C kernel takes float32 activations (what a CPU model computes in, but for --dtype bfloat16).
        self.context = LoRAContext(cpu_kernel=device.type == "cpu" and dtype == torch.float32
                                   and cpu_lora.available(max(_PIECES.values()) * config.max_lora_rank))
        for (_, path), linear in self.linears.items():
            sizes = list(linear.output_partition_sizes) if _PIECES[path] > 1 else [linear.out_features]
            linear.lora = LoRASlots(sizes, linear.in_features, linear.out_features, config.max_loras,
                                    config.max_lora_rank, self.context, self.dtype, device)
        self.adapters: dict[int, Packed] = {}
        self.slots: OrderedDict[int, int] = OrderedDict()      # adapter id -> slot, least recently used first

    # ---------------------------------------------------------------- adapters (collective calls)

    def add_lora(self, int_id: int, path: str, scaling: float) -> int:
        """Load (or reload) an adapter the core checked; the bytes it holds on this rank."""
        from safetensors.torch import load_file
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            parsed = parse_lora_key(key)
            if parsed is None or parsed[1] not in _PROJECTIONS:      # the core refused such an adapter already
                raise ValueError(f"LoRA adapter {path}: unexpected tensor {key!r}")
            found.setdefault(parsed[:2], {})[parsed[2]] = tensor
        per_linear: dict[tuple[int, str], list] = {}
        rank = 0
        for (index, proj), ab in found.items():
            path_in_layer, shard_id, piece = _PROJECTIONS[proj]
            linear = self.linears[(index, path_in_layer)]
            a, b = ab["A"], ab["B"] * scaling
            rank = a.shape[0]
            if isinstance(linear, RowParallelLinear):
                a, row = linear.shard(a, None)[1], 0
            else:
                row, b = linear.shard(b, shard_id)
            per_linear.setdefault((index, path_in_layer), [None] * _PIECES[path_in_layer])[piece] = (a, row, b)
        packed: Packed = {}
        for key, pieces in per_linear.items():
            linear = self.linears[key]
            a, b = pack_pieces(pieces, rank, linear.in_features, linear.out_features, self.dtype)
            packed[key] = (a.to(self.device), b.to(self.device))
        self.remove_lora(int_id)        # a reload under the same id replaces it, in its slot too
        self.adapters[int_id] = packed
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in packed.values())

    def remove_lora(self, int_id: int) -> None:
        self.adapters.pop(int_id, None)
        slot = self.slots.pop(int_id, None)
        if slot is not None:
            for linear in self.linears.values():
                linear.lora.clear_slot(slot)

    # ---------------------------------------------------------------- each step

    def prepare(self, req_ids: list[str], states: dict[str, CachedRequestState], query_start: Sequence[int]) -> bool:
        """Group the step's tokens by their adapter's slot; False when no token uses an adapter."""
        ids = [states[rid].lora_int_id for rid in req_ids]
        needed = set(ids) - {0}
        if not needed:
            self.context.clear()
            return False
        slot_of = self._activate(needed)
        query_start = list(query_start)
        token_slots: list[int] = []
        for i, int_id in enumerate(ids):
            token_slots += [slot_of.get(int_id, -1)] * (query_start[i + 1] - query_start[i])
        self.context.set_rows(token_slots, self.device)
        return True

    def _activate(self, needed: set[int]) -> dict[int, int]:
        if len(needed) > self.config.max_loras:       # the scheduler keeps batches within max_loras
            raise RuntimeError(f"a step uses {len(needed)} adapters; max_loras is {self.config.max_loras}")
        for int_id in needed:
            if int_id in self.slots:
                self.slots.move_to_end(int_id)
                continue
            if int_id not in self.adapters:
                raise RuntimeError(f"LoRA adapter id {int_id} is not loaded on this rank")
            used = set(self.slots.values())
            free = [s for s in range(self.config.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slots if i not in needed)
                slot = self.slots.pop(victim)
            self._fill(slot, self.adapters[int_id])
            self.slots[int_id] = slot
        return {int_id: self.slots[int_id] for int_id in needed}

    def _fill(self, slot: int, packed: Packed) -> None:
        for key, linear in self.linears.items():
            if key in packed:
                linear.lora.set_slot(slot, *packed[key])
            else:
                linear.lora.clear_slot(slot)
