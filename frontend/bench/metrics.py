"""Serving metrics from timed requests, as vLLM's `bench serve` defines them.

- TTFT: request sent -> first output chunk.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: every gap between two output chunks, of every request, pooled.
- E2EL: request sent -> last output chunk.
Output tokens are the server's own count (usage.completion_tokens) where it gives one, else the tokenizer's
count of the text it streamed (several tokens may share a chunk, so chunks are not counted); input tokens are
the server's usage.prompt_tokens where given (a chat template adds some), else the prompt's own.
Each metric reports mean, median, std and the chosen percentiles, in milliseconds.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.frontend.bench.request_func import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
_NAMES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
          "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def output_len(out: RequestOutput, tokenizer: Any) -> int:
    if out.output_tokens is not None:
        return out.output_tokens
    return len(tokenizer(out.generated_text, add_special_tokens=False).input_ids)


def calculate_metrics(outputs: list[RequestOutput], duration_s: float, tokenizer: Any,
                      metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    lens = [output_len(o, tokenizer) if o.success else 0 for o in outputs]
    samples: dict[str, list[float]] = {
        "ttft": [o.ttft for o in ok], "e2el": [o.latency for o in ok],
        "itl": [gap for o in ok for gap in o.itl],
        "tpot": [(o.latency - o.ttft) / (n - 1) for o, n in zip(outputs, lens) if o.success and n > 1]}
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(lens)
    result: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_concurrent_requests": peak_concurrency(ok),
        "input_lens": [o.prompt_len for o in outputs], "output_lens": lens,
    }
    for name in metrics:
        result.update(summarize(name, samples[name], percentiles))
    errors = [o.error for o in outputs if not o.success]
    if errors:
        result["errors"] = errors[:10]
    return result


def summarize(name: str, seconds: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std/pXX of `seconds`, in ms, under vLLM's keys (0 for an empty list, as vLLM does)."""
    values = np.asarray(seconds or [0.0]) * 1000.0
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
           f"std_{name}_ms": float(values.std())}
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return out


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def peak_concurrency(outputs: list[RequestOutput]) -> int:
    """Most requests in flight at once, over half-open [start, end) intervals."""
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def format_report(result: dict[str, Any], metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> str:
    """The result as vLLM prints it."""
    rate = result["request_rate"]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    rows: list[tuple[str, Any]] = [("Successful requests:", result["completed"]),
                                   ("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency:", result["max_concurrency"]))
    if rate != float("inf"):
        rows.append(("Request rate configured (RPS):", f"{rate:.2f}"))
    rows += [("Benchmark duration (s):", f"{result['duration']:.2f}"),
             ("Total input tokens:", result["total_input_tokens"]),
             ("Total generated tokens:", result["total_output_tokens"]),
             ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
             ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
             ("Peak concurrent requests:", result["max_concurrent_requests"]),
             ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")]
    lines += ["{:<40} {:<10}".format(k, v) for k, v in rows]
    for name in metrics:
        short, header = _NAMES[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append("{:<40} {:<10.2f}".format(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            word = percentile_word(p)
            lines.append("{:<40} {:<10.2f}".format(f"P{word} {short} (ms):", result[f"p{word}_{name}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)
