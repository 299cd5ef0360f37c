"""Load the tokenizer the engine core named, and `--chat-template` values."""
from __future__ import annotations

import os
from typing import Any


def load_tokenizer(folder: str) -> Any:
    """The tokenizer in `folder` (EngineInfo.tokenizer). A folder with tokenizer.json loads as a fast
    tokenizer directly: AutoTokenizer would import torch (through transformers' config classes), and the
    API process has no other use for it. Anything else goes through AutoTokenizer."""
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


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
