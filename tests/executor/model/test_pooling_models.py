"""Pooling models through the whole engine (LLM.embed / classify / score) against sentence-transformers and HF
transformers: BERT and XLM-R encoders, a Qwen3 decoder embedder under chunked prefill, a cross-encoder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import LLM
from pagedserve.common.errors import RequestError
from pagedserve.common.params.pooling_params import PoolingParams
from pagedserve.tests.helpers.models.pooling_models import (make_causal_classifier, make_cross_encoder, make_decoder_embedder,
                                                     make_encoder_embedder)

TEXTS = ["the quick brown fox jumps over the lazy dog", "paris is the capital of france", "what",
         "machine learning model for text embedding search, which is good"]
LONG = " ".join(["the quick brown fox jumps over the lazy dog and the cat"] * 20)     # > 200 tokens
PAIRS = [("what is the capital of france", "paris is the capital of france"),
         ("what is the capital of france", "the lazy dog jumps over the fox"),
         ("what is the weather today", "sunny and warm today in rome"),
         ("what is the weather today", "berlin is the capital of germany")]


def _cosines(got: list, ref: np.ndarray) -> np.ndarray:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)


@pytest.mark.parametrize("arch,pooling,normalize", [("bert", "MEAN", True), ("xlm-roberta", "CLS", False)])
def test_encoder_embeddings_match_sentence_transformers(tmp_path, arch, pooling, normalize):
    from sentence_transformers import SentenceTransformer
    path = make_encoder_embedder(str(tmp_path / arch), arch, pooling, normalize)
    texts = TEXTS + [LONG]
    ref = SentenceTransformer(path, device="cpu").encode(texts)
    with LLM(path, dtype="float32", device="cpu") as llm:
        assert llm.info.pooling_tasks == ["embed", "encode"]
        assert not llm.engine.config.cache.enable_prefix_caching      # an encoder keeps no KV to reuse
        got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]      # one batch, mixed lengths
        single = llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
        raw = llm.encode(TEXTS[:1], use_tqdm=False)[0].outputs.data
        with pytest.raises(RequestError, match="dimensions"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
        with pytest.raises(RequestError, match="not generation"):
            llm.generate("the cat", use_tqdm=False)
    assert _cosines(got, ref).min() >= 0.9999
    assert _cosines([single], ref[1:2]).min() >= 0.9999
    norms = np.linalg.norm(np.asarray(got), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize
    np.testing.assert_allclose(np.linalg.norm(got[0]) if not normalize else 1.0,
                               np.linalg.norm(raw) if not normalize else 1.0, rtol=1e-4)


def test_bert_hidden_states_match_hf(tmp_path):
    """Token-type ids and absolute positions: our BertModel's pooled CLS equals HF's for a text pair."""
    from transformers import AutoTokenizer, BertModel
    path = make_encoder_embedder(str(tmp_path / "bert"), "bert", "CLS", False)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(*PAIRS[0], return_tensors="pt")
    with torch.no_grad():
        want = BertModel.from_pretrained(path).eval()(**enc).last_hidden_state[0, 0].numpy()
    with LLM(path, dtype="float32", device="cpu") as llm:
        params = PoolingParams(token_type_ids=enc["token_type_ids"][0].tolist())
        got = llm.encode({"prompt_token_ids": enc["input_ids"][0].tolist()}, params, use_tqdm=False)
    np.testing.assert_allclose(got[0].outputs.data, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,base_model", [("qwen3", False), ("qwen2", True)])
def test_decoder_embedder_chunked_matches_sentence_transformers(tmp_path, arch, base_model):
    """Last-token pooling of a causal LM (--convert embed): the long prompt is prefilled in 64-token chunks
    beside short ones, and pooled at its last chunk's last token. qwen2: saved as its base model alone, with no
    LM head (gte-Qwen2's layout)."""
    from sentence_transformers import SentenceTransformer
    path = make_decoder_embedder(str(tmp_path / arch), arch, base_model=base_model)
    texts = TEXTS + [LONG]
    ref = SentenceTransformer(path, device="cpu").encode(texts)
    with LLM(path, dtype="float32", device="cpu", runner="pooling", convert="embed",
             max_num_batched_tokens=64) as llm:
        assert len(llm.tokenizer.encode(LONG)) > 3 * 64
        got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        again = llm.embed(texts[1:2], use_tqdm=False)[0].outputs.embedding     # a prefix-cache hit
        assert llm.engine.kv_cache_manager.usage == 0.0                        # every pooling request freed
    assert _cosines(got, ref).min() >= 0.9999
    assert _cosines([again], ref[1:2]).min() >= 0.9999


def test_cross_encoder_scores_and_rerank_order(tmp_path):
    from sentence_transformers import CrossEncoder
    path = make_cross_encoder(str(tmp_path / "ce"))
    want = CrossEncoder(path, device="cpu").predict(PAIRS)
    with LLM(path, dtype="float32", device="cpu") as llm:
        assert set(llm.info.pooling_tasks) == {"classify", "score", "encode"}
        got = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)]
        one_to_many = [o.outputs.score for o in llm.score(PAIRS[0][0], [b for _, b in PAIRS[:2]], use_tqdm=False)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one_to_many, want[:2], rtol=1e-4, atol=1e-5)
    assert list(np.argsort(got)) == list(np.argsort(want))


def test_classifier_probs_match_hf(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification
    path = make_cross_encoder(str(tmp_path / "cls"), num_labels=3)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        model = BertForSequenceClassification.from_pretrained(path).eval()
        want = [model(**tok(t, return_tensors="pt")).logits.softmax(-1)[0].numpy() for t in TEXTS]
    with LLM(path, dtype="float32", device="cpu") as llm:
        got = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
        with pytest.raises(RequestError, match="input"):
            llm.classify("", use_tqdm=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_matryoshka_dimensions_and_prompts_longer_than_one_step(tmp_path):
    """dimensions cut the vector, then normalize; an encoder's prompt over the step budget or max_model_len is
    refused naming input (truncate_prompt_tokens makes it fit)."""
    path = make_encoder_embedder(str(tmp_path / "mrl"), "bert", "CLS", True, matryoshka_dimensions=[8, 16])
    with LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=32) as llm:
        with pytest.raises(RequestError, match="input: .*max_num_batched_tokens"):
            llm.embed(LONG, use_tqdm=False)
        with pytest.raises(RequestError, match="input: .*max_model_len"):
            llm.embed({"prompt_token_ids": [5] * 600}, use_tqdm=False)
        assert len(llm.encode(LONG, truncate_prompt_tokens=32, use_tqdm=False)[0].prompt_token_ids) == 32
        full = np.asarray(llm.encode(TEXTS[0], use_tqdm=False)[0].outputs.data)
        cut = np.asarray(llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding)
        with pytest.raises(RequestError, match="dimensions: must be one of"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=12), use_tqdm=False)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-6)


def test_causal_lm_classifier_matches_hf(tmp_path):
    """Qwen2ForSequenceClassification: the score head over the last token, chunked like any decoder prompt."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    path = make_causal_classifier(str(tmp_path / "qcls"), "qwen2", num_labels=3)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        want = [model(**tok(t, return_tensors="pt")).logits.softmax(-1)[0].numpy() for t in TEXTS + [LONG]]
    with LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=64) as llm:
        got = [o.outputs.probs for o in llm.classify(TEXTS + [LONG], use_tqdm=False)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
