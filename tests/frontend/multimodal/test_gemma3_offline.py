"""Gemma 3 through the engine, beyond what every family runs (test_multimodal_offline.py): HF's exact prompt
ids (the "\\n\\n" around an image tokenized with its neighbours), greedy tokens that HF's causal-only run would
not give (so a dropped bidirectional mask fails here), pan-and-scan crops at HF's ids and tokens, and the
engine refused at start where its chunks cannot hold an image."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.models.tiny_gemma3 import IMAGE, make_tiny_gemma3
from pagedserve.tests.helpers.models.tiny_vlm import random_image

TEXTS = [f"USER: {IMAGE}describe it", f"{IMAGE}", f"a\n{IMAGE}\nb {IMAGE}{IMAGE} end", f"x {IMAGE}\n\n\nlast"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def processor(folder):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(folder, dtype="float32", max_model_len=256, kv_cache_memory=0.05) as engine:
        yield engine


def images(n: int) -> list:
    return [random_image(seed, 30 + 9 * seed, 41) for seed in range(n)]


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_ids_and_image_runs_are_hfs(llm, processor, text):
    n = text.count(IMAGE)
    want = processor(text=text, images=images(n))
    got = llm.input_processor.parse_prompt({"prompt": text, "multi_modal_data": {"image": images(n)}})
    assert got.prompt_token_ids == list(want["input_ids"][0])
    runs = [i for i, t in enumerate(want["token_type_ids"][0]) if t == 1]
    assert [p for f in got.mm_features for p in range(f.offset, f.offset + f.length)] == runs


def test_greedy_tokens_are_hfs_with_the_bidirectional_mask_not_without(llm, folder, processor):
    from transformers import Gemma3ForConditionalGeneration
    hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    text = f"USER: compare {IMAGE} and {IMAGE}\nASSISTANT:"
    inputs = processor(text=text, images=images(2), return_tensors="pt")
    with torch.no_grad():
        both_ways = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        causal_only = hf.generate(**{k: v for k, v in inputs.items() if k != "token_type_ids"}, max_new_tokens=8,
                                  do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert both_ways.tolist() != causal_only.tolist()      # a causal-only engine would fail the next line
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images(2)}}], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == both_ways.tolist()


def test_an_engine_whose_chunks_cannot_hold_an_image_is_refused_at_start(folder):
    with pytest.raises(ValueError, match="disable_chunked_mm_input.*--max-num-batched-tokens to at least 16"):
        LLM(folder, dtype="float32", max_model_len=256, max_num_batched_tokens=8)


def test_pan_and_scan_crops_are_hfs(folder):
    """--mm-processor-kwargs '{"do_pan_and_scan": true}': a wide image and its crops, each view its own run of
    image tokens inside HF's "Here is the original image ..." text, beside a square image that is not cropped."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}
    processor = AutoProcessor.from_pretrained(folder, **kwargs)
    hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    text = f"USER: {IMAGE} is wide, {IMAGE} is not\nASSISTANT:"
    views = [random_image(3, 96, 30), random_image(4, 32, 32)]
    inputs = processor(text=text, images=views, return_tensors="pt")
    assert len(inputs["pixel_values"]) > 2                 # the wide one was cropped
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    with LLM(folder, dtype="float32", max_model_len=512, kv_cache_memory=0.05, mm_processor_kwargs=kwargs) as llm:
        prompt = {"prompt": text, "multi_modal_data": {"image": views}}
        got = llm.input_processor.parse_prompt(prompt)
        assert got.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert [f.part for f in got.mm_features] == list(range(len(inputs["pixel_values"]) - 1)) + [0]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == want


def test_a_repeat_whose_prefix_hit_would_end_inside_the_image_recomputes_it(llm, processor):
    """A prompt that ends just after its image: a repeat's hit (whole blocks, the last token left to run) would
    end inside the image, so it is cut back to the image's start, and the tokens stay HF's."""
    text = f"{IMAGE}?"
    prompt = {"prompt": text, "multi_modal_data": {"image": images(1)}}
    item = llm.input_processor.parse_prompt(prompt).mm_features[0]
    block = llm.engine.scheduler.kv.block_size
    n = len(processor(text=text, images=images(1))["input_ids"][0])
    naive = (n - 1) // block * block
    assert item.offset < naive < item.offset + item.length          # the case this test is about
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens == item.offset // block * block
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
