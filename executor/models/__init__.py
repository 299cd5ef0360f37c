"""Model registry: architecture name -> our implementation."""
from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.executor.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                              Qwen3ForCausalLM)

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_BY_MODEL_TYPE = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
                  "qwen3": Qwen3ForCausalLM}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
        raise ValueError(f"model architecture {arch!r} is not supported (supported: {', '.join(_REGISTRY)})")
    cls = _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None))
    if cls is None:
        raise ValueError(f"model_type {getattr(hf_config, 'model_type', None)!r} is not supported "
                         f"(supported: {', '.join(_BY_MODEL_TYPE)})")
    return cls
