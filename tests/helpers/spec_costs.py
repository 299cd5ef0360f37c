"""A step cost curve for speculative decoding tests whose drafts must not hinge on how fast this machine ran a
step (core/spec_decode/cost_model.py learns the engine's own step timings; a busy test machine makes them anything)."""
from __future__ import annotations


class FixedStepCosts:
    """Steps cost 1 + per_row * rows whatever the engine times: with per_row 0 a verify row is free, so drafts
    run wherever they are expected to add 3 % to a step's tokens."""

    def __init__(self, per_row: float = 0.0) -> None:
        self.per_row = per_row

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def cost(self, rows: int) -> float:
        return 1.0 + self.per_row * rows
