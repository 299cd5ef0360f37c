"""The request fields that ask for structured output, and the one StructuredOutputsParams they become.

Accepted as vLLM's server takes them: OpenAI's `response_format` (text | json_object | json_schema), vLLM's
`structured_outputs` object, and the legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
(with `guided_whitespace_pattern`). One request may use one of them. This file only shapes the spec: the
engine core compiles it (a spec that does not compile comes back as a 400 naming the field it came from).
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pagedserve.common.errors import RequestError
from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.frontend.http.protocol_extras import StrictModel

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_CORE_PREFIX = "structured_outputs"


class StructuredOutputFields(StrictModel):
    response_format: Optional[dict[str, Any]] = None
    # vLLM's
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None

    def structured_outputs_source(self) -> Optional[str]:
        """The request field the constraint comes from (what its errors name); None without one."""
        given = [name for name in ("structured_outputs", *_GUIDED) if getattr(self, name) is not None]
        fmt = self.response_format
        if fmt is not None and fmt.get("type") != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise RequestError.at(given[1], f"give one of {', '.join(given)}, not several")
        return given[0] if given else None

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's constraint as StructuredOutputsParams; RequestError naming the field when malformed."""
        source = self.structured_outputs_source()
        if source is None:
            return None
        try:
            if source == "response_format":
                params = _from_response_format(self.response_format)
            elif source == "structured_outputs":
                if not isinstance(self.structured_outputs, dict):
                    raise ValueError("must be an object")
                params = StructuredOutputsParams(**self.structured_outputs)
            else:
                extra = {"whitespace_pattern": self.guided_whitespace_pattern} if self.guided_whitespace_pattern \
                    else {}
                params = StructuredOutputsParams(**{_GUIDED[source]: getattr(self, source)}, **extra)
            params.validate()
        except (TypeError, ValueError) as exc:
            raise RequestError.at(source, _strip(str(exc))) from None
        return params


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"type must be one of text, json_object, json_schema; got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("json_schema: an object with the schema is required for type json_schema")
    schema = spec.get("schema")
    if schema is None:        # OpenAI allows a schema-less json_schema: any JSON object
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, dict):
        raise ValueError("json_schema.schema must be a JSON Schema object")
    # strict: OpenAI's flag for "the output follows the schema exactly"; here it always does (grammar).
    return StructuredOutputsParams(json=schema)


def _strip(message: str) -> str:
    return message[len(_CORE_PREFIX):].lstrip(".: ") if message.startswith(_CORE_PREFIX) else message


def name_field(exc: ValueError, source: Optional[str]) -> ValueError:
    """An engine error about the compiled spec (field structured_outputs.json: "... does not compile") as an
    error about the request field it came from, so a 400 names what the user sent."""
    field = getattr(exc, "field", None)
    if source is None or source == _CORE_PREFIX or field is None or not field.startswith(_CORE_PREFIX):
        return exc
    return RequestError.at(source, _strip(str(exc)))
