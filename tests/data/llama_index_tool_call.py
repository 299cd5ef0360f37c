"""Run by tests/e2e/openai_api/test_llama_index_client.py in LlamaIndex's own environment (its openai<3 pin keeps
it out of the test venv): LlamaIndex's OpenAILike, as its users point it at a vLLM server, asks for one
forced tool call and prints the calls it parsed as JSON. Usage: python llama_index_tool_call.py URL KEY MODEL"""
import json
import sys
from typing import Literal

from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike


def get_weather(city: Literal["Paris", "Oslo", "Rome"]) -> str:
    """Weather for a city."""
    return f"sunny in {city}"


url, key, model = sys.argv[1:4]
llm = OpenAILike(model=model, api_base=url + "/v1", api_key=key, is_chat_model=True, is_function_calling_model=True,
                 context_window=512, max_tokens=48, temperature=0.0, max_retries=0)
tool = FunctionTool.from_defaults(fn=get_weather)
response = llm.chat_with_tools([tool], user_msg="Is it sunny in Paris?", tool_required=True)
calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
print(json.dumps([{"name": c.tool_name, "kwargs": c.tool_kwargs, "ran": tool(**c.tool_kwargs).content}
                  for c in calls]))
