"""What a worker remembers about each request in its persistent batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.common.params.pooling_params import PoolingParams
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.executor.worker.sample.logit_constraints import RowConstraints
from pagedserve.ipc.messages import MultiModalFeature, NewRequestData

if TYPE_CHECKING:
    from pagedserve.executor.worker.multimodal.mrope import MRopeRows

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
    # token_ids index -> (the launched step that samples it, a step_output.PendingStep, and its row there): ids
    # still on the device. The next step reads such an id from the device (step_buffers.apply_pending); its
    # host value is -1 until that step's output is taken (fill). Typed Any: step_output imports this module.
    pending: dict[int, tuple[Any, int]] = field(default_factory=dict, repr=False)
    lora_int_id: int = 0              # its LoRA adapter (0: the base model)
    pooling_params: PoolingParams | None = None     # a pooling request: pooled, never sampled
    mm_features: list[MultiModalFeature] = field(default_factory=list)   # its images' placeholder runs
    mrope: MRopeRows | None = None    # an M-RoPE model's positions of a request with vision items

    @classmethod
    def from_new(cls, data: NewRequestData) -> "CachedRequestState":
        params = data.sampling_params
        generator = torch.Generator() if params.seed is not None and not params.is_greedy else None
        return cls(req_id=data.req_id, token_ids=list(data.prompt_token_ids) + list(data.output_token_ids),
                   num_prompt_tokens=len(data.prompt_token_ids), output_token_ids=list(data.output_token_ids),
                   sampling_params=params, block_ids=list(data.block_ids),
                   num_computed_tokens=data.num_computed_tokens, generator=generator,
                   constraints=RowConstraints.of(params), lora_int_id=data.lora_int_id,
                   pooling_params=data.pooling_params, mm_features=list(data.mm_features or ()))

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

    def append_pending(self, step: Any, row: int) -> None:
        """A token sampled by a step still on the device: counted at once (positions, seeds, min_tokens),
        its value filled when the step's output is taken."""
        self.pending[len(self.token_ids)] = (step, row)
        self.append(-1)

    def fill(self, index: int, token_id: int) -> None:
        self.token_ids[index] = token_id
        self.output_token_ids[index - self.num_prompt_tokens] = token_id
        del self.pending[index]

    @property
    def needs_token_values(self) -> bool:
        """Sampling reads this request's earlier output ids themselves (penalties, bad words), not only
        their count: a pending one must be on the host before the request samples again."""
        p = self.sampling_params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                    or (self.constraints is not None and self.constraints.bad_words))
