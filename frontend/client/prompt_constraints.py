"""Request settings the frontend must resolve with the tokenizer before the engine sees them:
bad_words as token-id sequences, and truncate_prompt_tokens applied to the prompt."""
from __future__ import annotations

from typing import Any, Optional


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word tokenized as it would start the text and as it would follow a space, as vLLM does: the
    model may emit either form. Unlike vLLM, the spaced form is kept whenever it differs, also when its
    length does: " pavePhys" may be two tokens where "pavePhys" is three, and both must be banned."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if bare:
            sequences.append(list(bare))
        if spaced and spaced != bare:
            sequences.append(list(spaced))
    return sequences


def truncated_ids(token_ids: list[int], keep: Optional[int], max_model_len: int) -> list[int]:
    """The last `keep` prompt tokens (-1: the last max_model_len); None keeps them all."""
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids
