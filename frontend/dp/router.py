"""Which data-parallel engine core a request goes to.

vLLM's balancer looks only at queue lengths. Here a request goes to the engine that already holds the longest
cached prefix of its prompt, unless that engine's load is clearly above the least-loaded one's; with no prefix
held anywhere, to the least loaded. The router keeps its own record of the prompt blocks it sent to each engine
(chained hashes of full blocks, as the engines' prefix caches key them, in LRU order, bounded by an engine's
block count), so it needs nothing from the engines but their outputs' finishes.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence

ROUTING_POLICIES = ("prefix", "least-loaded")
# The prefix engine keeps a request while its load is within max(MIN_SLACK, half the least load) of the least.
MIN_SLACK = 4


class PrefixRouter:
    def __init__(self, num_engines: int, block_size: int, capacity_blocks: int, policy: str = "prefix") -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        self.block_size = block_size
        self.capacity = max(1, capacity_blocks)
        self.policy = policy
        self.loads = [0] * num_engines          # requests each engine has not finished
        self.available = [True] * num_engines   # False while an engine is dead or restarting
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_engines)]
        self._next = 0                          # round-robin among equally loaded engines
        self.last_matched = 0                   # prompt blocks the last routed engine was known to hold

    def route(self, prompt_token_ids: Sequence[Hashable], allowed: Collection[int] | None = None) -> int | None:
        """The engine for this prompt (None while none is available); its load counts the request until
        `finished`. The prompt may be token ids or text (the fleet router hashes characters); `allowed`: the
        engines that may take it (the fleet router's replicas serving its model), all when None."""
        usable = [up and (allowed is None or e in allowed) for e, up in enumerate(self.available)]
        if not any(usable):
            return None
        hashes = self._block_hashes(prompt_token_ids)
        engine = self._least_loaded(usable)
        self.last_matched = 0
        if self.policy == "prefix" and hashes:
            matched = [self._matched(held, hashes) if up else -1 for held, up in zip(self._held, usable)]
            best = max(range(len(matched)), key=lambda e: (matched[e], -self.loads[e]))
            least = self.loads[engine]
            if matched[best] > 0 and self.loads[best] <= least + max(MIN_SLACK, least // 2):
                engine = best
            self.last_matched = matched[engine]
        self._remember(engine, hashes)
        self.loads[engine] += 1
        return engine

    def finished(self, engine: int) -> None:
        self.loads[engine] = max(0, self.loads[engine] - 1)

    def add_engines(self, num_engines: int) -> None:
        """Grow to `num_engines` engines (the fleet router's discovered replicas), the new ones available."""
        while len(self.loads) < num_engines:
            self.loads.append(0)
            self.available.append(True)
            self._held.append(OrderedDict())

    def remove_engines(self, num_engines: int) -> None:
        """Shrink to the first `num_engines` engines (elastic scaling stopped the others)."""
        del self.loads[num_engines:], self.available[num_engines:], self._held[num_engines:]
        self._next = 0

    def set_available(self, engine: int, available: bool) -> None:
        """An engine leaves service (dead) or returns (restarted, its cache empty)."""
        self.available[engine] = available
        self._held[engine].clear()

    def _least_loaded(self, usable: list[bool]) -> int:
        n = len(self.loads)
        order = [(self._next + i) % n for i in range(n) if usable[(self._next + i) % n]]
        engine = min(order, key=lambda e: self.loads[e])
        self._next = (engine + 1) % n
        return engine

    def _block_hashes(self, ids: Sequence[Hashable]) -> list[int]:
        out, h, bs = [], 0, self.block_size
        for start in range(0, len(ids) - bs + 1, bs):
            h = hash((h, tuple(ids[start:start + bs])))
            out.append(h)
        return out

    @staticmethod
    def _matched(held: OrderedDict[int, None], hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _remember(self, engine: int, hashes: list[int]) -> None:
        held = self._held[engine]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)
