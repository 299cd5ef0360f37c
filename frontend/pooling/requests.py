"""Pooling requests on the frontend: prompts (and text pairs) to checked engine requests that carry
PoolingParams, and the engine's pooled bytes back to vLLM's output shapes. LLM.embed / encode / classify /
score and the HTTP pooling routes both build on this."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedserve.common.errors import RequestError
from pagedserve.common.params.pooling_params import PoolingParams, check_pooling_request, check_pooling_task
from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.client.input_processor import InputProcessor, PreparedRequest, ProcessedPrompt
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput,
                                                 EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                                 PoolingRequestOutput, ScoringOutput, ScoringRequestOutput,
                                                 decode_vector)
from pagedserve.frontend.client.prompt_constraints import truncated_ids
from pagedserve.ipc.messages import EngineCoreRequest

# A pooling request samples nothing: its sampling params only say "the prompt, one final output".
_PROMPT_ONLY = SamplingParams(max_tokens=0, output_kind=RequestOutputKind.FINAL_ONLY)


def tokenize_input(inputs: InputProcessor, prompt: Any, truncate: int | None) -> ProcessedPrompt:
    """A text (tokenized with the model's special tokens, cut to `truncate` tokens by the tokenizer, as
    sentence-transformers cuts), token ids (the last `truncate` kept) or a dict prompt."""
    if (isinstance(prompt, (str, list)) and len(prompt) == 0) or prompt is None:
        raise RequestError.at("input", "must not be empty")
    PoolingParams(truncate_prompt_tokens=truncate).validate()      # before the tokenizer is given it
    keep = inputs.info.max_model_len if truncate == -1 else truncate
    if isinstance(prompt, str) and keep is not None:
        return ProcessedPrompt(prompt, list(inputs.tokenizer.encode(prompt, truncation=True, max_length=keep)))
    parsed = inputs.parse_prompt(prompt)
    return ProcessedPrompt(parsed.prompt, truncated_ids(parsed.prompt_token_ids, keep, inputs.info.max_model_len))


def tokenize_pair(inputs: InputProcessor, text_1: str, text_2: str,
                  truncate: int | None) -> tuple[ProcessedPrompt, list[int] | None]:
    """A cross-encoder's input: both texts in one prompt, as the tokenizer pairs them ([CLS] a [SEP] b [SEP]),
    and its segment ids (1 for the second text) where the tokenizer makes them."""
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise RequestError("text_1", "a score pair is two strings")
    PoolingParams(truncate_prompt_tokens=truncate).validate()
    keep = inputs.info.max_model_len if truncate == -1 else truncate
    kwargs = {"truncation": True, "max_length": keep} if keep is not None else {}
    enc = inputs.tokenizer(text_1, text_2, return_token_type_ids=True, **kwargs)
    types = enc.get("token_type_ids")
    types = list(types) if types is not None and any(types) else None
    return ProcessedPrompt(f"{text_1}\n{text_2}", list(enc["input_ids"])), types


def prepare_pooling(inputs: InputProcessor, request_id: str, prompt: ProcessedPrompt, params: PoolingParams,
                    priority: int = 0, arrival_time: float | None = None) -> PreparedRequest:
    """Check (the same rules the core runs at its socket, here before anything is sent) and build the
    request. Token type ids, when a pair brings them, ride in params."""
    info = inputs.info
    if not isinstance(params, PoolingParams):
        raise RequestError("pooling_params", f"pooling_params must be PoolingParams, got {type(params).__name__}")
    check_pooling_task(params, info.pooling_tasks, info.is_matryoshka, info.matryoshka_dimensions)
    check_pooling_request(prompt.prompt_token_ids, params, info.max_model_len, info.vocab_size,
                          info.max_whole_prompt)
    arrival = time.time() if arrival_time is None else arrival_time
    request = EngineCoreRequest(request_id, prompt.prompt_token_ids, _PROMPT_ONLY, arrival, priority,
                                pooling_params=params)
    return PreparedRequest(request_id, prompt, _PROMPT_ONLY, [request_id], [request])


def to_pooling_output(out: RequestOutput) -> PoolingRequestOutput:
    return PoolingRequestOutput(out.request_id, PoolingOutput(decode_vector(out.pooling_output).tolist()),
                                out.prompt_token_ids, out.finished)


def to_embedding(out: RequestOutput) -> EmbeddingRequestOutput:
    return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(decode_vector(out.pooling_output).tolist()),
                                  out.prompt_token_ids, out.finished)


def to_classification(out: RequestOutput) -> ClassificationRequestOutput:
    return ClassificationRequestOutput(out.request_id,
                                       ClassificationOutput(decode_vector(out.pooling_output).tolist()),
                                       out.prompt_token_ids, out.finished)


def to_score(out: RequestOutput) -> ScoringRequestOutput:
    """A cross-encoder's score: its single label's probability (or the first label's)."""
    return ScoringRequestOutput(out.request_id, ScoringOutput(float(decode_vector(out.pooling_output)[0])),
                                out.prompt_token_ids, out.finished)


def cosine_score(a: RequestOutput, b: RequestOutput, request_id: str) -> ScoringRequestOutput:
    """An embedding model's score of a pair: the cosine similarity of the two embeddings (as vLLM)."""
    x, y = decode_vector(a.pooling_output).astype(np.float64), decode_vector(b.pooling_output).astype(np.float64)
    cos = float(x @ y / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-12))
    return ScoringRequestOutput(request_id, ScoringOutput(cos), a.prompt_token_ids + b.prompt_token_ids)


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against many (either side), or two lists of one length, pairwise."""
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(left) == 1 and len(right) >= 1:
        left = left * len(right)
    elif len(right) == 1:
        right = right * len(left)
    if len(left) != len(right) or not left:
        raise RequestError("text_2", f"text_1 and text_2: one text against many, or two lists of one length; "
                           f"got {len(left)} and {len(right)}")
    return list(zip(left, right))


def default_params(params: PoolingParams | None, task: str, truncate: int | None) -> PoolingParams:
    params = params.clone() if params is not None else PoolingParams()
    params.task = params.task or task
    if truncate is not None:
        params.truncate_prompt_tokens = truncate
    return params
