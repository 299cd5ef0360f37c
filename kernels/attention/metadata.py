"""What a paged-attention op needs to know about one mixed batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One forward pass over a ragged batch: prefill chunks and decodes, tokens concatenated.

    Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]); those tokens sit at
    the last positions of its context of seq_lens[i] tokens (cached ones first, then the new ones), and
    each sees the context up to its own position (causal, also among the new tokens).
    The runner orders decodes before prefill chunks: the first num_decodes sequences have exactly
    decode_query_len query tokens each, 1 for plain decoding, 1 + k when a speculative step verifies k
    draft tokens. Built once per step by the backend's AttentionMetadataBuilder
    (kernels/attention/interface.py).
    """
    slot_mapping: torch.Tensor      # [num_tokens] int64: flat cache slot per token, -1 = padding (not written)
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32; unused entries are 0 and never read
    num_decodes: int                # the first num_decodes sequences are decodes (decode_query_len tokens each)
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies: the reference path loops over prefills in Python
    seq_lens_cpu: list[int]
    decode_query_len: int = 1       # query tokens of each decode: 1, or 1 + draft tokens when verifying
    # [num_tokens] int64: the last key position each query token sees, where some token sees past itself (Gemma
    # 3's image tokens see their whole image: executor/worker/multimodal/item_bounds.py); None: causal. A
    # sliding window still bounds the keys from below by the token's own position. Only prefill chunks carry
    # such tokens; the backends without a path for it attend such steps through the reference.
    visible_until: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
