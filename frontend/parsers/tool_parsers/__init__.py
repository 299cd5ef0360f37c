"""Tool-call parsers (`--tool-call-parser`), by vLLM's names."""
from __future__ import annotations

from pagedserve.frontend.parsers.tool_parsers.base import PartialCall, Scan, ToolParser
from pagedserve.frontend.parsers.tool_parsers.hermes import HermesToolParser
from pagedserve.frontend.parsers.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.frontend.parsers.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

__all__ = ["TOOL_PARSERS", "PartialCall", "Scan", "ToolParser"]
