"""Load the model's tokenizer (HF folder, or converted once from GGUF and cached)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

from pagedserve.common.model_files import ModelSource

logger = logging.getLogger(__name__)


def cache_root() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    from transformers import AutoTokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.format == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    return _gguf_tokenizer(source.path)


def _gguf_tokenizer(path: str) -> Any:
    # Converting a GGUF vocabulary takes ~10 s; the converted tokenizer is cached by file identity.
    from transformers import AutoTokenizer
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_root(), "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a corrupt cache entry: rebuild it
            logger.warning("tokenizer cache %s is unreadable; rebuilding", cached)
    logger.info("converting the GGUF tokenizer of %s (cached afterwards)", path)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
    try:
        tok.save_pretrained(tmp)
        os.replace(tmp, cached) if not os.path.exists(cached) else shutil.rmtree(tmp)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)   # another process won the race; its copy is as good
    return tok


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja chat template, or the template itself (as vllm serve
    takes it). A template that does not parse is a ValueError now, not a 400 on every chat request."""
    import jinja2
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from exc
    return value
