"""Fixtures for the reliability tests: a tiny random model whose vocabulary covers the tokenizer."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_serving_model(tmp_path_factory) -> str:
    """Random Llama weights with the embedded tokenizer's full vocabulary, so text prompts and chat work."""
    from tiny_models import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_serving")), arch="llama", vocab_size=49152,
                           max_position_embeddings=512)


@pytest.fixture(scope="session")
def api_server(tiny_serving_model):
    """One server with --api-key for the HTTP-surface tests (fuzzing, auth)."""
    from served import ServedEngine
    srv = ServedEngine(tiny_serving_model, "--max-model-len", "256", "--max-num-seqs", "16")
    yield srv
    srv.stop()
