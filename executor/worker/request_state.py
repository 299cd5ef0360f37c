"""What a worker remembers about each request in its persistent batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.executor.worker.logit_constraints import RowConstraints
from pagedserve.ipc.messages import NewRequestData

_MASK63 = (1 << 63) - 1


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]              # prompt + outputs, grows as this worker samples
    num_prompt_tokens: int
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = field(default=None, repr=False)
    constraints: RowConstraints | None = field(default=None, repr=False)   # logit_bias, allowed ids, bad words

    @classmethod
    def from_new(cls, data: NewRequestData) -> "CachedRequestState":
        params = data.sampling_params
        generator = torch.Generator() if params.seed is not None and not params.is_greedy else None
        return cls(req_id=data.req_id, token_ids=list(data.prompt_token_ids) + list(data.output_token_ids),
                   num_prompt_tokens=len(data.prompt_token_ids), output_token_ids=list(data.output_token_ids),
                   sampling_params=params, block_ids=list(data.block_ids),
                   num_computed_tokens=data.num_computed_tokens, generator=generator,
                   constraints=RowConstraints.of(params))

    def step_generator(self) -> torch.Generator | None:
        """The seeded generator for the next sampled token.

        Re-seeded from (seed, output position) every step, so the draw for the k-th output token is
        the same whatever else is in the batch and even after preemption rebuilt this state.
        """
        if self.generator is None:
            return None
        seed = self.sampling_params.seed or 0
        self.generator.manual_seed((seed * 1_000_003 + len(self.output_token_ids)) & _MASK63)
        return self.generator

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
