"""Videos through the whole engine (offline LLM) on a tiny Qwen2-VL, at token parity with HF transformers given
the same pixel_values_videos / video_grid_thw: an array of frames, frames beside an image, a chat's video_url
(an mp4 in a data: URL, decoded with PyAV) sampled to --media-io-kwargs' num_frames, and the per-prompt limit."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.media import MediaLimits
from pagedserve.frontend.multimodal.video import load_video
from pagedserve.tests.helpers.models.tiny_qwen2_vl import IMAGE, VIDEO, make_tiny_qwen2_vl
from pagedserve.tests.helpers.models.tiny_vlm import mp4_bytes, random_frames, random_image

MAX_NEW = 6
NUM_FRAMES = 4


def frames(seed: int, n: int, w: int = 32, h: int = 24) -> np.ndarray:
    return random_frames(seed, n, w, h)


def mp4_data_url(video: np.ndarray) -> str:
    return "data:video/mp4;base64," + base64.b64encode(mp4_bytes(video)).decode()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen_video")))


@pytest.fixture(scope="module")
def hf(qwen_dir):
    from transformers import Qwen2VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(qwen_dir):
    with LLM(qwen_dir, dtype="float32", max_model_len=512, kv_cache_memory=0.05, max_num_batched_tokens=32,
             limit_mm_per_prompt={"image": 1, "video": 1},
             media_io_kwargs={"video": {"num_frames": NUM_FRAMES}}) as engine:
        yield engine


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def hf_inputs(llm: LLM, hf, prompt: dict, second_per_grid_ts: float | None = None) -> dict:
    """HF's inputs for the prompt as our frontend expanded it, given its items' own tensors
    (second_per_grid_ts: every video's, in place of the item's)."""
    processed = llm.input_processor.parse_prompt(prompt)
    ids = torch.tensor([processed.prompt_token_ids])
    kwargs = {}
    for feature in processed.mm_features:
        for name, t in feature.data.items():
            array = np.frombuffer(t.data, dtype=t.dtype).reshape(t.shape).copy()
            kwargs.setdefault(name, []).append(torch.from_numpy(array))
    kwargs = {name: torch.cat(parts) for name, parts in kwargs.items()}
    if second_per_grid_ts is not None:
        kwargs["second_per_grid_ts"] = torch.full_like(kwargs["second_per_grid_ts"], second_per_grid_ts)
    types = (ids == hf.config.image_token_id).long() + 2 * (ids == hf.config.video_token_id).long()
    return dict(input_ids=ids, mm_token_type_ids=types, **kwargs)


def hf_greedy(llm: LLM, hf, prompt: dict) -> list[int]:
    """HF's greedy tokens (generate) for the prompt as our frontend expanded it."""
    inputs = hf_inputs(llm, hf, prompt)
    ids = inputs["input_ids"]
    with torch.no_grad():
        out = hf.generate(attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, **inputs)
    return out[0, ids.shape[1]:].tolist()


def hf_stepwise_greedy(llm: LLM, hf, prompt: dict, second_per_grid_ts: float | None = None) -> list[int]:
    """HF's greedy tokens by the model's own forward, one token a call: its decode positions are the
    prompt's rope_deltas past each token's index (max position + 1 onwards), as Qwen's reference and vLLM
    place them. transformers 5's generate instead steps on from the last prompt token's position, which
    differs where a video's temporal positions reach past the text after it (a low frame rate)."""
    inputs = hf_inputs(llm, hf, prompt, second_per_grid_ts)
    hf.model.rope_deltas = None
    tokens: list[int] = []
    with torch.no_grad():
        out = hf(**inputs, use_cache=True)
        for _ in range(MAX_NEW):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


def test_videos_alone_and_beside_an_image_match_hf_and_chunked_prefill_splits_them(llm, hf):
    prompts = [{"prompt": f"<|im_start|>user\n{VIDEO}what happens?<|im_end|>\n",
                "multi_modal_data": {"video": frames(0, 6)}},                 # 6 frames sampled to 4: t = 2
               {"prompt": f"first {IMAGE} then {VIDEO} compare them",
                "multi_modal_data": {"image": random_image(1, 40, 30), "video": frames(2, 3, 24, 40)}}]
    want = [hf_greedy(llm, hf, p) for p in prompts]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    grids = [f.data["video_grid_thw"] for p in prompts for f in llm.input_processor.parse_prompt(p).mm_features
             if f.modality == "video"]
    assert [np.frombuffer(g.data, dtype=np.int64).tolist() for g in grids] == [[2, 6, 8], [2, 10, 6]]


def test_a_chats_video_url_is_decoded_sampled_and_matches_the_same_frames_offline(llm, hf):
    url = mp4_data_url(frames(3, 9))
    decoded = load_video(url, MediaLimits(), "v", NUM_FRAMES)
    assert decoded.frames.shape == (NUM_FRAMES, 24, 32, 3) and decoded.fps == pytest.approx(4 * NUM_FRAMES / 9)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "describe"}]}]
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    offline = {"prompt": f"<|im_start|>user\n{VIDEO}describe<|im_end|>\n<|im_start|>assistant\n",
               "multi_modal_data": {"video": decoded.frames}}
    assert list(chat.outputs[0].token_ids) == hf_greedy(llm, hf, offline)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": VIDEO * 2, "multi_modal_data": {"video": [frames(0, 2), frames(1, 2)]}}, "limit-mm-per-prompt"),
    ({"prompt": VIDEO, "multi_modal_data": {"video": np.zeros((2, 8, 8), dtype=np.uint8)}}, "uint8"),
    ({"prompt": VIDEO, "multi_modal_data": {"video": "clip.mp4"}}, "video"),
    ({"prompt": "no placeholder", "multi_modal_data": {"video": frames(0, 2)}}, "placeholder"),
])
def test_bad_videos_name_the_field(llm, prompt, match):
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt], greedy(), use_tqdm=False)


def test_a_broken_video_url_is_refused_by_name():
    with pytest.raises(RequestError, match="not a video"):
        load_video("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode(), MediaLimits(),
                   "v", 4)
    with pytest.raises(RequestError, match="video/"):
        load_video("data:image/png;base64,AAAA", MediaLimits(), "v", 4)


# Qwen2.5-VL: a video's temporal positions step by tokens_per_second (2 here) * second_per_grid_ts, the
# seconds one temporal patch (2 frames) spans at the kept frames' rate (24 a second where none is known)

@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory) -> str:
    from pagedserve.tests.helpers.models.tiny_qwen2_vl import make_tiny_qwen2_5_vl
    return make_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen25_video")))


@pytest.fixture(scope="module")
def hf25(qwen25_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen25_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm25(qwen25_dir):
    with LLM(qwen25_dir, dtype="float32", max_model_len=512, kv_cache_memory=0.05, max_num_batched_tokens=64,
             limit_mm_per_prompt={"image": 1, "video": 2},
             media_io_kwargs={"video": {"num_frames": NUM_FRAMES}}) as engine:
        yield engine


def seconds(llm: LLM, prompt: dict) -> list[float]:
    return [float(np.frombuffer(f.data["second_per_grid_ts"].data, dtype=np.float32)[0])
            for f in llm.input_processor.parse_prompt(prompt).mm_features if f.modality == "video"]


def test_qwen2_5_vl_videos_are_spaced_by_their_rate_as_hf_spaces_them(llm25, hf25):
    long = frames(4, 8, 32, 32)
    prompts = [
        # 6 frames sampled to 4 at 3 frames a second: 2 kept a second, a temporal patch spans 1 s
        {"prompt": f"{VIDEO} what happens?", "multi_modal_data": {"video": (frames(0, 6), {"fps": 3.0})}},
        # the source's 48 frames at 8 a second, 6 of them given (frames_indices), sampled to 4: 4 / 6 of 1 a second
        {"prompt": f"{VIDEO} and {VIDEO}", "multi_modal_data": {"video": [
            (frames(1, 6), {"fps": 8.0, "total_num_frames": 48, "frames_indices": list(range(0, 48, 8))}),
            long]}},                                     # no rate: 24 a second, as transformers assumes
        {"prompt": f"{VIDEO} then {VIDEO}", "multi_modal_data": {"video": [(long, {"fps": 0.5}), long]}}]
    assert [seconds(llm25, p) for p in prompts] == [[1.0], [3.0, pytest.approx(2 / 24)], [8.0, pytest.approx(2 / 24)]]
    want = [hf_stepwise_greedy(llm25, hf25, p) for p in prompts]
    outs = llm25.generate(prompts, greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    # the spacing reaches the logits: HF given Qwen2-VL's unit steps answers otherwise
    unit = [hf_stepwise_greedy(llm25, hf25, p, second_per_grid_ts=1.0) for p in prompts]
    assert unit != want


def test_qwen2_5_vl_video_url_carries_the_kept_frames_rate(llm25, hf25):
    url = mp4_data_url(frames(3, 9))        # 9 frames at 4 a second, 4 kept: 16 / 9 a second, 2 frames span 1.125 s
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "describe"}]}]
    chat = llm25.chat(messages, greedy(), use_tqdm=False)[0]
    decoded = load_video(url, MediaLimits(), "v", NUM_FRAMES)
    offline = {"prompt": f"<|im_start|>user\n{VIDEO}describe<|im_end|>\n<|im_start|>assistant\n",
               "multi_modal_data": {"video": (decoded.frames, {"fps": decoded.fps})}}
    assert seconds(llm25, offline) == [pytest.approx(1.125)]
    assert list(chat.outputs[0].token_ids) == hf_stepwise_greedy(llm25, hf25, offline)


@pytest.mark.parametrize("metadata, match", [
    ({"fps": -1.0}, "fps"), ({"fps": "fast"}, "fps"),
    ({"fps": 2.0, "total_num_frames": 0, "frames_indices": [0]}, "total_num_frames"),
    ({"fps": 1e-9}, "rotary table"),           # its 2 temporal patches 4e9 positions apart: the core refuses it
])
def test_bad_video_metadata_is_refused_by_name(llm25, metadata, match):
    with pytest.raises(RequestError, match=match):
        llm25.generate([{"prompt": VIDEO, "multi_modal_data": {"video": (frames(0, 4), metadata)}}], greedy(),
                       use_tqdm=False)
    assert llm25.generate([{"prompt": "still serving"}], greedy(), use_tqdm=False)[0].outputs[0].token_ids
