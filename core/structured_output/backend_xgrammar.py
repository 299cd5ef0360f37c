"""The xgrammar backend: the tokenizer's vocabulary, a compiler per spec kind, and matchers.

xgrammar (vLLM's default backend) compiles JSON Schema, regex, EBNF and choice lists into a grammar whose
per-token masks are precomputed, so filling a step's bitmask is cheap; it runs on CPU. Everything here runs
in the structured-output manager's thread pool, never on the engine's busy loop.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from pagedserve.common.errors import RequestError
from pagedserve.common.params.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Whitespace between JSON tokens is bounded to this many characters by default (vLLM lets any run through,
# which a small model can loop on until max_tokens).
MAX_JSON_WHITESPACE = 2


class XgrammarBackend:
    """One tokenizer's compiler. Built in the pool: loading the tokenizer takes a while."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer
        self._xgr = xgr
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        # The mask is as wide as the model's logits, which may exceed the tokenizer's vocabulary.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self.vocab_size = vocab_size
        self.bitmask_words = (vocab_size + 31) // 32
        # Our own cache sits in front (keyed by the spec), so xgrammar's would only hold duplicates.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A CompiledGrammar; ValueError naming the field when the spec does not compile."""
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return self._compiler.compile_json_schema(schema, **self._json_options(params))
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', **self._json_options(params))
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(self._xgr.Grammar.from_ebnf(_choice_ebnf(params.choice)))
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise RequestError(f"structured_outputs.{kind}", f"structured_outputs.{kind} does not compile: "
                               f"{_short(exc)}") from None

    def _json_options(self, params: StructuredOutputsParams) -> dict[str, Any]:
        if params.disable_any_whitespace:
            return {"any_whitespace": False, "strict_mode": True}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE,
                "strict_mode": True}

    def matcher(self, compiled: Any) -> "Matcher":
        return Matcher(self._xgr.GrammarMatcher(compiled))


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _short(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if ".cc:" in text.split(": ", 1)[0] else text
    return text.splitlines()[0] if text else type(exc).__name__
