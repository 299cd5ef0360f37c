"""The bench tool's parts that need no server: vLLM's metric definitions on known timings, the SSE reader on
awkwardly split bytes, Poisson arrivals, the datasets (W1 is the same 64 requests it always was) and the
results file."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pagedserve.frontend.bench import datasets
from pagedserve.frontend.bench.metrics import calculate_metrics
from pagedserve.frontend.bench.request_func import RequestOutput, SSEParser
from pagedserve.frontend.bench.results import append_result, read_results
from pagedserve.frontend.bench.serve import arrival_times
from pagedserve.frontend.bench.throughput import constrained
from pagedserve.tests.helpers.models.tiny_models import embedded_tokenizer


def timed(ttft: float, gaps: list[float], text: str = "", tokens: int | None = None, start: float = 0.0):
    return RequestOutput(success=True, generated_text=text, output_tokens=tokens, ttft=ttft, itl=gaps,
                         latency=ttft + sum(gaps), start_time=start, prompt_len=10)


def test_metrics_follow_vllms_definitions():
    outs = [timed(0.1, [0.02, 0.04], tokens=3), timed(0.3, [0.01] * 4, tokens=9, start=0.05),
            RequestOutput(success=False, error="HTTP 500")]
    m = calculate_metrics(outs, duration_s=2.0, tokenizer=None, metrics=("ttft", "tpot", "itl", "e2el"),
                          percentiles=(50, 99))
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 500"])
    assert m["output_lens"] == [3, 9, 0] and m["total_output_tokens"] == 12 and m["total_input_tokens"] == 20
    assert m["output_throughput"] == 6.0 and m["request_throughput"] == 1.0
    # TPOT per request: (E2EL - TTFT) / (tokens - 1), with the server's token count (not the chunks).
    assert m["mean_tpot_ms"] == pytest.approx(np.mean([0.06 / 2, 0.04 / 8]) * 1e3)
    # ITL pools every gap of every request.
    assert m["median_itl_ms"] == pytest.approx(10.0) and m["mean_itl_ms"] == pytest.approx(0.1 / 6 * 1e3)
    assert m["mean_e2el_ms"] == pytest.approx((0.16 + 0.34) / 2 * 1e3)
    assert m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["max_concurrent_requests"] == 2


def test_output_tokens_counted_by_the_tokenizer_without_usage():
    tok = embedded_tokenizer()
    text = " the quick brown fox"
    out = timed(0.1, [0.01], text=text)
    m = calculate_metrics([out], 1.0, tok, ("tpot",), (50,))
    assert m["output_lens"] == [len(tok(text, add_special_tokens=False).input_ids)] and m["output_lens"][0] > 1


def test_sse_parser_reassembles_split_events():
    payload = ('data: {"choices": [{"text": "é"}]}\r\n\r\n: ping\n\ndata: {"usage": {"completion_tokens": 2}}\n\n'
               'data: [DONE]\n\n').encode()
    parser = SSEParser()
    events = [e for i in range(0, len(payload), 3) for e in parser.feed(payload[i:i + 3])]
    assert [json.loads(e) if e != "[DONE]" else e for e in events] == [
        {"choices": [{"text": "é"}]}, {"usage": {"completion_tokens": 2}}, "[DONE]"]


def test_arrivals_are_poisson_at_the_rate_and_inf_is_at_once():
    assert arrival_times(5, float("inf"), 1.0, 0) == [0.0] * 5
    times = arrival_times(2000, 4.0, 1.0, 0)
    assert times == sorted(times) and times[-1] == pytest.approx(500.0)
    gaps = np.diff([0.0, *times])
    assert 0.8 < np.std(gaps) / np.mean(gaps) < 1.2              # exponential gaps: coefficient of variation 1
    even = np.diff([0.0, *arrival_times(2000, 4.0, 50.0, 0)])
    assert np.std(even) / np.mean(even) < 0.3                   # a large burstiness evens the gaps out
    assert arrival_times(50, 2.0, 1.0, 7) == arrival_times(50, 2.0, 1.0, 7)


def test_w1_is_the_workload_it_always_was():
    reqs = datasets.w1()
    assert len(reqs) == 64
    assert [(r.prompt_len, r.expected_output_len) for r in reqs[:4]] == [(464, 146), (503, 191), (142, 85),
                                                                         (477, 80)]
    assert all(32 <= r.prompt_len <= 512 and 32 <= r.expected_output_len <= 256 for r in reqs)
    assert all(len(r.prompt) == r.prompt_len and 100 <= min(r.prompt) and max(r.prompt) < 49000 for r in reqs)
    g1 = datasets.g1()
    assert len(g1) == 256 and all(100 <= r.prompt_len <= 1024 for r in g1)


def test_random_dataset_lengths_and_shared_prefix():
    reqs = datasets.random_dataset(50, 100, 20, 0.5, 7, vocab_size=1000, seed=3)
    assert all(7 + 50 <= r.prompt_len <= 7 + 150 and 10 <= r.expected_output_len <= 30 for r in reqs)
    assert len({tuple(r.prompt[:7]) for r in reqs}) == 1 and len({tuple(r.prompt[7:]) for r in reqs}) == 50
    assert all(max(r.prompt) < 1000 for r in reqs)
    fixed = datasets.random_dataset(3, 16, 4, 0.0, 0, vocab_size=1000)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(16, 4)] * 3


@pytest.mark.parametrize("ratio, chosen", [(0.0, []), (0.5, [0, 2, 4, 6]), (0.25, [0, 4]), (1.0, list(range(8)))])
def test_structured_share_is_spread_evenly(ratio, chosen):
    assert [i for i in range(8) if constrained(i, ratio)] == chosen


def test_results_file_appends_lines_and_writes_inf_as_a_string(tmp_path):
    path = str(tmp_path / "sub" / "r.jsonl")
    append_result(path, {"request_rate": float("inf"), "x": [1.5]})
    append_result(path, {"request_rate": 2.0})
    assert read_results(path) == [{"request_rate": "inf", "x": [1.5]}, {"request_rate": 2.0}]
    with open(path, "a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=r"r.jsonl:3"):
        read_results(path)


def test_a_chat_streams_opening_role_chunk_carries_no_output():
    """vLLM's server and ours open a chat stream with {"role": "assistant", "content": ""} before any token is
    sampled: counted, it made TTFT the time to that chunk (a few ms, whatever the prompt)."""
    from pagedserve.frontend.bench.mm_http import _carries_output
    from pagedserve.frontend.bench.request_func import _chunk_text
    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    empty_token = {"index": 0, "delta": {"content": ""}, "finish_reason": None}
    assert _chunk_text(opening, chat=True) is None and _chunk_text(empty_token, chat=True) == ""
    assert not _carries_output({"choices": [opening]}) and _carries_output({"choices": [empty_token]})
