"""Streamed text across multi-byte characters split over tokens, with the real SmolLM2 tokenizer.

SmolLM2's byte-level BPE splits emoji and most CJK characters over 2-4 tokens that decode to "\ufffd"
on their own. No streamed delta may carry a "\ufffd", and the deltas must add up to the non-streamed
text, both when the output processor is driven with exact token sequences and end to end through
AsyncEngineClient with prompts that make the model emit such characters.
"""
from __future__ import annotations

import logging

import pytest

from pagedserve.core.config import EngineArgs
from pagedserve.core.model_files import resolve_model
from pagedserve.core.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.async_client import AsyncEngineClient
from pagedserve.frontend.output_processor import OutputProcessor
from pagedserve.frontend.tokenizer import load_tokenizer
from pagedserve.ipc.messages import EngineCoreOutput

REPLACEMENT = "\ufffd"
TEXTS = ["Party time 🎉🎉 and 😀!", "你好，世界！我爱你", "日本語のテキスト, then ASCII", "mixed: é € 🤗 中文 ok"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(resolve_model(smollm2_path))


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Guard: the test only means something if some character really is split over tokens.
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids), f"no split character in {text!r}"
    return ids


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], chunk: int = 1,
           kind: RequestOutputKind = RequestOutputKind.DELTA, stop: list[str] | None = None) -> list[str]:
    """Feed output_ids to an OutputProcessor `chunk` tokens per engine step; the texts it hands out."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=len(output_ids), output_kind=kind, stop=stop)
    processor.add_request("r", None, prompt_ids, ["r"], [params])
    texts = []
    for start in range(0, len(output_ids), chunk):
        last = start + chunk >= len(output_ids)
        out = EngineCoreOutput("r", output_ids[start:start + chunk], finish_reason="length" if last else None)
        for request_output in processor.process_outputs([out]).request_outputs:
            texts.append(request_output.outputs[0].text)
            if request_output.finished:
                return texts
    return texts


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_never_stream_replacement_char(tokenizer, text, chunk):
    ids = encode(tokenizer, text)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    deltas = stream(tokenizer, prompt, ids, chunk)
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert stream(tokenizer, prompt, ids, chunk, RequestOutputKind.FINAL_ONLY) == [text]
    cumulative = stream(tokenizer, prompt, ids, chunk, RequestOutputKind.CUMULATIVE)
    assert all(REPLACEMENT not in t and text.startswith(t) for t in cumulative) and cumulative[-1] == text


def test_prompt_ending_inside_a_character(tokenizer):
    """A character split between prompt and output belongs to the prompt: the output starts after it."""
    ids = encode(tokenizer, "Hi 😀 there 你好")
    for cut in range(1, len(ids)):
        deltas = stream(tokenizer, ids[:cut], ids[cut:])
        assert not any(REPLACEMENT in d for d in deltas), (cut, deltas)
        assert "".join(deltas) == tokenizer.decode(ids[cut:]).lstrip(REPLACEMENT)
        assert stream(tokenizer, ids[:cut], ids[cut:], kind=RequestOutputKind.FINAL_ONLY) == ["".join(deltas)]


def test_multibyte_stop_string_is_not_leaked(tokenizer):
    ids = encode(tokenizer, "你好世界再见")
    deltas = stream(tokenizer, [], ids, stop=["世界"])
    assert "".join(deltas) == "你好"
    assert not any(REPLACEMENT in d or "世" in d for d in deltas)


@pytest.mark.slow
async def test_streamed_model_output_with_emoji_and_cjk(smollm2_path):
    """End to end: SmolLM2 continues these prompts greedily with emoji / CJK split over tokens."""
    args = EngineArgs(model=smollm2_path, dtype="float32", max_model_len=256, kv_cache_memory=0.1)
    client = AsyncEngineClient.from_engine_args(args, log_level=logging.WARNING)
    tokenizer = client.tokenizer
    try:
        for prompt in ["Party time 🎉🎉🎉", "Chinese: 你好，世界！我爱"]:
            deltas, token_ids = [], []
            params = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
            async for out in client.generate(prompt, params):
                deltas.append(out.outputs[0].text)
                token_ids += out.outputs[0].token_ids
            final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            outs = [out async for out in client.generate(prompt, final)]
            assert len(outs) == 1 and outs[0].outputs[0].token_ids == token_ids
            assert sum(REPLACEMENT in tokenizer.decode([t]) for t in token_ids) >= 2, "no split character emitted"
            assert not any(REPLACEMENT in d for d in deltas), deltas
            assert "".join(deltas) == outs[0].outputs[0].text == tokenizer.decode(token_ids, skip_special_tokens=True)
    finally:
        client.shutdown()
