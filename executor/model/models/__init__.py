"""Model registry: HF architecture name -> our implementation."""
from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.executor.model.models.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                              Qwen3ForCausalLM)
from pagedserve.executor.model.models.phi3 import Phi3ForCausalLM

_BY_ARCHITECTURE: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}
# Configs built from GGUF metadata carry no `architectures`, only `model_type`.
_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        cls = _BY_ARCHITECTURE.get(architectures[0])
        if cls is None:
            raise ValueError(f"architectures: {architectures[0]!r} is not supported "
                             f"(supported: {', '.join(_BY_ARCHITECTURE)})")
        return cls
    model_type = getattr(hf_config, "model_type", None)
    cls = _BY_MODEL_TYPE.get(model_type)
    if cls is None:
        raise ValueError(f"model_type: {model_type!r} is not supported (supported: {', '.join(_BY_MODEL_TYPE)}; "
                         f"architectures: {', '.join(_BY_ARCHITECTURE)})")
    return cls
