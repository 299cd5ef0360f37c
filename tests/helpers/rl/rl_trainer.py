"""A toy RL trainer in its own process, as TRL and verl run one beside vLLM: it takes the engine's samples,
changes the weights with a few SGD steps in HF transformers (pushing the sampled tokens' likelihood down, so
the next greedy answers differ), and broadcasts every parameter over a weight sync group it hosts as rank 0.
It answers each round with the parameters' names, dtypes and shapes and with HF's greedy continuation of the
prompts under the new weights (the oracle)."""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.executor.worker.rl.weight_sync import WeightSyncGroup
from pagedserve.tests.helpers.models.tiny_models import hf_greedy

SGD_STEPS, LR = 3, 0.05


def _sgd(model: Any, sequences: list[list[int]]) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for _ in range(SGD_STEPS):
        optim.zero_grad()
        loss = sum(model(torch.tensor([seq]), labels=torch.tensor([seq])).loss for seq in sequences)
        (-loss).backward()                  # reward -1 for every sample: make them less likely
        optim.step()
    model.eval()


def trainer_main(path: str, host: str, port: int, world_size: int, prompts: list[list[int]], new_tokens: int,
                 inbox: Any, outbox: Any) -> None:
    """Rounds until inbox yields None: samples in -> (names, dtypes, shapes, oracle) out, then the broadcast;
    "again" in: the same weights broadcast once more, untrained."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    group = WeightSyncGroup(host, port, 0, world_size)
    outbox.put("joined")
    while (samples := inbox.get()) is not None:
        if samples != "again":
            _sgd(model, samples)
        params = [(n, p.detach().contiguous()) for n, p in model.named_parameters()]
        oracle = hf_greedy(model, prompts, new_tokens)
        outbox.put(([n for n, _ in params], [str(p.dtype) for _, p in params], [list(p.shape) for _, p in params],
                    oracle))
        for _, p in params:
            group.broadcast(p, src=0)
    outbox.put("done")
