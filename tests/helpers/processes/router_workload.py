"""A multi-turn chat workload through `pagedserve router` (issue 49: prefix-aware routing against round-robin):
conversations, each with a system prompt of its own, sent one request at a time, turn after turn, each turn
carrying the whole conversation so far (the model's own replies included). The prefix-cache hit rate is read
from the replicas' own counters (vllm:prefix_cache_hits / vllm:prefix_cache_queries), the TTFT from the stream.

Four conversations by default, not six: with three replicas and turns sent in order, six would have round-robin
put every turn of a conversation on the same replica (a multiple of 3), luck no real arrival order has; with four
each turn lands one replica further on, and the fourth back on the first's."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import openai

from pagedserve.tests.helpers.processes.metrics import read_metrics

TOPICS = ("tides and the moon", "bread and yeast", "bridges and steel", "bees and flowers", "rivers and rain",
          "clocks and gears", "glass and sand")


@dataclass(frozen=True)
class RunResult:
    hits: float            # prefix-cache hits over the replicas, in tokens, during the run
    queries: float         # prefix-cache queries, in tokens
    ttfts_s: list[float]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def p50_ttft_s(self) -> float:
        return statistics.median(self.ttfts_s)


def _system_prompt(salt: str, c: int) -> str:
    # Long enough for several KV blocks of its own: the part a replica that saw the last turn holds.
    topic = TOPICS[c % len(TOPICS)]
    return (f"Session {salt}-{c}. You are a patient teacher who explains {topic} to a curious student. "
            f"Answer in short plain sentences, give one concrete example about {topic} in every answer, "
            "never use lists or headings, and end each answer with a question that checks understanding. "
            f"Keep the conversation about {topic}; if the student drifts, bring them back kindly.")


def _user_turn(c: int, turn: int) -> str:
    return f"Question {turn + 1} about {TOPICS[c % len(TOPICS)]}: what happens next, and why?"


def _prefix_counts(urls: list[str]) -> tuple[float, float]:
    readings = [read_metrics(url) for url in urls]
    return (sum(m["prefix_cache_hits_total"] for m in readings), sum(m["prefix_cache_queries_total"] for m in readings))


def _ask(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """(the reply, its TTFT in seconds)."""
    start = time.perf_counter()
    ttft, parts = None, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), ttft if ttft is not None else time.perf_counter() - start


def run_conversations(client: openai.OpenAI, model: str, replica_urls: list[str], salt: str,
                      conversations: int = 4, turns: int = 4, max_tokens: int = 8) -> RunResult:
    """Every conversation's turn 1, then every turn 2, ...; `salt` makes the prompts this run's own, so a run
    finds nothing another one cached."""
    hits0, queries0 = _prefix_counts(replica_urls)
    history = [[{"role": "system", "content": _system_prompt(salt, c)}] for c in range(conversations)]
    ttfts = []
    for turn in range(turns):
        for c, messages in enumerate(history):
            messages.append({"role": "user", "content": _user_turn(c, turn)})
            reply, ttft = _ask(client, model, messages, max_tokens)
            messages.append({"role": "assistant", "content": reply})
            ttfts.append(ttft)
    hits1, queries1 = _prefix_counts(replica_urls)
    return RunResult(hits1 - hits0, queries1 - queries0, ttfts)
