"""Overload answers 429 with Retry-After (never a 5xx, never a silent drop); abandoned requests leave the
engine; oversized bodies answer 413. Requests that must hold the queue are streams the test hangs up on
once it has seen what it needs, so the test never waits for hundreds of tokens."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

pytestmark = pytest.mark.timeout(300)

# Long enough that a held request outlives any test step even on a loaded machine (a few thousand steps):
# a request that finished early would free its queue slot and change what the next request meets.
LONG = {"prompt": "Count:", "max_tokens": 3800, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_serving_model(tmp_path_factory) -> str:
    """The tiny serving model with room for LONG: 4096 positions instead of 512."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_long")), arch="llama", vocab_size=49152,
                           max_position_embeddings=4096)


@pytest.fixture(scope="module")
def small_queue(long_serving_model):
    """One request runs at a time and two may wait; this frontend serves at most five at once."""
    srv = Server(*SMALL_KV, "--max-model-len", "4096", "--max-num-seqs", "1",
                       "--max-waiting-requests", "2", "--max-concurrent-requests", "5",
                       "--max-body-bytes", "65536", model=long_serving_model)
    yield srv
    srv.stop()


@pytest.fixture
def idle(small_queue):
    """The server, idle before the test and checked idle (nothing running or waiting, KV pool free) after."""
    small_queue.wait_idle()
    yield small_queue
    m = small_queue.wait_idle()
    assert (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0), \
        "requests or KV blocks left behind"


def _assert_429(resp: httpx.Response) -> None:
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    error = resp.json()["error"]
    assert error["code"] == 429 and error["type"] == "overloaded_error" and "retry later" in error["message"]


async def _open_stream(client: httpx.AsyncClient, srv: Server, body: dict) -> httpx.Response:
    """Send a streaming request and return once its status is known; the caller closes it (hangs up)."""
    req = client.build_request("POST", f"{srv.url}/v1/completions", json={**body, "stream": True})
    return await client.send(req, stream=True)


async def _wait_metric(srv: Server, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.metrics()[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.1)


def test_full_queue_answers_429_at_once(idle):
    async def scenario() -> None:
        async with httpx.AsyncClient(headers=idle.auth, timeout=120) as client:
            held = [await _open_stream(client, idle, LONG) for _ in range(3)]   # one running, two waiting
            assert [r.status_code for r in held] == [200, 200, 200]
            await _wait_metric(idle, "num_requests_waiting", 2)
            for extra in ({}, {"stream": True}):
                # A queued request would wait for the held ones, which never end before the test hangs up
                # on them: an answer at all, within the client's timeout, is an answer at once.
                _assert_429(await client.post(f"{idle.url}/v1/completions", json={"prompt": "x", **extra}))
            m = idle.metrics()     # refused while the queue was full, not after a slot freed
            assert (m["num_requests_running"], m["num_requests_waiting"]) == (1, 2), dict(m)
            async for line in held[0].aiter_lines():        # the running request is served, not dropped
                if line.startswith("data: {"):
                    assert '"text"' in line and '"error"' not in line
                    break
            for r in held:
                await r.aclose()
    asyncio.run(scenario())
    assert idle.metrics()["request_rejected_total"] >= 2


def test_burst_is_bounded_by_the_engine_core(idle):
    """A burst arrives before any stats show the queue: the engine core itself refuses past the bound,
    and the frontend maps its refusal to 429. Accepted requests run past the client's patience (or end)."""
    async def burst() -> list:
        async with httpx.AsyncClient(headers=idle.auth, timeout=5) as client:
            return await asyncio.gather(*(client.post(f"{idle.url}/v1/completions", json=LONG)
                                          for _ in range(4)), return_exceptions=True)
    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 429]
    accepted = [r for r in results if isinstance(r, httpx.TimeoutException) or
                (isinstance(r, httpx.Response) and r.status_code == 200)]
    assert len(refused) + len(accepted) == 4, results
    assert refused and 1 <= len(accepted) <= 3, results      # at most one running and two waiting
    for r in refused:
        _assert_429(r)


def test_n2_refused_half_frees_its_sibling(idle):
    """n=2 fans out into two engine requests: with one queue slot left the core takes the first sample and
    refuses the second; the client gets 429 and the accepted sample is aborted, not left to run."""
    async def scenario() -> None:
        async with httpx.AsyncClient(headers=idle.auth, timeout=120) as client:
            held = [await _open_stream(client, idle, LONG)]
            await _wait_metric(idle, "num_requests_running", 1)
            held.append(await _open_stream(client, idle, LONG))
            await _wait_metric(idle, "num_requests_waiting", 1)
            _assert_429(await client.post(f"{idle.url}/v1/completions", json={**LONG, "n": 2}))
            await _wait_metric(idle, "num_requests_waiting", 1)    # the accepted sample is gone
            for r in held:
                await r.aclose()
    asyncio.run(scenario())


def test_concurrency_bound_of_the_frontend(idle):
    """More streams than --max-concurrent-requests at once: the rest get 429 from the frontend itself
    (streams the engine refused end at once with an error event; the bound counts the others)."""
    async def scenario() -> list[int]:
        async with httpx.AsyncClient(headers=idle.auth, timeout=120) as client:
            opened = await asyncio.gather(*(_open_stream(client, idle, LONG) for _ in range(12)))
            statuses = [r.status_code for r in opened]
            for r in opened:
                if r.status_code == 429:
                    await r.aread()
                    _assert_429(r)
                await r.aclose()
            return statuses
    statuses = asyncio.run(scenario())
    assert 429 in statuses and all(s in (200, 429) for s in statuses), statuses
    text = httpx.get(f"{idle.url}/metrics", timeout=10).text
    assert any(line.startswith("pagedserve:request_rejected_total") and 'reason="concurrency"' in line
               and float(line.rsplit(" ", 1)[1]) >= 1 for line in text.splitlines()), text


def test_abandoned_requests_are_dropped(idle):
    """Clients that give up on non-streaming requests (timeout, hang-up) free the engine: the running one
    and the waiting ones are aborted, instead of generating hundreds of tokens nobody reads."""
    async def give_up() -> list:
        # Two, not three: with --max-waiting-requests 2, a third could arrive while the first still waits
        # and be refused with 429, which is right but not what this test is about.
        async with httpx.AsyncClient(headers=idle.auth, timeout=1.0) as client:
            return await asyncio.gather(*(client.post(f"{idle.url}/v1/completions", json=LONG)
                                          for _ in range(2)), return_exceptions=True)

    results = asyncio.run(give_up())
    assert all(isinstance(r, httpx.TimeoutException) or r.status_code == 200 for r in results), results
    assert any(isinstance(r, httpx.TimeoutException) for r in results), "nothing was abandoned"
    # Served to the end, the two would take 7,600 steps one after another.
    deadline = time.monotonic() + 5.0
    while True:
        m = idle.metrics()
        if (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"abandoned requests still in the engine: {dict(m)}"
        time.sleep(0.1)


def test_oversized_body_is_413_and_server_keeps_serving(idle):
    resp = httpx.post(f"{idle.url}/v1/completions", headers=idle.auth, timeout=60,
                      json={"prompt": "x " * 40000, "max_tokens": 1})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    # Chunked, with no Content-Length to refuse it by: counted as it arrives.
    chunked = httpx.post(f"{idle.url}/v1/completions", headers=idle.auth, timeout=60,
                         content=iter([b'{"prompt": "', b"x" * 70000, b'"}']))
    assert chunked.status_code == 413, chunked.text
    ok = httpx.post(f"{idle.url}/v1/completions", headers=idle.auth, timeout=60,
                    json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
