"""--runner / --convert and the pooler a model gets: vLLM's defaults per architecture, sentence-transformers'
files when the folder has them, and a clear refusal (naming the flag or file) for what cannot run."""
from __future__ import annotations

import json
import os

import pytest
from transformers import BertConfig, Qwen3Config

from pagedserve.common.pooler_config import resolve_pooler
from pagedserve.tests.helpers.models.pooling_models import write_sentence_transformers


def bert(**kw):
    return BertConfig(architectures=["BertModel"], **kw)


def qwen3():
    return Qwen3Config(architectures=["Qwen3ForCausalLM"])


def test_defaults_per_architecture():
    enc = resolve_pooler("auto", "auto", bert(), None)
    assert (enc.task, enc.pooling_type, enc.normalize, enc.causal, enc.whole_prompt) == ("embed", "CLS", True, False,
                                                                                       True)
    assert resolve_pooler("auto", "auto", qwen3(), None) is None
    dec = resolve_pooler("pooling", "auto", qwen3(), None)
    assert (dec.task, dec.pooling_type, dec.causal, dec.whole_prompt) == ("embed", "LAST", True, False)
    assert resolve_pooler("auto", "embed", qwen3(), None) == dec
    cross = BertConfig(architectures=["BertForSequenceClassification"], num_labels=1)
    cls = resolve_pooler("auto", "auto", cross, None)
    assert (cls.task, cls.num_labels, cls.tasks) == ("classify", 1, ("classify", "score", "encode"))


@pytest.mark.parametrize("runner,convert,config,field", [
    ("generate", "auto", bert(), "runner"),
    ("pooling", "classify", qwen3(), "convert"),
    ("generate", "embed", qwen3(), "convert"),
    ("pooling", "none", qwen3(), "convert"),
    ("pooling", "classify", bert(), "convert"),
])
def test_combinations_that_cannot_run_name_the_flag(runner, convert, config, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        resolve_pooler(runner, convert, config, None)


def test_sentence_transformers_files_and_matryoshka(tmp_path):
    write_sentence_transformers(str(tmp_path), "MEAN", False, 32)
    got = resolve_pooler("auto", "auto", bert(matryoshka_dimensions=[8, 16]), str(tmp_path))
    assert (got.pooling_type, got.normalize, got.is_matryoshka, got.matryoshka_dimensions) == ("MEAN", False, True,
                                                                                             (8, 16))
    write_sentence_transformers(str(tmp_path), "LAST", True, 32)
    assert resolve_pooler("pooling", "embed", qwen3(), str(tmp_path)).normalize is True
    with open(os.path.join(tmp_path, "modules.json")) as f:
        modules = json.load(f)
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    with open(os.path.join(tmp_path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match="Dense are not supported"):
        resolve_pooler("auto", "auto", bert(), str(tmp_path))
