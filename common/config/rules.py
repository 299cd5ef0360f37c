"""The rules EngineArgs validates and resolves with: each check and each resolution written once, for
common/config/engine_args.py (kept apart so the settings file stays a list of settings)."""
from __future__ import annotations

from typing import Any

from pagedserve.common.model.model_files import rope_max_positions
from pagedserve.common.quantization import WEIGHT_ONLY_METHODS, QuantSpec


def weight_only(quantization: QuantSpec | None) -> bool:
    return quantization is not None and quantization.method in WEIGHT_ONLY_METHODS


def check_timeout(name: str, value: float, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum < value < float("inf"):
        raise ValueError(f"{name} must be a number of seconds above {minimum:g}, got {value!r}")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_device(device: str, executor_backend: str = "uni") -> str:
    """With the Ray backend the ranks run on the cluster's nodes, not here: a CPU-only head (the engine core's
    node) still serves on the cluster's GPUs."""
    if device == "cpu":
        return device
    import torch
    if torch.cuda.is_available():
        return "cuda"
    if executor_backend == "ray":
        from pagedserve.common.ray_utils import cluster_has_gpus
        if cluster_has_gpus():
            return "cuda"
    if device == "cuda":
        raise ValueError("device: 'cuda' requested but no CUDA device is available"
                         + (" here or on the Ray cluster" if executor_backend == "ray" else ""))
    return "cpu"


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    if getattr(hf_config, "max_position_embeddings", None) is None:
        return requested or 2048
    limit = rope_max_positions(hf_config)      # max_position_embeddings, extended by YaRN / dynamic NTK
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's maximum length ({limit}: "
                         "max_position_embeddings, times the rope scaling factor for yarn and dynamic)")
    return requested


def check_parallel(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int | None) -> None:
    """The model splits over tp ranks: heads, KV heads (or their replicas) and the MLP divide."""
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {num_heads} attention heads")
    if (num_kv_heads % tp) and (tp % num_kv_heads):
        raise ValueError(f"tensor_parallel_size={tp} and the model's {num_kv_heads} KV heads: one must divide "
                         "the other")
    if intermediate_size is not None and intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size ({intermediate_size})")


# Families whose model class splits its layers over pipeline stages (executor/model/models/llama.py and the
# mixture-of-experts models built on it).
PIPELINE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def check_pipeline(pp: int, hf_config: Any, backend: str, speculative: Any, async_scheduling: bool) -> None:
    """pipeline_parallel_size > 1 is possible for this model and these settings; ValueError with the numbers."""
    if pp == 1:
        return
    layers = hf_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {layers} layers (a stage needs one)")
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch is not None and arch not in PIPELINE_ARCHITECTURES:
        raise ValueError(f"pipeline_parallel_size={pp}: {arch} runs in one stage only (pipeline stages: "
                         f"{', '.join(PIPELINE_ARCHITECTURES)})")
    if backend not in ("mp", "ray"):
        raise ValueError(f"pipeline_parallel_size={pp} runs with distributed_executor_backend 'mp' or 'ray', "
                         f"got {backend!r}")
    if speculative:
        raise ValueError("speculative_config cannot be combined with pipeline_parallel_size > 1 yet")
    if async_scheduling:
        raise ValueError("async_scheduling with pipeline_parallel_size > 1: the stages already keep one batch "
                         "each in flight (a batch queue); leave async_scheduling off")


# The model types whose projections take LoRA adapters (executor/model/models/llama.py's family; a GGUF file's
# config names its model type, not an architecture).
LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_lora_engine(hf_config: Any, pp: int, speculative: Any) -> None:
    """enable_lora is possible for this model and these settings; ValueError naming what is not."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in LORA_MODEL_TYPES:
        raise ValueError(f"enable_lora: model type {model_type!r} does not take LoRA adapters yet (these do: "
                         f"{', '.join(LORA_MODEL_TYPES)})")
    if pp > 1:
        raise ValueError("enable_lora cannot be combined with pipeline_parallel_size > 1 yet")
    if speculative:
        raise ValueError("enable_lora cannot be combined with speculative_config yet")
