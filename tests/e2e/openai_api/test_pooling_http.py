"""The pooling routes of a real engine-serve: OpenAI's SDK and LangChain's OpenAIEmbeddings on /v1/embeddings
(float and base64, token ids, refusals naming the field), /pooling, /score, /rerank (Jina and Cohere paths) and
/classify on a cross-encoder, and the refusals between generate and pooling models."""
from __future__ import annotations

import base64

import numpy as np
import httpx
import openai
import pytest

from pagedserve.tests.helpers.models.pooling_models import make_cross_encoder, make_encoder_embedder
from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

TEXTS = ["the quick brown fox jumps over the lazy dog", "paris is the capital of france", "what"]
DOCS = ["paris is the capital of france", "the lazy dog jumps over the fox", "berlin is the capital of germany"]
QUERY = "what is the capital of france"


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    path = make_encoder_embedder(str(tmp_path_factory.mktemp("bert")), "bert", "MEAN", True)
    server = Server(*SMALL_KV, "--served-model-name", "m", model=path, max_model_len=None, token=None)
    yield server, path
    server.stop()


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory):
    path = make_cross_encoder(str(tmp_path_factory.mktemp("ce")))
    server = Server(*SMALL_KV, "--served-model-name", "m", model=path, max_model_len=None, token=None)
    yield server, path
    server.stop()


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.auth, timeout=60)


def test_openai_embeddings_float_base64_and_token_ids(embed_server):
    from sentence_transformers import SentenceTransformer
    server, path = embed_server
    want = SentenceTransformer(path, device="cpu").encode(TEXTS)
    client = server.client()
    as_float = client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    as_b64 = client.embeddings.create(model="m", input=TEXTS)          # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in as_float.data])
    # Batched with others, a row may differ in the last bit (another SDPA padding); alone it is exact.
    np.testing.assert_allclose(got, np.array([d.embedding for d in as_b64.data]), rtol=0, atol=1e-6)
    as_float1, as_b641 = (client.embeddings.create(model="m", input=TEXTS[1], encoding_format=f).data[0].embedding
                          for f in ("float", "base64"))
    assert np.frombuffer(base64.b64decode(as_b641), dtype="<f4").tolist() == as_float1
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999
    ids = server.client().embeddings.create(model="m", input=[[2, 40, 41, 3], [2, 42, 3]], encoding_format="float")
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 7
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > 0
    pooled = _post(server, "/pooling", {"input": TEXTS[0]}).json()
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == got.shape[1]


def test_langchain_openai_embeddings(embed_server):
    from langchain_openai import OpenAIEmbeddings
    server, path = embed_server
    lc = OpenAIEmbeddings(model="m", base_url=f"{server.url}/v1", api_key=server.api_key,
                          check_embedding_ctx_length=False)
    docs = lc.embed_documents(TEXTS[:2])
    query = lc.embed_query(TEXTS[0])
    assert len(docs) == 2 and np.allclose(docs[0], query, atol=1e-6)


@pytest.mark.parametrize("body,field", [
    ({"input": "the cat", "dimensions": 8}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": "the dog " * 400}, "input"),
])
def test_embeddings_bad_input_is_400_naming_the_field(embed_server, body, field):
    server, _ = embed_server
    r = _post(server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_generate_on_pooling_model_and_embeddings_on_generate_model_are_400(embed_server, api_server):
    server, _ = embed_server
    with pytest.raises(openai.BadRequestError, match="pooling"):
        server.client().completions.create(model="m", prompt="the cat", max_tokens=2)
    r = _post(api_server, "/v1/embeddings", {"input": "hello"})
    assert r.status_code == 400 and "generate" in r.json()["error"]["message"]


def test_score_rerank_classify(rerank_server):
    from sentence_transformers import CrossEncoder
    server, path = rerank_server
    want = CrossEncoder(path, device="cpu").predict([(QUERY, d) for d in DOCS])
    for route in ("/score", "/v1/score"):
        score = _post(server, route, {"text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in score["data"]], want, rtol=1e-4, atol=1e-5)
    order = list(np.argsort(-want))
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(server, route, {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == order[:2]
        assert r["results"][0]["document"]["text"] == DOCS[order[0]]
    cls = _post(server, "/classify", {"input": DOCS[:2]}).json()
    assert [len(d["probs"]) for d in cls["data"]] == [1, 1] and cls["usage"]["prompt_tokens"] > 0
    r = _post(server, "/v1/embeddings", {"input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"
