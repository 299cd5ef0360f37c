"""InputProcessor: prompts in, validated EngineCoreRequests out; one validator shared with the engine core."""
from __future__ import annotations

import pytest
from pagedserve.tests.helpers.models.tiny_models import synthetic_tokenizer

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.frontend.client.input_processor import InputProcessor, ProcessedPrompt
from pagedserve.ipc.messages import EngineCoreRequest, EngineInfo

VOCAB = 64
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}" \
           "[assistant]{% endif %}"


def info(max_model_len: int = 16) -> EngineInfo:
    return EngineInfo(served_model_name="m", model_path="/nowhere", tokenizer="/nowhere", max_model_len=max_model_len,
                      vocab_size=VOCAB, eos_token_ids=[2], max_waiting_requests=None, block_size=16, num_blocks=8)


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer(VOCAB)


def test_parse_prompt_forms(tokenizer) -> None:
    ip = InputProcessor(tokenizer, info())
    assert ip.parse_prompt("w5 w6") == ProcessedPrompt("w5 w6", [5, 6])
    assert ip.parse_prompt([7, 8]) == ProcessedPrompt(None, [7, 8])
    assert ip.parse_prompt({"prompt_token_ids": [9], "prompt": "w9"}) == ProcessedPrompt("w9", [9])
    assert ip.parse_prompt({"prompt": "w4"}) == ProcessedPrompt("w4", [4])
    for bad, field in ((3.5, "prompt"), ({"x": 1}, "prompt"), ([1, "2"], "prompt_token_ids"),
                       ([True], "prompt_token_ids")):
        with pytest.raises(ValueError, match=f"^{field}"):
            ip.parse_prompt(bad)


def test_chat_template_passed_in_wins_and_tokenizer_is_untouched(tokenizer) -> None:
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="^messages: this model's tokenizer has no chat template"):
        InputProcessor(tokenizer, info()).apply_chat_template([{"role": "user", "content": "w5"}])
    ip = InputProcessor(tokenizer, info(), chat_template=TEMPLATE)
    out = ip.apply_chat_template([{"role": "user", "content": "w5"}])
    assert out.prompt == "[user] w5 [assistant]"
    assert tokenizer.chat_template is None          # passed in, never patched into the tokenizer
    other = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert ip.apply_chat_template([{"role": "user", "content": "w6"}], chat_template=other).prompt == "w6"
    with pytest.raises(ValueError, match="^chat_template_kwargs: .*tokenize"):
        ip.apply_chat_template([{"role": "user", "content": "w5"}], template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="^messages must be a list"):
        ip.apply_chat_template([{"content": "no role"}])


def test_make_requests_fans_out_samples(tokenizer) -> None:
    ip = InputProcessor(tokenizer, info())
    prepared = ip.make_requests("r", ProcessedPrompt(None, [5, 6]), SamplingParams(n=3, seed=10, max_tokens=4),
                                priority=2, arrival_time=1.5)
    assert prepared.child_ids == ["r#0", "r#1", "r#2"]
    assert [r.sampling_params.seed for r in prepared.requests] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 and r.priority == 2 and r.arrival_time == 1.5 for r in prepared.requests)
    single = ip.make_requests("s", ProcessedPrompt(None, [5]), SamplingParams(max_tokens=4))
    assert single.child_ids == ["s"] and single.requests[0].request_id == "s"


BAD = [([], 4, "prompt must contain at least one token"),
       ([5, VOCAB], 4, r"prompt_token_ids must be in \[0, 64\)"),
       ([5] * 16, 1, "prompt: 16 tokens, but this model's maximum context length"),
       ([5] * 10, 7, "max_tokens: 7 requested, but the prompt uses 10 of the 16 tokens")]


@pytest.mark.parametrize("prompt, max_tokens, message", BAD)
def test_frontend_refuses_with_the_validators_words(tokenizer, prompt, max_tokens, message) -> None:
    ip = InputProcessor(tokenizer, info())
    with pytest.raises(ValueError, match=f"^{message}"):
        ip.make_requests("r", ProcessedPrompt(None, prompt), SamplingParams(max_tokens=max_tokens))


def test_core_refuses_with_the_same_words(tiny_llama_dir) -> None:
    """The core runs the same validator authoritatively: a client that skips the frontend gets the same
    error text."""
    core = EngineCore.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=16,
                                                  kv_cache_memory=0.01), get_executor_class("uni"))
    try:
        vocab = core.info().vocab_size
        for prompt, max_tokens, message in BAD:
            prompt = [vocab if t == VOCAB else t for t in prompt]
            message = message.replace("64", str(vocab))
            with pytest.raises(ValueError, match=f"^{message}"):
                core.add_request(EngineCoreRequest("r", prompt, SamplingParams(max_tokens=max_tokens), 0.0))
    finally:
        core.shutdown()
