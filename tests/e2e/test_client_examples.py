"""The README's client examples, run as written against a real engine-serve: the official `openai` SDK,
`langchain-openai` and `litellm`. Only the port is changed; each example runs in its own interpreter."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pagedserve.tests.helpers.server import SMALL_KV, Server

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")
README_URL = "http://127.0.0.1:8000/v1"
# name -> requests the example sends
EXAMPLES = {"openai": 1, "openai-stream": 1, "langchain": 4, "litellm": 1}


def readme_examples() -> dict[str, str]:
    """The python block after each `<!-- client-example: NAME -->` marker."""
    text = open(README, encoding="utf-8").read()
    found = re.findall(r"<!-- client-example: ([\w-]+) -->\s*```python\n(.*?)```", text, flags=re.S)
    return dict(found)


def test_readme_marks_every_example():
    examples = readme_examples()
    assert sorted(examples) == sorted(EXAMPLES)
    for name, code in examples.items():
        assert README_URL in code, f"{name}: the example must use the served URL the README documents"


@pytest.fixture(scope="module")
def readme_server(tiny_serving_model):
    # The examples name the embedded model and the key "unused"; the tiny model stands in under that name.
    srv = Server(*SMALL_KV, "--max-num-seqs", "8", "--served-model-name", "SmolLM2-135M-Instruct",
                 model=tiny_serving_model, api_key="unused", max_model_len=256)
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_readme_client_example_runs(readme_server, name):
    code = readme_examples()[name].replace(README_URL, f"{readme_server.url}/v1")
    before = readme_server.wait_idle()["request_success_total"]
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", NO_PROXY="127.0.0.1,localhost")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), run.stderr[-3000:]
    after = readme_server.wait_idle()["request_success_total"]
    # The answers came from this server, every request of the example finished there.
    assert after - before == EXAMPLES[name]
