"""LlamaIndex's `OpenAILike` against the server, with one tool call (issue 51). Its newest releases pin
openai<3 (llama-index-llms-openai 0.8.3) while the Agents SDK the venv also tests needs openai>=3, so the client
is installed by pip into a folder of its own, as its users install it, and runs in its own process there."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedserve.tests.helpers.processes.server import Server

pytestmark = pytest.mark.timeout(900)

CLIENT = "llama-index-llms-openai-like==0.8.1"
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "data", "llama_index_tool_call.py")


@pytest.fixture(scope="module")
def llama_index(tmp_path_factory) -> str:
    target = str(tmp_path_factory.mktemp("llama_index"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--target", target, CLIENT], check=True, timeout=600, capture_output=True)
    return target


def test_openai_like_makes_a_forced_tool_call(tool_server: Server, llama_index: str):
    model = tool_server.client().models.list().data[0].id
    run = subprocess.run([sys.executable, SCRIPT, tool_server.url, tool_server.api_key, model], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": llama_index})
    assert run.returncode == 0, run.stderr[-3000:]
    [call] = json.loads(run.stdout.strip().splitlines()[-1])
    assert call["name"] == "get_weather" and call["kwargs"]["city"] in ("Paris", "Oslo", "Rome")
    assert call["ran"] == f"sunny in {call['kwargs']['city']}"
