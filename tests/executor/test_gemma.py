"""Gemma 2 / Gemma 3 (text): tiny random models against HF transformers (eager attention: soft-capping),
with prompts shorter and longer than the sliding window, chunked prefill, prefix-cache hits and TP=2."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.models.gemma import FULL, SLIDING, gemma3_ropes, layer_types
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.tiny_models import hf_greedy, make_tiny_model, prefill_logits, random_prompts
from pagedserve.tests.helpers.tp_ranks import run_ranks
from pagedserve.tests.executor.test_model import _tp_worker, hf_model, model_config

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
WINDOW = 12
COMMON = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, max_position_embeddings=512,
              pad_token_id=0, num_hidden_layers=4, tie_word_embeddings=True)
GEMMA2 = dict(COMMON, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)   # small caps: they bite
GEMMA3 = dict(COMMON, sliding_window_pattern=2, rope_theta=50000.0, rope_local_base_freq=500.0)


def _randomize_norms(path: str, seed: int) -> None:
    """HF initialises Gemma's norm weights to 0 (scale 1 + 0): random ones make the (1 + w) visible."""
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if "norm" in name:
            tensors[name] = torch.rand(t.shape, generator=gen) - 0.5
    save_file(tensors, file, metadata={"format": "pt"})


def _make(path, arch: str, **overrides) -> str:
    fields = {**(GEMMA2 if arch == "gemma2" else GEMMA3), **overrides}
    folder = make_tiny_model(str(path), arch=arch, tokenizer="synthetic", **fields)
    _randomize_norms(folder, seed=len(arch))
    return folder


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory) -> str:
    return _make(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> str:
    return _make(tmp_path_factory.mktemp("gemma3"), "gemma3")


def shared_prefix(vocab: int, base_len: int, tails: list[int]) -> list[list[int]]:
    base = random_prompts(7, [base_len], vocab, low=3)[0]
    return [base + tail for tail in random_prompts(8, tails, vocab, low=3)]


def check_engine(path: str, prompts: list[list[int]], shared: list[list[int]], **engine) -> None:
    """Greedy tokens equal HF generate under chunked prefill (32-token chunks), then with prefix-cache hits."""
    hf = hf_model(path)
    want, want_shared = hf_greedy(hf, prompts, NEW_TOKENS), hf_greedy(hf, shared, NEW_TOKENS)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, **engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.generate(shared[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want_shared[0]
    hits = llm.engine.kv_cache_manager.prefix_stats.hits
    got = [o.outputs[0].token_ids for o in llm.generate(shared[1:], GREEDY, use_tqdm=False)]
    assert got == want_shared[1:]
    assert llm.engine.kv_cache_manager.prefix_stats.hits - hits >= (len(shared) - 1) * 32   # >= 2 blocks each


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


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logits_match_hf_across_the_window(arch, gemma2_dir, gemma3_dir):
    path = gemma2_dir if arch == "gemma2" else gemma3_dir
    ours = load_model(model_config(path), TPGroup())
    prompt = random_prompts(11, [40], 512, low=3)[0]          # > 3 windows
    with torch.inference_mode():
        expected = hf_model(path)(torch.tensor([prompt])).logits[0]
    got = prefill_logits(ours, prompt, block_size=8)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    if arch == "gemma2":
        assert float(got.abs().max()) <= 5.0                   # the final soft-cap


def test_gemma2_engine_matches_hf_generate(gemma2_dir):
    check_engine(gemma2_dir, random_prompts(1, [5, 11, 47, 90], 512, low=3), shared_prefix(512, 40, [3, 17, 30]))


def test_gemma3_engine_matches_hf_generate(gemma3_dir):
    check_engine(gemma3_dir, random_prompts(2, [7, 12, 33, 75], 512, low=3), shared_prefix(512, 36, [1, 9, 26]))


def test_tp2_logits_equal_tp1(tmp_path):
    """Gemma 3 (q/k norms, two RoPE bases, windows) and Gemma 2 (soft-caps) on 2 gloo ranks equal TP=1."""
    import torch.multiprocessing as mp
    paths = [_make(tmp_path / "g3", "gemma3", vocab_size=509), _make(tmp_path / "g2", "gemma2", num_key_value_heads=1)]
    prompt = random_prompts(3, [30], 509, low=3)[0]
    expected = [prefill_logits(load_model(model_config(p), TPGroup()), prompt) for p in paths]
    out = str(tmp_path / "tp2_logits.pt")
    run_ranks(_tp_worker, (paths, prompt, out))
    for want, got in zip(expected, torch.load(out)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
