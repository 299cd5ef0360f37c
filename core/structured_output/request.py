"""One request's structured-output state: its compile (a future), its matcher, and whether it is past the
reasoning (the grammar constrains only the answer after the end-of-thinking marker)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Optional

import numpy as np

from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.core.structured_output.backend_xgrammar import Matcher


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams, compiled: "Future[Any]") -> None:
        self.params = params
        self.compiled = compiled
        self.submitted = time.monotonic()
        self.matcher: Optional[Matcher] = None
        self.reasoning_ended = True
        self._end_marker: list[int] = []

    def start(self, matcher: Matcher, end_marker: list[int], prompt_token_ids: list[int]) -> None:
        """The grammar is ready: the matcher begins at the answer's start."""
        self.matcher = matcher
        self._end_marker = end_marker
        if end_marker:
            # Constrain from the start only when the thinking already ended in the prompt (a template that
            # closes it, as qwen3's does with thinking switched off).
            self.reasoning_ended = _ends_thinking(prompt_token_ids, end_marker)

    @property
    def constrains_next(self) -> bool:
        return self.matcher is not None and self.reasoning_ended and not self.matcher.terminated

    def accept(self, token_id: int, output_token_ids: list[int]) -> bool:
        """Advance by one sampled token (already appended to output_token_ids); True when the grammar is
        complete (the request ends with finish_reason "stop")."""
        if self.matcher is None:
            return False
        if not self.reasoning_ended:
            marker = self._end_marker
            self.reasoning_ended = output_token_ids[-len(marker):] == marker
            return False
        if not self.matcher.accept(token_id):
            # Only a token the mask allowed can be sampled, so this means a mask/state mismatch: end the
            # request rather than let it run unconstrained.
            return True
        return self.matcher.terminated


def valid_draft(state: StructuredOutputRequest, draft: list[int]) -> list[int]:
    """The longest prefix of a speculative draft the grammar accepts (through the token that completes it); the
    matcher is left where it was. No drafts while the reasoning runs (its end marker would switch the grammar on
    mid-draft)."""
    if not state.constrains_next:
        return []
    n = 0
    for token in draft:
        if not state.matcher.accept(token):
            break
        n += 1
        if state.matcher.terminated:
            break
    state.matcher.rollback(n)
    return draft[:n]


def fill_draft_masks(state: StructuredOutputRequest, draft: list[int], mask: np.ndarray, row: int) -> None:
    """Rows row .. row + len(draft) of the mask: what the grammar allows after each prefix of a valid draft
    (every token after one that completes the grammar: that position's token is never emitted)."""
    state.matcher.fill(mask, row)
    for j, token in enumerate(draft, 1):
        state.matcher.accept(token)
        if not state.matcher.terminated:
            state.matcher.fill(mask, row + j)
    state.matcher.rollback(len(draft))


def _ends_thinking(tokens: list[int], marker: list[int]) -> bool:
    n = len(marker)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i:i + n] == marker:
            return True
    return False
