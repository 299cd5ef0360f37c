"""What pooling calls return, shaped like vLLM's: PoolingRequestOutput and its embed / classify / score
views (EmbeddingRequestOutput.outputs.embedding, ClassificationRequestOutput.outputs.probs,
ScoringRequestOutput.outputs.score)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def decode_vector(data: bytes | None) -> np.ndarray:
    """The engine's pooled bytes (little-endian float32) as an array."""
    if data is None:
        raise RuntimeError("a pooling request finished without a pooled output")
    return np.frombuffer(data, dtype="<f4")
