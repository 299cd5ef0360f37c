"""The resolved EngineConfig crosses to workers as JSON data, and they rebuild it without reading a model
config or asking the Hub: the same values, the same transformers config (rope scaling included), the same
model."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedserve.common.config.engine_args import EngineArgs, EngineConfig
from pagedserve.common.config.wire import (config_from_builtins, config_to_builtins, decode_engine_config,
                                           encode_engine_config, hf_config_from_dict)
from pagedserve.common.model.model_files import rope_max_positions, rope_settings
from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.models.hub_cache import add_snapshot, offline_env
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, prefill_logits, random_prompts

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# case -> (arch, make_tiny_model overrides): plain, each rope scaling layout, sub-layouts of other families.
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "qwen2_yarn_legacy_type": ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32},
                                         "max_position_embeddings": 32}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    # Gemma 3: a second rope (rope_local_base_freq) for its sliding layers.
    "gemma3": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12, "pad_token_id": 0,
                          "num_hidden_layers": 4, "tie_word_embeddings": True, "sliding_window_pattern": 2,
                          "rope_theta": 50000.0, "rope_local_base_freq": 500.0}),
    "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "mlp_only_layers": [1],
                                "norm_topk_prob": False, "pad_token_id": 0}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("wire")
    return {name: make_tiny_model(str(root / name), arch=arch, tokenizer="synthetic", **kw)
            for name, (arch, kw) in CASES.items()}


def assert_same_config(got: EngineConfig, expected: EngineConfig) -> None:
    assert got == expected                                    # every field but the two below
    assert got.model.default_sampling == expected.model.default_sampling
    assert type(got.model.hf_config) is type(expected.model.hf_config)
    assert got.model.hf_config.to_dict() == expected.model.hf_config.to_dict()
    assert rope_settings(got.model.hf_config) == rope_settings(expected.model.hf_config)
    assert rope_max_positions(got.model.hf_config) == rope_max_positions(expected.model.hf_config)
    for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "eos_token_ids"):
        assert getattr(got.model, name) == getattr(expected.model, name), name


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_configs_round_trip(folders, case):
    config = EngineArgs(model=folders[case], dtype="float32", device="cpu").create_engine_config()
    data = encode_engine_config(config)
    assert_same_config(decode_engine_config(data), config)
    assert_same_config(config_from_builtins(json.loads(data)), config)      # any JSON decoder will do


def test_gguf_config_round_trips_with_rope_theta(smollm2_path):
    """A config built from GGUF metadata keeps rope_theta beside transformers 5's rope_parameters."""
    config = EngineArgs(model=smollm2_path, device="cpu").create_engine_config()
    got = decode_engine_config(encode_engine_config(config))
    assert_same_config(got, config)
    assert got.model.quantization == config.model.quantization and got.model.quantization.method == "gguf"
    assert rope_settings(got.model.hf_config)[0] == 100000.0


def test_everything_resolved_survives(folders, tmp_path):
    """Settings away from their defaults, a generation_config.json and a tokenizer folder all cross."""
    folder = shutil.copytree(folders["llama"], tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20,
                                                               "eos_token_id": [2, 7]}))
    config = EngineArgs(model=str(folder), tokenizer=str(folder), dtype="float32", device="cpu", seed=7,
                        max_model_len=100, block_size=8, kv_cache_memory=0.1, max_num_seqs=3,
                        max_waiting_requests=None, scheduling_policy="priority", enable_chunked_prefill=False,
                        reasoning_parser="deepseek_r1", structured_outputs_compile_timeout=2.5,
                        tensor_parallel_size=2, worker_heartbeat_timeout=4.0, async_scheduling=True,
                        served_model_name="x", enable_prefix_caching=False).create_engine_config()
    got = decode_engine_config(encode_engine_config(config))
    assert_same_config(got, config)
    assert got.model.default_sampling == {"temperature": 0.6, "top_k": 20}
    assert got.model.generation_eos_token_ids == (2, 7) and got.model.tokenizer == str(folder)
    assert got.structured_outputs.reasoning_parser == "deepseek_r1" and got.parallel.worker_heartbeat_timeout_s == 4.0


def test_checkpoint_quantization_config_round_trips(folders, tmp_path):
    folder = shutil.copytree(folders["llama"], tmp_path / "gptq")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                  "sym": False}
    (folder / "config.json").write_text(json.dumps(raw))
    from transformers import AutoConfig
    original = AutoConfig.from_pretrained(str(folder))
    rebuilt = hf_config_from_dict(json.loads(json.dumps(original.to_dict())))
    assert rebuilt.to_dict() == original.to_dict()
    from pagedserve.common.quantization import checkpoint_quant_spec
    assert checkpoint_quant_spec(rebuilt) == checkpoint_quant_spec(original)


@pytest.mark.parametrize("case", ["llama3_rope", "qwen2_yarn_legacy_type", "gemma3"])
def test_rebuilt_config_builds_the_same_model(folders, case):
    config = EngineArgs(model=folders[case], dtype="float32", device="cpu").create_engine_config()
    rebuilt = decode_engine_config(encode_engine_config(config))
    prompt = random_prompts(3, [24], config.model.vocab_size, low=3)[0]
    torch.manual_seed(0)
    expected = prefill_logits(load_model(config.model, TPGroup()), prompt)
    torch.manual_seed(0)
    got = prefill_logits(load_model(rebuilt.model, TPGroup()), prompt)
    assert torch.equal(got, expected)


_DECODE_SCRIPT = textwrap.dedent("""
    import json, sys
    watched = sys.argv[2]
    opened = []
    def audit(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].startswith(watched):
            opened.append(args[0])
    sys.addaudithook(audit)
    from pagedserve.common.config.wire import decode_engine_config
    with open(sys.argv[1], "rb") as f:
        config = decode_engine_config(f.read())
    print(json.dumps({"opened": opened, "hf_config": config.model.hf_config.to_dict(),
                      "path": config.model.source.path, "tokenizer": config.model.tokenizer,
                      "max_model_len": config.model.max_model_len}))
""")


def _decode_elsewhere(data: bytes, tmp_path, watched: str, env: dict[str, str]) -> dict:
    (tmp_path / "config.json").write_bytes(data)
    proc = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT, str(tmp_path / "config.json"), watched],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_worker_side_decode_needs_no_model_files_and_no_hub(folders, tmp_path):
    """A Hub model resolved offline from a cache; then the cache is gone, the Hub unreachable (offline, an
    empty cache): the worker side still rebuilds the same config, and opens nothing of the model's."""
    cache = tmp_path / "hub"
    add_snapshot(str(cache), "org/tiny", folders["qwen2_yarn_legacy_type"])
    env = offline_env(HF_HUB_CACHE=str(cache))
    script = ("import sys; from pagedserve.common.config.engine_args import EngineArgs; "
              "from pagedserve.common.config.wire import encode_engine_config; "
              "sys.stdout.buffer.write(encode_engine_config(EngineArgs(model='org/tiny', dtype='float32', "
              "device='cpu').create_engine_config()))")
    made = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    expected = json.loads(made.stdout)["model"]
    shutil.rmtree(cache)
    empty = tmp_path / "empty"
    empty.mkdir()
    got = _decode_elsewhere(made.stdout, tmp_path, str(cache) + os.sep, offline_env(HF_HUB_CACHE=str(empty)))
    assert got["opened"] == [] and not os.path.exists(got["path"])
    assert got["path"].startswith(str(cache)) and got["max_model_len"] == 128     # yarn: 32 x 4
    assert got["hf_config"] == expected["hf_config"]


def test_worker_side_decode_of_a_gguf_config_opens_no_file_of_it(smollm2_path, tmp_path):
    config = EngineArgs(model=smollm2_path, device="cpu").create_engine_config()
    got = _decode_elsewhere(encode_engine_config(config), tmp_path, smollm2_path, offline_env())
    assert got["opened"] == []
    assert got["hf_config"] == json.loads(json.dumps(config.model.hf_config.to_dict()))


def test_not_a_config_is_refused_naming_it():
    with pytest.raises(ValueError, match="not an encoded EngineConfig"):
        config_from_builtins({"model": {}})
    with pytest.raises(ValueError, match="model_type 'nope' has no transformers config class"):
        hf_config_from_dict({"model_type": "nope"})


def test_builtins_are_plain_json_data(folders):
    config = EngineArgs(model=folders["llama"], dtype="float32", device="cpu").create_engine_config()
    data = config_to_builtins(config)
    assert json.loads(json.dumps(data)) == json.loads(encode_engine_config(config))
    assert set(data) == {f.name for f in dataclasses.fields(EngineConfig)}
