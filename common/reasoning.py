"""Reasoning output formats (`--reasoning-parser`): where a model's thinking starts and ends.

One table for both sides: the frontend splits `reasoning_content` from `content` with it, and the core's
structured-output manager starts constraining a request only after the end marker (the grammar applies to
the answer, not to the thinking)."""
from __future__ import annotations

from typing import NamedTuple


class ReasoningFormat(NamedTuple):
    start: str
    end: str
    # qwen3's template may open the thinking in the prompt, so the output can start inside it;
    # deepseek_r1 likewise puts "<think>\n" in its generation prompt.
    starts_in_reasoning: bool


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
}
