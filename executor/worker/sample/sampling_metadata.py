"""Per-row sampling settings for one step, as tensors (built by the model runner, read by the Sampler)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedserve.executor.worker.sample.grammar_mask import GrammarRows
from pagedserve.executor.worker.sample.logit_constraints import ConstrainedRow


@dataclass
class SamplingMetadata:
    """Row i describes logits row i. Optional tensors are None when no row needs them."""
    # [n] float32, 0.0 marks a greedy row; None when every row is greedy (argmax needs no tensor, and on
    # a GPU each tensor built here is a host-to-device copy on the step's critical path).
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None          # [n] float32 in (0, 1]
    top_k: torch.Tensor | None = None          # [n] int64; 0 = no top-k
    min_p: torch.Tensor | None = None          # [n] float32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    no_penalties: bool = True
    presence_penalties: torch.Tensor | None = None    # [n] float32
    frequency_penalties: torch.Tensor | None = None   # [n] float32
    repetition_penalties: torch.Tensor | None = None  # [n] float32
    prompt_token_ids: list[list[int]] = field(default_factory=list)   # per row (penalties only)
    output_token_ids: list[list[int]] = field(default_factory=list)   # per row, generated so far
    # row -> token ids that must not be sampled yet (EOS and stop_token_ids while below min_tokens)
    min_tokens_blocked: dict[int, list[int]] = field(default_factory=dict)
    max_num_logprobs: int | None = None        # None: no row wants logprobs
    constrained: list[ConstrainedRow] = field(default_factory=list)   # rows with logit_bias / allowed / bad words
    grammar: Optional[GrammarRows] = None      # rows under a structured-output grammar, with their bitmask


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor            # [n] int64
    # When max_num_logprobs is set: [n, k+1] ids / logprobs, column 0 = the sampled token,
    # columns 1.. = the top-k of the raw (unprocessed) distribution; ranks [n] of the sampled token (1 = top).
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
