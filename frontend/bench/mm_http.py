"""The HTTP half of `pagedserve bench mm`: TTFT of chat requests against a fresh `pagedserve serve`.

TTFT is the time from sending a request to the first streamed chunk that carries output (request_func.py's
rule). Request bodies are built, images encoded as PNG data URLs, before any clock starts: on a 2-core machine
this client shares the CPU with the server, and encoding a 2048 x 2048 PNG here would be timed as the server's.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import statistics
import time
from typing import Any

from pagedserve.frontend.bench import require
from pagedserve.frontend.bench.models import random_image
from pagedserve.frontend.bench.peer.ladder_serve import pagedserve_server
from pagedserve.frontend.bench.request_func import SSEParser
from pagedserve.frontend.bench.serve import first_model

_TIMEOUT_S = 60 * 60
_JSON = {"Content-Type": "application/json"}
TEXT_PROMPT = "Request {}: write a short story about a lighthouse keeper."


def run_http(args: argparse.Namespace, cfg: dict[str, Any], measures: list[str]) -> list[tuple[str, dict]]:
    """Each of `measures` ("ttft-cache", "ttft-beside") on one fresh server; (measure, result) pairs."""
    # Random noise does not compress: a large image's PNG data URL is ~4/3 of 3 bytes a pixel, over the
    # server's default 8 MiB body limit at 2048 x 2048.
    body_limit = max(8 << 20, 8 * args.large_image_size ** 2 + (1 << 20))
    extra = ("--dtype", cfg["dtype"], "--max-body-bytes", str(body_limit))
    with pagedserve_server(cfg["model"], cfg["threads"], cfg["engine_options"], extra=extra) as url:
        return asyncio.run(_measure(url, args, cfg, measures))


async def _measure(url: str, args: argparse.Namespace, cfg: dict[str, Any],
                   measures: list[str]) -> list[tuple[str, dict]]:
    aiohttp = require("aiohttp", "pagedserve bench mm")
    # A fresh connection per request, as bench serve does; no pool limit, so the large requests all go at once.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as s:
        model = await first_model(s, url, {})
        client = Client(s, url, model, args.ttft_output_len)
        results = []
        for measure in measures:
            run = ttft_cache if measure == "ttft-cache" else ttft_beside
            results.append((measure, {"base_url": url, "served_model": model,
                                      "ttft_output_len": args.ttft_output_len, **await run(client, args, cfg)}))
        return results


class Client:
    """Streamed chat requests to one server, timed to their first output chunk."""

    def __init__(self, session: Any, url: str, model: str, max_tokens: int) -> None:
        self.session, self.url, self.model, self.max_tokens = session, url, model, max_tokens

    def body(self, content: str | list[dict[str, Any]]) -> bytes:
        return json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                           "stream": True}).encode()

    def image_body(self, image: Any, text: str) -> bytes:
        return self.body([{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                          {"type": "text", "text": text}])

    async def ttft(self, body: bytes) -> float:
        """Seconds to the first output chunk; the stream is read to its end, so the request is done when
        this returns. RuntimeError on an HTTP error or a stream without output."""
        start = time.perf_counter()
        first: float | None = None
        async with self.session.post(self.url + "/v1/chat/completions", data=body, headers=_JSON) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            parser = SSEParser()
            async for data in response.content.iter_any():
                for event in parser.feed(data):
                    if first is None and event != "[DONE]" and _carries_output(json.loads(event)):
                        first = time.perf_counter() - start
        if first is None:
            raise RuntimeError("the stream carried no output")
        return first

    async def prefix_hits(self) -> float:
        """The server's prefix-cache hit tokens so far (vllm:prefix_cache_hits)."""
        async with self.session.get(self.url + "/metrics") as response:
            text = await response.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits{")))


def _carries_output(message: dict[str, Any]) -> bool:
    # Empty text with no finish reason is a token that decodes to nothing yet (request_func.py's rule).
    for choice in message.get("choices") or []:
        delta = choice.get("delta") or {}
        if "role" in delta and not delta.get("content"):
            continue                     # the opening chunk, sent before any token
        piece = delta.get("content")
        if piece or (piece == "" and choice.get("finish_reason") is None):
            return True
    return False


def png_data_url(image: Any) -> str:
    buf = io.BytesIO()
    # Noise does not compress at any level; the fastest keeps a round's 8 large encodes to seconds.
    image.save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def ttft_cache(client: Client, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """Per round, an image never sent before, then the same request again."""
    warm = client.image_body(random_image(1, cfg["image_size"]), args.text)
    for _ in range(2):                   # the first request's one-time costs, on the miss and the hit path
        await client.ttft(warm)
    uncached, cached, hits = [], [], []
    for r in range(args.ttft_rounds):
        body = client.image_body(random_image(100 + r, cfg["image_size"]), args.text)
        uncached.append(await client.ttft(body))
        before = await client.prefix_hits()
        cached.append(await client.ttft(body))
        hits.append(await client.prefix_hits() - before)
    u, c = statistics.median(uncached), statistics.median(cached)
    return {"uncached_ttft_ms": _ms(uncached), "cached_ttft_ms": _ms(cached), "cached_prefix_hit_tokens": hits,
            "median_uncached_ttft_ms": u * 1e3, "median_cached_ttft_ms": c * 1e3, "cached_vs_uncached": c / u,
            "rounds": args.ttft_rounds}


async def ttft_beside(client: Client, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """A text request's TTFT idle, then per round sent right after the large-image requests."""
    # Every text request differs in its first block, so none is served from the prefix cache.
    texts = (client.body(TEXT_PROMPT.format(i)) for i in itertools.count())
    await client.ttft(next(texts))
    idle = [await client.ttft(next(texts)) for _ in range(args.idle_samples)]
    beside, large = [], []
    for r in range(args.ttft_rounds):
        bodies = [client.image_body(random_image(10 ** 4 * (r + 1) + i, args.large_image_size), args.text)
                  for i in range(args.num_large_images)]
        text = next(texts)
        tasks = [asyncio.create_task(client.ttft(b)) for b in bodies]
        await asyncio.sleep(args.beside_delay_s)
        beside.append(await client.ttft(text))
        large += await asyncio.gather(*tasks)
    i, b = statistics.median(idle), statistics.median(beside)
    return {"idle_ttft_ms": _ms(idle), "beside_ttft_ms": _ms(beside), "large_image_ttft_ms": _ms(large),
            "median_idle_ttft_ms": i * 1e3, "median_beside_ttft_ms": b * 1e3, "beside_vs_idle": b / i,
            "large_image_size": args.large_image_size, "num_large_images": args.num_large_images,
            "large_body_bytes": len(bodies[0]), "beside_delay_s": args.beside_delay_s, "rounds": args.ttft_rounds}


def _ms(seconds: list[float]) -> list[float]:
    return [round(s * 1e3, 3) for s in seconds]
