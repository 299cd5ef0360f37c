"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's shape).

One kind per request: a JSON Schema, any JSON object, a regex, a choice among strings, or an EBNF grammar.
The frontend builds it (from response_format, structured_outputs, guided_* or forced tool calls), the core
compiles it off its busy loop and fills the token bitmask, the worker applies the bitmask before sampling.
"""
from __future__ import annotations

import json as _json
from typing import Any, Optional, Union

import msgspec

from pagedserve.common.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    json: Optional[Union[str, dict[str, Any]]] = None   # a JSON Schema (text or object)
    json_object: Optional[bool] = None                  # any JSON object
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None                       # EBNF (GBNF-style), as vLLM takes it
    # JSON whitespace: vLLM's flags. By default whitespace between JSON tokens is bounded (see the
    # core's compiler), so a small model cannot loop on spaces until max_tokens.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    def validate(self) -> None:
        """The spec's shape: RequestError naming structured_outputs (or its field). Run with the request's
        other rules (SamplingParams.validate), never at decode; whether it compiles is the core's to find."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError("structured_outputs", "structured_outputs must set exactly one of "
                               f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise RequestError("structured_outputs.choice", "structured_outputs.choice must be a non-empty list "
                               "of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured_outputs.{name}", f"structured_outputs.{name} must be a non-empty "
                                   "string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError("structured_outputs.json", "structured_outputs.json must be a JSON Schema (an "
                               "object, or its text)")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise RequestError("structured_outputs.json", f"structured_outputs.json is not valid JSON: {e}") \
                    from None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """Equal for specs that compile to the same grammar (the compiled-grammar cache's key)."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = _json.loads(value)
        return _json.dumps([self.kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                            self.whitespace_pattern], sort_keys=True, separators=(",", ":"))
