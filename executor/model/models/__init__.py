"""Model registry: HF architecture name -> our implementation, imported only when a model is built.

The registry itself imports no torch, so the engine core can reject an unsupported checkpoint at start,
before any worker process exists (Executor.__init__).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# architecture -> (module under pagedserve.executor.model.models, class name)
_BY_ARCHITECTURE: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "LlavaForConditionalGeneration": ("vision.llava", "LlavaForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("vision.idefics3", "Idefics3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("vision.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("vision.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("vision.gemma3_mm", "Gemma3ForConditionalGeneration"),
}
# Pooling models (--runner pooling: common/pooler_config.py), tested against sentence-transformers and HF in
# tests/executor/model/test_pooling_models.py rather than by generation parity.
_POOLING: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "LlamaForSequenceClassification": ("seq_cls", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("seq_cls", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("seq_cls", "Qwen3ForSequenceClassification"),
}
# Draft heads, never a served model: common/speculative.mark_eagle_head names them in an EAGLE checkpoint's config.
_HEADS: dict[str, tuple[str, str]] = {
    "EagleLlamaForCausalLM": ("llama_eagle", "EagleLlamaForCausalLM"),
    "Eagle3LlamaForCausalLM": ("llama_eagle", "Eagle3LlamaForCausalLM"),
}
# Configs built from GGUF metadata carry no `architectures`, only `model_type`.
_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    """The generating architectures (pooling_architectures: the rest)."""
    return list(_BY_ARCHITECTURE)


def pooling_architectures() -> list[str]:
    return list(_POOLING)


def resolve_architecture(hf_config: Any) -> str:
    """The registered architecture for the config, or ValueError naming what is supported (one line)."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        if architectures[0] not in _BY_ARCHITECTURE and architectures[0] not in _POOLING:
            raise ValueError(f"architectures: {architectures[0]!r} is not supported "
                             f"(supported: {', '.join(_BY_ARCHITECTURE)}; pooling: {', '.join(_POOLING)})")
        return architectures[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"model_type: {model_type!r} is not supported (supported: {', '.join(_BY_MODEL_TYPE)}; "
                         f"architectures: {', '.join(_BY_ARCHITECTURE)})")
    return _BY_MODEL_TYPE[model_type]


def text_model_class(text_config: Any) -> type[nn.Module]:
    """The causal LM a multimodal config's text_config names by its model_type (a VLM's language model)."""
    model_type = getattr(text_config, "model_type", None)
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"text_config.model_type: {model_type!r} is not supported (supported: "
                         f"{', '.join(_BY_MODEL_TYPE)})")
    module, name = _BY_ARCHITECTURE[_BY_MODEL_TYPE[model_type]]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and architectures[0] in _HEADS:
        module, name = _HEADS[architectures[0]]
    else:
        arch = resolve_architecture(hf_config)
        module, name = _BY_ARCHITECTURE[arch] if arch in _BY_ARCHITECTURE else _POOLING[arch]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
