"""SamplingParams: how to pick tokens and when to stop (vLLM-compatible fields)."""
from __future__ import annotations

import enum
from typing import Optional, Union

import msgspec

from pagedserve.common.errors import RequestError
from pagedserve.common.params.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# The most top logprobs a token may ask for (vLLM's default max_logprobs), in every API that takes them.
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(1 << 63), (1 << 63) - 1, (1 << 64) - 1


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0   # every output holds all text so far
    DELTA = 1        # every output holds only what is new
    FINAL_ONLY = 2   # one output when the request ends


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16   # None: up to max_model_len
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Optional[int] = None   # number of top logprobs per sampled token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: Optional[dict[int, float]] = None    # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None    # only these ids may be sampled
    bad_words: Optional[list[str]] = None            # words that must never be generated
    truncate_prompt_tokens: Optional[int] = None     # keep the last k prompt tokens (-1: max_model_len)
    structured_outputs: Optional[StructuredOutputsParams] = None   # constrained decoding (grammar engine)
    prompt_logprobs: Optional[int] = None   # top logprobs per prompt position (vLLM): scoring a prompt
    # bad_words as token-id sequences: the frontend tokenizes them (the core has no tokenizer).
    _bad_words_token_ids: Optional[list[list[int]]] = None

    def __post_init__(self) -> None:
        # Normalization only, and idempotent: this runs at every msgspec decode too (the core's socket, and
        # every worker rank's SchedulerOutput), where validating again would cost each step. The rules run
        # once per trust boundary, in validate().
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self) -> None:
        """Every rule of these parameters: RequestError naming the first field at fault. Called where a request
        enters (the frontend's input processor, the engine core's add_request), never at decode. Then greedy
        sampling drops the truncations that cannot change its argmax (idempotent), so a batch of greedy rows
        takes no top-p/top-k path in the worker."""
        self._validate()
        check_constraints(self)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise RequestError("structured_outputs", "structured_outputs must be StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.temperature < _GREEDY_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        check_field(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check_field(is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        check_field(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check_field(is_int(self.top_k) and self.top_k >= 0, "top_k",
               f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        check_field(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check_field(is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        check_field(is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty!r}")
        check_field(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 0), "max_tokens",
               f"must be at least 0, got {self.max_tokens!r}")
        check_field(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be >= 0, got {self.min_tokens!r}")
        check_field(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        check_logprobs("logprobs", self.logprobs)
        check_logprobs("prompt_logprobs", self.prompt_logprobs)
        # Integers cross process boundaries as msgpack 64-bit ints, and seed a torch.Generator.
        check_field(self.seed is None or (is_int(self.seed) and _INT64_MIN <= self.seed <= _UINT64_MAX), "seed",
               f"must be a 64-bit integer, got {self.seed!r}")
        check_field(self.top_k <= _INT64_MAX, "top_k", f"must be a 64-bit integer, got {self.top_k!r}")
        check_field(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check_field(all(is_int(t) and 0 <= t <= _INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative 64-bit integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: object) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def check_constraints(params: SamplingParams) -> None:
    """Shape and range of the logit constraints; ids against the vocabulary are checked in
    common/request_checks, which knows the model."""
    bias = params.logit_bias
    if bias is not None:
        check_field(isinstance(bias, dict), "logit_bias", "must map token ids to biases")
        for tok, value in bias.items():
            check_field(is_int(tok) and 0 <= tok <= _INT64_MAX, "logit_bias",
                   f"keys must be non-negative integer token ids, got {tok!r}")
            check_field(is_number(value) and -100 <= value <= 100, "logit_bias",
                   f"values must be in [-100, 100], got {value!r} for token {tok}")
    allowed = params.allowed_token_ids
    if allowed is not None:
        check_field(isinstance(allowed, list) and len(allowed) > 0, "allowed_token_ids", "must be a non-empty list")
        check_field(all(is_int(t) and 0 <= t <= _INT64_MAX for t in allowed), "allowed_token_ids",
               "must be non-negative integer token ids")
    if params.bad_words is not None:
        check_field(isinstance(params.bad_words, list) and all(isinstance(w, str) and w.strip()
                                                          for w in params.bad_words),
               "bad_words", "must be a list of non-empty strings")
    words = params._bad_words_token_ids
    if words is not None:
        check_field(all(isinstance(w, list) and w and all(is_int(t) and 0 <= t <= _INT64_MAX for t in w)
                   for w in words), "bad_words", "token sequences must be non-empty lists of token ids")
    k = params.truncate_prompt_tokens
    check_field(k is None or (is_int(k) and (k == -1 or 1 <= k <= _INT64_MAX)), "truncate_prompt_tokens",
           f"must be -1 (max_model_len) or an integer >= 1, got {k!r}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def check_logprobs(field: str, value: object) -> None:
    """None, or an integer in [0, MAX_LOGPROBS]; RequestError naming the field otherwise."""
    check_field(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), field,
                f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")


def check_field(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise RequestError(field, f"{field} {message}")
