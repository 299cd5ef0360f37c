"""Which replica a request goes to (--routing-logic), among the healthy ones serving its model.

prefix reuses the data-parallel router's prefix record (frontend/dp/router.py: chained block hashes of what
it routed, per replica, in LRU order, and its load cap), here over the prompt's characters: the router sees
text, not token ids, and the same leading text is the same leading tokens.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.frontend.dp.router import PrefixRouter
from pagedserve.frontend.router.pool import Replica

# Blocks remembered per replica: 64-character blocks of 16 Ki prompts of 1 Ki characters.
PREFIX_CAPACITY_BLOCKS = 1 << 18


@dataclass(frozen=True)
class RequestFacts:
    """What routing reads from a request."""
    model: str | None
    session: str | None
    prompt: Sequence[Hashable]      # text, or token ids; empty when the request has none


def request_facts(body: bytes, headers: dict[str, str], session_key: str) -> RequestFacts:
    """The facts of a JSON request body (anything else routes on no facts)."""
    try:
        data = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    model = data.get("model") if isinstance(data.get("model"), str) else None
    session = headers.get(session_key.lower()) or (data["user"] if isinstance(data.get("user"), str) else None)
    return RequestFacts(model, session, _prompt_of(data))


def _prompt_of(data: dict[str, Any]) -> Sequence[Hashable]:
    for key in ("prompt", "messages", "input"):
        value = data.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return tuple(value)
        if value:        # chat messages, a batch of prompts: their JSON shares the requests' leading text
            return json.dumps(value, ensure_ascii=False)
    return ""


class Routing:
    def __init__(self, logic: str, num_replicas: int, block_chars: int) -> None:
        self.logic = logic
        self.prefix = PrefixRouter(num_replicas, block_chars, PREFIX_CAPACITY_BLOCKS, policy="prefix")
        self._next = 0

    def pick(self, candidates: list[Replica], facts: RequestFacts) -> tuple[Replica, str]:
        """(the replica, the decision's name for the metrics); `candidates` is not empty. The replica's
        `in_flight` counts the request until `done`."""
        if self.logic == "prefix":
            by_index = {r.index: r for r in candidates}
            index = self.prefix.route(facts.prompt, allowed=by_index)
            replica = by_index[index] if index is not None else candidates[0]
            decision = "prefix-hit" if self.prefix.last_matched else "prefix-miss"
        elif self.logic == "session" and facts.session is not None:
            replica, decision = max(candidates, key=lambda r: _weight(facts.session, r.url)), "session"
        elif self.logic in ("least-load", "lora"):     # lora: the candidates are the replicas with the adapter
            replica, decision = self._round_robin(candidates, least_load=True), self.logic
        else:       # roundrobin, and a session request that names no session
            replica = self._round_robin(candidates, least_load=False)
            decision = "roundrobin" if self.logic == "roundrobin" else "session-none"
        replica.in_flight += 1
        return replica, decision

    def done(self, replica: Replica) -> None:
        replica.in_flight -= 1
        if self.logic == "prefix":
            self.prefix.finished(replica.index)

    def replica_changed(self, replica: Replica) -> None:
        """A replica joined or left: what it held is gone (a restarted replica's cache starts empty), unless it
        was there throughout (`Replica.cache_kept`: slow or unhealthy, never unreachable, so not restarted). A discovered replica's index may be new here."""
        self.prefix.add_engines(replica.index + 1)
        if not replica.cache_kept:
            self.prefix.set_available(replica.index, True)      # (which forgets what it held)

    def _round_robin(self, candidates: list[Replica], least_load: bool) -> Replica:
        n = max(r.index for r in candidates) + 1
        ordered = sorted(candidates, key=lambda r: (r.index - self._next) % n)
        replica = min(ordered, key=lambda r: r.score) if least_load else ordered[0]
        self._next = replica.index + 1
        return replica


def _weight(session: str, url: str) -> int:
    """Rendezvous hashing: a session keeps its replica while that one is up, and when one leaves only its
    sessions move. blake2b, not hash(): the same across router processes and restarts."""
    return int.from_bytes(hashlib.blake2b(f"{session}\0{url}".encode(), digest_size=8).digest(), "big")
