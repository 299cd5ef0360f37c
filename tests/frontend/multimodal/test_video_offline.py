"""Videos through the whole engine (offline LLM) on a tiny Qwen2-VL, at token parity with HF transformers given
the same pixel_values_videos / video_grid_thw: an array of frames, frames beside an image, a chat's video_url
(an mp4 in a data: URL, decoded with PyAV) sampled to --media-io-kwargs' num_frames, and the per-prompt limit."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.media import MediaLimits
from pagedserve.frontend.multimodal.video import load_video
from pagedserve.tests.helpers.tiny_qwen2_vl import IMAGE, VIDEO, make_tiny_qwen2_vl
from pagedserve.tests.helpers.tiny_vlm import random_image

MAX_NEW = 6
NUM_FRAMES = 4


def frames(seed: int, n: int, w: int = 32, h: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def mp4_data_url(video: np.ndarray) -> str:
    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = video.shape[2], video.shape[1], "yuv420p"
        for frame in video:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


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


def hf_greedy(llm: LLM, hf, prompt: dict) -> list[int]:
    """HF's greedy tokens for the prompt as our frontend expanded it, given its items' own tensors."""
    processed = llm.input_processor.parse_prompt(prompt)
    ids = torch.tensor([processed.prompt_token_ids])
    kwargs = {}
    for feature in processed.mm_features:
        for name, t in feature.data.items():
            array = np.frombuffer(t.data, dtype=t.dtype).reshape(t.shape).copy()
            kwargs.setdefault(name, []).append(torch.from_numpy(array))
    kwargs = {name: torch.cat(parts) for name, parts in kwargs.items()}
    types = (ids == hf.config.image_token_id).long() + 2 * (ids == hf.config.video_token_id).long()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                          max_new_tokens=MAX_NEW, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


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
    assert decoded.shape == (NUM_FRAMES, 24, 32, 3)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "describe"}]}]
    chat = llm.chat(messages, greedy(), use_tqdm=False)[0]
    offline = {"prompt": f"<|im_start|>user\n{VIDEO}describe<|im_end|>\n<|im_start|>assistant\n",
               "multi_modal_data": {"video": decoded}}
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
