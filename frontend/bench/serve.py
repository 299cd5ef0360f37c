"""`pagedserve bench serve`: load on any OpenAI-compatible server over HTTP, as `vllm bench serve` makes it.

Requests arrive as a Poisson process at each --request-rate (a gamma process with --burstiness other than 1;
inf sends them all at once), stream their output, and are timed on this side (metrics.py). The same tool and
the same requests drive pagedserve, llama.cpp's llama-server and vLLM, so their numbers compare:

    pagedserve bench serve --base-url http://127.0.0.1:8000 --label pagedserve --dataset-name w1 \\
        --request-rate 1 2 inf --ignore-eos --result-file benchmarks/results/serve.jsonl --plot serve.png
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from pagedserve.common import envs
from pagedserve.frontend.bench import datasets, require
from pagedserve.frontend.bench.metrics import METRICS, calculate_metrics, format_report
from pagedserve.frontend.bench.request_func import RequestInput, RequestOutput, send_request
from pagedserve.frontend.bench.results import append_result, run_metadata

_TIMEOUT_S = 6 * 60 * 60                # one request may take as long as a slow CPU run does


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="the server's root URL, e.g. http://127.0.0.1:8080 (default: --host and --port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    parser.add_argument("--header", metavar="KEY=VALUE", nargs="*", default=None,
                        help="headers sent with every request (the API key comes from OPENAI_API_KEY)")
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's first "
                                                      "/v1/models entry)")
    parser.add_argument("--tokenizer", default=None,
                        help="a model folder, .gguf file or hub id whose tokenizer counts output tokens when the "
                             "server reports none, and decodes prompts for chat (default: the embedded model's)")
    datasets.add_dataset_args(parser)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                        help="requests per second, one run per value; inf sends every request at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not measured) first")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's and the arrivals' seed")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos, so every request makes exactly its max_tokens")
    parser.add_argument("--extra-body", type=json.loads, default=None,
                        help="a JSON object merged into every request body, e.g. '{\"temperature\": 1.0}'")
    parser.add_argument("--percentile-metrics", default=",".join(METRICS),
                        help=f"comma-separated, of {', '.join(METRICS)}")
    parser.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    parser.add_argument("--label", default=None, help="names the engine in results and plots (default: the model)")
    parser.add_argument("--result-file", default=None, help="append one JSON line per rate to this file")
    parser.add_argument("--plot", default=None,
                        help="draw TTFT, ITL and E2EL against request throughput into this PNG, one line per label "
                             "of the result file (or of this run without one)")


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        settings = _check(args)
        return asyncio.run(_main_async(args, *settings))
    except ValueError as exc:        # a flag's value, or a --tokenizer that names no tokenizer
        raise SystemExit(f"pagedserve bench serve: {exc}") from None


def _check(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...], dict[str, str]]:
    datasets.check_dataset_args(args)
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {list(METRICS)}")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {args.metric_percentiles!r}")
    if not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {args.metric_percentiles!r}")
    if any(r <= 0 for r in args.request_rate):
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    headers = {}
    for item in args.header or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--header must be KEY=VALUE, got {item!r}")
        headers[key.strip()] = value.strip()
    if envs.OPENAI_API_KEY:
        headers.setdefault("Authorization", f"Bearer {envs.OPENAI_API_KEY}")
    return metrics, percentiles, headers


def base_url(args: argparse.Namespace) -> str:
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return url[:-3] if url.endswith("/v1") else url       # a root URL given with /v1 still works


async def _main_async(args: argparse.Namespace, metrics: tuple[str, ...], percentiles: tuple[float, ...],
                      headers: dict[str, str]) -> list[dict[str, Any]]:
    from pagedserve.frontend.bench.tokenizers import load_bench_tokenizer  # transformers: loaded only here
    root = base_url(args)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests = datasets.sample_requests(args, len(tokenizer), args.seed)
    chat = args.endpoint == "/v1/chat/completions"
    prompts = [tokenizer.decode(r.prompt) if chat else r.prompt for r in requests]
    async with _session(args.max_concurrency) as session:
        model = args.model or await first_model(session, root, headers)
        inputs = [RequestInput(root + args.endpoint, model, p, r.prompt_len, r.expected_output_len, args.ignore_eos,
                               chat, args.extra_body) for p, r in zip(prompts, requests)]
        await _test_request(session, inputs[0], headers, args.num_warmups)
        results = []
        for rate in args.request_rate:
            result = await run_rate(session, inputs, headers, rate, args, tokenizer, metrics, percentiles)
            result = {**run_metadata("serve", args.label or model, args.command_line),
                      **_settings(args, root, model, len(inputs)), **result}
            for i, error in enumerate(result.get("errors", [])):
                print(f"Error {i}: {error}")
            print(format_report(result, metrics, percentiles), flush=True)
            if args.result_file:
                append_result(args.result_file, result)
            results.append(result)
    if args.plot:
        from pagedserve.frontend.bench.plot import plot_serve
        plot_serve(args.plot, args.result_file, results)
    return results


@contextlib.asynccontextmanager
async def _session(max_concurrency: int | None) -> AsyncIterator[Any]:
    aiohttp = require("aiohttp", "pagedserve bench serve")
    timeout = aiohttp.ClientTimeout(total=_TIMEOUT_S)
    # A fresh connection per request: llama-server closes idle kept-alive connections on its own schedule,
    # and a request sent on one it just closed fails (seen here); a loopback connect costs every engine alike.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


async def first_model(session: Any, root: str, headers: dict[str, str]) -> str:
    """The id of the server's first /v1/models entry (vLLM's default for --model)."""
    try:
        async with session.get(root + "/v1/models", headers=headers) as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {json.dumps(body)[:300]}")
    except Exception as exc:             # noqa: BLE001 - any failure here means: say which server and why
        raise SystemExit(f"pagedserve bench serve: cannot list the models of {root}/v1/models: {exc}") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not data:
        raise SystemExit(f"pagedserve bench serve: {root}/v1/models lists no model; give --model")
    return data[0]["id"]


async def _test_request(session: Any, first: RequestInput, headers: dict[str, str], warmups: int) -> None:
    """One request before anything is measured, so a wrong URL, model or key fails at once and clearly;
    then --num-warmups more, all at once."""
    out = await send_request(first, session, headers)
    if not out.success:
        raise SystemExit(f"pagedserve bench serve: the test request to {first.api_url} failed: {out.error}")
    if warmups:
        await asyncio.gather(*(send_request(first, session, headers) for _ in range(warmups)))


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `n` requests is sent: gamma gaps of mean 1 / rate (shape
    `burstiness`; 1 is exponential, i.e. Poisson arrivals), rescaled so that the last arrives at n / rate, as
    vLLM does, so a seed's draw does not move the offered load by a few percent."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()


async def run_rate(session: Any, inputs: list[RequestInput], headers: dict[str, str], rate: float,
                   args: argparse.Namespace, tokenizer: Any, metrics: tuple[str, ...],
                   percentiles: tuple[float, ...]) -> dict[str, Any]:
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

    async def one(req: RequestInput) -> RequestOutput:
        async with limit:
            return await send_request(req, session, headers)

    start = time.perf_counter()
    tasks = []
    for req, at in zip(inputs, arrival_times(len(inputs), rate, args.burstiness, args.seed)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    result = calculate_metrics(outputs, duration, tokenizer, metrics, percentiles)
    return {"request_rate": rate, "expected_output_lens": [r.output_len for r in inputs], **result}


def _settings(args: argparse.Namespace, root: str, model: str, num_prompts: int) -> dict[str, Any]:
    return {"base_url": root, "endpoint": args.endpoint, "model": model, "tokenizer": args.tokenizer,
            **datasets.dataset_settings(args, num_prompts), "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "extra_body": args.extra_body}
