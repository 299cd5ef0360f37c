"""The one validator of a prompt against the model's limits.

The frontend calls it early, so a bad request fails before a stream answers 200; the engine core calls it
again, authoritatively, because any client (another process, another host) can send it anything. Both
raise the same ValueError, whose first word names the request field.
"""
from __future__ import annotations

from collections.abc import Sequence


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int | None, max_model_len: int,
                 vocab_size: int) -> int:
    """The number of tokens the request may generate, or ValueError naming the field at fault."""
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
