"""The same chat request through engine-serve on the embedded model (its Q4_1 GGUF, the default engine) at
concurrency 1 and at concurrency 48 gives identical `logprobs` fields, exact equality (issue 50): greedy,
48 tokens, top_logprobs 5, through the openai SDK. The 48 copies share one prompt, so all but the first hit the
prefix cache and they decode in steps of up to 48 rows; the one alone decodes in steps of one."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.processes.server import Server

CONCURRENCY = 48
MESSAGE = "Écris une phrase en français avec des accents, puis répète: 東京, 北京, ☕ 🚀."

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not c_step_runs(), reason="the C decode step does not build on this CPU")]


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", str(CONCURRENCY), dtype=None)      # the embedded model, engine-serve's defaults
    yield s
    s.stop_and_check_clean()


async def _send(client, model: str, count: int) -> list[dict]:
    async def one() -> dict:
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": MESSAGE}], temperature=0,
            max_tokens=48, logprobs=True, top_logprobs=5)
        choice = r.choices[0]
        assert r.usage.completion_tokens == 48 or choice.finish_reason == "stop"
        return choice.logprobs.model_dump()
    return await asyncio.gather(*(one() for _ in range(count)))


def test_logprobs_equal_at_concurrency_1_and_48(server):
    async def run() -> tuple[list[dict], list[dict]]:
        client = server.async_client(timeout_s=600)
        model = (await client.models.list()).data[0].id
        alone = await _send(client, model, 1)
        crowd = await _send(client, model, CONCURRENCY)
        alone += await _send(client, model, 1)          # alone again, after the crowd: a prefix hit
        return alone, crowd

    alone, crowd = asyncio.run(run())
    assert len(alone[0]["content"]) >= 8
    assert alone[1] == alone[0], "alone, fresh and after a prefix hit"
    for i, got in enumerate(crowd):
        assert got == alone[0], f"copy {i} of {CONCURRENCY} at once: its logprobs differ from the one alone"
