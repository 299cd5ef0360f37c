"""LLM.embed / encode / classify / score: pooling requests through the offline engine (vLLM's shapes)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.common.params.pooling_params import PoolingParams
from pagedserve.frontend.pooling import requests as pooling
from pagedserve.frontend.client.input_processor import InputProcessor, PreparedRequest, ProcessedPrompt
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.client.prompt_lists import as_prompt_list, per_prompt


Params = PoolingParams | Sequence[PoolingParams] | None      # one for every prompt, or one per prompt


@dataclass(frozen=True)
class PoolingRunner:
    """What these calls need of the LLM: its input processor, request ids, and running prepared requests."""
    input_processor: InputProcessor
    new_id: Callable[[], str]
    run_prepared: Callable[[list[PreparedRequest], bool], list[RequestOutput]]
    pooling_tasks: list[str]


def embed(llm: PoolingRunner, prompts: Any, params: Params, use_tqdm: bool, truncate: int | None) -> list:
    return _single(llm, prompts, params, "embed", truncate, use_tqdm, pooling.to_embedding)


def encode(llm: PoolingRunner, prompts: Any, params: Params, use_tqdm: bool, truncate: int | None) -> list:
    return _single(llm, prompts, params, "encode", truncate, use_tqdm, pooling.to_pooling_output)


def classify(llm: PoolingRunner, prompts: Any, params: Params, use_tqdm: bool, truncate: int | None) -> list:
    return _single(llm, prompts, params, "classify", truncate, use_tqdm, pooling.to_classification)


def score(llm: PoolingRunner, data_1: Any, data_2: Any, params: PoolingParams | None, use_tqdm: bool,
          truncate: int | None) -> list:
    """A cross-encoder scores each pair in one prompt; an embedding model embeds both sides and compares."""
    pairs = pooling.score_pairs(data_1, data_2)
    if "score" in llm.pooling_tasks:
        p = pooling.default_params(params, "score", truncate)
        batch = []
        for a, b in pairs:
            prompt, types = pooling.tokenize_pair(llm.input_processor, a, b, p.truncate_prompt_tokens)
            batch.append(_prepare(llm, prompt, p.clone(token_type_ids=types)))
        return [pooling.to_score(o) for o in llm.run_prepared(batch, use_tqdm)]
    p = pooling.default_params(params, "embed", truncate)
    texts = [t for pair in pairs for t in pair]
    outs = llm.run_prepared([_prepare(llm, _tokenize(llm, t, p), p) for t in texts], use_tqdm)
    return [pooling.cosine_score(outs[2 * i], outs[2 * i + 1], outs[2 * i].request_id) for i in range(len(pairs))]


def _single(llm: PoolingRunner, prompts: Any, params: Params, task: str, truncate: int | None, use_tqdm: bool,
            convert: Callable[[RequestOutput], Any]) -> list:
    items: Sequence[Any] = as_prompt_list(prompts)
    given = list(params) if isinstance(params, (list, tuple)) else params
    each = [pooling.default_params(p, task, truncate)
            for p in per_prompt(given, len(items), "pooling_params", None)]
    batch = [_prepare(llm, _tokenize(llm, p, pp), pp) for p, pp in zip(items, each)]
    return [convert(o) for o in llm.run_prepared(batch, use_tqdm)]


def _tokenize(llm: PoolingRunner, prompt: Any, params: PoolingParams) -> ProcessedPrompt:
    return pooling.tokenize_input(llm.input_processor, prompt, params.truncate_prompt_tokens)


def _prepare(llm: PoolingRunner, prompt: ProcessedPrompt, params: PoolingParams) -> PreparedRequest:
    return pooling.prepare_pooling(llm.input_processor, llm.new_id(), prompt, params)
