"""The soak test's request mix, shared by scripts/soak.py and tests/e2e/reliability/test_load.py.

Random OpenAI requests (completions and chat, streamed or not, random lengths, some n=2, some stop strings,
some clients that hang up mid-stream), sent with the official `openai` client and classified by how they
ended: "ok", an explicit "error", "hung" past a deadline, "disconnected" (the client hung up on purpose),
or "wrong" (completed with the wrong choices or token count).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from typing import Any

import openai

STOP_STRINGS = [" the", ".", ",", "\n", " a"]
WORDS = "the quick brown fox jumps over a lazy dog while seven bakers sing about rivers and stone".split()


@dataclasses.dataclass
class Spec:
    """One request of the mix."""
    kind: str                 # "completion" | "chat"
    prompt: str
    max_tokens: int
    n: int
    stream: bool
    stop: list[str] | None
    hang_up_after: int | None     # streamed chunks read before the client disconnects; None = read all


@dataclasses.dataclass
class Result:
    spec: Spec
    outcome: str              # "ok" | "error" | "hung" | "disconnected" | "wrong"
    detail: str = ""
    seconds: float = 0.0


def random_spec(rng: random.Random, max_tokens: int = 32, disconnect_frac: float = 0.05) -> Spec:
    stream = rng.random() < 0.7
    return Spec(kind=rng.choice(["completion", "chat"]),
                prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))),
                max_tokens=rng.randint(1, max_tokens), n=2 if rng.random() < 0.2 else 1, stream=stream,
                stop=[rng.choice(STOP_STRINGS)] if rng.random() < 0.2 else None,
                hang_up_after=rng.randint(1, 4) if stream and rng.random() < disconnect_frac else None)


def _check_counts(spec: Spec, finish: dict[int, str | None], tokens: int) -> str | None:
    """None if the choices and token count are what the spec asks for, else what is wrong."""
    if sorted(finish) != list(range(spec.n)):
        return f"choices {sorted(finish)} for n={spec.n}"
    if any(r not in ("length", "stop") for r in finish.values()):
        return f"finish reasons {finish}"
    if spec.stop is None and any(r != "length" for r in finish.values()):
        return f"finish reasons {finish} without a stop string (ignore_eos)"
    if all(r == "length" for r in finish.values()) and tokens != spec.n * spec.max_tokens:
        return f"{tokens} tokens, expected {spec.n * spec.max_tokens}"
    if tokens > spec.n * spec.max_tokens:
        return f"{tokens} tokens, more than {spec.n * spec.max_tokens}"
    return None


def _kwargs(spec: Spec, model: str) -> dict[str, Any]:
    kw: dict[str, Any] = dict(model=model, max_tokens=spec.max_tokens, n=spec.n, temperature=0.8,
                              extra_body={"ignore_eos": True})
    if spec.stop:
        kw["stop"] = spec.stop
    if spec.stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    return kw


async def _create(client: openai.AsyncOpenAI, spec: Spec, model: str) -> Any:
    if spec.kind == "completion":
        return await client.completions.create(prompt=spec.prompt, **_kwargs(spec, model))
    return await client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}],
                                                **_kwargs(spec, model))


async def _consume(spec: Spec, resp: Any) -> tuple[str, str]:
    if not spec.stream:
        finish = {c.index: c.finish_reason for c in resp.choices}
        wrong = _check_counts(spec, finish, resp.usage.completion_tokens)
        return ("wrong", wrong) if wrong else ("ok", "")
    finish: dict[int, str | None] = {}
    usage, chunks = None, 0
    try:
        async for chunk in resp:
            chunks += 1
            for c in chunk.choices:
                finish.setdefault(c.index, None)
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
            usage = chunk.usage or usage
            if spec.hang_up_after is not None and chunks >= spec.hang_up_after:
                return "disconnected", ""
    finally:
        await resp.close()
    if usage is None:
        return "wrong", "stream ended without usage"
    wrong = _check_counts(spec, finish, usage.completion_tokens)
    return ("wrong", wrong) if wrong else ("ok", "")


async def run_one(client: openai.AsyncOpenAI, spec: Spec, model: str, deadline_s: float) -> Result:
    """Send one request; classify how it ended. An exception from the server is an explicit error."""
    start = time.monotonic()

    async def go() -> tuple[str, str]:
        return await _consume(spec, await _create(client, spec, model))
    try:
        outcome, detail = await asyncio.wait_for(go(), deadline_s)
    except asyncio.TimeoutError:
        outcome, detail = "hung", f"no end within {deadline_s} s"
    except openai.APIStatusError as exc:
        outcome, detail = "error", f"HTTP {exc.status_code}: {str(exc)[:160]}"
    except openai.APIError as exc:
        outcome, detail = "error", f"{type(exc).__name__}: {str(exc)[:160]}"
    return Result(spec, outcome, detail, time.monotonic() - start)


@dataclasses.dataclass
class Streams:
    """start_streams' streams: each ends in ended[i] = ("done" or the error's type, when)."""
    threads: list[threading.Thread]
    ended: dict[int, tuple[str, float]]
    streaming: list[threading.Event]       # set at each stream's first chunk

    def wait_streaming(self, timeout_s: float = 60) -> None:
        """Until every stream has had its first chunk (a loaded machine starts them late)."""
        deadline = time.monotonic() + timeout_s
        for i, event in enumerate(self.streaming):
            if not event.wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"stream {i} had no first chunk in {timeout_s} s: {self.ended}")

    def join(self, timeout_s: float = 120) -> None:
        for t in self.threads:
            t.join(timeout_s)


def start_streams(client: openai.OpenAI, model: str, count: int, max_tokens: int = 480,
                  stagger_s: float = 0.2) -> Streams:
    """`count` streamed completions on threads, started in order `stagger_s` apart (least-loaded routing
    alternates them between two engines)."""
    streams = Streams([], {}, [threading.Event() for _ in range(count)])

    def stream(i: int) -> None:
        try:
            for _ in client.completions.create(model=model, prompt=f"Story {i}:", max_tokens=max_tokens, stream=True,
                                               extra_body={"ignore_eos": True}):
                streams.streaming[i].set()
            streams.ended[i] = ("done", time.monotonic())
        except Exception as exc:       # a killed engine's streams end in an error
            streams.ended[i] = (type(exc).__name__, time.monotonic())
    for i in range(count):
        streams.threads.append(threading.Thread(target=stream, args=(i,)))
        streams.threads[-1].start()
        time.sleep(stagger_s)
    return streams
