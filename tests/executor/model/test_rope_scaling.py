"""RoPE scaling (yarn, dynamic NTK, longrope, llama3, linear): our cos/sin tables against transformers' own
rotary embedding classes, elementwise, over positions on both sides of original_max_position_embeddings."""
from __future__ import annotations

import pytest
import torch

from pagedserve.common.model.model_files import rope_max_positions
from pagedserve.executor.model.layers.rotary import get_rope

HEAD_DIM = 16
ORIGINAL = 64
BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)
# 8 = HEAD_DIM / 2 per-dimension factors; distinct values so a swapped or shifted list shows.
SHORT = [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6]
LONG = [1.1, 1.5, 2.2, 3.4, 5.1, 7.7, 11.3, 16.9]


def _llama(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(**BASE, **kw)


def _qwen2(**kw):
    from transformers import Qwen2Config
    return Qwen2Config(**BASE, **kw)


def _phi3(**kw):
    from transformers import Phi3Config
    return Phi3Config(**BASE, original_max_position_embeddings=ORIGINAL, **kw)


def hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding module for the config's family, one forward over `positions`."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    cls = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "phi3": Phi3RotaryEmbedding}
    rotary = cls[config.model_type](config)
    x = torch.zeros(1, positions.numel(), HEAD_DIM)
    cos, sin = rotary(x, positions[None, :])
    return cos[0], sin[0]


def ours(config, positions: torch.Tensor, max_model_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = get_rope(config, HEAD_DIM, max_model_len).cos_sin(positions, torch.float32)
    return cos[:, 0], sin[:, 0]


def assert_same(config, length: int, max_model_len: int | None = None) -> None:
    """Our table at positions [0, length) equals transformers' forward over that whole sequence."""
    positions = torch.arange(length)
    want_cos, want_sin = hf_cos_sin(config, positions)
    got_cos, got_sin = ours(config, positions, max_model_len)
    torch.testing.assert_close(got_cos, want_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_sin, want_sin, atol=1e-6, rtol=0)


YARN_CASES = {
    "qwen2.5_style": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "betas_no_truncate": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                          "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
               "mscale": 0.707, "mscale_all_dim": 1.0},
    "attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL,
                         "attention_factor": 1.3},
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_equals_hf(case):
    config = _qwen2(max_position_embeddings=ORIGINAL, rope_scaling=dict(YARN_CASES[case]), rope_theta=10000.0)
    length = rope_max_positions(config)
    assert length == int(ORIGINAL * YARN_CASES[case]["factor"])      # the usable context grows with the factor
    assert_same(config, length)


def test_yarn_scales_cos_sin():
    """The attention factor multiplies cos and sin: the table is no longer on the unit circle."""
    config = _qwen2(max_position_embeddings=ORIGINAL, rope_scaling=dict(YARN_CASES["qwen2.5_style"]))
    cos, sin = ours(config, torch.arange(8))
    radius = (cos ** 2 + sin ** 2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0))


def test_dynamic_ntk_equals_hf_at_the_extended_length():
    """We fix the NTK base for max_position_embeddings * factor (vLLM's choice, see rope_scaling.dynamic_ntk):
    equal to transformers' forward over a sequence of that length, at every position of it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = _llama(max_position_embeddings=ORIGINAL, rope_scaling={"type": "dynamic", "factor": 2.0})
    length = rope_max_positions(config)
    assert length == 2 * ORIGINAL
    assert_same(config, length)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=length)
    rope = get_rope(config, HEAD_DIM)
    position = torch.tensor([length - 1])
    torch.testing.assert_close(rope.cos_sin(position, torch.float32)[0][0, 0, :HEAD_DIM // 2],
                               ((length - 1) * inv_freq).cos(), atol=1e-6, rtol=0)
    # Shorter sequences: transformers uses the unscaled base there; we keep one table for every length.
    short_cos, _ = hf_cos_sin(config, torch.arange(ORIGINAL))
    assert not torch.allclose(ours(config, torch.arange(ORIGINAL))[0], short_cos, atol=1e-3)


@pytest.mark.parametrize("factor_field", [None, 3.0])
def test_longrope_long_factors_equal_hf_for_long_sequences(factor_field):
    """max_model_len > original length: long factors at every position, as transformers uses for any sequence
    longer than the original length (from position 0), including the attention factor."""
    scaling = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    if factor_field is not None:
        scaling["factor"] = factor_field
    config = _phi3(max_position_embeddings=4 * ORIGINAL, rope_scaling=scaling)
    assert rope_max_positions(config) == 4 * ORIGINAL
    assert_same(config, 4 * ORIGINAL)
    assert_same(config, ORIGINAL + 1)
    picks = torch.tensor([0, 1, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, 3 * ORIGINAL + 7])
    want_cos, want_sin = hf_cos_sin(config, torch.arange(4 * ORIGINAL))
    got_cos, got_sin = ours(config, picks)
    torch.testing.assert_close(got_cos, want_cos[picks], atol=1e-6, rtol=0)
    torch.testing.assert_close(got_sin, want_sin[picks], atol=1e-6, rtol=0)


def test_longrope_short_factors_when_max_model_len_fits_the_original():
    """max_model_len <= original length: short factors, as transformers uses for every such sequence."""
    config = _phi3(max_position_embeddings=4 * ORIGINAL,
                   rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    assert_same(config, ORIGINAL, max_model_len=ORIGINAL)
    long_cos, _ = ours(config, torch.arange(ORIGINAL))
    short_cos, _ = ours(config, torch.arange(ORIGINAL), max_model_len=ORIGINAL)
    assert not torch.allclose(long_cos, short_cos, atol=1e-3)


def test_longrope_factor_count_is_checked():
    config = _phi3(max_position_embeddings=4 * ORIGINAL,
                   rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    config.rope_parameters["long_factor"] = LONG[:-1]
    with pytest.raises(ValueError, match="long_factor has 7 entries"):
        get_rope(config, HEAD_DIM)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": ORIGINAL},
    None,
])
def test_existing_kinds_still_equal_hf(scaling):
    config = _llama(max_position_embeddings=4 * ORIGINAL, rope_scaling=scaling, rope_theta=500000.0)
    assert_same(config, 4 * ORIGINAL)


def test_unknown_rope_type_names_the_supported_ones():
    config = _llama(max_position_embeddings=ORIGINAL)
    config.rope_parameters = {"rope_type": "fancy", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="'fancy' is not supported.*yarn.*dynamic.*longrope"):
        get_rope(config, HEAD_DIM)


def test_max_model_len_reaches_the_scaled_length():
    """YaRN and dynamic NTK configs keep the pre-training length in max_position_embeddings: as vLLM, the
    engine may serve up to that length times the factor (our table covers it), and no further."""
    from pagedserve.common.config.rules import resolve_max_model_len as _resolve_max_model_len
    yarn = _qwen2(max_position_embeddings=ORIGINAL, rope_scaling=dict(YARN_CASES["qwen2.5_style"]))
    assert _resolve_max_model_len(None, yarn) == 4 * ORIGINAL
    assert get_rope(yarn, HEAD_DIM).cos_cache.shape == (4 * ORIGINAL, HEAD_DIM)
    with pytest.raises(ValueError, match="max_model_len"):
        _resolve_max_model_len(4 * ORIGINAL + 1, yarn)
    plain = _llama(max_position_embeddings=ORIGINAL)
    assert _resolve_max_model_len(None, plain) == ORIGINAL
    with pytest.raises(ValueError, match="max_model_len"):
        _resolve_max_model_len(ORIGINAL + 1, plain)
