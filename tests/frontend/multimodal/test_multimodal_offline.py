"""Images through the whole engine (offline LLM: frontend processing, core scheduling, workers' encoder) at
token parity with HF transformers, for each family (Llava: one item per image; Idefics3: one per sub-image;
Qwen2-VL and Qwen2.5-VL: one per image, of its own size, with M-RoPE positions; Gemma 3: one per image, its
tokens attending to each other both ways), across batching, chunked prefill, preemption and prefix hits."""
from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.errors import RequestError
from pagedserve.tests.helpers.models import tiny_gemma3, tiny_qwen2_vl
from pagedserve.tests.helpers.models.tiny_vlm import IMAGE_TOKEN, make_tiny_idefics3, make_tiny_llava, random_image

MAX_NEW = 8


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[str], str]
    hf_class: str
    # engines too small for the batch below: chunks smaller than one image's tokens, too few blocks for all
    chunked: dict[str, Any]
    preempted: dict[str, Any]
    tp2: dict[str, Any]          # a replicated tower on each rank beside a sharded language model
    placeholder: str = IMAGE_TOKEN                  # one image in a prompt's text
    processor: Callable[[str], Any] | None = None   # HF's processor of the folder (None: AutoProcessor)


FAMILIES = [
    Family("llava", make_tiny_llava, "LlavaForConditionalGeneration",
           dict(max_num_batched_tokens=24, max_model_len=128),
           dict(num_gpu_blocks_override=10, block_size=8, max_model_len=80),
           dict(tensor_parallel_size=2, max_model_len=128)),
    # prompts of 12 to 294 tokens (each image 2x2 sub-images plus the global one, 16 tokens each); 39 blocks
    # hold the first two prompts, whose decoding then preempts
    Family("idefics3", make_tiny_idefics3, "Idefics3ForConditionalGeneration",
           dict(max_num_batched_tokens=24, max_model_len=320),
           dict(num_gpu_blocks_override=39, block_size=8, max_model_len=312),
           dict(tensor_parallel_size=2, max_model_len=320)),
    # prompts of 32, 59, 100 and 12 tokens (images of 20, 24 and 35 tokens, M-RoPE positions); chunks of 24
    # split every image; 7 blocks of 16 hold the first two prompts, whose decoding then preempts
    Family("qwen2_vl", tiny_qwen2_vl.make_tiny_qwen2_vl, "Qwen2VLForConditionalGeneration",
           dict(max_num_batched_tokens=24, max_model_len=256),
           dict(num_gpu_blocks_override=7, block_size=16, max_model_len=112),
           dict(tensor_parallel_size=2, max_model_len=256), tiny_qwen2_vl.IMAGE, tiny_qwen2_vl.hf_processor),
    # the same prompts through Qwen2.5-VL's window-attention tower
    Family("qwen2_5_vl", tiny_qwen2_vl.make_tiny_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration",
           dict(max_num_batched_tokens=24, max_model_len=256),
           dict(num_gpu_blocks_override=7, block_size=16, max_model_len=112),
           dict(tensor_parallel_size=2, max_model_len=256), tiny_qwen2_vl.IMAGE, tiny_qwen2_vl.hf_processor),
    # prompts of 30, 49, 72 and 12 tokens (16 tokens an image, attended both ways); chunks of 20 stop before
    # an image rather than split it; 11 blocks of 8 hold the first two prompts, whose decoding then preempts
    Family("gemma3", tiny_gemma3.make_tiny_gemma3, "Gemma3ForConditionalGeneration",
           dict(max_num_batched_tokens=20, max_model_len=128),
           dict(num_gpu_blocks_override=11, block_size=8, max_model_len=88),
           dict(tensor_parallel_size=2, max_model_len=256), tiny_gemma3.IMAGE),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request) -> Family:
    return request.param


@pytest.fixture(scope="module")
def vlm_dir(family, tmp_path_factory) -> str:
    return family.make(str(tmp_path_factory.mktemp(family.name)))


@pytest.fixture(scope="module")
def hf(family, vlm_dir):
    import transformers
    model = getattr(transformers, family.hf_class).from_pretrained(vlm_dir, dtype=torch.float32).eval()
    processor = (family.processor or transformers.AutoProcessor.from_pretrained)(vlm_dir)
    return model, processor


def hf_greedy(hf, text: str, images: list) -> list[int]:
    model, processor = hf
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


CASES = [  # (text, number of images), {image} the family's placeholder
    ("USER: {image}describe it\nASSISTANT:", 1),
    ("USER: compare {image} and {image}\nASSISTANT:", 2),
    ("USER: {image}{image}{image} three in a row, then a longer question about them\n", 3),
    ("USER: no image at all here\nASSISTANT:", 0),
]
PLACEHOLDER = {f.name: f.placeholder for f in FAMILIES}


def case_inputs(seed: int, family: str = "llava") -> list[tuple[str, list]]:
    return [(text.format(image=PLACEHOLDER[family]), [random_image(seed * 10 + i, 40 + 7 * i, 30 + 5 * i)
                                                     for i in range(n)]) for text, n in CASES]


@pytest.fixture(scope="module")
def want(hf, family) -> list[list[int]]:
    return [hf_greedy(hf, text, images) for text, images in case_inputs(0, family.name)]


def run(llm: LLM, family: Family, seed: int = 0) -> list[list[int]]:
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
               for text, images in case_inputs(seed, family.name)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(vlm_dir):
    with LLM(vlm_dir, dtype="float32", max_model_len=512, kv_cache_memory=0.05) as engine:
        yield engine


def test_batched_prompts_with_zero_to_three_images_match_hf(llm, family, want):
    assert run(llm, family) == want


def test_the_same_images_again_hit_the_prefix_cache_and_still_match(llm, family, want):
    text, images = case_inputs(0, family.name)[1]
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], greedy(), use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == want[1]
    assert outs[0].num_cached_tokens >= 16          # the image's blocks came back from the cache


def test_the_same_text_beside_other_images_reuses_no_image_kv(llm, family, hf):
    text, images = case_inputs(5, family.name)[1]
    out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, text, images)
    hf_ids = hf[1](text=text, images=images)["input_ids"][0]
    first_image = list(hf_ids).index(hf[0].config.image_token_id)     # its first placeholder token
    assert out.num_cached_tokens <= first_image


@pytest.mark.parametrize("mode", ["chunked", "preempted", "tp2"])
def test_chunked_prefill_and_preemption_keep_parity(family, vlm_dir, want, mode):
    engine = getattr(family, mode)
    with LLM(vlm_dir, dtype="float32", enable_prefix_caching=False, **engine) as small:
        assert run(small, family) == want
        if mode == "preempted":
            assert small.engine.scheduler.num_preemptions > 0


def test_chat_with_image_url_parts_matches_hf(llm, hf):
    image = random_image(42, 36, 36)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "?"}]}]
    out = llm.chat(messages, greedy(), use_tqdm=False)[0]
    text = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, text, [image])


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "no placeholder", "multi_modal_data": {"image": [None]}}, "placeholder"),
    ({"prompt": "{image}", "multi_modal_data": {"image": ["not an image"]}}, "PIL"),
    ({"prompt": "{image}", "multi_modal_data": {"audio": []}}, "images"),
])
def test_bad_multimodal_prompts_name_the_field(llm, family, prompt, match):
    prompt = {**prompt, "prompt": prompt["prompt"].format(image=family.placeholder)}
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt], greedy(), use_tqdm=False)


def test_more_images_than_the_limit_are_refused(vlm_dir, family):
    # an Idefics3 image is five items (its sub-images), still one image to the limit
    cases = case_inputs(0, family.name)
    with LLM(vlm_dir, dtype="float32", max_model_len=256, limit_mm_per_prompt={"image": 1}) as one:
        with pytest.raises(RequestError, match="limit-mm-per-prompt"):
            one.generate([{"prompt": family.placeholder * 2, "multi_modal_data": {"image": cases[1][1]}}],
                         greedy(), use_tqdm=False)
        out = one.generate([{"prompt": cases[0][0], "multi_modal_data": {"image": cases[0][1]}}],
                           greedy(), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == MAX_NEW


def test_a_text_model_refuses_images(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128) as text_only:
        with pytest.raises(RequestError, match="text only"):
            text_only.generate([{"prompt": "x", "multi_modal_data": {"image": random_image(0, 8, 8)}}],
                               greedy(), use_tqdm=False)


def test_the_core_refuses_hostile_items_and_keeps_serving(llm, family, want):
    """The core's trust boundary: items a client could forge are refused by name, before any step runs them."""
    import time

    import msgspec

    from pagedserve.ipc.messages import EngineCoreRequest, TensorData
    text, images = case_inputs(0, family.name)[0]
    good = llm.input_processor.parse_prompt({"prompt": text, "multi_modal_data": {"image": images}})
    item = good.mm_features[0]
    pixels = item.data["pixel_values"]
    forged = {
        "too few tokens": msgspec.structs.replace(item, length=item.length - 1),
        "outside the prompt": msgspec.structs.replace(item, offset=len(good.prompt_token_ids)),
        "no data": msgspec.structs.replace(item, data=None),
        "another tensor": msgspec.structs.replace(item, data={"pixels": pixels}),
        "wrong shape": msgspec.structs.replace(item, data={"pixel_values": TensorData("float32", [1, 3, 16, 64],
                                                                                      pixels.data)}),
        "short bytes": msgspec.structs.replace(item, data={"pixel_values": TensorData("float32", pixels.shape,
                                                                                      pixels.data[:-4])}),
        "unknown dtype": msgspec.structs.replace(item, data={"pixel_values": TensorData("complex64", pixels.shape,
                                                                                        pixels.data)}),
    }
    if "image_grid_thw" in item.data:       # a dynamic item's grid must agree with its tokens and pixels
        grid = item.data["image_grid_thw"]
        for j, thw in enumerate(([1, 8, 12], [0, 8, 10], [1, 7, 10], [1, 800, 1000])):
            forged[f"grid {j}"] = msgspec.structs.replace(item, data={**item.data, "image_grid_thw": TensorData(
                "int64", [1, 3], np.array([thw], dtype=np.int64).tobytes())})
        forged["patches short"] = msgspec.structs.replace(item, data={**item.data, "pixel_values": TensorData(
            "float32", [pixels.shape[0] - 1, pixels.shape[1]], pixels.data[:-4 * pixels.shape[1]])})
        forged["grid dtype"] = msgspec.structs.replace(item, data={**item.data, "image_grid_thw": TensorData(
            "int32", [1, 3], grid.data[:12])})
    for i, (name, bad) in enumerate(forged.items()):
        request = EngineCoreRequest(f"forged-{i}", good.prompt_token_ids, greedy(), time.time(), mm_features=[bad])
        with pytest.raises(RequestError, match="multi_modal_data"):
            llm.engine.add_request(request)
    assert run(llm, family) == want
