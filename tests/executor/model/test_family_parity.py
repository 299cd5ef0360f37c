"""Every model family against HF transformers, one suite over the architecture registry
(tests/helpers/models/architectures.py): for each tiny random checkpoint, the logits at every position, greedy tokens
through our model alone and through the engine (chunked prefill, then prefix-cache hits), and the logits on
2 gloo ranks (TP=2) equal to one rank's."""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable

import pytest
import torch

from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.models import supported_architectures
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.models.architectures import ARCH_CASES, build
from pagedserve.tests.helpers.parity import (check_engine, hf_model, model_config, our_greedy, shared_prefix,
                                             tp_prefill_worker)
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, prefill_logits, random_prompts
from pagedserve.tests.helpers.processes.tp_ranks import run_ranks

GREEDY_NEW_TOKENS = 16
CASES = list(ARCH_CASES)
ENGINE_CASES = [name for name, case in ARCH_CASES.items() if case.engine]
# Image-and-text models, checked against HF with images merged in: test_llava.py, test_idefics3.py,
# test_qwen2_vl.py, test_gemma3_mm.py.
MULTIMODAL = {"LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
              "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Callable[..., str]:
    """folder(name) -> the case's checkpoint; folder(name, tp=True) -> its TP=2 checkpoint. Built once."""
    root = tmp_path_factory.mktemp("families")

    @functools.cache
    def get(name: str, tp: bool = False) -> str:
        case = ARCH_CASES[name]
        if tp and case.tp_fields is not None:
            return build(case, str(root / f"{name}_tp"), **case.tp_fields)
        return build(case, str(root / name))
    return get


@pytest.fixture(scope="module")
def models(folder) -> Callable[[str], tuple[torch.nn.Module, torch.nn.Module]]:
    """models(name) -> (our model, HF's), loaded once."""
    @functools.cache
    def get(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
        path = folder(name)
        return load_model(model_config(path, max_model_len=ARCH_CASES[name].max_model_len), TPGroup()), hf_model(path)
    return get


def _prompt(name: str, vocab: int, seed: int = 11) -> list[int]:
    return random_prompts(seed, [ARCH_CASES[name].prompt_len], vocab, low=3)[0]


def test_every_supported_architecture_has_a_case(folder):
    covered = set()
    for name in ARCH_CASES:
        with open(os.path.join(folder(name), "config.json")) as f:
            covered.update(json.load(f)["architectures"])
    assert covered == set(supported_architectures()) - MULTIMODAL


@pytest.mark.parametrize("name", CASES)
def test_logits_match_hf(name, models):
    ours, hf = models(name)
    prompt = _prompt(name, hf.config.vocab_size)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = prefill_logits(ours, prompt, block_size=ARCH_CASES[name].logits_block_size)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got[-1], expected[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)     # every position, not only the last
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap is not None:
        assert float(got.abs().max()) <= cap


@pytest.mark.parametrize("name", CASES)
def test_greedy_matches_hf(name, folder, models):
    ours, hf = models(name)
    prompt = _prompt(name, hf.config.vocab_size)
    eos = model_config(folder(name)).eos_token_ids
    assert our_greedy(ours, prompt, GREEDY_NEW_TOKENS, eos) == hf_greedy(hf, [prompt], GREEDY_NEW_TOKENS)[0]


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_engine_matches_hf_generate(name, folder, models):
    """Greedy tokens equal HF generate with 32-token chunked prefill, then with prefix-cache hits."""
    case, hf = ARCH_CASES[name], models(name)[1]
    vocab = hf.config.vocab_size
    prompts = random_prompts(case.engine_seed, list(case.engine_prompts), vocab, low=3)
    shared = shared_prefix(vocab, case.shared_prefix[0], list(case.shared_prefix[1]))
    engine = {} if case.max_model_len is None else {"max_model_len": case.max_model_len}
    check_engine(folder(name), hf, prompts, shared, **engine)


def _tp_job(folder: Callable[..., str], name: str) -> tuple[str, int | None, list[int]]:
    path = folder(name, tp=True)
    max_len = ARCH_CASES[name].max_model_len
    return path, max_len, _prompt(name, model_config(path).vocab_size, seed=3)


@pytest.fixture(scope="module")
def tp2_logits(folder, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Every case's prefill logits on 2 gloo ranks, in one launch of the two rank processes."""
    out = str(tmp_path_factory.mktemp("tp2") / "logits.pt")
    run_ranks(tp_prefill_worker, ([_tp_job(folder, name) for name in CASES], out))
    return dict(zip(CASES, torch.load(out)))


@pytest.mark.parametrize("name", CASES)
def test_tp2_logits_equal_tp1(name, folder, tp2_logits):
    path, max_len, prompt = _tp_job(folder, name)
    want = prefill_logits(load_model(model_config(path, max_model_len=max_len), TPGroup()), prompt)
    got = tp2_logits[name]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
