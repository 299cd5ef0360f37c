"""Request and response schemas of the pooling routes, as vLLM serves them: /v1/embeddings (OpenAI's),
/pooling, /score, /rerank (+ /v1/rerank, /v2/rerank: Jina's and Cohere's shape) and /classify."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from pagedserve.frontend.http.protocol_extras import StrictModel

EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]


class _PoolingFields(StrictModel):
    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None      # keep this many tokens (-1: max_model_len)
    priority: int = 0


class EmbeddingRequest(_PoolingFields):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None                   # Matryoshka models only
    normalize: Optional[bool] = None                   # vLLM's extra: None is the model's pooler config
    add_special_tokens: bool = True


class PoolingRequest(EmbeddingRequest):
    pass


class ClassificationRequest(_PoolingFields):
    input: Union[str, list[str], list[int], list[list[int]]]
    add_special_tokens: bool = True


class ScoreRequest(_PoolingFields):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankRequest(_PoolingFields):
    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)          # 0: every document
    return_documents: bool = True


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


def listing(prefix_id: str, model: str, data: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    """The shared envelope of embeddings, pooling, score and classify responses."""
    return {"id": prefix_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens).model_dump()}


def rerank_response(rid: str, model: str, results: list[dict[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    return {"id": rid, "model": model, "results": results,
            "usage": {"total_tokens": prompt_tokens, "prompt_tokens": prompt_tokens}}
