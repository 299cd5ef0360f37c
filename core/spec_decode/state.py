"""The engine core's side of speculative decoding: which requests get how many drafts this step, and the counters.

Each step (`plan`, at the start of schedule()) the requests that decode (their one new token is their last
sampled one) are offered drafts: the n-gram lookup's or the draft model's last proposals, cut to what
max_tokens and max_model_len leave and, under a grammar, to the longest prefix it accepts. How many of them each
verifies is the step cost model's choice (core/spec_decode/cost_model.py): the draft lengths, 0 included, that make the
step's expected tokens per second highest, from each request's measured acceptance and the step's time by its
row count as the engine timed it (EngineCore reports each step's time to `cost`). Two bounds hold whatever it
says: no drafts while more than `disable_by_batch_size` requests run (vLLM's key), and at most
`num_speculative_tokens` drafts in one step (with the default bound of 3 requests a step is then at most 8
tokens, which the CPU's one-call decode step takes, giving a verified token the arithmetic of a one-token
decode). A request whose drafts stopped paying gets a one-token probe every PROBE_EVERY output tokens where a
sure draft would pay, so a request that starts copying its input gets its drafts back.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from pagedserve.common.config.engine_args import SchedulerConfig
from pagedserve.common.speculative import MODEL_METHODS, SpeculativeConfig
from pagedserve.core.spec_decode.ngram_proposer import propose_ngram
from pagedserve.core.request import Request
from pagedserve.core.spec_decode.cost_model import StepCostModel, plan_draft_lengths, sure_draft_pays
from pagedserve.core.structured_output.request import valid_draft

logger = logging.getLogger(__name__)
T = TypeVar("T")
LOG_INTERVAL_S = 10.0     # the acceptance log line, at most this often (vLLM logs its stats every 10 s too)
# A draft position's acceptance: the share of verified positions accepted (a draft is tried position by
# position up to its first rejection), a request's own recent ones (each verify pass's counts decay by
# DECAY at the next) drawn toward the engine's recent rate as if it had been tried PRIOR_TRIALS more times.
DECAY = 0.7
ENGINE_DECAY = 0.98
PRIOR_TRIALS = 2.0
SEED_ACCEPTANCE = 0.8     # the engine's rate before any verify pass: optimistic, so drafting is tried
PROBE_EVERY = 8


class SpecDecodeState:
    def __init__(self, config: SpeculativeConfig, scheduler: SchedulerConfig) -> None:
        self.config = config
        self.max_model_len = scheduler.max_model_len
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens
        self.cost = StepCostModel()
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self._hits, self._trials = SEED_ACCEPTANCE * PRIOR_TRIALS, PRIOR_TRIALS    # engine-wide, decayed
        self._plan: dict[str, list[int]] = {}
        self._logged = (0, 0, 0, [0] * config.num_speculative_tokens)   # totals at the last log line
        self._last_log = time.monotonic()

    @property
    def workers_propose(self) -> bool:
        """The drafts come from the workers' draft model or head (which the core tells how many to propose)."""
        return self.config.method in MODEL_METHODS

    def acceptance(self, request: Request) -> float:
        """The probability that the request's next draft position is accepted (given the ones before it were)."""
        prior = self._hits / self._trials
        return (request.spec_hits + PRIOR_TRIALS * prior) / (request.spec_trials + PRIOR_TRIALS)

    def plan(self, running: list[Request], budget: int) -> None:
        """Choose this step's drafts for the running requests (schedule() then takes them by drafts_for)."""
        self._plan = {}
        if len(running) > self.config.disable_by_batch_size:
            return
        rows, tokens, offers = _step_rows(
            running, budget, lambda r: r.num_tokens + r.num_output_placeholders - r.num_computed_tokens,
            lambda r, num_new, left: self._offer(r)[:left] if num_new == 1 and not r.num_output_placeholders else None)
        lengths = plan_draft_lengths(self.cost.cost, rows, max(tokens, 1), [self.acceptance(r) for r, _ in offers],
                                     [len(draft) for _, draft in offers], self.config.num_speculative_tokens)
        due = [bool(draft) and r.num_output_tokens % PROBE_EVERY == 0 for r, draft in offers]
        for (request, draft), n in zip(offers, self._with_probes(lengths, due, rows, tokens)):
            if n:
                self._plan[request.request_id] = draft[:n]

    def to_propose(self, running: list[Request], sampling: list[Request],
                   drafts: dict[str, list[int]]) -> dict[str, int]:
        """How many tokens the workers' draft model or head should propose after this step, by request (absent:
        none), called once schedule() has counted the step in: `sampling`, the requests this step samples for,
        decode next step, and the next plan can verify at most what is proposed now, so each is asked for what
        that plan would give it with a full-length proposal, or its probe. The next step's batch is unknown
        (arrivals, stops), so this is a bound from what is known: the requests that surely continue, each at its
        least progress (no draft accepted), its acceptance as if all were. A request asked for 0 that the next
        plan would have drafted for (e.g. another stopped and brought the batch under disable_by_batch_size)
        just gets no drafts that step: correct, only not optimal. With async scheduling too the next step is
        scheduled only after this one's output (needs_each_output_before_scheduling), so its plan sees these."""
        if not self.workers_propose:
            return {}
        k, budget = self.config.num_speculative_tokens, self.max_num_batched_tokens
        ending = {r.request_id for r in sampling if r.num_output_tokens + 1 >= r.max_tokens
                  or r.num_tokens + 1 >= self.max_model_len}
        following = [r for r in running if r.request_id not in ending]
        if len(following) > self.config.disable_by_batch_size:
            return {}
        decoding = {r.request_id for r in sampling}
        rows, tokens, offers = _step_rows(          # the next step's rows, as plan() will count them
            following, budget, lambda r: 1 if r.request_id in decoding else
            r.num_tokens + r.num_output_placeholders - r.num_computed_tokens,
            lambda r, num_new, left: min(k, r.max_tokens - r.num_output_tokens - 2,
                                         self.max_model_len - r.num_tokens - 1, left)
            if r.request_id in decoding else None)
        alphas = self._acceptance_if_accepted(offers, drafts)
        lengths = plan_draft_lengths(self.cost.cost, rows, max(tokens, 1), alphas, [c for _, c in offers], k)
        # plan()'s probe fires at an output count that is a multiple of PROBE_EVERY: the next step's count is this
        # one's + 1 + the drafts accepted now, any of which it may be.
        due = [cap > 0 and (r.num_output_tokens + 1 + len(drafts.get(r.request_id, ()))) // PROBE_EVERY
               * PROBE_EVERY >= r.num_output_tokens + 1 for r, cap in offers]
        return {r.request_id: n for (r, _), n in zip(offers, self._with_probes(lengths, due, rows, tokens)) if n}

    def _with_probes(self, lengths: list[int], due: list[bool], rows: int, tokens: int) -> list[int]:
        """The cost model's draft lengths, with a one-token probe for each request it gave none whose probe is
        due, while the step's draft bound holds and a sure draft would pay."""
        drafted, out = sum(lengths), []
        for n, is_due in zip(lengths, due):
            if n == 0 and is_due and drafted < self.config.num_speculative_tokens \
                    and sure_draft_pays(self.cost.cost, rows + drafted, max(tokens, 1)):
                n, drafted = 1, drafted + 1
            out.append(n)
        return out

    def _acceptance_if_accepted(self, offers: list[tuple[Request, int]], drafts: dict[str, list[int]]) -> list[float]:
        """Each request's acceptance as the next plan would see it were all of this step's drafts accepted: the
        most it can be then (record() raises it most so), so no request is asked for fewer than it would get."""
        hits, trials = self._hits, self._trials
        for request, _ in offers:
            if n := len(drafts.get(request.request_id, ())):
                hits, trials = ENGINE_DECAY * hits + n, ENGINE_DECAY * trials + n
        prior = hits / trials
        out = []
        for request, _ in offers:
            n = len(drafts.get(request.request_id, ()))
            own_hits = DECAY * request.spec_hits + n if n else request.spec_hits
            own_trials = DECAY * request.spec_trials + n if n else request.spec_trials
            out.append((own_hits + PRIOR_TRIALS * prior) / (own_trials + PRIOR_TRIALS))
        return out

    def _offer(self, request: Request) -> list[int]:
        """The drafts a request could verify this step, before the cost model's choice."""
        cfg = self.config
        room = min(cfg.num_speculative_tokens,
                   request.max_tokens - request.num_output_tokens - 1,    # tokens past max_tokens are dropped
                   self.max_model_len - request.num_tokens)                # a draft's KV slot must exist
        if room < 1:
            return []
        if cfg.method in MODEL_METHODS:      # proposed by the workers' draft model / head after the last step
            draft = request.spec_token_ids[:room]
        else:
            draft = propose_ngram(request.all_token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        # Under a grammar, only what it accepts: a draft it forbids has no chance under the masked distribution.
        return draft if request.structured is None or not draft else valid_draft(request.structured, draft)

    def drafts_for(self, request: Request, budget: int, drafted: int) -> list[int]:
        """The draft tokens to verify with this request's next token this step ([] for none); drafted: the
        draft tokens other requests got this step."""
        draft = self._plan.pop(request.request_id, [])
        return draft[:max(0, min(budget - 1, self.config.num_speculative_tokens - drafted))]

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        trials = num_accepted + (num_accepted < num_drafts)      # positions verified: up to the first rejection
        request.spec_hits = DECAY * request.spec_hits + num_accepted
        request.spec_trials = DECAY * request.spec_trials + trials
        self._hits = ENGINE_DECAY * self._hits + num_accepted
        self._trials = ENGINE_DECAY * self._trials + trials
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def maybe_log(self) -> None:
        """vLLM's periodic "SpecDecoding metrics" line, over the drafts since the last one."""
        now = time.monotonic()
        drafts, tokens, accepted, per_pos = self._logged
        if now - self._last_log < LOG_INTERVAL_S or self.num_drafts == drafts:
            return
        d_drafts, d_tokens = self.num_drafts - drafts, self.num_draft_tokens - tokens
        d_accepted = self.num_accepted_tokens - accepted
        rates = ", ".join(f"{(a - b) / d_drafts:.3f}" for a, b in zip(self.accepted_per_pos, per_pos))
        logger.info("SpecDecoding metrics: mean acceptance length %.2f, accepted %d of %d draft tokens "
                    "(acceptance rate %.1f%%), per-position acceptance rate %s",
                    1 + d_accepted / d_drafts, d_accepted, d_tokens, 100 * d_accepted / max(1, d_tokens), rates)
        self._logged = (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos))
        self._last_log = now


def _step_rows(requests: list[Request], budget: int, num_new_of: Callable[[Request], int],
               offer_of: Callable[[Request, int, int], T | None]) -> tuple[int, int, list[tuple[Request, T]]]:
    """A step's rows and its tokens (requests it takes whole) in schedule()'s order, each request within the
    budget left to it, and the offers made (offer_of(request, its new tokens, the budget left past its own
    token); None: no offer)."""
    rows = tokens = 0
    offers: list[tuple[Request, T]] = []
    for request in requests:
        num_new = num_new_of(request)
        take = min(num_new, budget - rows)
        if take <= 0:
            continue
        offer = offer_of(request, num_new, budget - rows - 1)
        if offer is not None:
            offers.append((request, offer))
        rows, tokens = rows + take, tokens + (take == num_new)
    return rows, tokens, offers
