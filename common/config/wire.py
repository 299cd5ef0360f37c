"""An EngineConfig as plain data (msgspec builtins, JSON on the wire), never pickle.

The process that resolves the config (the engine core; rank 0 under torchrun) sends it to its workers this
way, and they rebuild it without reading a model file or asking the Hub. The transformers config inside
ModelConfig travels as its `to_dict()` and is rebuilt from the config class of its model_type.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from pagedserve.common.config.engine_args import EngineConfig


def config_to_builtins(config: EngineConfig) -> dict[str, Any]:
    # The transformers config first, by hand: msgspec would take a transformers 5 config (a dataclass) field
    # by field, class-level tables included, and a 4.x one not at all.
    mm = config.model.mm_config
    model = dataclasses.replace(config.model, hf_config=config.model.hf_config.to_dict(),
                                mm_config=mm.to_dict() if mm is not None else None)
    draft = config.draft_model
    if draft is not None:
        draft = dataclasses.replace(draft, hf_config=draft.hf_config.to_dict())
    return msgspec.to_builtins(dataclasses.replace(config, model=model, draft_model=draft))


def config_from_builtins(data: Any) -> EngineConfig:
    """ValueError (naming what is wrong) for data that is not an encoded EngineConfig."""
    try:
        config = msgspec.convert(data, EngineConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not an encoded EngineConfig: {exc}") from None
    mm = config.model.mm_config
    model = dataclasses.replace(config.model, hf_config=hf_config_from_dict(config.model.hf_config),
                                mm_config=hf_config_from_dict(mm) if mm is not None else None)
    draft = config.draft_model
    if draft is not None:
        draft = dataclasses.replace(draft, hf_config=hf_config_from_dict(draft.hf_config))
    return dataclasses.replace(config, model=model, draft_model=draft)


def encode_engine_config(config: EngineConfig) -> bytes:
    return msgspec.json.encode(config_to_builtins(config))


def decode_engine_config(data: bytes) -> EngineConfig:
    return config_from_builtins(msgspec.json.decode(data))


def hf_config_from_dict(data: Any) -> Any:
    """The transformers config `to_dict()` gave, rebuilt from the config class of its model_type (no files)."""
    from transformers import CONFIG_MAPPING
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"hf_config: model_type {model_type!r} has no transformers config class")
    config = CONFIG_MAPPING[model_type].from_dict(data)
    kept = config.to_dict()
    for key, value in data.items():
        # Attributes set after construction (GGUF's rope_theta beside transformers 5's rope_parameters) are
        # no constructor argument: set them back as they were.
        if key not in kept:
            setattr(config, key, value)
    return config

