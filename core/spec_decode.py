"""The engine core's side of speculative decoding: which requests get drafts this step, and the counters.

A request gets drafts when it decodes (its one new token is its last sampled one), at most
`disable_by_batch_size` requests run, and its recent drafts were accepted often enough (below); under a
grammar, the drafts' longest prefix the grammar accepts (the step then carries a mask row per position). One step verifies at
most `num_speculative_tokens` drafts in all, shared out in running order: a verify pass stops being nearly
free once its rows make the step compute-bound (on the 2-core CPU a 6-token step of the embedded model cost
~2.5x a 1-token one), so under load the drafts shrink to nothing rather than slow every request
(docs/speculative_decoding.md). Drafts never reach past max_tokens or max_model_len, nor past the step's
token budget.
"""
from __future__ import annotations

import logging
import math
import time

from pagedserve.common.speculative import MODEL_METHODS, SpeculativeConfig
from pagedserve.core.ngram_proposer import propose_ngram
from pagedserve.core.request import Request
from pagedserve.core.structured_output.request import valid_draft

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0     # the acceptance log line, at most this often (vLLM logs its stats every 10 s too)
# A request's recent acceptance: an average over its last verify passes (each weighs ACCEPTANCE_WEIGHT).
# Drafts it keeps rejecting are verify rows for nothing, so its drafts shrink with that rate, and below
# MIN_ACCEPTANCE stop, but for a one-token probe every PROBE_EVERY output tokens (a request that starts
# copying its input gets its drafts back).
ACCEPTANCE_WEIGHT = 0.3
MIN_ACCEPTANCE = 0.15
PROBE_EVERY = 8


class SpecDecodeState:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self._logged = (0, 0, 0, [0] * config.num_speculative_tokens)   # totals at the last log line
        self._last_log = time.monotonic()

    def drafts_for(self, request: Request, num_running: int, budget: int, drafted: int) -> list[int]:
        """The draft tokens to verify with this request's next token ([] for none); drafted: the draft
        tokens other requests got this step."""
        cfg = self.config
        if num_running > cfg.disable_by_batch_size or request.num_output_placeholders:
            return []
        room = min(cfg.num_speculative_tokens - drafted, budget - 1,
                   request.max_tokens - request.num_output_tokens - 1,    # tokens past max_tokens are dropped
                   self.max_model_len - request.num_tokens)                # a draft's KV slot must exist
        if request.spec_acceptance < MIN_ACCEPTANCE:
            room = min(room, 1 if request.num_output_tokens % PROBE_EVERY == 0 else 0)
        room = min(room, math.ceil(cfg.num_speculative_tokens * request.spec_acceptance))
        if room < 1:
            return []
        if cfg.method in MODEL_METHODS:      # proposed by the workers' draft model / head after the last step
            draft = request.spec_token_ids[:room]
        else:
            draft = propose_ngram(request.all_token_ids, room, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        # Under a grammar, only what it accepts: a draft it forbids has no chance under the masked distribution.
        return draft if request.structured is None or not draft else valid_draft(request.structured, draft)

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.spec_acceptance += ACCEPTANCE_WEIGHT * (num_accepted / num_drafts - request.spec_acceptance)
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
