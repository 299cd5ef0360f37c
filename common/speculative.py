"""--speculative-config: vLLM's keys, parsed and checked once, into a frozen SpeculativeConfig.

Speculative decoding proposes up to k tokens a step that the target model then verifies in one pass
(docs/speculative_decoding.md). `ngram` (prompt lookup over the prompt and the output so far), `draft_model` (a
smaller model with the same vocabulary, drafting greedily) and `eagle` / `eagle3` (a draft head from an EAGLE
checkpoint that reads the model's hidden states) run here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.common.json_file import parse_json_object

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
PLANNED_METHODS = ("medusa", "mtp")
# Methods that load `model`: a draft model, or an EAGLE head.
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# Keys of vLLM's SpeculativeConfig that mean something here.
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
         "model", "draft_tensor_parallel_size")
# vLLM's rule: one of prompt_lookup_min / _max unset takes the other's value, both unset are 5.
DEFAULT_PROMPT_LOOKUP = 5
# Running requests beyond which no request gets drafts (vLLM's disable_by_batch_size): with 3 and k = 5 a step
# is at most 18 tokens, within what the CPU's one-call decode step takes (CpuDecodeStep.max_rows: 32 where the
# int4 GEMM is built).
DEFAULT_DISABLE_BY_BATCH_SIZE = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                      # one of METHODS
    num_speculative_tokens: int      # k: the most draft tokens a request gets per step
    prompt_lookup_min: int           # ngram: shortest suffix looked up
    prompt_lookup_max: int           # ngram: longest suffix looked up (tried first)
    disable_by_batch_size: int       # no drafts while more requests than this run
    model: str | None                # MODEL_METHODS: a path or Hub id (resolved into EngineConfig.draft_model)
    # MODEL_METHODS: the ranks the draft shards over, 1 (whole on each rank) or the model's tensor_parallel_size
    # (sharded with the model's own group); unset: the model's, as in vLLM.
    draft_tensor_parallel_size: int

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request holds past its scheduled tokens: a draft model or head writes its proposals there."""
        return self.num_speculative_tokens if self.method in MODEL_METHODS else 0

    @property
    def is_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")


def parse_speculative_config(value: dict[str, Any] | str | None,
                             tensor_parallel_size: int = 1) -> SpeculativeConfig | None:
    """The config a user gave (a dict, or its JSON as the flag takes it), for a model on tensor_parallel_size
    ranks; ValueError naming the field."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        value = parse_json_object(value, "speculative_config")
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be an object of vLLM's keys, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(_KEYS)})")
    method = value.get("method") or ("draft_model" if value.get("model") else None)
    if method is None:
        raise ValueError("speculative_config.method is required (one of: " + ", ".join(METHODS) + ")")
    if method in PLANNED_METHODS:
        raise ValueError(f"speculative_config.method {method!r} is not supported yet; this build runs: "
                         + ", ".join(METHODS))
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
    model = value.get("model")
    if method in MODEL_METHODS:
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config.model (a path or Hub id) is required for method {method}")
    elif model is not None:
        raise ValueError(f"speculative_config.model is only for methods {', '.join(MODEL_METHODS)}")
    k = _int(value, "num_speculative_tokens", None)
    given_lo, given_hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo = _int(value, "prompt_lookup_min", given_hi if given_hi is not None else DEFAULT_PROMPT_LOOKUP)
    hi = _int(value, "prompt_lookup_max", given_lo if given_lo is not None else DEFAULT_PROMPT_LOOKUP)
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
    disable = _int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo,
                             prompt_lookup_max=hi, disable_by_batch_size=disable, model=model,
                             draft_tensor_parallel_size=_draft_tp(value, tensor_parallel_size))


def _draft_tp(value: dict[str, Any], tensor_parallel_size: int) -> int:
    """vLLM's rule: the draft runs whole on each rank (1) or sharded like the model (its tensor_parallel_size,
    also the default); nothing between."""
    if value.get("draft_tensor_parallel_size") is None:
        return tensor_parallel_size
    got = _int(value, "draft_tensor_parallel_size", None)
    if got not in (1, tensor_parallel_size):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 or the model's "
                         f"tensor_parallel_size ({tensor_parallel_size}), got {got}")
    return got


def _int(value: dict[str, Any], key: str, default: int | None) -> int:
    got = value.get(key, default)
    if got is None:
        raise ValueError(f"speculative_config.{key} is required")
    if isinstance(got, bool) or not isinstance(got, int) or got < 1:
        raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {got!r}")
    return got


# EAGLE-3 reads the residual stream entering these target layers (vLLM's default: an early, a middle and a late one).
def default_eagle3_layers(num_target_layers: int) -> list[int]:
    return [2, num_target_layers // 2, num_target_layers - 3]


def mark_eagle_head(head_config: Any, method: str, target_config: Any) -> None:
    """Point an EAGLE checkpoint's config at our head classes (EAGLE-1 checkpoints say LlamaForCausalLM, EAGLE-3
    ones LlamaForCausalLMEagle3) and fill what the head needs from the model it drafts for; ValueError naming
    the field where the pair cannot work."""
    if getattr(head_config, "model_type", None) != "llama":
        raise ValueError(f"speculative_config.model: method {method} takes a Llama-style EAGLE head, got "
                         f"model_type {getattr(head_config, 'model_type', None)!r}")
    target_hidden = target_config.hidden_size
    if method == "eagle":
        if head_config.hidden_size != target_hidden:
            raise ValueError(f"speculative_config.model: the EAGLE head's hidden_size ({head_config.hidden_size}) "
                             f"differs from the model's ({target_hidden})")
        head_config.architectures = ["EagleLlamaForCausalLM"]
        return
    layers = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None) \
        or default_eagle3_layers(target_config.num_hidden_layers)
    if any(not 0 < i < target_config.num_hidden_layers for i in layers):
        raise ValueError(f"speculative_config.model: EAGLE-3 reads target layers {layers}, but the model has "
                         f"{target_config.num_hidden_layers}")
    head_config.eagle_aux_hidden_state_layer_ids = list(layers)
    head_config.target_hidden_size = getattr(head_config, "target_hidden_size", None) or target_hidden
    head_config.architectures = ["Eagle3LlamaForCausalLM"]
