"""The model's generation_config.json: default sampling for requests that leave a field unset, and the extra
end-of-turn ids that end generation (many chat models keep their end-of-turn id only there).

`--generation-config` picks the source, as in vLLM: "auto" reads the model's folder, "vllm" ignores the file
(the engine's own defaults), anything else is a folder holding a generation_config.json.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Union

from pagedserve.common.json_file import read_json_object
from pagedserve.common.params.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

AUTO, VLLM = "auto", "vllm"
FILE_NAME = "generation_config.json"
# The generation_config.json keys that become request defaults (same names in SamplingParams).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

Number = Union[int, float]


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Number] = field(default_factory=dict)   # only the keys the file sets
    eos_token_ids: tuple[int, ...] = ()


def check_setting(value: str) -> None:
    """The cheap check (no model files): a folder must exist."""
    if value in (AUTO, VLLM):
        return
    if not os.path.isdir(os.path.expanduser(value)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding {FILE_NAME}, "
                         f"got {value!r}")


def load_generation_defaults(value: str, model_folder: str | None) -> GenerationDefaults:
    """model_folder: the model's HF folder (None for a .gguf file, which has no generation_config.json)."""
    if value == VLLM:
        return GenerationDefaults()
    if value == AUTO:
        if model_folder is None or not os.path.isfile(os.path.join(model_folder, FILE_NAME)):
            return GenerationDefaults()
        path = os.path.join(model_folder, FILE_NAME)
    else:
        check_setting(value)
        path = os.path.join(os.path.expanduser(value), FILE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"generation_config: the folder {value!r} has no {FILE_NAME}")
    defaults = parse_generation_config(read_json_object(path, "generation_config"), path)
    if defaults.sampling:
        logger.info("default sampling from %s: %s (a request's own values win)", path, defaults.sampling)
    return defaults


def parse_generation_config(data: dict[str, Any], where: str) -> GenerationDefaults:
    sampling = {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
    try:
        SamplingParams(**sampling).validate()      # the same rules a request's own values meet
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return GenerationDefaults(sampling=sampling, eos_token_ids=tuple(ids))
