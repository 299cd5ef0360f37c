"""One default per setting, in EngineArgs: the frozen configs have none of their own, an unset setting
resolves to EngineArgs' default (or its documented unset rule), every command line takes its engine flags
from EngineArgs, and environment variables are read in common/envs.py only."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

import pagedserve
from pagedserve.common import envs
from pagedserve.common.config.arg_utils import add_dataclass_args, dataclass_from, setting
from pagedserve.common.config.engine_args import (DEFAULT_CPU_KV_CACHE_GIB, DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                      DEFAULT_TORCHRUN_COLLECTIVE_TIMEOUT_S, DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S,
                                      CacheConfig, EngineArgs, EngineConfig, ModelConfig, ParallelConfig,
                                      RLConfig, SchedulerConfig, StructuredOutputsConfig)
from pagedserve.common.kv_transfer.config import KVTransferConfig
from pagedserve.common.speculative import SpeculativeConfig

ROOT = os.path.dirname(os.path.abspath(pagedserve.__file__))         # the package: the repository root
DEFAULTS = EngineArgs()

# EngineArgs field -> where create_engine_config puts it, unchanged (RESOLVED: from model files or a
# documented rule for unset, checked below; ELSEWHERE: not part of the EngineConfig).
WHERE = {
    "block_size": "cache.block_size", "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "enable_prefix_caching": "cache.enable_prefix_caching", "num_gpu_blocks_override": "cache.num_blocks_override",
    "max_num_seqs": "scheduler.max_num_seqs", "max_waiting_requests": "scheduler.max_waiting_requests",
    "scheduling_policy": "scheduler.policy", "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "async_scheduling": "scheduler.async_scheduling", "tensor_parallel_size": "parallel.tensor_parallel_size",
    "reasoning_parser": "structured_outputs.reasoning_parser",
    "structured_outputs_compile_timeout": "structured_outputs.compile_timeout_s",
    "seed": "model.seed", "enforce_eager": "model.enforce_eager", "batch_invariant": "model.batch_invariant",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "worker_extension_cls": "rl.worker_extension_cls", "enable_sleep_mode": "rl.enable_sleep_mode",
    "requests_while_sleeping": "rl.requests_while_sleeping",
}
RESOLVED = {"model", "tokenizer", "revision", "tokenizer_revision", "download_dir", "generation_config",
            "served_model_name", "dtype", "device", "quantization", "max_model_len", "kv_cache_dtype",
            "kv_cache_memory", "max_num_batched_tokens", "distributed_executor_backend", "worker_heartbeat_timeout",
            "speculative_config", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
            "runner", "convert",    # runner, convert: resolved with the model files into EngineConfig.pooler
            # resolved with the model's config into EngineConfig.multimodal (None for a text model)
            "limit_mm_per_prompt", "mm_processor_kwargs", "mm_processor_cache_gb", "allowed_local_media_path",
            "media_io_kwargs",
            # resolved with the model's files (the tier's namespace) into EngineConfig.kv_transfer (None: unset)
            "kv_transfer_config", "kv_offloading_backend", "kv_offloading_size", "kv_offloading_path"}
# Not the engine core's: the client that starts the core (or cores: data_parallel_size) reads it; accepted
# vLLM no-ops.
ELSEWHERE = {"engine_heartbeat_timeout", "trust_remote_code", "disable_log_stats", "data_parallel_size"}


def value_at(config: EngineConfig, path: str):
    part, name = path.split(".")
    return getattr(getattr(config, part), name)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module           # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cls", [ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
                                 StructuredOutputsConfig, SpeculativeConfig, RLConfig, KVTransferConfig,
                                 EngineConfig])
def test_frozen_configs_repeat_no_default(cls):
    with_default = [f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert with_default == []


def test_every_engine_arg_is_accounted_for():
    assert set(WHERE) | RESOLVED | ELSEWHERE == EngineArgs.field_names()
    assert not (set(WHERE) & RESOLVED) and not (set(WHERE) & ELSEWHERE) and not (RESOLVED & ELSEWHERE)


def test_unset_settings_resolve_to_the_engine_args_defaults(tiny_llama_dir):
    config = EngineArgs(model=tiny_llama_dir, device="cpu").create_engine_config()
    for name, path in WHERE.items():
        assert value_at(config, path) == getattr(DEFAULTS, name), name
    assert config.scheduler.max_waiting_requests == 4096
    assert config.cache.kv_cache_memory_gib == DEFAULT_CPU_KV_CACHE_GIB
    assert config.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.parallel.worker_heartbeat_timeout_s == DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S
    assert config.parallel.distributed_executor_backend == "uni"
    assert config.model.max_model_len == config.scheduler.max_model_len == 1024      # max_position_embeddings
    assert config.speculative is None and config.draft_model is None                  # unset: no speculation
    assert config.kv_transfer is None                                                 # unset: no KV connector


@pytest.mark.parametrize("name, value", [
    ("block_size", 8), ("gpu_memory_utilization", 0.5), ("enable_prefix_caching", False),
    ("num_gpu_blocks_override", 300), ("max_num_seqs", 3), ("max_waiting_requests", None),
    ("scheduling_policy", "priority"), ("enable_chunked_prefill", False), ("async_scheduling", True),
    ("tensor_parallel_size", 2), ("reasoning_parser", "deepseek_r1"), ("structured_outputs_compile_timeout", 2.5),
    ("seed", 9), ("enforce_eager", True), ("batch_invariant", True),
    ("worker_extension_cls", "pagedserve.tests.helpers.rl.rl_extension.Probe"), ("enable_sleep_mode", True),
    ("requests_while_sleeping", "wait"),
])
def test_a_set_setting_reaches_its_config_field(tiny_llama_dir, name, value):
    extra = {"max_num_batched_tokens": 1024} if name == "enable_chunked_prefill" else {}
    config = EngineArgs(model=tiny_llama_dir, device="cpu", **{name: value}, **extra).create_engine_config()
    assert value_at(config, WHERE[name]) == value != getattr(DEFAULTS, name)


def test_worker_heartbeat_timeout_unset_depends_on_the_backend():
    assert EngineArgs().resolved_worker_heartbeat_timeout() == DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S == 30.0
    assert EngineArgs(tensor_parallel_size=2).resolved_worker_heartbeat_timeout() == 30.0
    torchrun = EngineArgs(distributed_executor_backend="torchrun")
    assert torchrun.resolved_worker_heartbeat_timeout() == DEFAULT_TORCHRUN_COLLECTIVE_TIMEOUT_S == 300.0
    assert EngineArgs(distributed_executor_backend="torchrun", worker_heartbeat_timeout=5).resolved_worker_heartbeat_timeout() == 5.0
    with pytest.raises(ValueError, match="worker_heartbeat_timeout must be a number of seconds"):
        EngineArgs(worker_heartbeat_timeout=0).validate()


def test_max_waiting_requests_is_4096_unless_set(tiny_llama_dir):
    from pagedserve import LLM
    from pagedserve.frontend.cli import parse_args
    assert DEFAULTS.max_waiting_requests == parse_args([])[0].max_waiting_requests == 4096
    with LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02) as llm:
        assert llm.info.max_waiting_requests == llm.engine.config.scheduler.max_waiting_requests == 4096


def test_client_heartbeat_defaults_are_engine_args():
    from pagedserve.frontend.client.async_client import AsyncEngineClient
    from pagedserve.frontend.client.core_client import AsyncMPClient, SyncMPClient
    for fn in (SyncMPClient.__init__, AsyncMPClient.__init__, AsyncEngineClient.connect):
        assert inspect.signature(fn).parameters["heartbeat_timeout_s"].default == DEFAULTS.engine_heartbeat_timeout


def test_structured_output_manager_takes_its_settings_from_the_config():
    from pagedserve.core.structured_output import StructuredOutputManager
    params = inspect.signature(StructuredOutputManager).parameters
    assert "compile_timeout_s" not in params and params["config"].default is inspect.Parameter.empty


@pytest.mark.parametrize("command", ["engine-serve", "generate", "torchrun_launch"])
def test_every_cli_takes_its_engine_flags_from_engine_args(command):
    """The flags are EngineArgs' own (no flag of a command's own shares a name), and none given means
    EngineArgs' defaults (torchrun's launcher picks its backend)."""
    from pagedserve.frontend import cli
    from pagedserve.frontend.offline import generate
    module = {"engine-serve": cli, "generate": generate, "torchrun_launch": load_script("torchrun_launch")}[command]
    dests = {a.dest for a in module.make_parser()._actions}
    assert EngineArgs.field_names() <= dests
    expected = DEFAULTS
    if command == "engine-serve":
        args, _ = module.parse_args([])
    else:
        own = module.GenerateArgs if command == "generate" else module.LaunchArgs
        assert not {f.name for f in dataclasses.fields(own)} & EngineArgs.field_names()
        args, _ = module.parse_args(["--prompt", "x"])
        if command == "torchrun_launch":
            expected = dataclasses.replace(DEFAULTS, distributed_executor_backend="torchrun")
    assert args == expected


def test_generate_runs_with_engine_flags(tiny_serving_model):
    cmd = [sys.executable, "-m", "pagedserve.frontend.offline.generate", "--model", tiny_serving_model, "--dtype", "float32",
           "--kv-cache-memory", "0.02", "--seed", "3", "--max-tokens", "4", "--prompt", "Hello", "--prompt", "Hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("--- ")] == ["--- 'Hello'", "--- 'Hi'"]
    missing = subprocess.run(cmd[:-4], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--prompt" in missing.stderr


def test_torchrun_launcher_refuses_another_backend():
    with pytest.raises(SystemExit):
        load_script("torchrun_launch").parse_args(["--distributed-executor-backend", "mp"])


def test_append_flags_repeat_and_leave_the_default_alone():
    @dataclass(frozen=True)
    class Knobs:
        word: tuple[str, ...] = setting(("a",), append=True, help="a word")

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Knobs)
    assert dataclass_from(parser.parse_args(["--word", "b", "--word", "c"]), Knobs).word == ("a", "b", "c")
    assert dataclass_from(parser.parse_args([]), Knobs).word == ("a",) == Knobs().word
    assert "(repeatable)" in parser.format_help()

    @dataclass(frozen=True)
    class Bad:
        count: int = setting(1, append=True, help="a count")
    with pytest.raises(TypeError, match="an append flag must be a tuple"):
        add_dataclass_args(argparse.ArgumentParser(), Bad)


_ENV_READ = re.compile(r"""os\.(?:environ\.get|getenv)\(\s*["'](\w+)|os\.environ\[\s*["'](\w+)["']\s*\](?!\s*=[^=])""")


def test_environment_variables_are_read_in_envs_only():
    """Our variables are read through common/envs.py; setting one for a child process is fine."""
    ours = set(envs.environment_variables)
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in ("tests", ".git", ".venv", "__pycache__")]
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path == os.path.join(ROOT, "common", "envs.py"):
                continue
            with open(path) as f:
                text = f.read()
            found += [(path, m.group(1) or m.group(2)) for m in _ENV_READ.finditer(text)
                      if (m.group(1) or m.group(2)) in ours or (m.group(1) or m.group(2)).startswith("PAGEDSERVE_")]
    assert found == []


def test_one_json_object_rule_for_flags_api_values_and_result_files(tmp_path):
    """A JSON object is read by one rule (json_file.parse_json_object): a flag's value, the Python API's
    speculative_config string and a results file's line each name what is wrong."""
    from pagedserve.common.config.arg_utils import json_object
    from pagedserve.common.json_file import parse_json_object
    from pagedserve.common.speculative import parse_speculative_config
    from pagedserve.frontend.bench.results import read_results
    assert parse_json_object('{"a": 1}', "x") == {"a": 1}
    with pytest.raises(ValueError, match=r"^x: not JSON"):
        parse_json_object("{", "x")
    with pytest.raises(ValueError, match=r"^x: expected a JSON object .* got a list"):
        parse_json_object("[1]", "x")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a JSON object"):
        json_object("[1]")
    with pytest.raises(ValueError, match=r"^speculative_config: not JSON"):
        parse_speculative_config("{")
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n"s"\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: expected a JSON object"):
        read_results(str(path))
