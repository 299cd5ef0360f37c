"""`pagedserve` end to end: `bench serve` drives a real engine-serve (and llama.cpp's llama-server when one is
built) and appends what vLLM's benchmark reports; `bench throughput` / `latency` run the offline engine on a
tiny model; `serve` is engine-serve's parser; `chat -q` / `complete -q` answer from a real server.
No timing is asserted: only counts, the presence and order of the metrics, and the files written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.common import envs
from pagedserve.common.model.model_files import embedded_model_path
from pagedserve.frontend.bench.datasets import random_dataset
from pagedserve.frontend.bench.results import read_results
from pagedserve.tests.helpers.processes.server import API_KEY, SMALL_KV, Server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p50", "p90", "p99")


def pagedserve(*args: str, api_key: str | None = API_KEY, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if api_key is not None:
        env["OPENAI_API_KEY"] = api_key
    return subprocess.run([sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def server(tiny_serving_model):
    srv = Server(*SMALL_KV, "--max-model-len", "256", "--max-num-seqs", "16", model=tiny_serving_model)
    yield srv
    srv.stop()


SMALL_RANDOM = ("--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "6",
                "--random-range-ratio", "0.5")


def check_serve_line(line: dict, num_prompts: int) -> None:
    assert line["bench"] == "serve" and line["completed"] == num_prompts and line["failed"] == 0
    assert line["num_prompts"] == num_prompts and len(line["output_lens"]) == num_prompts
    # ignore_eos: every request made exactly its max_tokens, and the server's count says so.
    assert line["output_lens"] == line["expected_output_lens"]
    assert line["total_output_tokens"] == sum(line["expected_output_lens"])
    assert line["total_input_tokens"] == sum(line["input_lens"])
    for metric in METRICS:
        for stat in STATS:
            assert isinstance(line[f"{stat}_{metric}_ms"], float), (stat, metric)
        assert 0 < line[f"p50_{metric}_ms"] <= line[f"p90_{metric}_ms"] <= line[f"p99_{metric}_ms"]
    for stat in ("mean", "p50", "p90", "p99"):        # each request's TTFT is within its E2EL
        assert line[f"{stat}_ttft_ms"] <= line[f"{stat}_e2el_ms"]
    assert 1 <= line["max_concurrent_requests"] <= num_prompts


def test_bench_serve_against_engine_serve(server, tiny_serving_model, tmp_path):
    results, plot = tmp_path / "results" / "serve.jsonl", tmp_path / "serve.png"
    proc = ok(pagedserve("bench", "serve", "--base-url", server.url, *SMALL_RANDOM, "--num-prompts", "6",
                         "--request-rate", "4", "inf", "--ignore-eos", "--label", "pagedserve",
                         "--tokenizer", tiny_serving_model, "--result-file", str(results), "--plot", str(plot)))
    assert proc.stdout.count("Serving Benchmark Result") == 2 and "P99 ITL (ms):" in proc.stdout
    lines = read_results(str(results))
    assert [line["request_rate"] for line in lines] == [4.0, "inf"]
    for line in lines:
        check_serve_line(line, 6)
        assert line["label"] == "pagedserve" and line["model"] == os.path.basename(tiny_serving_model)
        assert line["endpoint"] == "/v1/completions" and line["ignore_eos"] is True
    assert lines[0]["input_lens"] == lines[1]["input_lens"]            # the same requests at every rate
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_bench_serve_chat_endpoint_and_limits(server, tmp_path):
    results = tmp_path / "chat.jsonl"
    ok(pagedserve("bench", "serve", "--host", "127.0.0.1", "--port", str(server.port), "--endpoint",
                  "/v1/chat/completions", *SMALL_RANDOM, "--num-prompts", "4", "--request-rate", "50",
                  "--burstiness", "0.5", "--max-concurrency", "2", "--ignore-eos", "--percentile-metrics",
                  "ttft,e2el", "--metric-percentiles", "50,99", "--result-file", str(results)))
    [line] = read_results(str(results))
    assert line["completed"] == 4 and line["output_lens"] == line["expected_output_lens"]
    assert line["max_concurrency"] == 2 and line["max_concurrent_requests"] <= 2
    assert "p99_e2el_ms" in line and "p90_e2el_ms" not in line and "mean_itl_ms" not in line


@pytest.mark.parametrize("flags, message", [
    (("--request-rate", "0"), "--request-rate"),
    (("--percentile-metrics", "ttft,goodput"), "--percentile-metrics"),
    (("--metric-percentiles", "50,x"), "--metric-percentiles"),
    (("--random-range-ratio", "1.5"), "--random-range-ratio"),
    (("--header", "novalue"), "--header"),
])
def test_bench_serve_bad_flags_name_the_flag(flags, message):
    proc = pagedserve("bench", "serve", "--port", "1", *flags, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr


def test_bench_serve_says_which_server_it_cannot_reach():
    from pagedserve.tests.helpers.processes.server import free_port
    port = free_port()
    proc = pagedserve("bench", "serve", "--port", str(port), "--num-prompts", "1", timeout=120)
    assert proc.returncode != 0 and f"127.0.0.1:{port}/v1/models" in proc.stderr


def llama_server_binary() -> str | None:
    path = os.path.join(envs.PAGEDSERVE_LLAMA_CPP_DIR, "build", "bin", "llama-server")
    return path if os.access(path, os.X_OK) else None


@pytest.mark.skipif(llama_server_binary() is None, reason="no llama-server built (scripts/build_llama_server.sh)")
def test_bench_serve_drives_llama_server(tmp_path):
    from pagedserve.frontend.bench.peer.llama_server import LlamaServer
    server = LlamaServer(llama_server_binary(), embedded_model_path(), threads=1, parallel=2, ctx=1024)
    try:
        results = tmp_path / "llama.jsonl"
        ok(pagedserve("bench", "serve", "--base-url", server.url, "--label", "llama.cpp", *SMALL_RANDOM,
                      "--num-prompts", "4", "--ignore-eos", "--result-file", str(results), api_key=None))
    finally:
        server.stop()
    [line] = read_results(str(results))
    check_serve_line(line, 4)
    assert line["label"] == "llama.cpp" and line["model"]        # the model llama-server listed


def test_serve_takes_exactly_engine_serves_flags():
    ours = ok(pagedserve("serve", "--help", timeout=120))
    theirs = ok(subprocess.run([sys.executable, "-m", "pagedserve.frontend.cli", "--help"], capture_output=True,
                               text=True, timeout=120))
    assert ours.stdout == theirs.stdout
    top = ok(pagedserve("--help", timeout=120)).stdout
    assert all(name in top for name in ("serve", "chat", "complete", "bench"))


def test_serve_refuses_what_engine_serve_refuses():
    proc = pagedserve("serve", "--max-num-seqs", "many", timeout=120)
    assert proc.returncode == 2 and "--max-num-seqs" in proc.stderr


@pytest.mark.parametrize("command, flags", [("complete", ()), ("chat", ("--system-prompt", "Be brief."))])
def test_quick_clients_answer(server, tiny_serving_model, command, flags):
    proc = ok(pagedserve(command, "--url", f"{server.url}/v1", "--api-key", API_KEY, *flags, "-q", "Hello",
                         api_key=None, timeout=300))
    assert proc.stdout.strip()
    assert f"Using model: {os.path.basename(tiny_serving_model)}" in proc.stderr


def test_quick_client_with_a_wrong_key_says_so(server):
    proc = pagedserve("complete", "--url", f"{server.url}/v1", "--api-key", "wrong", "-q", "Hi", api_key=None,
                      timeout=300)
    assert proc.returncode != 0 and "401" in proc.stderr


def test_interactive_complete_reads_until_end_of_input(server):
    proc = subprocess.run([sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", "complete", "--url",
                           f"{server.url}/v1", "--api-key", API_KEY], input="one\ntwo\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # Each prompt line "> " is followed by its completion; the third finds the end of input.
    assert [line.startswith("> ") for line in proc.stdout.split("\n")] == [True, True, True]


def test_bench_throughput_on_a_tiny_model(tiny_serving_model, tmp_path):
    results = tmp_path / "throughput.jsonl"
    common = ("--model", tiny_serving_model, "--dtype", "float32", "--max-model-len", "256", *SMALL_RANDOM,
              "--num-prompts", "4", "--result-file", str(results))
    ok(pagedserve("bench", "throughput", *common, "--num-iters-warmup", "1", "--structured-output-ratio", "0.5"))
    ok(pagedserve("bench", "throughput", *common, "--backend", "hf", "--hf-max-batch-size", "2"))
    ours, hf = read_results(str(results))
    asked = sum(r.expected_output_len for r in random_dataset(4, 16, 6, 0.5, 0, vocab_size=49152, seed=0))
    assert (ours["label"], hf["label"]) == ("pagedserve", "hf")
    for line in (ours, hf):
        assert line["bench"] == "throughput" and line["num_requests"] == 4 and line["dataset_name"] == "random"
        assert line["output_tokens_per_second"] > 0 and line["peak_rss_mib"] > 0
    assert ours["engine_args"] == {"dtype": "float32", "max_model_len": 256, "enable_prefix_caching": False}
    assert ours["total_prompt_tokens"] == hf["total_prompt_tokens"]    # the same requests for both backends
    assert hf["total_output_tokens"] == asked
    # Half the requests ran under the schema: a grammar may end its request early, the rest made max_tokens
    # (the engine checks that itself and fails the run otherwise).
    assert ours["structured_output_ratio"] == 0.5 and 0 <= ours["finished_by_grammar"] <= 2
    assert ours["total_output_tokens"] <= asked
    assert ours["schema_compile_cold_ms"] > 0 and ours["schema_compile_cached_ms"] >= 0


def test_bench_latency_on_a_tiny_model(tiny_serving_model, tmp_path):
    results, plot = tmp_path / "latency.jsonl", tmp_path / "latency.png"
    ok(pagedserve("bench", "latency", "--model", tiny_serving_model, "--dtype", "float32", "--max-model-len", "64",
                  "--input-len", "8", "--output-len", "4", "--batch-size", "1", "2", "--num-iters-warmup", "1",
                  "--num-iters", "3", "--bandwidth-bound", "--result-file", str(results), "--plot", str(plot)))
    lines = read_results(str(results))
    assert [line["batch_size"] for line in lines] == [1, 2]
    for line in lines:
        assert line["bench"] == "latency" and line["label"] == "pagedserve" and len(line["latencies"]) == 3
        p = line["percentiles"]
        assert 0 < p["10"] <= p["50"] <= p["90"] <= p["99"]
        assert isinstance(line["decode_ms_per_tok"], float) and line["output_tokens_per_second"] > 0
        assert line["weight_bytes"] > 0 and line["bound_ms_per_tok"] > 0
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_make_model_needs_a_path():
    proc = pagedserve("bench", "throughput", "--make-model", "qwen3-0.6b", timeout=120)
    assert proc.returncode != 0 and "--make-model needs --model" in proc.stderr
