"""`--reasoning-parser`: split a model's thinking (reasoning_content) from its answer (content).

Markers come from common/reasoning.py's table. deepseek_r1's output starts inside the thinking (the template
opened it), so everything before the end marker is reasoning; qwen3's is reasoning only when the output opens
with the start marker. Like the tool parsers, `split` is prefix-consistent: a marker still being written is
held back, so streams reassemble into the whole response's split."""
from __future__ import annotations

from pagedserve.common.reasoning import ReasoningFormat
from pagedserve.frontend.parsers.tool_parsers.base import held_back


class ReasoningParser:
    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        start, end = self.fmt.start, self.fmt.end
        body = text.lstrip()
        if not final and start.startswith(body):
            return "", ""                         # undecided: it may open the thinking
        if body.startswith(start):
            body = body[len(start):]
        elif not self.fmt.starts_in_reasoning:
            return "", text
        else:
            body = text                           # deepseek_r1 without the start marker
        at = body.find(end)
        if at < 0:
            return (body if final else held_back(body, end)), ""
        return body[:at], body[at + len(end):]
