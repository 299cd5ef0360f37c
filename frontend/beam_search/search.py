"""Beam search driven from the frontend, as vLLM does it: a loop of one-token steps. Each step submits every live
beam as its own request (prompt + the beam's tokens, max_tokens=1, the top logprobs of the next position), so
the engine batches them like any requests; with prefix caching on, beams reuse the KV blocks their shared
prefix already filled (the block pool's reference counts), and only each beam's partial last block is
computed again. With it off the search is the same, and every step prefills each beam whole.

The ranking is HF transformers' (generate with num_beams, do_sample=False), so the best beam equals HF's:
- of the candidates (every beam extended by one token, ranked by summed logprob), the best beam_width that do
  not end become the next running beams;
- a candidate that ends (an EOS id, or the max_tokens-th token) among the best beam_width ranks is a finished
  hypothesis scoring cum_logprob / generated_tokens ** length_penalty (generated tokens count its EOS);
  the beam_width best hypotheses are kept;
- early_stopping True ends the search once beam_width hypotheses exist; False ends it once they exist and the
  best running beam, scored at its current length, cannot beat the worst of them; "never" scores it at
  max_tokens instead (when length_penalty > 0).
(vLLM's own scoring divides by the prompt's length too and keeps every EOS candidate; HF's is the oracle here.)

One implementation serves both callers: BeamSearch is the state of one prompt's search, and run_beam_search /
arun_beam_search drive a batch of them through a step function (LLM's generate, or the async client).
"""
from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.common.errors import RequestError
from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.client.outputs import Logprob, RequestOutput

StepLogprobs = dict[int, Logprob]
# Runs one step: the token ids of every live beam (prompt included) -> the logprobs of each one's next token.
StepFn = Callable[[list[list[int]]], list[StepLogprobs]]
AsyncStepFn = Callable[[list[list[int]]], Awaitable[list[StepLogprobs]]]


@dataclass
class BeamSearchSequence:
    """One returned beam, shaped like vLLM's: tokens include the prompt; logprobs has, for each generated
    token, the top logprobs of its position. score is pagedserve's addition: the rank it was sorted by."""
    tokens: list[int]
    logprobs: list[StepLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None       # "stop": it ended with an EOS id; "length": at max_tokens
    stop_reason: int | None = None         # the EOS id that ended it
    score: float = 0.0
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The sequences of one prompt, best first."""
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[StepLogprobs]
    cum_logprob: float

    def extend(self, token: int, logprobs: StepLogprobs, cum_logprob: float) -> "_Beam":
        return _Beam(self.tokens + [token], self.logprobs + [logprobs], cum_logprob)


def beam_search_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """HF's score of a finished hypothesis: its summed logprob over its generated length (EOS included)."""
    try:
        denominator = float(num_generated) ** length_penalty
    except OverflowError:           # a huge length_penalty: HF's float tensors give inf, the score 0
        denominator = math.inf
    return cum_logprob / denominator if denominator > 0 else -math.inf


def step_sampling_params(params: BeamSearchParams, num_eos: int) -> SamplingParams:
    """The engine request of one beam's step: one greedy token with the top logprobs the ranking needs (raw
    logprobs: the model's distribution, whatever the sampling settings)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=params.step_logprobs(num_eos),
                          output_kind=RequestOutputKind.FINAL_ONLY)


def step_logprobs(output: RequestOutput) -> StepLogprobs:
    """The logprobs of the one token a step request generated."""
    logprobs = output.outputs[0].logprobs
    if not logprobs:
        raise RuntimeError(f"beam search step {output.request_id} returned no logprobs")
    return logprobs[0]


class BeamSearch:
    """The search of one prompt. Call beams_to_run(), run those beams one token, then advance() with their
    logprobs, until done; then result()."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 max_model_len: int) -> None:
        self.prompt = list(prompt_token_ids)
        if not self.prompt:
            raise RequestError("prompt", "prompt must not be empty")
        if len(self.prompt) >= max_model_len:
            raise RequestError("prompt", f"prompt has {len(self.prompt)} tokens: at least max_model_len "
                               f"({max_model_len}), leaving no room to generate")
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.max_new = min(params.max_tokens, max_model_len - len(self.prompt))
        self.top_k = params.step_logprobs(len(self.eos))
        self.running: list[_Beam] = [_Beam([], [], 0.0)]
        self.finished: list[tuple[float, _Beam]] = []      # best first, at most beam_width
        self.num_generated = 0
        self.improvable = True      # HF's early-stop heuristic: can a running beam still beat the finished?
        self.done = False

    def beams_to_run(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + beam.tokens for beam in self.running]

    def advance(self, logprobs: Sequence[StepLogprobs]) -> None:
        """Take the next-token logprobs of every running beam (in beams_to_run's order)."""
        width = self.params.beam_width
        self.num_generated += 1
        at_max = self.num_generated >= self.max_new
        may_finish = self.improvable and not (len(self.finished) >= width and self.params.early_stopping is True)
        running: list[_Beam] = []
        new_finished: list[tuple[float, _Beam]] = []
        for rank, (cum, beam, token, step) in enumerate(self._candidates(logprobs)):
            if rank >= width and len(running) >= width:
                break
            if not at_max and token not in self.eos:
                if len(running) < width:
                    running.append(beam.extend(token, step, cum))
            elif rank < width and may_finish:
                # Only the best beam_width ranks may finish: the rest only back the running beams up (HF).
                score = beam_search_score(cum, self.num_generated, self.params.length_penalty)
                new_finished.append((score, beam.extend(token, step, cum)))
        self.finished = sorted(self.finished + new_finished, key=lambda f: -f[0])[:width]
        self.running = running
        self._update_heuristic()
        self.done = (at_max or not running or not self.improvable
                     or (len(self.finished) >= width and self.params.early_stopping is True))

    def _candidates(self, logprobs: Sequence[StepLogprobs]) -> list[tuple[float, _Beam, int, StepLogprobs]]:
        """Every running beam extended by each of its top tokens, best summed logprob first."""
        if len(logprobs) != len(self.running):
            raise RuntimeError(f"beam search step got {len(logprobs)} results for {len(self.running)} beams")
        cands = []
        for beam, step in zip(self.running, logprobs):
            # A sampled token outside the top k may be listed too: the ranking takes the top k only.
            top = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:self.top_k]
            cands += [(beam.cum_logprob + lp.logprob, beam, token, step) for token, lp in top]
        cands.sort(key=lambda c: -c[0])      # stable: ties keep beam order, as HF's flat top-k does
        return cands

    def _update_heuristic(self) -> None:
        width, penalty = self.params.beam_width, self.params.length_penalty
        if not self.running or len(self.finished) < width:
            return
        length = self.max_new if self.params.early_stopping == "never" and penalty > 0 else self.num_generated
        best_possible = beam_search_score(self.running[0].cum_logprob, length, penalty)
        if not best_possible > self.finished[-1][0]:
            self.improvable = False

    def result(self) -> list[BeamSearchSequence]:
        """The finished beams, best first (text left for the caller to decode)."""
        return [self._sequence(score, beam) for score, beam in self.finished]

    def _sequence(self, score: float, beam: _Beam) -> BeamSearchSequence:
        last = beam.tokens[-1] if beam.tokens else None
        stopped = last is not None and last in self.eos
        return BeamSearchSequence(tokens=self.prompt + beam.tokens, logprobs=beam.logprobs,
                                  cum_logprob=beam.cum_logprob, finish_reason="stop" if stopped else "length",
                                  stop_reason=last if stopped else None, score=score,
                                  num_prompt_tokens=len(self.prompt))


def _batch(searches: Sequence[BeamSearch]) -> list[list[int]]:
    return [tokens for search in searches for tokens in search.beams_to_run()]


def _deliver(searches: Sequence[BeamSearch], results: list[StepLogprobs]) -> None:
    start = 0
    for search in searches:
        n = len(search.running) if not search.done else 0
        if n:
            search.advance(results[start:start + n])
        start += n


def run_beam_search(searches: Sequence[BeamSearch], step: StepFn) -> None:
    """Run every search to its end, all live beams of all of them in each step's one batch."""
    while batch := _batch(searches):
        _deliver(searches, step(batch))


async def arun_beam_search(searches: Sequence[BeamSearch], step: AsyncStepFn) -> None:
    """run_beam_search for an async step function (the server's)."""
    while batch := _batch(searches):
        _deliver(searches, await step(batch))


def output_text_ids(seq: BeamSearchSequence, include_stop_str_in_output: bool) -> list[int]:
    """The generated ids a response's text shows: a beam's closing EOS only with include_stop_str_in_output."""
    ids = seq.output_token_ids
    return ids if include_stop_str_in_output or seq.finish_reason != "stop" else ids[:-1]
