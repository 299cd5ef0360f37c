"""Streamed text across multi-byte characters split over tokens, with the real SmolLM2 tokenizer.

SmolLM2's byte-level BPE splits emoji and most CJK characters over 2-4 tokens that decode to "\ufffd"
on their own. No streamed delta may carry a "\ufffd", and the deltas must add up to the non-streamed
text. Here the output processor is driven with exact token sequences (deterministic); the end-to-end check
(SmolLM2 streaming emoji and CJK over HTTP) is test_server.py::test_stream_never_splits_a_multibyte_character.
"""
from __future__ import annotations

import pytest

from pagedserve.common.model.model_files import resolve_model, tokenizer_folder
from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.client.output_processor import OutputProcessor
from pagedserve.frontend.client.tokenizer import load_tokenizer
from pagedserve.ipc.messages import EngineCoreOutput

REPLACEMENT = "\ufffd"
TEXTS = ["Party time 🎉🎉 and 😀!", "你好，世界！我爱你", "日本語のテキスト, then ASCII", "mixed: é € 🤗 中文 ok"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(tokenizer_folder(resolve_model(smollm2_path)))


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


@pytest.mark.parametrize("skip_special", [True, False])
def test_fast_decoder_matches_tokenizer_decode(tokenizer, skip_special):
    """The detokenizer decodes through the Rust tokenizer directly; it must give transformers' text."""
    import random

    from pagedserve.frontend.client.detokenizer import fast_decoder
    decode = fast_decoder(tokenizer)
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 12))]
        ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        assert decode(ids, skip_special) == tokenizer.decode(ids, skip_special_tokens=skip_special), ids
