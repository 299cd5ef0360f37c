"""Build the Sampler's per-row tensors from the requests that sample this step."""
from __future__ import annotations

import torch

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.sample.sampling_metadata import SamplingMetadata


def build_sampling_metadata(states: list[CachedRequestState], eos_token_ids: tuple[int, ...],
                            device: torch.device) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    greedy = [p.is_greedy for p in params]
    all_greedy = all(greedy)
    meta = SamplingMetadata(
        temperature=None if all_greedy else _tensor([0.0 if g else p.temperature for p, g in zip(params, greedy)],
                                                    device),
        all_greedy=all_greedy, all_random=not any(greedy))
    if not meta.all_greedy:
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = _tensor([p.top_p for p in params], device)
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        if any(p.min_p > 0 for p in params):
            meta.min_p = _tensor([p.min_p for p in params], device)
        meta.generators = {row: g for row, s in enumerate(states) if (g := s.step_generator()) is not None}
    penalised = [bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0) for p in params]
    if any(penalised):
        meta.no_penalties = False
        meta.presence_penalties = _tensor([p.presence_penalty for p in params], device)
        meta.frequency_penalties = _tensor([p.frequency_penalty for p in params], device)
        meta.repetition_penalties = _tensor([p.repetition_penalty for p in params], device)
        # Only penalised rows' ids: another row's latest id may still be on the device (async scheduling),
        # and with no penalty its counts change nothing.
        meta.prompt_token_ids = [s.token_ids[:s.num_prompt_tokens] if pen else [] for s, pen in zip(states, penalised)]
        meta.output_token_ids = [s.output_token_ids if pen else [] for s, pen in zip(states, penalised)]
    for row, (state, p) in enumerate(zip(states, params)):
        if len(state.output_token_ids) < p.min_tokens:
            blocked = list(p.stop_token_ids or ())
            if not p.ignore_eos:
                blocked += eos_token_ids
            if blocked:
                meta.min_tokens_blocked[row] = blocked
    meta.constrained = [(row, s.constraints, s.output_token_ids) for row, s in enumerate(states)
                        if s.constraints is not None]
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(wanted) if wanted else None
    return meta


def _tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
