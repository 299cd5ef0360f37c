"""What the mixture-of-experts families share on top of Llama: loading expert tensors into stacked weights.

The decoder layers are Llama's with an expert block as the MLP (LlamaForCausalLM.make_mlp). Expert tensors
(per expert or stacked, layers/fused_moe.py) go to their FusedMoE; everything else loads as for Llama.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.executor.model.layers.fused_moe import FusedMoE, expert_shard
from pagedserve.executor.model.models.llama import LlamaForCausalLM

_STACKED_PARAMS = (".experts.w13_weight", ".experts.w2_weight")


class MoeForCausalLM(LlamaForCausalLM):
    # checkpoint names of each expert's (gate, up, down) tensors
    expert_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # the expert block's name in the checkpoint (ours is always the decoder layer's `mlp`)
    checkpoint_block = "mlp"

    def to_checkpoint(self, name: str) -> str:
        return name.replace(".mlp.", f".{self.checkpoint_block}.")

    def from_checkpoint(self, name: str) -> str:
        return name.replace(f".{self.checkpoint_block}.", ".mlp.")

    def _experts(self) -> dict[str, FusedMoE]:
        """Checkpoint prefix (`...experts`) -> the FusedMoE that loads it."""
        return {self.to_checkpoint(f"{name}"): module for name, module in self.named_modules()
                if isinstance(module, FusedMoE)}

    def stream_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = self._experts()
        loaded: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                shard = expert_shard(name)
                if shard is None or shard[0] not in experts:
                    yield self.from_checkpoint(name), tensor
                    continue
                prefix, shard_id, expert = shard
                moe = experts[prefix]
                try:
                    moe.weight_loader(moe.w2_weight if shard_id == "w2" else moe.w13_weight, tensor, shard_id,
                                      expert)
                except ValueError as exc:   # the layer knows the shapes, the caller the tensor's name
                    raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
                loaded.update([name] if expert is not None else self._covered(moe, prefix, shard_id))

        loaded |= {self.to_checkpoint(name) for name in super().stream_weights(others())}
        return loaded

    def _covered(self, moe: FusedMoE, prefix: str, shard_id: str) -> list[str]:
        """The per-expert names a stacked tensor stands for, so completeness is checked one way."""
        gate, up, down = self.expert_parts
        parts = (down,) if shard_id == "w2" else (gate, up)
        return moe.checkpoint_names(prefix, parts)

    def expected_weights(self) -> set[str]:
        names = {self.to_checkpoint(name) for name in super().expected_weights()
                 if not name.endswith(_STACKED_PARAMS)}
        for prefix, moe in self._experts().items():
            names.update(moe.checkpoint_names(prefix, self.expert_parts))
        return names
