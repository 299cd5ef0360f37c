"""The rejection sampler (executor/worker/spec_decode/rejection_sampler.py): greedy drafts accepted exactly while they are
the argmax, and sampled rows distributed as the target model, checked statistically with a bound that a
biased sampler fails."""
from __future__ import annotations

import torch

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.executor.worker.spec_decode import rejection_sampler
from pagedserve.executor.worker.spec_decode.rejection_sampler import verify_drafts
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.sample.sampler import exponential_race

V = 8


def _state(params: SamplingParams, outputs: list[int] | None = None) -> CachedRequestState:
    outputs = outputs or []
    return CachedRequestState(req_id="r", token_ids=[1, 2, 3] + outputs, num_prompt_tokens=3,
                              output_token_ids=list(outputs), sampling_params=params, block_ids=[0],
                              num_computed_tokens=3, generator=torch.Generator() if params.seed is not None else None)


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.full((4, V), -5.0)
    for pos, best in enumerate([4, 6, 1, 2]):
        logits[pos, best] = 5.0
    params = SamplingParams(temperature=0.0)
    rows = verify_drafts(logits, [_state(params)], [[4, 6, 5]], (0,), torch.device("cpu"))
    assert (rows[0].accepted, rows[0].token) == ([4, 6], 1)          # 5 is rejected: the argmax 1 follows
    rows = verify_drafts(logits, [_state(params)], [[4, 6, 1]], (0,), torch.device("cpu"))
    assert (rows[0].accepted, rows[0].token) == ([4, 6, 1], 2)       # all accepted: the bonus token


def test_each_position_sees_the_drafts_before_it():
    """A frequency penalty at position 1 must count the draft of position 0 as already output."""
    logits = torch.zeros(2, V)
    logits[:, 3] = 2.0
    logits[:, 5] = 1.5
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    rows = verify_drafts(logits, [_state(params)], [[3]], (0,), torch.device("cpu"))
    assert rows[0].accepted == [3] and rows[0].token == 5           # 2.0 - 1 < 1.5 once 3 was output


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def _total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((_frequencies(samples) - probs.double()).abs().sum())


# E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 sqrt(V / N): 0.010 at N = 20000, V = 8. Four times that
# stays clear of chance; a sampler that draws the recovered token from p instead of norm(p - q) is off by
# p(d) * (1 - p(d)) on the draft's token (0.16 here).
N, BOUND = 20000, 0.04


def _first_tokens(drafts: list[int], logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample N rows with the same drafts; returns each row's first emitted token and second one (where the
    first draft was accepted)."""
    k = len(drafts)
    rows = verify_drafts(logits.repeat(N, 1), [_state(params) for _ in range(N)], [drafts] * N, (0,),
                         torch.device("cpu"))
    first = torch.tensor([(r.accepted + [r.token])[0] for r in rows])
    second = torch.tensor([(r.accepted + [r.token])[1] for r in rows if r.accepted[:1] == drafts[:1]])
    assert k >= 1
    return first, second


def test_sampled_rows_follow_the_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6)
    from pagedserve.executor.worker.sample.sampler import sampling_probs
    from pagedserve.executor.worker.sample.sampling_inputs import build_sampling_metadata
    target = sampling_probs(logits, build_sampling_metadata([_state(params)] * 3, (0,), torch.device("cpu")))
    draft = [int(target[0].argsort()[-2]), int(target[1].argmax())]   # a likely but not certain first draft
    first, second = _first_tokens(draft, logits, params)
    assert _total_variation(first, target[0]) < BOUND
    assert second.numel() > 2000 and _total_variation(second, target[1]) < BOUND


def test_the_bound_catches_a_biased_sampler(monkeypatch):
    """The same check fails a sampler that, on rejection, draws from p itself (the draft's token twice)."""
    torch.manual_seed(1)
    logits = torch.randn(2, V) * 1.5
    params = SamplingParams(temperature=1.0)
    probs = torch.softmax(logits, -1)
    draft = [int(probs[0].argmax())]

    def biased(probs_rows, draft_ids, generators):
        for j, d in enumerate(draft_ids):
            if torch.rand(1).item() < probs_rows[j, d].item():
                continue
            return draft_ids[:j], int(exponential_race(probs_rows[j:j + 1], {})[0])    # p, not p without d
        return draft_ids, int(exponential_race(probs_rows[len(draft_ids):], {})[0])
    monkeypatch.setattr(rejection_sampler, "_rejection", biased)
    first, _ = _first_tokens(draft, logits, params)
    assert _total_variation(first, probs[0]) > BOUND


def test_a_seeded_row_draws_the_same_whatever_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = verify_drafts(logits, [_state(params)], [[1, 2]], (0,), torch.device("cpu"))[0]
    other = SamplingParams(temperature=1.0)
    mixed = verify_drafts(torch.cat([torch.randn(2, V), logits]), [_state(other), _state(params)], [[5], [1, 2]],
                          (0,), torch.device("cpu"))[1]
    assert (alone.accepted, alone.token) == (mixed.accepted, mixed.token)


def test_a_seeded_row_gets_the_same_tokens_whatever_its_drafts():
    """The engine picks a step's draft lengths from timings (core/spec_decode/cost_model.py): a seeded request's tokens
    must not depend on them. Every draft length, accepted or not, emits a prefix of the one sequence that
    one-token steps sample."""
    torch.manual_seed(3)
    logits = torch.randn(5, V)
    params = SamplingParams(temperature=1.0, seed=77)

    def emitted(draft: list[int]) -> list[int]:
        row = verify_drafts(logits[:len(draft) + 1], [_state(params)], [draft], (0,), torch.device("cpu"))[0]
        return row.accepted + [row.token]
    steps = emitted([])                                   # one-token steps: each sample fed back as a draft
    while len(steps) < 5:
        steps = emitted(steps)
    for draft in ([], [0], [steps[0], 7], steps[:3], [steps[0], steps[1], 0, 0], steps[:4]):
        got = emitted(draft)
        assert got == steps[:len(got)], (draft, got, steps)
