"""The grammar bitmask from the scheduler, applied to the constrained rows' logits just before sampling.

Only the rows the core sent a mask row for pay anything; a step with no constrained row carries no mask.
The mask is unpacked with plain torch ops (bit t of row r: token t allowed), so the worker needs no
grammar library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedserve.ipc.messages import GrammarBitmask

_NEG_INF = float("-inf")


@dataclass
class GrammarRows:
    rows: torch.Tensor      # [m] int64: logits rows under a grammar
    words: torch.Tensor     # [m, num_words] int32 packed bits


def grammar_rows(bitmask: Optional[GrammarBitmask], row_req_ids: list[str],
                 device: torch.device) -> Optional[GrammarRows]:
    """Map the core's mask rows onto logits rows: row i of the logits is row_req_ids[i]'s, and a request with
    several logits rows (a speculative verify pass: one per position, in order) takes its mask rows in order."""
    if bitmask is None:
        return None
    mask_rows: dict[str, list[int]] = {}
    for i, rid in enumerate(bitmask.req_ids):
        mask_rows.setdefault(rid, []).append(i)
    taken: dict[str, int] = {}
    pairs = []
    for row, rid in enumerate(row_req_ids):
        n = taken.get(rid, 0)
        if n < len(mask_rows.get(rid, ())):
            pairs.append((row, mask_rows[rid][n]))
            taken[rid] = n + 1
    if not pairs:
        return None
    words = np.frombuffer(bitmask.data, dtype=np.int32).reshape(len(bitmask.req_ids), bitmask.num_words)
    take = [i for _, i in pairs]
    return GrammarRows(rows=torch.tensor([r for r, _ in pairs], dtype=torch.int64, device=device),
                       words=torch.from_numpy(words[take].copy()).to(device))


def apply_grammar(logits: torch.Tensor, grammar: GrammarRows) -> torch.Tensor:
    """Out-of-place: -inf for every token the grammar does not allow next."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((grammar.words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits = logits.clone()
    logits[grammar.rows] = logits[grammar.rows].masked_fill(~allowed, _NEG_INF)
    return logits
