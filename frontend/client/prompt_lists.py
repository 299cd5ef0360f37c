"""What the offline API's calls accept as "prompts" and as per-prompt settings (LLM.generate, beam_search, embed...)."""
from __future__ import annotations

from typing import Any

from pagedserve.frontend.client.input_processor import PromptType


def as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]            # one prompt given as token ids
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids, or a list of them, got {type(prompts).__name__}")


def per_prompt(value: Any, n: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
