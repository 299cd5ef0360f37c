"""Disaggregated prefill/decode (docs/kv_tiers.md): a kv_producer and a kv_consumer engine-serve on one
shared folder (SharedStorageConnector), `pagedserve proxy` in front, over HTTP with the openai SDK. A single
engine-serve without a connector is the oracle; the decode instance's counters say the prompts came from the
folder, not from its own prefill."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedserve.common.kv_transfer.layout import HEADER_PREFIX, header_size
from pagedserve.tests.helpers.processes.server import API_KEY, SMALL_KV, Server, free_port
from pagedserve.tests.helpers.models.tiny_models import random_prompts

BS = 16
# 2, 3 and 4 full blocks; the decode instance computes only the partial last block (and at least one token).
PROMPTS = random_prompts(7, [40, 50, 70], 2000)
FULL_BLOCKS = [2, 3, 4]
STREAMED = random_prompts(8, [33, 64], 2000)         # 2 and 3 full blocks (64: the last token is computed)
STREAMED_BLOCKS = [2, 3]
MAX_TOKENS = 8
NAME = "tiny"
COMMON = (*SMALL_KV, "--block-size", str(BS), "--max-num-seqs", "4", "--served-model-name", NAME)


def _connector(role: str, folder: str) -> tuple[str, ...]:
    cfg = {"kv_connector": "SharedStorageConnector", "kv_role": role,
           "kv_connector_extra_config": {"shared_storage_path": folder}}
    return ("--kv-transfer-config", json.dumps(cfg))


class Proxy:
    def __init__(self, prefill: Server, decode: Server, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", "proxy", "--port", str(self.port),
             "--prefill", prefill.url, "--decode", decode.url, "--log-level", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("pagedserve proxy did not become healthy")

    def client(self) -> openai.OpenAI:
        # No --api-key on the proxy: the client's key passes through to the instances.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shared_kv"))


@pytest.fixture(scope="module")
def servers(tiny_serving_model, folder):
    """A single server without a connector (the oracle), the prefill and the decode instance, started side
    by side."""
    extras = [(), _connector("kv_producer", folder), _connector("kv_consumer", folder)]
    with ThreadPoolExecutor(3) as pool:
        started = list(pool.map(lambda e: _start(tiny_serving_model, e), extras))
    try:
        if any(s is None for s in started):
            pytest.fail("an engine-serve did not start")
        yield started
    finally:
        for server in started:
            if server is not None:
                server.stop()


def _start(model: str, extra: tuple[str, ...]) -> Server | None:
    try:
        return Server(*COMMON, *extra, model=model, max_model_len=256)
    except (RuntimeError, TimeoutError):
        return None


@pytest.fixture(scope="module")
def oracle(servers) -> dict[str, list[str]]:
    single = servers[0]
    return {"plain": [_complete(single.client(), p) for p in PROMPTS],
            "streamed": [_complete(single.client(), p) for p in STREAMED]}


@pytest.fixture(scope="module")
def disagg(servers, oracle):
    prefill, decode = servers[1], servers[2]
    proxy = Proxy(prefill, decode)
    yield prefill, decode, proxy
    proxy.stop()


def _complete(client: openai.OpenAI, prompt: list[int], stream: bool = False) -> str:
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length"
        return choice.text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def test_proxy_output_equals_a_single_server_and_decode_loads_the_prompt(disagg, oracle, folder, tiny_serving_model):
    prefill, decode, proxy = disagg
    before = decode.metrics()
    got = [_complete(proxy.client(), p) for p in PROMPTS]
    assert got == oracle["plain"]
    m = decode.wait_idle()
    # Every full block of every prompt came from the folder: none of those tokens was prefilled on decode.
    assert m["external_prefix_cache_hits_total"] - before["external_prefix_cache_hits_total"] == sum(FULL_BLOCKS) * BS
    assert prefill.metrics()["external_prefix_cache_hits_total"] == 0      # a producer never loads
    assert len(glob.glob(os.path.join(folder, "*", "*", "*.kvb"))) == sum(FULL_BLOCKS)
    # The prefill instance generated one token per request; decode generated them all.
    assert prefill.metrics()["generation_tokens_total"] == len(PROMPTS)


def test_kv_transfer_metrics_count_the_folder_s_traffic(disagg, folder):
    """/metrics' kv_transfer section on both instances, read after the tests above."""
    prefill, decode, proxy = disagg
    files = glob.glob(os.path.join(folder, "*", "*", "*.kvb"))
    payload = _payload_bytes(files[0])
    p, d = prefill.wait_idle(), decode.wait_idle()
    assert p["kv_offload_total_bytes_total"] == sum(os.path.getsize(f) for f in files)     # CPU_to_DISK
    assert p["kv_offload_total_time_total"] > 0
    assert p["kv_offload_disk_block_lookup_total"] == 0                 # a producer never looks up
    hits = d["kv_offload_disk_block_hit_total"]
    assert hits == d["external_prefix_cache_hits_total"] / BS
    assert d["kv_offload_total_bytes_total"] == hits * payload          # DISK_to_CPU: checked payloads
    assert d["kv_offload_total_time_total"] > 0
    # A prompt the prefill instance never saw, sent to decode directly: its first block is a miss.
    before = d["kv_offload_disk_block_miss_total"]
    decode.client().completions.create(model=NAME, prompt=random_prompts(9, [40], 2000)[0], max_tokens=1)
    d = decode.wait_idle()
    assert d["kv_offload_disk_block_miss_total"] == before + 1
    assert d["kv_offload_disk_block_lookup_total"] == d["kv_offload_disk_block_hit_total"] + \
        d["kv_offload_disk_block_miss_total"]
    assert d["kv_offload_stores_skipped_total"] == d["kv_offload_block_eviction_total"] == 0
    labels = {line.split("transfer_type=\"")[1].split("\"")[0] for line in
              httpx.get(f"{decode.url}/metrics", timeout=10).text.splitlines()
              if line.startswith("vllm:kv_offload_total_bytes_total{")}
    assert labels == {"CPU_to_DISK", "DISK_to_CPU"}


def _payload_bytes(path: str) -> int:
    with open(path, "rb") as f:
        head = header_size(f.read(HEADER_PREFIX))
    return os.path.getsize(path) - head


def test_streaming_through_the_proxy_equals_the_oracle(disagg, oracle, tiny_serving_model):
    _, decode, proxy = disagg
    before = decode.metrics()["external_prefix_cache_hits_total"]
    got = [_complete(proxy.client(), p, stream=True) for p in STREAMED]
    assert got == oracle["streamed"]
    after = decode.wait_idle()["external_prefix_cache_hits_total"]
    assert after - before == sum(STREAMED_BLOCKS) * BS


def test_chat_through_the_proxy_equals_a_single_server(disagg, tiny_serving_model):
    prefill, decode, proxy = disagg
    messages = [{"role": "user", "content": "Tell me a story about a small robot who learns to paint the sea."}]
    kwargs = dict(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    before = decode.metrics()["external_prefix_cache_hits_total"]
    via_proxy = proxy.client().chat.completions.create(**kwargs)
    direct = prefill.client().chat.completions.create(**kwargs)       # a whole request on one server
    assert via_proxy.choices[0].message.content == direct.choices[0].message.content
    assert via_proxy.usage.completion_tokens == MAX_TOKENS
    assert decode.metrics()["external_prefix_cache_hits_total"] > before


def test_a_bad_request_gets_the_instance_s_400_through_the_proxy(disagg, tiny_serving_model):
    _, _, proxy = disagg
    with pytest.raises(openai.BadRequestError) as err:
        proxy.client().completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=-1)
    assert err.value.status_code == 400
    r = httpx.post(f"{proxy.url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_the_proxy_s_own_key_guards_it_and_its_backend_key_reaches_the_instances(disagg):
    prefill, decode, _ = disagg
    guarded = Proxy(prefill, decode, "--api-key", "client-key", "--backend-api-key", API_KEY)
    try:
        ok = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="client-key", max_retries=0, timeout=120)
        assert ok.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):     # the instances' key is not the proxy's
            openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=API_KEY, max_retries=0).models.list()
        assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200      # open, as the server's
    finally:
        guarded.stop()


@pytest.mark.parametrize("argv, message", [
    (["proxy", "--decode", "http://127.0.0.1:1"], "give at least one --prefill URL"),
    (["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "127.0.0.1:2"], "--decode must be an http"),
])
def test_proxy_flags_are_checked_before_it_starts(argv, message, capsys):
    from pagedserve.frontend.pagedserve_cli import parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
