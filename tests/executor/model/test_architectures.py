"""The model registry: every entry builds, it imports no torch, and an unsupported checkpoint stops the
engine at start with one line naming what is supported (before any tensor-parallel worker starts)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedserve.executor.model.models import (get_model_class, pooling_architectures, resolve_architecture,
                                              supported_architectures)
from pagedserve.frontend.cli import main
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model


def test_every_registered_architecture_resolves_to_its_class():
    from torch import nn
    assert "Phi3ForCausalLM" in supported_architectures()
    for arch in supported_architectures() + pooling_architectures():
        cls = get_model_class(SimpleNamespace(architectures=[arch]))
        assert cls.__name__ == arch and issubclass(cls, nn.Module)


def test_registry_imports_no_torch():
    """The engine core process checks the architecture with it and stays free of torch."""
    code = ("import sys; from types import SimpleNamespace; "
            "from pagedserve.executor.model.models import resolve_architecture; "
            "print(resolve_architecture(SimpleNamespace(architectures=['Phi3ForCausalLM'])), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["Phi3ForCausalLM", "False"]


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type: 'gpt2' is not supported \(supported: llama.*Phi3ForCausalLM"):
        resolve_architecture(SimpleNamespace(architectures=None, model_type="gpt2"))


@pytest.fixture(scope="module")
def unknown_arch_dir(tmp_path_factory) -> str:
    folder = make_tiny_model(str(tmp_path_factory.mktemp("unknown_arch")), tokenizer="synthetic")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["FancyNewForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("tp", ["1", "2"])
def test_unknown_architecture_stops_the_server_with_one_line(unknown_arch_dir, tp, capfd):
    with pytest.raises(SystemExit) as exc:
        main(["--model", unknown_arch_dir, "--dtype", "float32", "--port", "0", "--tensor-parallel-size", tp])
    message = str(exc.value.code)
    assert "\n" not in message
    assert message.startswith("engine-serve: engine core failed to start: ValueError: architectures: "
                              "'FancyNewForCausalLM' is not supported (supported: LlamaForCausalLM, ")
    assert "Phi3ForCausalLM" in message
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err and "worker rank" not in printed.err and "ERROR" not in printed.err
