"""engine-serve's flags are generated from EngineArgs and ServerArgs: every field is a flag, no flag means the
field's default, each flag lands in its field, and bad values are refused naming the flag. Also: offline
LLM.generate takes more prompts than max_waiting_requests."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from pagedserve.tests.helpers.models.tiny_models import random_prompts
from pagedserve import LLM, SamplingParams
from pagedserve.common.config.arg_utils import add_dataclass_args, dataclass_from, setting
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.frontend.cli import main, make_parser, parse_args
from pagedserve.frontend.server_args import ServerArgs

ENV_VARS = ("PAGEDSERVE_API_KEY", "PAGEDSERVE_ENGINE_TOKEN")
CONFIGURATION_DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "configuration.md")


@pytest.fixture(autouse=True)
def no_env_secrets(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def changed_fields(settings: Any, defaults: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(defaults) if getattr(settings, f.name) != getattr(defaults, f.name)]


def all_fields() -> list[dataclasses.Field]:
    return [*dataclasses.fields(EngineArgs), *dataclasses.fields(ServerArgs)]


def test_help_lists_every_field():
    proc = subprocess.run([sys.executable, "-m", "pagedserve.frontend.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = set(re.findall(r"--[a-z][a-z0-9-]*", proc.stdout))
    missing = [flag(f) for f in all_fields() if flag(f) not in listed]
    assert missing == []
    for f in all_fields():
        assert f.metadata["help"].split()[0] in proc.stdout     # each flag has its field's help
    assert "--no-enable-prefix-caching" in listed and "--no-enable-chunked-prefill" in listed
    assert "--no-enforce-eager" not in listed                      # a plain switch, as in vLLM
    assert "-tp" in proc.stdout


def test_configuration_doc_lists_every_flag():
    with open(CONFIGURATION_DOC) as f:
        text = f.read()
    assert [flag(f) for f in all_fields() if flag(f) not in text] == []


def test_no_flags_give_the_dataclass_defaults():
    args, server = parse_args([])
    for f in dataclasses.fields(EngineArgs):
        assert getattr(args, f.name) == getattr(EngineArgs(), f.name), f.name
    for f in dataclasses.fields(ServerArgs):
        assert getattr(server, f.name) == getattr(ServerArgs(), f.name), f.name
    assert args.max_waiting_requests == 4096 and server.max_body_bytes == 8 << 20
    assert server.api_key is None and server.max_concurrent_requests is None


def test_env_defaults_reach_the_parser_and_the_dataclass(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k-env")
    monkeypatch.setenv("PAGEDSERVE_ENGINE_TOKEN", "t-env")
    _, server = parse_args([])
    assert (server.api_key, server.engine_token) == ("k-env", "t-env") == (ServerArgs().api_key,
                                                                           ServerArgs().engine_token)
    _, server = parse_args(["--api-key", "k-flag"])
    assert server.api_key == "k-flag"
    assert "k-env" not in make_parser().format_help()           # a secret never shows in --help


@pytest.mark.parametrize("argv, name, value", [
    (["--model", "/m"], "model", "/m"),
    (["/m"], "model", "/m"),
    (["--tokenizer", "/t"], "tokenizer", "/t"),
    (["--served-model-name", "x"], "served_model_name", "x"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--device", "cpu"], "device", "cpu"),
    (["--seed", "3"], "seed", 3),
    (["--max-model-len", "512"], "max_model_len", 512),
    (["--block-size", "32"], "block_size", 32),
    (["--kv-cache-dtype", "fp8_e4m3"], "kv_cache_dtype", "fp8_e4m3"),
    (["--kv-cache-dtype", "bfloat16"], "kv_cache_dtype", "bfloat16"),
    (["--kv-cache-memory", "0.5"], "kv_cache_memory", 0.5),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--num-gpu-blocks-override", "7"], "num_gpu_blocks_override", 7),
    (["--max-num-seqs", "4"], "max_num_seqs", 4),
    (["--max-num-batched-tokens", "256"], "max_num_batched_tokens", 256),
    (["--max-waiting-requests", "9"], "max_waiting_requests", 9),
    (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--tensor-parallel-size", "3"], "tensor_parallel_size", 3),
    (["--distributed-executor-backend", "mp"], "distributed_executor_backend", "mp"),
    (["--enforce-eager"], "enforce_eager", True),
    (["--worker-heartbeat-timeout", "5"], "worker_heartbeat_timeout", 5.0),
    (["--engine-heartbeat-timeout", "7.5"], "engine_heartbeat_timeout", 7.5),
])
def test_engine_flag_sets_its_field(argv, name, value):
    args, _ = parse_args(argv)
    assert getattr(args, name) == value and type(getattr(args, name)) is type(value)
    assert changed_fields(args, EngineArgs()) == [name]


@pytest.mark.parametrize("argv, name, value", [
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "9001"], "port", 9001),
    (["--api-key", "k"], "api_key", "k"),
    (["--engine-address", "ipc:///tmp/x"], "engine_address", "ipc:///tmp/x"),
    (["--engine-token", "t"], "engine_token", "t"),
    (["--chat-template", "{{ x }}"], "chat_template", "{{ x }}"),
    (["--max-body-bytes", "1024"], "max_body_bytes", 1024),
    (["--max-concurrent-requests", "3"], "max_concurrent_requests", 3),
    (["--log-level", "debug"], "log_level", "debug"),
])
def test_server_flag_sets_its_field(argv, name, value):
    _, server = parse_args(argv)
    assert getattr(server, name) == value
    assert changed_fields(server, ServerArgs()) == [name]


def test_tls_files_reach_server_args(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("k")
    cert.write_text("c")
    _, server = parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    assert (server.ssl_keyfile, server.ssl_certfile) == (str(key), str(cert))


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--distributed-executor-backend", "dask"], "argument --distributed-executor-backend: invalid choice"),
    (["--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice"),
    (["--log-level", "trace"], "argument --log-level: invalid choice"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["-tp", "1.5"], "argument --tensor-parallel-size/-tp: invalid int value"),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: invalid float value"),
    (["--enforce-eager=yes"], "argument --enforce-eager: ignored explicit argument 'yes'"),
    (["--enable-chunked-prefill=no"], "argument --enable-chunked-prefill/--no-enable-chunked-prefill: ignored"),
    (["/a", "--model", "/b"], "give the model once"),
])
def test_bad_flag_is_a_usage_error_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--engine-address", "tcp://127.0.0.1:1"], "a tcp:// --engine-address requires --engine-token"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be a positive integer"),
    (["--max-body-bytes", "-1"], "--max-body-bytes must be a positive integer"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--ssl-keyfile", "/etc/hostname"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"],
     "--ssl-keyfile '/no/key.pem' is not a file"),
])
def test_bad_server_value_stops_main_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(argv)
    with pytest.raises(SystemExit) as exc:       # before any model is loaded
        main(argv)
    assert str(exc.value.code).startswith(f"engine-serve: {message}")


def test_server_args_validate_when_made_in_python():
    with pytest.raises(ValueError, match="--max-concurrent-requests"):
        ServerArgs(max_concurrent_requests=-2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerArgs().port = 1       # type: ignore[misc]


def test_bad_engine_value_stops_main_naming_the_setting():
    with pytest.raises(SystemExit) as exc:
        main(["--max-num-seqs", "0"])
    assert exc.value.code == "engine-serve: max_num_seqs must be a positive integer, got 0"


@dataclasses.dataclass(frozen=True)
class _Knobs:
    size: int | None = setting(None, help="a size")
    ratio: float = setting(0.5, help="100% means all")
    name: str = setting("a", choices=("a", "b"), help="a name")
    fast: bool = setting(True, help="go fast")


def test_generator_on_any_dataclass():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, _Knobs)
    assert dataclass_from(parser.parse_args([]), _Knobs) == _Knobs()
    parsed = dataclass_from(parser.parse_args(["--size", "4", "--ratio", "1", "--name", "b", "--no-fast"]), _Knobs)
    assert parsed == _Knobs(size=4, ratio=1.0, name="b", fast=False)
    assert "100% means all (default: 0.5)" in parser.format_help()


def test_generator_refuses_a_field_that_is_not_a_setting():
    @dataclasses.dataclass
    class Plain:
        x: int = 1

    @dataclasses.dataclass
    class Listy:
        xs: list = setting(None, help="many")

    for cls, message in ((Plain, "not a setting"), (Listy, "flags parse")):
        with pytest.raises(TypeError, match=message):
            add_dataclass_args(argparse.ArgumentParser(), cls)


# -------------------------------------------------------------------- offline backlog

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _generate(model: str, prompts: list[list[int]], **kwargs: Any) -> list[Any]:
    sampled = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    params = [GREEDY] * (len(prompts) - 1) + [sampled]
    with LLM(model, dtype="float32", **kwargs) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("multiprocess_core", [False, True])
def test_llm_feeds_more_prompts_than_max_waiting_requests(tiny_llama_dir, multiprocess_core):
    """The core refuses requests beyond max_waiting_requests waiting; generate holds the rest back."""
    prompts = random_prompts(11, [5, 30, 9, 2, 17, 40, 8], 512)
    bounded = _generate(tiny_llama_dir, prompts, max_waiting_requests=2, multiprocess_core=multiprocess_core)
    unbounded = _generate(tiny_llama_dir, prompts, max_waiting_requests=None)
    assert len(bounded) == 7 and all(o.finished and o.error is None for o in bounded)
    assert [o.prompt_token_ids for o in bounded] == prompts
    assert [o.outputs[0].token_ids for o in bounded[:6]] == [o.outputs[0].token_ids for o in unbounded[:6]]
    assert [len(c.token_ids) for c in bounded[6].outputs] == [6, 6, 6]     # n=3 > the bound of 2
