"""What the Anthropic API modules share: the SDK's client and the served model's id, over each module's own
`server` fixture."""
from __future__ import annotations

import anthropic
import pytest


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.client().models.list().data[0].id
