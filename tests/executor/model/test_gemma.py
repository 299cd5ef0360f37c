"""Gemma 2 / Gemma 3 (text): which layers slide, soft-cap and rotate with which base, from every spelling of the
config. (Tiny random checkpoints against HF transformers, TP=2 included: test_family_parity.py.)"""
from __future__ import annotations

import pytest
import torch

from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.models.gemma import FULL, SLIDING, gemma3_ropes, layer_types
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.models.architectures import ARCH_CASES, GEMMA_WINDOW as WINDOW, build
from pagedserve.tests.helpers.parity import model_config


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> str:
    return build(ARCH_CASES["gemma2"], str(tmp_path_factory.mktemp("gemma2")))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> str:
    return build(ARCH_CASES["gemma3"], str(tmp_path_factory.mktemp("gemma3")))


def test_layer_kinds_follow_the_config(gemma2_dir, gemma3_dir):
    g2, g3 = (load_model(model_config(p), TPGroup()) for p in (gemma2_dir, gemma3_dir))
    assert [a.sliding_window for a in g2.attention_layers()] == [WINDOW, None, WINDOW, None]
    assert [a.logit_softcap for a in g2.attention_layers()] == [3.0] * 4
    assert [a.sliding_window for a in g3.attention_layers()] == [WINDOW, None, WINDOW, None]
    assert [a.logit_softcap for a in g3.attention_layers()] == [None] * 4
    # Gemma 3 local layers rotate with rope_local_base_freq, global ones with rope_theta
    ropes = g3.model.ropes
    assert not torch.equal(ropes[SLIDING].cos_cache, ropes[FULL].cos_cache)


def test_layer_types_older_config_fields():
    from types import SimpleNamespace
    g3 = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=6, sliding_window_pattern=3)
    assert layer_types(g3) == [SLIDING, SLIDING, FULL] * 2
    g2 = SimpleNamespace(model_type="gemma2", num_hidden_layers=3)
    assert layer_types(g2) == [SLIDING, FULL, SLIDING]
    with pytest.raises(ValueError, match="layer_types"):
        layer_types(SimpleNamespace(model_type="gemma2", num_hidden_layers=2, layer_types=["sliding_attention"]))


def test_gemma3_ropes_from_flat_and_nested_configs():
    """transformers 4.x (rope_theta, rope_local_base_freq, rope_scaling for global layers) and 5.x
    (rope_parameters per layer kind) spell the same RoPEs."""
    from types import SimpleNamespace
    flat = SimpleNamespace(max_position_embeddings=64, rope_theta=1e6, rope_local_base_freq=1e4,
                           rope_scaling={"rope_type": "linear", "factor": 8.0})
    nested = SimpleNamespace(max_position_embeddings=64, rope_parameters={
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        SLIDING: {"rope_type": "default", "rope_theta": 1e4}})
    a, b = gemma3_ropes(flat, 16), gemma3_ropes(nested, 16)
    for kind in (SLIDING, FULL):
        torch.testing.assert_close(a[kind].cos_cache, b[kind].cos_cache, rtol=0, atol=0)
    pos = torch.arange(64, dtype=torch.float32)[:, None]
    exponents = torch.arange(0, 16, 2) / 16
    local, full = 1.0 / 1e4 ** exponents, 1.0 / 1e6 ** exponents / 8.0      # linear scaling: positions / 8
    torch.testing.assert_close(a[SLIDING].cos_cache[:, :8], (pos * local).cos())
    torch.testing.assert_close(a[FULL].cos_cache[:, :8], (pos * full).cos())
