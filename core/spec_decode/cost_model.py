"""How many draft tokens pay: a step's time by its row count, learned from the engine's own steps, against the
tokens a draft of each length is expected to yield (issue 26: throughput with speculation on is never below it
off).

A verify pass costs rows: nearly nothing while a step is bound by streaming the weights (one stream), as much as
any token once its rows make it compute-bound (a busy batch). So the time of a step is learned as a function of
its rows (an average per row count, from the steps the engine times), and a request whose drafts are accepted
with probability alpha each (the first rejection ends a draft) yields 1 + alpha + ... + alpha^d tokens from d
drafts. `plan_draft_lengths` gives each request the draft length, 0 included, that makes the step's expected
tokens per second highest. Pure Python: the engine core calls it every step, the tests feed it synthetic times.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

# Before a step of some row count was timed, its cost is shaped like 1 + SEED_ROW_COST * (rows - 1) times that of
# the nearest row count that was: on the 2-core CPU a 6-token step of the embedded model took ~2.4x a one-token
# one (docs/speculative_decoding.md). Only the shape matters; it is scaled to the timed steps.
SEED_ROW_COST = 0.3
EMA_WEIGHT = 0.2          # each new timing of a row count moves its average by this share
OUTLIER = 3.0             # a timing above this many times its row count's average (or first, its estimate)
                          # counts as that much: a stall, a one-time cost
EXACT_ROWS = 64           # row counts up to this have an average each; above, 16 per doubling share one
# A row count not timed for this many steps is forgotten, and estimated (and so tried) afresh: one that looked
# dear while the machine was busy would otherwise never run again.
FORGET_AFTER = 1024
# Drafts run only where they are expected to beat no drafts by this factor: timings and acceptance are
# estimates, and a mistake the other way costs speed where no drafts would not have.
MIN_SPEEDUP = 1.03


def _bucket(rows: int) -> int:
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return rows - rows % step


def _seed(rows: float) -> float:
    return 1.0 + SEED_ROW_COST * (rows - 1)


class StepCostModel:
    """Seconds per step by row count: an average per row count the engine timed (above EXACT_ROWS, per bucket
    of row counts, at the bucket's average row count); between those, the lesser of the line between them and
    the seed's shape scaled to the one below; beyond them, the seed's shape scaled to the nearest. Before any
    timing, the seed itself (relative units)."""

    def __init__(self) -> None:
        self._averages: dict[int, tuple[float, float]] = {}      # bucket -> (average rows, average seconds)
        self._last_seen: dict[int, int] = {}                      # bucket -> the step that last timed it
        self._steps = 0
        self._curve: tuple[list[float], list[float]] | None = None   # rows, seconds by rows: built on demand

    @property
    def num_row_counts(self) -> int:
        """How many row counts (buckets) have been timed."""
        return len(self._averages)

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` scheduled tokens took `seconds`."""
        if rows < 1 or not seconds > 0:
            return
        key = _bucket(rows)
        self._steps += 1
        if self._steps % 64 == 0:
            self._forget(self._steps - FORGET_AFTER)
        self._last_seen[key] = self._steps
        old = self._averages.get(key)
        if old is None:
            # A row count's first step may hold a one-time cost (a first use of a kernel or buffer): it counts
            # at most OUTLIER times what the model expected, or the row count would look too dear to run again.
            self._averages[key] = (float(rows), min(seconds, OUTLIER * self.cost(rows)) if self._averages
                                   else seconds)
        else:
            old_rows, old_seconds = old
            self._averages[key] = (old_rows + EMA_WEIGHT * (rows - old_rows),
                                   old_seconds + EMA_WEIGHT * (min(seconds, OUTLIER * old_seconds) - old_seconds))
        self._curve = None

    def _forget(self, before: int) -> None:
        for key in [k for k, step in self._last_seen.items() if step < before]:
            del self._averages[key], self._last_seen[key]
        self._curve = None

    def cost(self, rows: int) -> float:
        """The expected time of a step of `rows` tokens."""
        rows = max(rows, 1)
        if not self._averages:
            return _seed(rows)
        if self._curve is None:
            points = [self._averages[key] for key in sorted(self._averages)]
            self._curve = ([r for r, _ in points], [t for _, t in points])
        xs, ts = self._curve
        i = bisect.bisect_left(xs, rows)
        if i < len(xs) and xs[i] == rows:
            return ts[i]
        if i == 0:
            return ts[0] * _seed(rows) / _seed(xs[0])
        shaped = ts[i - 1] * _seed(rows) / _seed(xs[i - 1])
        if i == len(xs):
            return shaped
        # The lesser of the seed's shape from below and the line to the next timed count: that count may be far
        # (a prompt's step) and its timing may hold a one-time cost (the first step's warm-up); either way a
        # row count never timed is tried once, and from then on its own timings say what it costs.
        share = (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
        return min(shaped, ts[i - 1] + share * (ts[i] - ts[i - 1]))


def expected_tokens(alpha: float, drafts: int) -> float:
    """Tokens a verify pass of `drafts` drafts yields when each is accepted with probability alpha (its
    sampled token included): 1 + alpha + ... + alpha^drafts."""
    return sum(alpha ** j for j in range(drafts + 1))


def plan_draft_lengths(cost: Callable[[int], float], base_rows: int, base_tokens: float,
                       alphas: Sequence[float], caps: Sequence[int], max_total: int) -> list[int]:
    """Each request's number of drafts (0 .. its cap, at most max_total in all) that maximizes the step's
    expected tokens per second, (base_tokens + sum of what the drafts add) / cost(base_rows + drafts); all 0
    where no drafts beat none by MIN_SPEEDUP. base_rows / base_tokens: the step's tokens and the tokens it
    samples without drafts. Request i's j-th draft adds alpha_i^j expected tokens, which falls with j, so
    taking the largest additions first gives, for every total, the most tokens any split of it gives."""
    gains = sorted((-(alpha ** j), i, j) for i, (alpha, cap) in enumerate(zip(alphas, caps))
                   for j in range(1, cap + 1))[:max(max_total, 0)]
    lengths = [0] * len(alphas)
    if not gains:
        return lengths
    none = base_tokens / cost(base_rows)
    best, best_rate, tokens = 0, none, base_tokens
    for total, (gain, _, _) in enumerate(gains, 1):
        tokens -= gain
        rate = tokens / cost(base_rows + total)
        if rate > best_rate:
            best, best_rate = total, rate
    if best_rate < none * MIN_SPEEDUP:
        return lengths
    for _, i, _ in gains[:best]:
        lengths[i] += 1
    return lengths


def sure_draft_pays(cost: Callable[[int], float], rows: int, tokens: float) -> bool:
    """Whether one more draft row would pay were it sure to be accepted: where it would not, no acceptance
    makes a draft worth its row (the batch is compute-bound), so probing a request's acceptance is waste."""
    return (tokens + 1) / cost(rows + 1) > tokens / cost(rows) * MIN_SPEEDUP
