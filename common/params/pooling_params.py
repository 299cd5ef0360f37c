"""PoolingParams: what a pooling request (embed, encode, classify, score) asks of the pooler, shaped like
vLLM's; and the rules a pooling request meets where it enters (frontend and engine core both run them)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import msgspec

from pagedserve.common.errors import RequestError
from pagedserve.common.params.sampling_params import is_int

# embed: one normalized vector per prompt; encode: the pooler's raw vector (no normalization);
# classify: class probabilities; score: a cross-encoder's relevance of a text pair.
POOLING_TASKS = ("embed", "encode", "classify", "score")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    task: Optional[str] = None                   # one of POOLING_TASKS; None: the model's own (embed or classify)
    normalize: Optional[bool] = None             # embed: L2-normalize (None: the model's pooler config)
    dimensions: Optional[int] = None             # embed: Matryoshka truncation to this many dimensions
    use_activation: Optional[bool] = None        # classify/score: softmax (sigmoid for one label); None: yes
    truncate_prompt_tokens: Optional[int] = None  # keep the last k prompt tokens (-1: max_model_len)
    # A text pair's segment ids (BERT's token_type_ids), one per prompt token; None: all 0. Set by the
    # frontend's tokenizer, never by a user.
    token_type_ids: Optional[list[int]] = None

    def validate(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise RequestError.at("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise RequestError.at("dimensions", f"must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not is_int(t) or (t < 1 and t != -1)):
            raise RequestError.at("truncate_prompt_tokens", f"must be a positive integer or -1, got {t!r}")

    def clone(self, **changes: object) -> "PoolingParams":
        return msgspec.structs.replace(self, **changes)


def check_pooling_request(prompt_token_ids: Sequence[int], params: PoolingParams, max_model_len: int,
                          vocab_size: int, max_whole_prompt: int | None) -> None:
    """The prompt against the model's limits. max_whole_prompt: the most tokens one step takes, for models
    whose pooler needs the whole prompt in one step (encoders; CLS/mean pooling); None: chunked prefill."""
    if not isinstance(params, PoolingParams):
        raise RequestError("pooling_params", f"pooling_params must be PoolingParams, got {type(params).__name__}")
    params.validate()
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError.at("input", "must contain at least one token")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestError("prompt_token_ids", f"prompt_token_ids must be in [0, {vocab_size}) for this model")
    if n > max_model_len:
        raise RequestError.at("input", f"{n} tokens, but this model's maximum context length (max_model_len) is "
                              f"{max_model_len}; shorten it or set truncate_prompt_tokens")
    if max_whole_prompt is not None and n > max_whole_prompt:
        raise RequestError.at("input", f"{n} tokens, but this pooling model runs a prompt in one step of at most "
                              f"{max_whole_prompt} tokens (max_num_batched_tokens)")
    types = params.token_type_ids
    if types is not None and (len(types) != n or any(t not in (0, 1) for t in types)):
        raise RequestError.at("token_type_ids", "one 0 or 1 per prompt token")


def check_generation_allowed(pooling_tasks: Sequence[str]) -> None:
    """A generate request on a pooling model is refused (as vLLM: its completion and chat routes 400)."""
    if pooling_tasks:
        raise RequestError("model", "this model runs with --runner pooling: it answers embeddings, pooling, "
                           "classification and score requests, not generation")


def check_pooling_task(params: PoolingParams, tasks: Sequence[str], is_matryoshka: bool,
                       matryoshka_dimensions: Sequence[int] | None) -> None:
    """The request's task and dimensions against what the served model answers (tasks: [] = a generating
    model, which answers no pooling request)."""
    if not tasks:
        raise RequestError("model", "this model runs with --runner generate: it answers no pooling requests "
                           "(start it with --runner pooling, and --convert embed for a causal LM)")
    if params.task is not None and params.task not in tasks:
        raise RequestError.at("task", f"this model answers {', '.join(tasks)}, not {params.task}")
    dims = params.dimensions
    if dims is not None:
        if not is_matryoshka:
            raise RequestError.at("dimensions", "this model does not support Matryoshka (reduced) dimensions")
        if matryoshka_dimensions is not None and dims not in matryoshka_dimensions:
            raise RequestError.at("dimensions", f"must be one of {list(matryoshka_dimensions)}, got {dims}")

