"""The README's client examples, run as written against a real engine-serve: the official `openai` SDK,
`langchain-openai` and `litellm`. Only the port is changed; each example runs in its own interpreter.
The same server runs every other block of README.md and docs/*.md marked `run: python-client` or
`run: bash-client` (tests/helpers/doc_blocks.py); tests/e2e/docs_and_tools/test_docs.py checks the rest."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pagedserve.tests.helpers.doc_blocks import Block, blocks_to_run, client_rewrites
from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "README.md")
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
    # The examples name the embedded model; the tiny model stands in under that name. No API key: as with the
    # documented `engine-serve`, the clients' "unused" key and curl without one are both let in.
    srv = Server(*SMALL_KV, "--max-num-seqs", "8", "--served-model-name", "SmolLM2-135M-Instruct",
                 model=tiny_serving_model, api_key=None, max_model_len=256)
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


@pytest.mark.parametrize("block", blocks_to_run("python-client") + blocks_to_run("bash-client"), ids=lambda b: b.id)
def test_documented_client_block_runs(readme_server, block: Block):
    code = client_rewrites(block.code, readme_server.url, f"tcp://127.0.0.1:{readme_server.engine_port}",
                           readme_server.token)
    command = [sys.executable, "-c", code] if block.argument == "python-client" else \
        ["bash", "-euo", "pipefail", "-c", code]
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost")
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), run.stderr[-3000:]
    readme_server.wait_idle()      # nothing left running for the next block
