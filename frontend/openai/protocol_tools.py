"""Tool calling's request fields (tools, tool_choice, parallel_tool_calls, legacy functions/function_call):
their checks, what reaches the chat template, and the grammar that forces a call.

As vLLM does: tool_choice "required" or a named function is enforced by a JSON Schema constraint (the answer is
then exactly a call, parsed straight into tool_calls); "auto" leaves the model free and needs the server's
--enable-auto-tool-choice and --tool-call-parser; "none" only shows the tools to the template.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from pagedserve.common.errors import RequestError
from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.frontend.openai.protocol_structured import StructuredOutputFields

_CHOICES = ("none", "auto", "required")
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class ToolFields(StructuredOutputFields):
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None

    # ---------------------------------------------------------------- checks

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools as OpenAI's tools list (legacy `functions` wrapped), checked; [] without any."""
        if self.tools and self.functions:
            raise RequestError.at("functions", "give tools or the legacy functions, not both")
        field = "tools" if self.tools else "functions"
        raw = self.tools or [{"type": "function", "function": f} for f in self.functions or []]
        for i, tool in enumerate(raw):
            where = f"tools[{i}]" if field == "tools" else f"functions[{i}]"
            _check_tool(tool, where, field == "tools")
        return raw

    def chosen_tool(self) -> Union[str, dict[str, Any]]:
        """tool_choice (or the legacy function_call) as none | auto | required | {"function": {"name"}}."""
        if self.function_call is not None and self.tool_choice is None:
            fc = self.function_call
            return fc if isinstance(fc, str) else {"type": "function", "function": fc}
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools or self.functions else "none"

    def check_tools(self, auto_enabled: bool) -> Optional[str]:
        """ValueError naming the field for a bad combination. Returns the forced function's name, "required",
        "auto" (parse the answer with the server's tool parser) or None (plain text)."""
        tools = self.tool_list()
        field = "function_call" if self.function_call is not None and self.tool_choice is None else "tool_choice"
        choice = self.chosen_tool()
        if self.tool_choice is None and self.function_call is None:
            field = "functions" if self.functions else "tools"    # auto is their default: name what was sent
        if isinstance(choice, str):
            if choice not in _CHOICES:
                raise RequestError.at(field, f"must be one of {', '.join(_CHOICES)} or a named function, "
                                             f"got {choice!r}")
            if not tools:
                if choice == "required":
                    raise RequestError.at(field, "'required' needs tools")
                return None          # none/auto with no tools: plain text
            if choice == "auto" and not auto_enabled:
                raise RequestError.at(field, AUTO_NEEDS_FLAGS)
            return None if choice == "none" else choice
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError.at(field, 'a named choice is {"type": "function", "function": {"name": ...}}')
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError.at(field, f"function {name!r} is not in tools")
        return name

    # ---------------------------------------------------------------- the forcing grammar

    def forced_call_schema(self) -> Optional[dict[str, Any]]:
        """The JSON Schema that forces the answer to be a call (required or named), else None."""
        mode = self.check_tools(auto_enabled=True)
        if mode is None or mode == "auto":
            return None
        functions = [t["function"] for t in self.tool_list()]
        if mode != "required":
            return _parameters(next(f for f in functions if f["name"] == mode))
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                   "parameters": _parameters(f)},
                  "required": ["name", "parameters"]} for f in functions]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def structured_outputs_source(self) -> Optional[str]:
        source = super().structured_outputs_source()
        if self.forced_call_schema() is None:
            return source
        if source is not None:
            raise RequestError.at(source, "cannot be combined with a forced tool call (tool_choice)")
        return "function_call" if self.function_call is not None and self.tool_choice is None else "tool_choice"

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        schema = self.forced_call_schema()
        if schema is None:
            return super().structured_outputs_params()
        self.structured_outputs_source()          # refuses a second constraint
        return StructuredOutputsParams(json=schema)

    # ---------------------------------------------------------------- what the template sees

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        return self.tool_list() or None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects: OpenAI sends JSON text, chat templates iterate
    them as dicts (vLLM converts them the same way). Arguments that are not JSON are a ValueError naming them."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise RequestError.at(f"messages[{i}].tool_calls", "must be a list")
            message = {**message, "tool_calls": [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                                 for j, c in enumerate(calls)]}
        out.append(message)
    return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError.at(f"{where}.function", "an object with a name is required")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise RequestError.at(f"{where}.function.arguments", "not valid JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _check_tool(tool: Any, where: str, wrapped: bool) -> None:
    import jsonschema      # checks schemas only; cheap, and never torch
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise RequestError.at(where, 'must be {"type": "function", "function": {"name": ..., ...}}')
    fn = tool["function"]
    prefix = f"{where}.function" if wrapped else where
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError.at(f"{prefix}.name", "a non-empty string is required")
    params = fn.get("parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise RequestError.at(f"{prefix}.parameters", "must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as exc:
        raise RequestError.at(f"{prefix}.parameters", f"not a valid JSON Schema: {exc.message}") from None
