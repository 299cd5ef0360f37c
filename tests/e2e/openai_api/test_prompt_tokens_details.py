"""usage.prompt_tokens_details.cached_tokens on chat and completions (vLLM's --enable-prompt-tokens-details),
whole and in the final streamed usage chunk, against a real engine-serve: the prefix cache's hit, the same
number the Responses API's input_tokens_details.cached_tokens reports. Without the flag, usage is as before
(tests/e2e/anthropic_api/test_anthropic_messages.py's server runs without it and checks so)."""
from __future__ import annotations

import anthropic
import pytest

from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

# Several KV blocks long, so that a second request reads most of it from the prefix cache.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 10
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tiny_serving_model):
    srv = Server(*SMALL_KV, "--enable-prompt-tokens-details", model=tiny_serving_model, max_model_len=256)
    yield srv
    srv.stop_and_check_clean()


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.client().models.list().data[0].id


def test_chat_and_completions_report_cached_tokens(server, model):
    client = server.client()
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0       # a prompt never seen: nothing cached
    again = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    prompt = again.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Full blocks of the prompt are cached; the last token is always computed (it makes the first logits).
    assert 0 < cached < prompt and cached >= prompt - 32
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [cached]
    # The Responses API reports the same number from the same source.
    resp = client.responses.create(model=model, input=MESSAGES, max_output_tokens=2)
    assert resp.usage.input_tokens_details.cached_tokens == cached
    # Completions: the same count per prompt, summed over a batch of prompts.
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=2).usage.prompt_tokens_details.cached_tokens
    assert one > 0
    batch = client.completions.create(model=model, prompt=[PROMPT, PROMPT], max_tokens=2)
    assert batch.usage.prompt_tokens_details.cached_tokens == 2 * one
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    assert [c.usage.prompt_tokens_details.cached_tokens for c in stream if c.usage is not None] == [one]


def test_anthropic_usage_reads_the_same_number(server, model):
    client = server.client()
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    msg = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0).messages.create(
        model=chat.model, max_tokens=2, messages=MESSAGES)
    assert msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens_details.cached_tokens > 0
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens

