"""Videos over HTTP: a chat's video_url parts (an mp4 as a data: URL and from a real HTTP site) on a real
engine-serve of a tiny Qwen2.5-VL, through the openai SDK, answered as the offline LLM answers the same chat
(tests/frontend/multimodal/test_video_offline.py holds that at HF's tokens); a broken video is a 400 with an
OpenAI-shaped body and the server keeps serving."""
from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.models.tiny_qwen2_vl import make_tiny_qwen2_5_vl
from pagedserve.tests.helpers.models.tiny_vlm import mp4_bytes, random_frames

MAX_NEW = 6
FLAGS = {"limit_mm_per_prompt": '{"image": 1, "video": 1}', "media_io_kwargs": '{"video": {"num_frames": 4}}'}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen25_http")))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> tuple[str, bytes]:
    """(the folder it is in, an mp4 of 9 frames at 4 a second)."""
    folder = tmp_path_factory.mktemp("clips")
    raw = mp4_bytes(random_frames(3, 9))
    (folder / "clip.mp4").write_bytes(raw)
    return str(folder), raw


@pytest.fixture(scope="module")
def offline_answer(qwen_dir):
    """The offline LLM's greedy answer to one user turn of a video and text."""
    import json
    with LLM(qwen_dir, dtype="float32", max_model_len=512, kv_cache_memory=0.05,
             **{k: json.loads(v) for k, v in FLAGS.items()}) as llm:
        def answer(url: str, text: str) -> str:
            out = llm.chat(video_message(url, text), SamplingParams(temperature=0, max_tokens=MAX_NEW),
                           use_tqdm=False)
            return out[0].outputs[0].text
        yield answer


@pytest.fixture(scope="module")
def server(qwen_dir) -> Iterator[Server]:
    srv = Server("--limit-mm-per-prompt", FLAGS["limit_mm_per_prompt"], "--media-io-kwargs",
                 FLAGS["media_io_kwargs"], "--kv-cache-memory", "0.05", model=qwen_dir,
                 max_model_len=512)
    yield srv
    srv.stop_and_check_clean()


@pytest.fixture(scope="module")
def site(clip) -> Iterator[str]:
    """A real HTTP server on a free port serving the clip's folder."""
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=clip[0])   # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def video_message(url: str, text: str = "what happens?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def data_url(raw: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(raw).decode()


def test_the_openai_sdk_with_a_video_url_gets_the_offline_answer(server, clip, offline_answer):
    client = server.client()
    out = client.chat.completions.create(model=client.models.list().data[0].id,
                                         messages=video_message(data_url(clip[1])), max_tokens=MAX_NEW,
                                         temperature=0)
    assert out.choices[0].message.content == offline_answer(data_url(clip[1]), "what happens?")
    assert out.usage.prompt_tokens > 8           # the video's placeholder tokens are counted


def test_an_http_video_url_is_fetched_and_answered_as_the_same_bytes_inline(server, clip, site):
    body = {"messages": video_message(f"{site}/clip.mp4"), "max_tokens": MAX_NEW, "temperature": 0}
    fetched = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.auth, timeout=60)
    assert fetched.status_code == 200, fetched.text
    inline = httpx.post(server.url + "/v1/chat/completions", headers=server.auth, timeout=60,
                        json={**body, "messages": video_message(data_url(clip[1]))})
    assert fetched.json()["choices"][0]["message"]["content"] == inline.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("url, match", [(data_url(b"not a video at all"), "not a video"),
                                        ("data:image/png;base64,AAAA", "video/")])
def test_a_broken_video_is_a_400_and_the_server_keeps_serving(server, clip, url, match):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.auth, timeout=60,
                   json={"messages": video_message(url), "max_tokens": MAX_NEW, "temperature": 0})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and match in error["message"], error
    ok = httpx.post(server.url + "/v1/chat/completions", headers=server.auth, timeout=60,
                    json={"messages": video_message(data_url(clip[1])), "max_tokens": MAX_NEW, "temperature": 0})
    assert ok.status_code == 200, ok.text
