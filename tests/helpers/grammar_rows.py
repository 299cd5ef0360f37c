"""One structured-output case for the tests of engine modes (async scheduling, pipeline stages): a regex row and
a choice row, seeded, beside a free greedy row; each mode's tokens are compared with one synchronous stage's."""
from __future__ import annotations

import re
from typing import Any

from pagedserve import SamplingParams, StructuredOutputsParams

PATTERN = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("yes", "no", "maybe so")
PROMPTS = ["Code:", "Answer:", "Free:"]


def grammar_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                           structured_outputs=StructuredOutputsParams(regex=PATTERN)),
            SamplingParams(temperature=1.0, seed=6, max_tokens=30,
                           structured_outputs=StructuredOutputsParams(choice=list(CHOICES))),
            SamplingParams(temperature=0.0, max_tokens=12)]


def checked_rows(outs: list[Any]) -> list[tuple[list[int], str | None]]:
    """Each row's (token ids, finish reason), once the constrained rows are found to obey their grammar."""
    assert re.fullmatch(PATTERN, outs[0].outputs[0].text), outs[0].outputs[0].text
    assert outs[1].outputs[0].text in CHOICES, outs[1].outputs[0].text
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
