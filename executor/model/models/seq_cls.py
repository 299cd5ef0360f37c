"""Causal LMs with a sequence-classification head (HF's Qwen2/Qwen3/LlamaForSequenceClassification: the base
model and a bias-free `score` linear over the last token's state), served as pooling models (classify, score)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.layers.linear import copy_weight
from pagedserve.executor.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup


class _ScoreHead:
    """Mixed into a causal LM class: the checkpoint's `score.weight` [num_labels, hidden] as the classifier.
    The LM head the base class builds is never used (the loader asks no weights of it for pooling)."""

    def _init_score(self, hf_config: Any) -> None:
        self.score = nn.Linear(hf_config.hidden_size, hf_config.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [R, hidden] (the last token's final-normed state) -> logits [R, num_labels]."""
        return self.score(pooled)

    def stream_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        taken: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == "score.weight":
                    copy_weight(self.score.weight.data, tensor, f"checkpoint tensor {name!r}")
                    taken.add(name)
                else:
                    yield name, tensor
        loaded = super().stream_weights(others())
        return loaded | taken

    def expected_weights(self) -> set[str]:
        return {n for n in super().expected_weights() if not n.startswith("score.")} | {"score.weight"}


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__(hf_config, tp, pp)
        self._init_score(hf_config)


class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__(hf_config, tp, pp)
        self._init_score(hf_config)


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__(hf_config, tp, pp)
        self._init_score(hf_config)
