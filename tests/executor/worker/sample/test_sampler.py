"""Sampler semantics on hand-made logits: greedy, seeds, truncations, penalties, min_tokens, logprobs.

Statistical tests run under fixed seeds inside fork_rng, so they are deterministic and leave the
global RNG as they found it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.sample.sampler import Sampler, apply_penalties, sampling_probs
from pagedserve.executor.worker.sample.sampling_inputs import build_sampling_metadata
from pagedserve.executor.worker.sample.sampling_metadata import SamplerOutput, SamplingMetadata
from pagedserve.ipc.messages import NewRequestData

V = 50
CPU = torch.device("cpu")
sampler = Sampler()


def state(params: SamplingParams, prompt: Sequence[int] = (1, 2, 3), outputs: Sequence[int] = (),
          rid: str = "r") -> CachedRequestState:
    return CachedRequestState.from_new(NewRequestData(rid, list(prompt), list(outputs), params, [0], 0))


def meta_for(states: list[CachedRequestState], eos: tuple[int, ...] = (0,)) -> SamplingMetadata:
    return build_sampling_metadata(states, eos, CPU)


def sample(logits: torch.Tensor, states: list[CachedRequestState], eos: tuple[int, ...] = (0,)) -> SamplerOutput:
    return sampler(logits, meta_for(states, eos))


def frequencies(logits_row: torch.Tensor, params: SamplingParams, draws: int = 4000,
                seed: int = 0) -> torch.Tensor:
    """Empirical distribution of `draws` independent unseeded rows holding the same logits."""
    states = [state(params, rid=str(i)) for i in range(draws)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = sample(logits_row.expand(draws, -1).clone(), states).sampled_token_ids
    return torch.bincount(out, minlength=logits_row.numel()).float() / draws


def renormalized(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


# ------------------------------------------------------------------------------------------------
# Greedy and basic contract
# ------------------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    greedy = sample(logits, [state(SamplingParams(temperature=0))] * 6).sampled_token_ids
    assert torch.equal(greedy, logits.argmax(-1))
    topk1 = sample(logits, [state(SamplingParams(temperature=1.0, top_k=1), rid=str(i)) for i in range(6)])
    assert torch.equal(topk1.sampled_token_ids, greedy)


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    rows = [state(SamplingParams(temperature=0 if i % 2 == 0 else 1.5, top_p=0.9), rid=str(i)) for i in range(6)]
    out = sample(logits, rows).sampled_token_ids
    assert torch.equal(out[::2], logits[::2].argmax(-1))


def test_output_dtype_and_caller_logits_untouched() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    logits[:, 0] = 10.0     # EOS is the argmax and gets blocked below
    before = logits.clone()
    params = SamplingParams(temperature=0.7, min_tokens=3, repetition_penalty=1.3, top_k=5, min_p=0.05)
    out = sample(logits, [state(params, rid=str(i), outputs=[4, 4]) for i in range(3)])
    assert torch.equal(logits, before)
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape == (3,)
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None
    half = sample(logits.bfloat16(), [state(SamplingParams(temperature=0))]).sampled_token_ids
    assert half.dtype == torch.int64


# ------------------------------------------------------------------------------------------------
# Seeds
# ------------------------------------------------------------------------------------------------

def run_seeded(row: int, batch: int, steps: int = 20) -> list[int]:
    """Tokens of one seeded request placed at `row` among other seeded and unseeded random requests."""
    logits_gen = torch.Generator().manual_seed(123)
    target = state(SamplingParams(temperature=1.0, seed=7), rid="target")
    others = [state(SamplingParams(temperature=1.0, seed=None if i % 2 else 99 + i, top_k=10 * (i % 3)),
                    rid=f"o{i}") for i in range(batch - 1)]
    rows = others[:row] + [target] + others[row:]
    tokens = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(batch)    # the unseeded neighbours differ between compositions
        for _ in range(steps):
            logits = torch.randn(batch, V)
            logits[row] = torch.randn(V, generator=logits_gen)
            out = sample(logits, rows).sampled_token_ids.tolist()
            for s, t in zip(rows, out):
                s.append(t)      # the engine appends, and the next step re-seeds from the new length
            tokens.append(out[row])
    return tokens


def test_seeded_rows_reproducible_across_batch_compositions() -> None:
    alone = run_seeded(0, 1)
    assert run_seeded(0, 5) == alone
    assert run_seeded(3, 8) == alone
    assert len(set(alone)) > 3     # it really samples


def test_different_seeds_differ() -> None:
    logits = torch.zeros(2, V)     # uniform: every token equally likely
    rows = [state(SamplingParams(seed=s), rid=str(s)) for s in (1, 2)]
    seqs: list[list[int]] = [[], []]
    for _ in range(10):
        out = sample(logits, rows).sampled_token_ids.tolist()
        for s, seq, t in zip(rows, seqs, out):
            s.append(t)
            seq.append(t)
    assert seqs[0] != seqs[1]


# ------------------------------------------------------------------------------------------------
# Truncations and temperature
# ------------------------------------------------------------------------------------------------

LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
PROBS = LOGITS.softmax(-1)


def check_distribution(params: SamplingParams, keep: torch.Tensor, atol: float = 0.03) -> None:
    """Exact support and renormalized probabilities, both from the hook and from real draws."""
    want = renormalized(PROBS, keep)
    meta = meta_for([state(params)])
    torch.testing.assert_close(sampling_probs(LOGITS.unsqueeze(0), meta)[0], want)
    f = frequencies(LOGITS, params)
    assert f[~keep].sum() == 0
    assert (f[keep] > 0).all()
    torch.testing.assert_close(f, want, atol=atol, rtol=0)


def test_top_k_support_and_distribution() -> None:
    check_distribution(SamplingParams(top_k=3), torch.arange(8) < 3)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    two = float(PROBS[:2].sum())
    check_distribution(SamplingParams(top_p=two + 1e-3), torch.arange(8) < 3)
    check_distribution(SamplingParams(top_p=two - 1e-3), torch.arange(8) < 2)
    # Below the top token's own mass, the top token still stays.
    check_distribution(SamplingParams(top_p=float(PROBS[0]) / 2), torch.arange(8) < 1)


def test_top_p_applies_to_top_k_renormalized_mass() -> None:
    top4 = renormalized(PROBS, torch.arange(8) < 4)
    # p lies between the top two tokens' mass before and after top-k renormalization: top-p on the
    # full distribution would keep 3 tokens, on the top-k one (vLLM's order) it keeps 2.
    p = (float(PROBS[:2].sum()) + float(top4[:2].sum())) / 2
    assert float(PROBS[:2].sum()) < p < float(top4[:2].sum())
    check_distribution(SamplingParams(top_k=4, top_p=p), torch.arange(8) < 2)


def test_min_p_support_and_distribution() -> None:
    check_distribution(SamplingParams(min_p=0.3), PROBS >= 0.3 * PROBS.max())


def test_temperature_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    f = frequencies(logits, SamplingParams(temperature=0.5), draws=6000)
    torch.testing.assert_close(f, (logits / 0.5).softmax(-1), atol=0.025, rtol=0)


def test_temperature_scales_before_min_p() -> None:
    # At T=2 the distribution flattens, so more tokens pass the same min_p threshold.
    hot = (LOGITS / 2).softmax(-1)
    keep = hot >= 0.3 * hot.max()
    assert keep.sum() > (PROBS >= 0.3 * PROBS.max()).sum()
    meta = meta_for([state(SamplingParams(temperature=2.0, min_p=0.3))])
    torch.testing.assert_close(sampling_probs(LOGITS.unsqueeze(0), meta)[0], renormalized(hot, keep))


# ------------------------------------------------------------------------------------------------
# Penalties
# ------------------------------------------------------------------------------------------------

def test_penalties_follow_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    s = state(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              prompt=[0], outputs=[1, 3, 3])
    got = apply_penalties(logits.clone(), meta_for([s], ()))
    # token 0: prompt only -> repetition only (positive: divided)
    # token 1: output once, negative -> multiplied by 2, then -0.5*1 - 0.25
    # token 3: output twice, positive -> divided by 2, then -0.5*2 - 0.25
    want = torch.tensor([[1.0, -2.0 - 0.5 - 0.25, 0.5, 0.5 - 1.0 - 0.25, 3.0]])
    torch.testing.assert_close(got, want)


def reference_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                        outputs: list[list[int]]) -> torch.Tensor:
    """The definitions, token by token."""
    want = logits.clone()
    for row, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
        for tok in set(prompt) | set(out):
            x = want[row, tok].item()
            want[row, tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for tok in set(out):
            want[row, tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
    return want


def test_penalties_batch_matches_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 20, generator=gen) * 3
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=-0.2),
              SamplingParams(),   # no penalties: must come back unchanged
              SamplingParams(repetition_penalty=0.7, frequency_penalty=-1.0),
              SamplingParams(presence_penalty=2.0)]
    prompts = [torch.randint(0, 20, (n,), generator=gen).tolist() for n in (7, 3, 1, 12)]
    outputs = [torch.randint(0, 20, (n,), generator=gen).tolist() for n in (9, 0, 5, 2)]
    states = [state(p, prompt=pr, outputs=o, rid=str(i))
              for i, (p, pr, o) in enumerate(zip(params, prompts, outputs))]
    got = apply_penalties(logits, meta_for(states, ()))
    torch.testing.assert_close(got, reference_penalties(logits, params, prompts, outputs))
    torch.testing.assert_close(got[1], logits[1])


def greedy_token(logits: list[float], prompt: list[int], outputs: list[int], **penalties: float) -> int:
    params = SamplingParams(temperature=0, **penalties)
    return sample(torch.tensor([logits]), [state(params, prompt=prompt, outputs=outputs)], eos=()).sampled_token_ids.item()


def test_penalties_flip_greedy_choice_exactly_as_defined() -> None:
    # Repetition sees the prompt: 2.0 / 2 = 1.0 < 1.5; negative logits are multiplied: -1 * 2 < -1.5.
    assert greedy_token([2.0, 1.5], [0], [], repetition_penalty=2.0) == 1
    assert greedy_token([2.0, 1.5], [0], [], repetition_penalty=1.3) == 0      # 1.54 > 1.5
    assert greedy_token([-1.0, -1.5], [0], [], repetition_penalty=2.0) == 1
    # Frequency and presence ignore the prompt...
    assert greedy_token([2.0, 1.5], [0], [], frequency_penalty=2.0, presence_penalty=2.0) == 0
    # ...and count outputs: 2.0 - 0.2 * 3 = 1.4 < 1.5, but 2.0 - 0.2 * 2 = 1.6 > 1.5.
    assert greedy_token([2.0, 1.5, 0.0], [2], [0, 0, 0], frequency_penalty=0.2) == 1
    assert greedy_token([2.0, 1.5, 0.0], [2], [0, 0], frequency_penalty=0.2) == 0
    # Presence is paid once however often the token appeared.
    assert greedy_token([2.0, 1.5, 0.0], [2], [0, 0, 0], presence_penalty=0.4) == 0
    assert greedy_token([2.0, 1.5, 0.0], [2], [0], presence_penalty=0.6) == 1


# ------------------------------------------------------------------------------------------------
# min_tokens
# ------------------------------------------------------------------------------------------------

def test_min_tokens_blocks_eos_and_stop_ids_greedy() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sample(logits, [state(params, outputs=[3])], eos=(0,)).sampled_token_ids.item() == 2
    assert sample(logits, [state(params, outputs=[3, 3])], eos=(0,)).sampled_token_ids.item() == 0
    ignore = params.clone(ignore_eos=True)
    assert sample(logits, [state(ignore, outputs=[3])], eos=(0,)).sampled_token_ids.item() == 0


def test_min_tokens_never_samples_blocked_ids() -> None:
    logits = torch.zeros(V)
    logits[0], logits[1] = 8.0, 7.0     # EOS and a stop id hold almost all the mass
    params = SamplingParams(temperature=1.5, min_tokens=5, stop_token_ids=[1])
    f = frequencies(logits, params, draws=3000)
    assert f[0] == 0 and f[1] == 0
    # Blocking is per row: once min_tokens is reached, the same logits give EOS most of the time
    # (p = 0.574 each; over 400 seeded rows the share sits 5 standard deviations above 0.45).
    torch.manual_seed(0)
    done = sample(logits.expand(400, -1), [state(params, outputs=[3] * 5, rid=str(i)) for i in range(400)])
    assert (done.sampled_token_ids == 0).float().mean() > 0.45


# ------------------------------------------------------------------------------------------------
# Logprobs
# ------------------------------------------------------------------------------------------------

def test_logprobs_are_raw_and_ranked() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    params = SamplingParams(temperature=2.0, logprobs=2, presence_penalty=1.0, seed=3)
    out = sample(logits, [state(params, outputs=[1])])
    raw = torch.log_softmax(logits, -1)
    tok = out.sampled_token_ids.item()
    assert out.logprob_token_ids[0, 0].item() == tok
    assert abs(out.logprobs[0, 0].item() - raw[0, tok].item()) < 1e-6
    assert out.logprob_token_ids[0, 1:].tolist() == [1, 2]
    torch.testing.assert_close(out.logprobs[0, 1:], raw[0, [1, 2]])
    assert out.sampled_ranks.item() == 1 + int((raw[0] > raw[0, tok]).sum())


def test_logprobs_batch_topk_and_ranks() -> None:
    n, k = 64, 3
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(9))
    # A hot temperature, a penalty and min_tokens all change the sampled token, never the logprobs.
    rows = [state(SamplingParams(temperature=3.0, logprobs=k if i % 2 else 1, repetition_penalty=1.5,
                                 min_tokens=2, seed=i), prompt=[int(logits[i].argmax())], rid=str(i))
            for i in range(n)]
    with torch.random.fork_rng(devices=[]):
        out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    tok = out.sampled_token_ids
    top = raw.topk(k, dim=-1)
    assert out.logprobs.shape == (n, k + 1) and out.logprob_token_ids.shape == (n, k + 1)
    assert torch.equal(out.logprob_token_ids[:, 0], tok)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, tok.unsqueeze(1)).squeeze(1))
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    ranks = torch.tensor([1 + int((raw[i] > raw[i, t]).sum()) for i, t in enumerate(tok.tolist())])
    assert torch.equal(out.sampled_ranks, ranks)
    assert (ranks > 1).any()     # the temperature really moved samples off the top token
    assert not (tok == 0).any()  # EOS stayed blocked even though logprobs are raw


def test_logprobs_zero_gives_only_sampled_column() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = sample(logits, [state(SamplingParams(temperature=0, logprobs=0), prompt=[1])], eos=())
    assert out.logprob_token_ids.tolist() == [[1]]
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[:, [1]])
    assert out.sampled_ranks.tolist() == [1]
