"""The steps of a weight-only quantized Llama-family model on CPU, each pass of up to c_step.max_rows tokens in one
C call.

The model runner asks the model for this step once, when the KV cache is bound (LlamaForCausalLM
.make_decode_step), and offers it every step; the step takes the ones it can (`__call__`, the one
eligibility test: every token with a cache slot, no image rows) and the model's own layers run the rest. Models outside what it takes (other devices and dtypes, tensor parallelism, MoE blocks,
sliding windows, unquantized or fp8 linears) get no step at all. With LoRA enabled, the step holds the layers'
adapter slots (bound once, filled in place by executor/worker/lora/manager.py) and takes steps whose rows use
adapters too, each row its own.
It takes steps of any size, in passes of c_step.max_rows tokens, so that every token of every step goes through
the same arithmetic (docs/determinism.md). PAGEDSERVE_CPU_DECODE_STEP=0 keeps the layers for every step, =short
for the steps past max_rows (the split before issue 50), for A/B runs against them.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagedserve.common import envs
from pagedserve.executor.model.layers.rotary import RotaryEmbedding
from pagedserve.kernels.cpu.decode_step import CpuDecodeStep, DecoderWeights
from pagedserve.kernels.attention.metadata import AttentionMetadata


class SteppedModel(Protocol):
    """What the step needs of a model (LlamaModel)."""
    embed_tokens: nn.Module
    rotary_emb: RotaryEmbedding

    def cpu_step_weights(self) -> DecoderWeights | None: ...


class LlamaCpuDecodeStep:
    """The whole decoder (embedding excepted) of a decode-only step in one C call."""

    def __init__(self, model: SteppedModel, c_step: CpuDecodeStep, every_step: bool = True) -> None:
        self.model, self.c_step = model, c_step
        # Every step, whatever its size, in passes of c_step.max_rows tokens: a token then gets the same bits
        # fresh, after a prefix-cache hit, in any chunk of its prompt and beside any batch, since the C step's
        # rows never depend on one another (docs/determinism.md). False: steps past max_rows run the layers.
        self.every_step = every_step

    @classmethod
    def build(cls, model: SteppedModel) -> LlamaCpuDecodeStep | None:
        """The step over the model's current weights and KV caches, or None where it does not apply."""
        mode = envs.PAGEDSERVE_CPU_DECODE_STEP
        if mode == "0":
            return None
        weights = model.cpu_step_weights()
        # A float32 CPU model only (what the C code reads); asked before CpuDecodeStep.build, which compiles the
        # C kernels on first use, so other models never build them.
        if weights is None or weights.final_norm.device.type != "cpu" or weights.final_norm.dtype != torch.float32:
            return None
        c_step = CpuDecodeStep.build(weights)
        return None if c_step is None else cls(model, c_step, every_step=mode != "short")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 lora_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final-normed hidden states of a step whose tokens all have a cache slot (of at most c_step.max_rows
        tokens unless every_step); None for any other step (the layers run it). Each token is a row of the C step
        that attends to its sequence's context up to its own position: a one-token decode, or several tokens of
        one sequence (a speculative verify pass, a prompt chunk), whose K/V every layer writes before any row of
        its pass attends. A token's arithmetic is the same in either (docs/speculative_decoding.md). lora_slots: int32 [T], each
        token's adapter slot (-1: the base model), None for a step without adapter tokens."""
        rows = input_ids.shape[0]
        limit = self.c_step.max_rows if not self.every_step else rows
        if not 1 <= rows <= limit or int(meta.slot_mapping.min()) < 0:
            return None
        if lora_slots is not None and not self.c_step.lora_slots:
            return None         # built without the layers' adapter slots: the layers apply them
        tables, lengths = row_tables_and_lengths(meta, rows)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, torch.float32)
        cos, sin = cos.view(rows, -1), sin.view(rows, -1)
        # Passes of max_rows tokens in order: a row attends to its own sequence's keys up to itself, all of which
        # an earlier pass or its own has written, so the split changes no token's arithmetic.
        step = self.c_step.max_rows
        if rows <= step:
            return self.c_step(h, cos, sin, meta.slot_mapping, tables, lengths, lora_slots)
        for a in range(0, rows, step):
            b = min(a + step, rows)
            self.c_step(h[a:b], cos[a:b], sin[a:b], meta.slot_mapping[a:b], tables[a:b], lengths[a:b],
                        None if lora_slots is None else lora_slots[a:b])
        return h


def row_tables_and_lengths(meta: AttentionMetadata, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's block table and context length (int32), from the attention metadata, not from the row's
    position: an M-RoPE model's positions are shifted from the token indices (worker/multimodal/mrope.py)."""
    if meta.num_seqs == rows:
        return meta.block_tables[:rows], meta.seq_lens[:rows].to(torch.int32)
    starts, ends = torch.tensor(meta.query_start_loc_cpu[:-1]), torch.tensor(meta.query_start_loc_cpu[1:])
    counts = ends - starts
    # a row sees its sequence's context less the step's rows after it
    lengths = (torch.tensor(meta.seq_lens_cpu) - ends).repeat_interleave(counts) + torch.arange(1, rows + 1)
    return meta.block_tables.repeat_interleave(counts, dim=0), lengths.to(torch.int32)
