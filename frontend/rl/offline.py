"""LLM's calls for RL rollouts (vLLM's spellings): collective_rpc, reload_weights, sleep, wake_up, is_sleeping,
reset_prefix_cache. An LLM holds one RLClient as `llm.rl` and its methods of those names call it. Each is one
utility call to the engine core (core/rl/control.py); arguments and results are JSON-able data, tensors never
travel through them (docs/rl_weight_updates.md)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


class RLClient:
    def __init__(self, client: Any, requests_while_sleeping: str) -> None:
        self.client = client
        self.requests_while_sleeping = requests_while_sleeping

    def _rl_call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        # A weight update can wait on a trainer for long: no deadline unless the caller gives one.
        return self.client.call_utility(method, *args, timeout_s=math.inf if timeout is None else float(timeout))

    def collective_rpc(self, method: str, timeout: float | None = None, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run the worker method `method` (the engine's own, or a worker_extension_cls's) on every rank; each
        rank's result, in rank order. ValueError naming the method if it is unknown or its result is not
        JSON-able."""
        if not isinstance(method, str):
            raise TypeError(f"collective_rpc: method must be a worker method's name (str), got {type(method).__name__}")
        return list(self._rl_call("collective_rpc", method, list(args), dict(kwargs or {}), timeout=timeout))

    def reload_weights(self, weights_path: str | None = None) -> None:
        """Load every weight again, from the model's checkpoint or from weights_path (same architecture and
        shapes); all or nothing: a missing or misshapen tensor fails before any weight changes."""
        self._rl_call("reload_weights", weights_path)

    def sleep(self, level: int = 1, abort_requests: bool = False) -> None:
        """Level 1: release the KV cache (and on GPU move the weights to host memory); level 2: release the
        weights too (reload_weights after wake_up). Requests in the engine finish first, or are aborted."""
        self._rl_call("sleep", level, abort_requests)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep released: all, or tags of ["weights", "kv_cache"]."""
        self._rl_call("wake_up", None if tags is None else list(tags))

    def is_sleeping(self) -> bool:
        return bool(self._rl_call("is_sleeping"))

    def reset_prefix_cache(self) -> bool:
        return bool(self._rl_call("reset_prefix_cache"))

    def refuse_waiting_asleep(self) -> None:
        """With requests_while_sleeping="wait" the engine would queue this LLM's requests until a wake_up that
        nothing else can send while generate() waits: refuse at once instead."""
        if self.requests_while_sleeping == "wait" and self.is_sleeping():
            raise ValueError("the engine is sleeping: call wake_up() before generate()")
