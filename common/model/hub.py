"""A model argument -> a local folder: a path on disk wins; otherwise a Hugging Face Hub id is found in the hub
cache or downloaded into it through huggingface_hub.

huggingface_hub itself honours HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE; it reads them when it is
imported, so they must be set before the process that resolves the model starts (the engine core, a fresh
process, or the offline LLM's own). Its progress bars are left on: a first download can take minutes.
"""
from __future__ import annotations

import os
import re

# What serving needs and nothing more: no .bin / .pt / .gguf duplicates, no optimizer states, no images.
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template*", "config.json")
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               *TOKENIZER_FILES)

# "name" or "org/name": letters, digits, "-", "_", "."; never a path that starts with "/", "." or "~".
_REPO_ID = re.compile(r"^(?![.~])[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")


class ModelUnavailableError(ValueError):
    """The model argument is neither on disk nor obtainable from the Hub; the message names what was tried."""


def looks_like_hub_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith(".gguf")


def local_or_hub_path(model: str, revision: str | None = None, download_dir: str | None = None,
                      patterns: tuple[str, ...] = MODEL_FILES, what: str = "model") -> tuple[str, bool]:
    """(a local path, whether it came from the Hub). An existing file or folder wins over a Hub id of the
    same spelling; anything else that looks like an id is looked up in the hub cache, then downloaded."""
    local = os.path.abspath(os.path.expanduser(model))
    if os.path.exists(local):
        return local, False
    if not looks_like_hub_id(model):
        raise ModelUnavailableError(f"{what}: {model!r} does not exist on disk (looked for {local}) and is not a "
                                    "Hugging Face Hub id (org/name)")
    return snapshot(model, revision, download_dir, patterns, what), True


def snapshot(repo_id: str, revision: str | None, download_dir: str | None, patterns: tuple[str, ...],
             what: str = "model") -> str:
    """The snapshot folder of `repo_id` at `revision` holding the files matching `patterns`."""
    from huggingface_hub import constants, snapshot_download
    offline = constants.HF_HUB_OFFLINE
    cache_dir = download_dir or constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(patterns),
                                 local_files_only=offline)
    except Exception as exc:     # huggingface_hub's errors are many kinds, all meaning "not available"
        tried = (f"not found locally ({os.path.abspath(repo_id)}), not in the Hugging Face cache {cache_dir}")
        how = ("HF_HUB_OFFLINE is set, so nothing was downloaded" if offline
               else f"asking the Hub failed ({_first_line(exc)})")
        raise ModelUnavailableError(f"{what}: {repo_id!r} (revision {revision or 'main'}) is {tried}, and {how}"
                                    ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
