"""The rules a request meets where it enters: each rule once, here, for both trust boundaries.

The frontend's input processor runs them before anything is sent, so a bad request fails before a stream
answers 200; the engine core runs them again where it takes a request (its socket), because any client
(another process, another host) can send it anything. Both raise the same RequestError, naming the field.
Decoding a message never validates: a worker rank trusts what its core sends.
"""
from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any, Optional

from pagedserve.common.errors import EngineOverloadedError, RequestError
from pagedserve.common.params.sampling_params import SamplingParams

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_request(prompt_token_ids: Sequence[int], params: Any, priority: Any, max_model_len: int,
                  vocab_size: int) -> int:
    """Every rule of one request against the model's limits; returns the number of tokens it may generate.
    (The frontend runs the same three checks, with prompt truncation between them.)"""
    check_params(params, priority)
    return check_prompt(prompt_token_ids, params, max_model_len, vocab_size)


def check_params(params: Any, priority: Any) -> None:
    """The request's own settings, before the prompt is looked at (truncation reads them)."""
    if not isinstance(params, SamplingParams):
        raise RequestError("sampling_params", f"sampling_params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    if not isinstance(priority, int) or not _INT64_MIN <= priority <= _INT64_MAX:
        raise RequestError("priority", f"priority must be a 64-bit integer, got {priority!r}")


def check_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int,
                 vocab_size: int) -> int:
    """The prompt against the model's limits (and the token ids the params name against its vocabulary);
    returns the number of tokens the request may generate: max_tokens, or what the prompt leaves."""
    check_token_constraints(params, vocab_size)
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise RequestError("prompt", "prompt must contain at least one token")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestError("prompt_token_ids", f"prompt_token_ids must be in [0, {vocab_size}) for this model")
    if prompt_len >= max_model_len:
        raise RequestError("prompt", f"prompt: {prompt_len} tokens, but this model's maximum context length "
                           f"(max_model_len) is {max_model_len}: it leaves no room to generate")
    max_tokens = generation_budget(params, prompt_len, max_model_len)
    if params.max_tokens is None and params.min_tokens > max_tokens:
        raise RequestError("min_tokens", f"min_tokens must be <= max_tokens ({max_tokens}, what the prompt leaves "
                           f"of max_model_len), got {params.min_tokens}")
    if prompt_len + max_tokens > max_model_len:
        raise RequestError("max_tokens", f"max_tokens: {max_tokens} requested, but the prompt uses {prompt_len} "
                           f"of the {max_model_len} tokens of max_model_len")
    return max_tokens


def generation_budget(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """How many tokens a request may generate: its max_tokens, or (None) what the prompt leaves."""
    return max_model_len - prompt_len if params.max_tokens is None else params.max_tokens


def check_token_constraints(params: SamplingParams, vocab_size: int) -> None:
    """Every token id a sampling constraint names must be in the vocabulary (a wrong id would index
    past the logits row in the worker)."""
    if params.bad_words and params._bad_words_token_ids is None:
        raise RequestError("bad_words", "bad_words: not tokenized (a frontend turns them into token ids before "
                           "sending)")
    _in_vocab(params.logit_bias or (), vocab_size, "logit_bias")
    _in_vocab(params.allowed_token_ids or (), vocab_size, "allowed_token_ids")
    _in_vocab((t for word in params._bad_words_token_ids or () for t in word), vocab_size, "bad_words")


def check_request_id(request_id: str, in_use: Container[str]) -> None:
    """A request id names one live request: a second one under it would take the first one's outputs."""
    if request_id in in_use:
        raise RequestError("request_id", f"request_id {request_id!r} is already in use")


def has_waiting_room(num_waiting: int, bound: Optional[int]) -> bool:
    """Whether one more request may wait, under max_waiting_requests (None: no bound)."""
    return bound is None or num_waiting < bound


def check_waiting_room(num_waiting: int, bound: Optional[int]) -> None:
    """EngineOverloadedError (HTTP 429: refused, not queued) when the waiting queue is at its bound."""
    if not has_waiting_room(num_waiting, bound):
        raise EngineOverloadedError(f"{num_waiting} requests are already waiting "
                                    f"(max_waiting_requests={bound}); retry later")


def _in_vocab(ids: Iterable[int], vocab_size: int, field: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(field, f"{field}: token id {bad} is not in [0, {vocab_size}) for this model")
