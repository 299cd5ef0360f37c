"""Stored responses (`store: true`), for GET /v1/responses/{id} and `previous_response_id`.

Bounded two ways, both engine-serve flags: `--responses-store-max-entries` (beyond it the least recently used
response is dropped) and `--responses-store-ttl` (a response is dropped that many seconds after it was
stored, however often it is read). Memory only: a restart forgets every response, as vLLM's store does.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ResponseNotFoundError(LookupError):
    """An id no stored response has (never stored, evicted or expired): HTTP 404. `field` names the request
    field that gave the id."""

    def __init__(self, response_id: str, field: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.")
        self.field = field


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]                   # the response object, as it was answered
    conversation: list[dict[str, Any]]     # every item so far: the chain's inputs and outputs, this turn's last


class ResponsesStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """max_entries 0 stores nothing (every `store` is ignored, as vLLM does without its store)."""
        if max_entries < 0 or ttl_s <= 0:
            raise ValueError(f"max_entries must be >= 0 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()    # least recently used first
        # Deadlines in the order stored: with one TTL for all, the first is always the next to expire.
        self._deadlines: OrderedDict[str, float] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        self._expire()
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        self._deadlines.pop(response_id, None)
        self._deadlines[response_id] = self.clock() + self.ttl_s
        while len(self._entries) > self.max_entries:
            evicted, _ = self._entries.popitem(last=False)
            del self._deadlines[evicted]

    def get(self, response_id: str, field: str = "response_id") -> StoredResponse:
        """The stored response (now the most recently used); ResponseNotFoundError naming `field` if none."""
        self._expire()
        stored = self._entries.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(response_id, field)
        self._entries.move_to_end(response_id)
        return stored

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = self.clock()
        while self._deadlines:
            key, deadline = next(iter(self._deadlines.items()))
            if deadline > now:
                return
            del self._deadlines[key], self._entries[key]
