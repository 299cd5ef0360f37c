"""Which runner a model gets (vLLM's --runner / --convert) and, for pooling, how its hidden states become one
vector: the pooling type and normalization, read from a sentence-transformers folder (modules.json,
1_Pooling/config.json, a Normalize module) when there is one, else vLLM's defaults for the architecture."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.common.json_file import read_json_object

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "CLS", "MEAN")

# Architectures that are pooling models as they stand: (task, default pooling type, causal).
_NATIVE: dict[str, tuple[str, str, bool]] = {
    "BertModel": ("embed", "CLS", False),
    "XLMRobertaModel": ("embed", "CLS", False),
    "RobertaModel": ("embed", "CLS", False),
    "BertForSequenceClassification": ("classify", "CLS", False),
    "XLMRobertaForSequenceClassification": ("classify", "CLS", False),
    "RobertaForSequenceClassification": ("classify", "CLS", False),
    # A causal LM with a score head classifies by its last token (HF pools the last non-padding one).
    "LlamaForSequenceClassification": ("classify", "LAST", True),
    "Qwen2ForSequenceClassification": ("classify", "LAST", True),
    "Qwen3ForSequenceClassification": ("classify", "LAST", True),
}
# sentence-transformers' 1_Pooling/config.json switches, in the order it checks them.
_ST_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_lasttoken", "LAST"))


@dataclass(frozen=True)
class PoolerConfig:
    task: str                       # "embed" | "classify": what the model answers (score rides on classify)
    pooling_type: str               # one of POOLING_TYPES
    normalize: bool                 # embed: L2-normalize by default
    causal: bool                    # False: a bidirectional encoder (BERT): no KV cache, one step per prompt
    num_labels: int                 # classify: the classifier's outputs
    is_matryoshka: bool             # embed: `dimensions` may truncate the vector
    matryoshka_dimensions: tuple[int, ...] | None   # the dimensions it was trained for (None: any)

    @property
    def whole_prompt(self) -> bool:
        """The pooler reads every position of the prompt in one step: no chunked prefill, no prefix cache
        (only last-token pooling of a causal model builds on the KV cache)."""
        return not self.causal or self.pooling_type != "LAST"

    @property
    def tasks(self) -> tuple[str, ...]:
        return ("embed", "encode") if self.task == "embed" else ("classify", "score", "encode")


def resolve_pooler(runner: str, convert: str, hf_config: Any, model_path: str | None) -> PoolerConfig | None:
    """The pooler of this model under --runner/--convert, or None for a generating model; ValueError naming
    the flag for a combination that cannot run."""
    arch = _architecture(hf_config)
    native = _NATIVE.get(arch)
    if runner == "generate" and native is not None:
        raise ValueError(f"runner: {arch} is a pooling model; it cannot run with --runner generate")
    if runner == "auto":
        runner = "pooling" if native is not None or convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"convert: --convert {convert} needs --runner pooling")
        return None
    if native is not None:
        if convert not in ("auto", "none", native[0]):
            raise ValueError(f"convert: {arch} is a {native[0]} model; --convert {convert} does not apply")
        task, pooling, causal = native
    else:
        if convert == "none":
            raise ValueError(f"convert: {arch} is no pooling model; use --convert embed")
        task, pooling, causal = ("embed" if convert == "auto" else convert), "LAST", True
        if task == "classify":
            raise ValueError(f"convert: --convert classify of a causal LM ({arch}) is not supported: serve a "
                             "*ForSequenceClassification checkpoint, or use --convert embed")
    st_pooling, st_normalize = _sentence_transformers(model_path)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        task=task, pooling_type=st_pooling or pooling,
        normalize=st_normalize if st_normalize is not None else True,
        causal=causal, num_labels=int(getattr(hf_config, "num_labels", 1) or 1),
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False)) or dims is not None,
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)


def position_limit(hf_config: Any) -> int | None:
    """RoBERTa-family encoders number positions from padding_idx + 1: that many fewer tokens fit."""
    if getattr(hf_config, "model_type", None) in ("xlm-roberta", "roberta"):
        return int(hf_config.max_position_embeddings) - int(hf_config.pad_token_id) - 1
    return None


def _architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else ""


def _sentence_transformers(path: str | None) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers folder; (None, None) for a plain HF folder."""
    if path is None or not os.path.isfile(os.path.join(path, "modules.json")):
        return None, None
    try:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"modules.json: cannot read {path}/modules.json: {exc}") from None
    if not isinstance(modules, list):
        raise ValueError(f"modules.json: {path}/modules.json must hold a JSON list")
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:      # a Dense projection would change the vector: refuse rather than answer another one
        raise ValueError(f"{path}/modules.json: sentence-transformers modules {', '.join(sorted(unknown))} are not "
                         "supported (only Transformer, Pooling and Normalize)")
    pooling = None
    if "Pooling" in kinds:
        cfg = read_json_object(os.path.join(path, kinds["Pooling"], "config.json"), "1_Pooling/config.json")
        pooling = next((kind for key, kind in _ST_MODES if cfg.get(key)), None)
        if pooling is None:
            raise ValueError(f"{path}: the sentence-transformers pooling mode is none of CLS, mean, last token")
    return pooling, "Normalize" in kinds
