"""Decode steps of a few sequences of a weight-only quantized Llama-family model, in one C call on CPU.

The PyTorch path stays the reference and serves every other step: prefills, mixed steps, more sequences
than the C step takes, other devices and dtypes, tensor parallelism, MoE blocks, sliding windows.
PAGEDSERVE_CPU_DECODE_STEP=0 keeps it for every step (for A/B runs against it).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagedserve.common import envs
from pagedserve.executor.model.layers.rotary import RotaryEmbedding
from pagedserve.kernels.cpu_decode_step import MAX_ROWS, CpuDecodeStep, DecoderWeights
from pagedserve.kernels.metadata import AttentionMetadata



class SteppedModel(Protocol):
    """What the cache needs of a model (LlamaModel)."""
    layers: nn.ModuleList
    rotary_emb: RotaryEmbedding

    def cpu_step_weights(self) -> DecoderWeights | None: ...


class CpuStepCache:
    """The model's C step, built at its first eligible step and again if the KV cache is re-bound."""

    def __init__(self) -> None:
        self.enabled = envs.PAGEDSERVE_CPU_DECODE_STEP
        self._key: tuple | None = None
        self._step: CpuDecodeStep | None = None

    def run(self, model: SteppedModel, h: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """The final-normed hidden states of a decode-only CPU step, or None: the PyTorch path runs it."""
        rows = h.shape[0]
        if (not self.enabled or h.device.type != "cpu" or h.dtype != torch.float32 or not 1 <= rows <= MAX_ROWS
                or meta.num_decodes != rows or meta.num_seqs != rows):
            return None
        step = self._get(model)
        if step is None or int(meta.slot_mapping.min()) < 0:
            return None
        cos, sin = model.rotary_emb.cos_sin(positions, torch.float32)
        return step(h, cos.view(rows, -1), sin.view(rows, -1), meta.slot_mapping, meta.block_tables[:rows],
                    meta.seq_lens)

    def _get(self, model: SteppedModel) -> CpuDecodeStep | None:
        cache = model.layers[0].self_attn.attn.kv_cache
        key = None if cache is None else (cache.data_ptr(), tuple(cache.shape), cache.dtype)
        if key != self._key:
            weights = model.cpu_step_weights()
            self._step = None if weights is None else CpuDecodeStep.build(weights)
            self._key = key
        return self._step
