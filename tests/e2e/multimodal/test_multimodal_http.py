"""Images over HTTP: the openai SDK's and LangChain's image_url parts (data:, http:// and file:// URLs) on a
real engine-serve of a tiny Llava, answers equal to HF transformers', and every bad image a 400 with an
OpenAI-shaped body while the server keeps serving."""
from __future__ import annotations

import base64
import http.server
import io
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.models.tiny_vlm import make_tiny_llava, random_image

MAX_NEW = 6
BODY_LIMIT = 1 << 20          # --max-body-bytes: an image over it, however it comes, is a 400


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava_http")))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(random_image(3, 40, 40)))
    (folder / "big.png").write_bytes(png_bytes(random_image(5, 800, 800)))       # noise: ~1.9 MB of PNG
    return str(folder)


@pytest.fixture(scope="module")
def server(llava_dir, media_dir) -> Iterator[Server]:
    srv = Server("--allowed-local-media-path", media_dir, "--limit-mm-per-prompt", '{"image": 2}',
                 "--max-body-bytes", str(BODY_LIMIT), "--max-num-seqs", "8", "--kv-cache-memory", "0.05", model=llava_dir, max_model_len=256)
    os.environ.setdefault("VLLM_IMAGE_FETCH_TIMEOUT", "5")
    yield srv
    srv.stop_and_check_clean()


@pytest.fixture(scope="module")
def image_site(media_dir) -> Iterator[str]:
    """A real HTTP server on a free port serving the media folder."""
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=media_dir)   # noqa: E731
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


@pytest.fixture(scope="module")
def hf_text(llava_dir):
    """HF transformers' greedy answer, as text, to one user turn of `text` around one image."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(llava_dir)

    def answer(text: str, image) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=prompt, images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return answer


def image_message(url: str, text: str = "what is it?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def ask(server: Server, messages: list[dict], **fields) -> httpx.Response:
    body = {"messages": messages, "max_tokens": MAX_NEW, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.auth, timeout=60)


def test_the_openai_sdk_with_a_data_url_gets_hf_s_answer(server, hf_text):
    image = random_image(1, 48, 40)
    out = server.client().chat.completions.create(model=server.client().models.list().data[0].id,
                                                  messages=image_message(data_url(png_bytes(image))),
                                                  max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].message.content == hf_text("what is it?", image)
    assert out.usage.prompt_tokens > 16              # the image's 16 placeholder tokens are counted


def test_http_and_file_urls_load_the_same_image(server, image_site, media_dir, hf_text):
    from PIL import Image
    want = hf_text("what is it?", Image.open(os.path.join(media_dir, "cat.png")).convert("RGB"))
    for url in (f"{image_site}/cat.png", "file://" + os.path.join(media_dir, "cat.png")):
        r = ask(server, image_message(url))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want


def test_a_streamed_answer_with_an_image_equals_the_whole_one(server):
    url = data_url(png_bytes(random_image(2, 33, 33)))
    whole = ask(server, image_message(url)).json()["choices"][0]["message"]["content"]
    stream = server.client().chat.completions.create(model=server.client().models.list().data[0].id,
                                                     messages=image_message(url), max_tokens=MAX_NEW,
                                                     temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def test_langchain_human_message_with_image_content(server, hf_text):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    image = random_image(4, 30, 50)
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=server.api_key, temperature=0, max_tokens=MAX_NEW,
                     model=server.client().models.list().data[0].id)
    msg = HumanMessage(content=[{"type": "image_url", "image_url": {"url": data_url(png_bytes(image))}},
                                {"type": "text", "text": "describe"}])
    assert llm.invoke([msg]).content == hf_text("describe", image)


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/x.png"


def _tiff() -> bytes:
    buf = io.BytesIO()
    random_image(0, 8, 8).save(buf, format="TIFF")
    return buf.getvalue()


BAD = {
    "broken base64": (lambda d: "data:image/png;base64,!!notbase64", "base64"),
    "not an image": (lambda d: data_url(b"hello, world"), "not an image"),
    "unsupported format": (lambda d: data_url(_tiff(), "image/tiff"), "unsupported"),
    "outside the allowed folder": (lambda d: "file:///etc/hostname", "allowed-local-media-path"),
    "unreachable URL": (lambda d: _closed_port_url(), "127.0.0.1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_image_is_a_400_and_the_server_keeps_serving(server, media_dir, case):
    make, match = BAD[case]
    start = time.monotonic()
    r = ask(server, image_message(make(media_dir)))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and match in error["message"], error
    assert time.monotonic() - start < 10
    ok = ask(server, image_message(data_url(png_bytes(random_image(9, 20, 20)))))
    assert ok.status_code == 200


def test_an_image_over_max_body_bytes_by_url_or_path_is_a_400(server, image_site, media_dir):
    """--max-body-bytes holds an image whatever brings it in: a fetched URL or a file read may not bring in
    more than a body may carry (the fetch stops at the limit)."""
    assert os.path.getsize(os.path.join(media_dir, "big.png")) > BODY_LIMIT
    for url in (f"{image_site}/big.png", f"file://{media_dir}/big.png"):
        r = ask(server, image_message(url))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert f"over the limit of {BODY_LIMIT}" in error["message"], error
    assert ask(server, image_message(data_url(png_bytes(random_image(9, 20, 20))))).status_code == 200


def test_more_images_than_the_limit_is_a_400(server):
    url = data_url(png_bytes(random_image(5, 20, 20)))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3}]
    r = ask(server, messages)
    assert r.status_code == 400 and "limit-mm-per-prompt" in r.json()["error"]["message"]


def test_an_image_sent_to_a_text_model_is_a_400(api_server):
    url = data_url(png_bytes(random_image(6, 20, 20)))
    r = ask(api_server, image_message(url))
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]


def test_rss_stays_flat_over_500_distinct_images(server):
    """vLLM #15294: RSS grew without bound under image traffic. Every cache here is bounded (processed items
    by bytes, encoder outputs by tokens, pixel data dropped with its request)."""
    import asyncio

    async def send(client: httpx.AsyncClient, seed: int) -> None:
        url = data_url(png_bytes(random_image(1000 + seed, 64, 64)))
        body = {"messages": image_message(url), "max_tokens": 1, "temperature": 0}
        r = await client.post(server.url + "/v1/chat/completions", json=body, headers=server.auth)
        assert r.status_code == 200, r.text

    async def wave(seeds: range) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            for start in range(seeds.start, seeds.stop, 16):
                await asyncio.gather(*(send(client, s) for s in range(start, min(start + 16, seeds.stop))))

    asyncio.run(wave(range(0, 250)))
    server.wait_idle()
    half = server.usage()[0]
    asyncio.run(wave(range(250, 500)))
    server.wait_idle()
    assert server.usage()[0] - half < 100 * 2**20


def test_the_responses_api_takes_input_image(server, hf_text):
    image = random_image(7, 40, 40)
    content = [{"type": "input_image", "image_url": data_url(png_bytes(image))},
               {"type": "input_text", "text": "what is it?"}]
    out = server.client().responses.create(model=server.client().models.list().data[0].id, max_output_tokens=MAX_NEW,
                                           temperature=0, input=[{"role": "user", "content": content}])
    assert out.output_text == hf_text("what is it?", image)


def test_the_anthropic_sdk_takes_base64_image_blocks(server, hf_text, api_server):
    """Anthropic's image block (source.type base64) goes the same multimodal path: HF's answer, the image's
    placeholders counted, streamed as whole; a bad block or a text-only model is an Anthropic-shaped 400."""
    import anthropic
    image = random_image(8, 40, 40)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(image)).decode()}}
    messages = [{"role": "user", "content": [block, {"type": "text", "text": "what is it?"}]}]
    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    model = server.client().models.list().data[0].id
    msg = client.messages.create(model=model, max_tokens=MAX_NEW, messages=messages, extra_body={"temperature": 0})
    assert msg.content[0].text == hf_text("what is it?", image)
    assert client.messages.count_tokens(model=model, messages=messages).input_tokens == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 16
    with client.messages.stream(model=model, max_tokens=MAX_NEW, messages=messages,
                                extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content[0].text == msg.content[0].text
    bad = {**block, "source": {**block["source"], "data": "bm90IGFuIGltYWdl"}}       # "not an image"
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=model, max_tokens=MAX_NEW, messages=[{"role": "user", "content": [bad]}])
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "invalid_request_error"
    text_only = anthropic.Anthropic(base_url=api_server.url, api_key=api_server.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        text_only.messages.create(model=api_server.client().models.list().data[0].id, max_tokens=2,
                                  messages=messages)
    assert "text only" in refused.value.body["error"]["message"]
    assert server.health() == 200
