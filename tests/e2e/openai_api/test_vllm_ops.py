"""vLLM drop-in for operations: vLLM's metric names, the flags launch scripts carry (no-ops, --root-path,
CORS), and --dtype auto following the checkpoint. Against a real engine-serve where it can be seen there."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.config.dtype import checkpoint_dtype, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.common.model.model_files import load_hf_config, resolve_model
from pagedserve.tests.helpers.processes.metrics import parse_metrics
from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

ROOT = "/llm"
GOOD_ORIGIN = "http://dashboard.example"
NO_OP_FLAGS = ("--disable-log-requests", "--disable-log-stats", "--trust-remote-code",
               "--uvicorn-log-level", "debug")


@pytest.fixture(scope="module")
def server(tiny_serving_model):
    # One sequence at a time, so that concurrent requests really queue.
    srv = Server(*SMALL_KV, "--max-model-len", "256", "--max-num-seqs", "1", *NO_OP_FLAGS, "--root-path", ROOT,
                 "--allowed-origins", json.dumps([GOOD_ORIGIN]), "--allowed-methods", '["GET", "POST"]',
                 "--allowed-headers", '["Authorization", "Content-Type"]', model=tiny_serving_model)
    yield srv
    srv.stop()


def _complete(srv: Server, max_tokens: int, n: int = 1, stream: bool = False) -> None:
    resp = srv.client().completions.create(model=srv.client().models.list().data[0].id, prompt="Hello there",
                                           max_tokens=max_tokens, n=n, temperature=1.0, stream=stream,
                                           extra_body={"ignore_eos": True})
    if stream:
        for _ in resp:
            pass


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def test_vllm_metric_names_and_counts(server):
    before = server.metrics()
    # (max_tokens, n, stream): every sequence runs to max_tokens (ignore_eos).
    plan = [(5, 1, False), (7, 1, True), (4, 2, False)]
    for max_tokens, n, stream in plan:
        _complete(server, max_tokens, n, stream)
    after = server.wait_idle()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["request_queue_time_seconds_count"] == len(plan)
    assert delta["inter_token_latency_seconds_count"] == sum(n * (t - 1) for t, n, _ in plan)
    assert delta["time_per_output_token_seconds_count"] == delta["inter_token_latency_seconds_count"]
    assert delta["generation_tokens_total"] == sum(n * t for t, n, _ in plan)
    assert delta["request_success_total"] == sum(n for _, n, _ in plan)
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                 "request_prompt_tokens_count", "request_generation_tokens_count"):
        assert delta[name] == len(plan), name
    assert delta["request_queue_time_seconds_sum"] >= 0
    # Every decode step feeds back each sequence's last token but the final one; prefills add the prompts.
    assert delta["iteration_tokens_total_count"] > 0
    assert delta["iteration_tokens_total_sum"] >= sum(n * (t - 1) for t, n, _ in plan) + delta["prompt_tokens_total"]


def test_queue_time_is_the_wait_for_a_free_seat(server):
    before = server.metrics()
    start = threading.Barrier(3)

    def one(_: int) -> None:
        start.wait()
        _complete(server, 96)           # long enough that all three arrive while the first still runs

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(one, range(3)))
    after = server.wait_idle()
    queued = after["request_queue_time_seconds_sum"] - before["request_queue_time_seconds_sum"]
    decoding = after["request_decode_time_seconds_sum"] - before["request_decode_time_seconds_sum"]
    # Run one by one, the second waits about one request's run and the third two: about the decode time of
    # all three together; a third of it is a safe floor that a queue time of ~0 cannot reach.
    assert queued > decoding / 3 > 0


def test_every_series_has_vllm_labels_and_no_duplicates(server):
    _complete(server, 3)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    model = server.client().models.list().data[0].id
    # Families by name (a counter's TYPE line names it with its _total).
    names = {m.group(1).removesuffix("_total") for m in re.finditer(r"^# TYPE (\S+) ", text, re.M)}
    vllm = {n.removeprefix("vllm:") for n in names if n.startswith("vllm:")}
    own = {n.removeprefix("pagedserve:") for n in names if n.startswith("pagedserve:")}
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
            "prompt_tokens", "generation_tokens", "request_success", "num_preemptions", "prefix_cache_queries",
            "prefix_cache_hits", "time_to_first_token_seconds", "inter_token_latency_seconds",
            "e2e_request_latency_seconds", "request_queue_time_seconds", "iteration_tokens"} <= vllm
    assert names == {f"vllm:{n}" for n in vllm} | {f"pagedserve:{n}" for n in own}
    assert not own & vllm                      # nothing exported twice under two prefixes
    assert own == {"request_rejected"}
    for line in _series(text, "vllm:num_requests_running") + _series(text, "vllm:request_success_total"):
        assert f'model_name="{model}"' in line and 'engine="0"' in line
    assert any('finished_reason="length"' in line for line in _series(text, "vllm:request_success_total"))


def test_parse_metrics_reads_both_prefixes():
    text = 'vllm:num_requests_running{model_name="m",engine="0"} 2.0\npagedserve:request_rejected_total 3.0\n'
    assert parse_metrics(text) == {"num_requests_running": 2.0, "request_rejected_total": 3.0}


# ------------------------------------------------------------------ --root-path

def test_root_path_with_and_without_the_prefix(server):
    model = server.client().models.list().data[0].id
    for base in (f"{server.url}{ROOT}", server.url):     # a client direct / a proxy that strips the prefix
        assert httpx.get(f"{base}/v1/models", headers=server.auth, timeout=10).json()["data"][0]["id"] == model
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200           # open path, no key
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401        # still guarded
    import openai
    client = openai.OpenAI(base_url=f"{server.url}{ROOT}/v1", api_key=server.api_key, max_retries=0, timeout=60)
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_root_path_in_the_api_description(server):
    spec = httpx.get(f"{server.url}{ROOT}/openapi.json", timeout=10).json()
    assert spec["servers"] == [{"url": ROOT}]
    assert f"{ROOT}/openapi.json" in httpx.get(f"{server.url}{ROOT}/docs", timeout=10).text


# ------------------------------------------------------------------ CORS

def _preflight(srv: Server, origin: str, method: str = "POST") -> httpx.Response:
    return httpx.options(f"{srv.url}/v1/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_needs_no_key_and_echoes_only_allowed_origins(server):
    ok = _preflight(server, GOOD_ORIGIN)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    bad = _preflight(server, "http://evil.example")
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    assert _preflight(server, GOOD_ORIGIN, method="DELETE").status_code == 400     # not in --allowed-methods


def test_cors_headers_on_simple_requests(server):
    good = httpx.get(f"{server.url}/v1/models", headers={**server.auth, "Origin": GOOD_ORIGIN}, timeout=10)
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == GOOD_ORIGIN
    bad = httpx.get(f"{server.url}/v1/models", headers={**server.auth, "Origin": "http://evil.example"},
                    timeout=10)
    assert "access-control-allow-origin" not in bad.headers
    # A refused key is still readable by the allowed page (CORS is outermost).
    denied = httpx.get(f"{server.url}/v1/models", headers={"Origin": GOOD_ORIGIN}, timeout=10)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == GOOD_ORIGIN


def test_cors_and_no_op_flags_parse_like_vllm(capsys):
    from pagedserve.frontend.cli import parse_args
    args, server = parse_args([])
    assert (server.allowed_origins, server.allowed_methods, server.allowed_headers) == (("*",),) * 3
    assert server.allow_credentials is False and server.root_path is None
    args, server = parse_args(["--allowed-origins", '["http://a", "http://b"]', "--allow-credentials",
                               *NO_OP_FLAGS])
    assert server.allowed_origins == ("http://a", "http://b") and server.allow_credentials
    assert args.trust_remote_code and args.disable_log_stats and server.disable_log_requests
    with pytest.raises(SystemExit):
        parse_args(["--allowed-origins", "http://a"])
    assert "--allowed-origins" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--root-path"):
        parse_args(["--root-path", "llm/"])
    from pagedserve.frontend.server_args import ServerArgs
    assert ServerArgs(allowed_origins=["http://a"]).allowed_origins == ("http://a",)
    with pytest.raises(ValueError, match="--allowed-headers"):
        ServerArgs(allowed_headers="*")


def test_llm_takes_vllm_no_op_kwargs():
    assert EngineArgs(trust_remote_code=True, disable_log_stats=True).trust_remote_code


# ------------------------------------------------------------------ --dtype

@pytest.mark.parametrize("config_dtype, expected", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                                    ("float32", "bfloat16"), (None, "bfloat16")])
def test_auto_dtype_on_cuda_follows_the_checkpoint(config_dtype, expected):
    assert resolve_dtype("auto", "cuda", config_dtype) == expected


def test_auto_dtype_on_cpu_keeps_the_cpu_rule():
    for config_dtype in ("float16", "bfloat16", "float32", None):
        assert resolve_dtype("auto", "cpu", config_dtype, cpu_native_bf16=False) == "float32"
        assert resolve_dtype("auto", "cpu", config_dtype, cpu_native_bf16=True) == "bfloat16"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_dtypes_and_vllm_spellings(device):
    for given, expected in (("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                            ("float", "float32"), ("float32", "float32")):
        assert resolve_dtype(given, device, "bfloat16") == expected
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp16", device, None)


def test_kv_cache_dtype_auto_is_bfloat16_only_for_quantized_weights_on_cpu():
    # int4/int8 weights on CPU run float32 activations; their cache is bfloat16 (memory-bound decode attention).
    assert resolve_kv_cache_dtype("auto", "cpu", "float32", weight_only_quantized=True) == "bfloat16"
    # Everything else keeps vLLM's auto (the model dtype): an unquantized float32 model stays exact.
    assert resolve_kv_cache_dtype("auto", "cpu", "float32", weight_only_quantized=False) == "auto"
    assert resolve_kv_cache_dtype("auto", "cuda", "bfloat16", weight_only_quantized=True) == "auto"
    assert resolve_kv_cache_dtype("float32", "cpu", "float32", weight_only_quantized=True) == "float32"
    assert resolve_kv_cache_dtype("fp8_e4m3", "cuda", "bfloat16", weight_only_quantized=False) == "fp8"


def test_checkpoint_dtype_from_config_files(tmp_path):
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    fp16 = make_tiny_model(str(tmp_path / "fp16"), dtype=torch.float16)
    assert checkpoint_dtype(load_hf_config(resolve_model(fp16))) == "float16"
    legacy = tmp_path / "legacy"            # config.json written before transformers renamed the key
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    from transformers import AutoConfig
    assert checkpoint_dtype(AutoConfig.from_pretrained(str(legacy))) == "bfloat16"


def test_half_runs_on_cpu_and_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from pagedserve import LLM, SamplingParams
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    path = make_tiny_model(str(tmp_path / "fp16"), dtype=torch.float16)
    assert EngineArgs(model=path, dtype="half", device="cpu").create_engine_config().model.dtype == "float16"
    prompt = [1, 5, 9, 22, 7]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    with LLM(path, dtype="half", device="cpu", max_model_len=64) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.tolist()


def test_output_processor_reports_each_inter_token_interval_and_the_queue_time():
    import time

    from pagedserve.common.params.sampling_params import SamplingParams
    from pagedserve.frontend.client.output_processor import OutputProcessor
    from pagedserve.ipc.messages import EngineCoreOutput
    from pagedserve.tests.helpers.models.tiny_models import synthetic_tokenizer
    processor = OutputProcessor(synthetic_tokenizer(64))
    processor.add_request("r", None, [10, 11], ["r#0", "r#1"], [SamplingParams(max_tokens=8)] * 2)
    first = processor.process_outputs([EngineCoreOutput("r#0", [20], queue_time=0.25),
                                       EngineCoreOutput("r#1", [21, 22], queue_time=0.5)])
    assert first.inter_token_latencies == [0.0]          # r#1's second token came with its first
    time.sleep(0.05)
    later = processor.process_outputs([EngineCoreOutput("r#0", [23, 24], finish_reason="length"),
                                       EngineCoreOutput("r#1", [25], finish_reason="length")])
    gaps = later.inter_token_latencies
    assert len(gaps) == 3 and gaps[0] == gaps[1] and gaps[0] + gaps[1] >= 0.05 and gaps[2] >= 0.05
    assert later.request_outputs[0].metrics["queue_time"] == 0.25     # the first sample's, once per request
