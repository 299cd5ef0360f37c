"""The one validator of a prompt against the model's limits.

The frontend calls it early, so a bad request fails before a stream answers 200; the engine core calls it
again, authoritatively, because any client (another process, another host) can send it anything. Both
raise the same ValueError, whose first word names the request field.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

from pagedserve.common.sampling_params import SamplingParams


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int | None, max_model_len: int,
                 vocab_size: int, params: Optional[SamplingParams] = None) -> int:
    """The number of tokens the request may generate, or ValueError naming the field at fault.
    `params`: its token-id constraints are checked against the vocabulary too."""
    if params is not None:
        check_token_constraints(params, vocab_size)
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise ValueError("prompt must contain at least one token")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}) for this model")
    if prompt_len >= max_model_len:
        raise ValueError(f"prompt: {prompt_len} tokens, but this model's maximum context length "
                         f"(max_model_len) is {max_model_len}: it leaves no room to generate")
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(f"max_tokens: {max_tokens} requested, but the prompt uses {prompt_len} of the "
                         f"{max_model_len} tokens of max_model_len")
    return max_tokens


def check_token_constraints(params: SamplingParams, vocab_size: int) -> None:
    """Every token id a sampling constraint names must be in the vocabulary (a wrong id would index
    past the logits row in the worker)."""
    if params.bad_words and params._bad_words_token_ids is None:
        raise ValueError("bad_words: not tokenized (a frontend turns them into token ids before sending)")
    _in_vocab(params.logit_bias or (), vocab_size, "logit_bias")
    _in_vocab(params.allowed_token_ids or (), vocab_size, "allowed_token_ids")
    _in_vocab((t for word in params._bad_words_token_ids or () for t in word), vocab_size, "bad_words")


def _in_vocab(ids: Iterable[int], vocab_size: int, field: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is not in [0, {vocab_size}) for this model")
