"""The engine core's side of RL rollouts: collective_rpc, weight reloads, sleep and wake_up.

The core runs these between steps, so no step runs beside a weight update. After anything that may change
the weights the prefix cache can never serve KV computed under the old ones: a weights version salts every
new request's block hashes (old blocks, even those a running request still fills, never match a new
request), and the free cached blocks are dropped.

Sleep keeps every request: by default the core first runs the requests it holds to completion; with
abort_requests=True it ends them with finish_reason "abort". Their outputs go out with the next step.
While asleep the core schedules nothing; a new request is refused (EngineSleepingError, HTTP 503) or, with
requests_while_sleeping="wait", queued until wake_up.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from pagedserve.common.config.engine_config import RLConfig
from pagedserve.common.errors import EngineSleepingError
from pagedserve.ipc.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

# Worker methods that may change the weights: the prefix cache is invalidated after any of them (a worker
# extension's own method is assumed to, too: the core cannot know what it did).
_KEEPS_WEIGHTS = frozenset({"ping", "determine_num_blocks", "init_weight_update_group",
                            "destroy_weight_update_group", "sleep", "wake_up", "add_lora", "remove_lora"})


class RLControl:
    def __init__(self, executor: Any, config: RLConfig, reset_prefix_cache: Callable[[], bool],
                 settle: Callable[[bool], list[EngineCoreOutput]]) -> None:
        """executor: the core's (collective_rpc); settle(abort): the core runs or aborts every request it holds
        and returns their outputs."""
        self.executor, self.config = executor, config
        self._reset_prefix_cache, self._settle = reset_prefix_cache, settle
        self.level = 0                          # 0: awake
        self.asleep_tags: set[str] = set()      # what is still asleep: "weights", "kv_cache"
        self.weights_version = 0
        self.held: list[EngineCoreOutput] = []  # outputs of requests finished or aborted by sleep()

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {"collective_rpc": self.collective_rpc, "reload_weights": self.reload_weights,
                "sleep": self.sleep, "wake_up": self.wake_up, "is_sleeping": self.is_sleeping}

    # ---------------------------------------------------------------- weights

    def collective_rpc(self, method: str, args: list[Any] | None = None,
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if not isinstance(method, str) or not method:
            raise ValueError(f"collective_rpc: method must be a worker method's name, got {method!r}")
        if method in ("sleep", "wake_up"):
            raise ValueError(f"collective_rpc: call {method}() itself, so the engine core knows it sleeps")
        try:
            return self.executor.collective_rpc(method, tuple(args or ()), dict(kwargs or {}))
        finally:            # a refused update changed nothing; dropping the cache then only costs recomputing
            if method not in _KEEPS_WEIGHTS:
                self.weights_changed()

    def reload_weights(self, weights_path: str | None = None) -> list[Any]:
        if "weights" in self.asleep_tags:
            raise ValueError("reload_weights: the weights are asleep; wake_up(tags=['weights']) first")
        try:
            return self.executor.collective_rpc("reload_weights", (weights_path,))
        finally:
            self.weights_changed()

    def weights_changed(self) -> None:
        self.weights_version += 1
        self._reset_prefix_cache()          # the free cached blocks; the salt covers the rest

    def cache_salt(self, lora_digest: bytes | None) -> bytes | None:
        """The salt of a new request's first block hash: its adapter's digest, and the weights version."""
        if self.weights_version == 0:
            return lora_digest
        h = hashlib.blake2b(digest_size=16)
        h.update(self.weights_version.to_bytes(8, "little"))
        h.update(lora_digest or b"")
        return h.digest()

    # ---------------------------------------------------------------- sleep

    def sleep(self, level: int = 1, abort_requests: bool = False) -> dict[str, Any]:
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep: start the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        self.held += self._settle(abort_requests)
        answers = self.executor.collective_rpc("sleep", (level,))
        self.level = max(self.level, level)
        self.asleep_tags = {"weights", "kv_cache"}
        self.weights_changed()                  # the KV cache's contents are gone
        logger.info("engine asleep at level %d", self.level)
        return {"level": self.level, "released_bytes": [a["released_bytes"] for a in answers]}

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        if tags is not None and (not isinstance(tags, list) or any(t not in ("weights", "kv_cache") for t in tags)):
            raise ValueError(f"wake_up: tags must be a list of 'weights' and 'kv_cache', got {tags!r}")
        answers = self.executor.collective_rpc("wake_up", (tags,))
        self.asleep_tags -= set(tags or ("weights", "kv_cache"))
        if not self.asleep_tags:
            self.level = 0
        return {"sleeping": self.is_sleeping(), "weights_need_reload": any(a["weights_need_reload"] for a in answers)}

    def is_sleeping(self) -> bool:
        return bool(self.asleep_tags)

    def check_admission(self) -> None:
        """EngineSleepingError for a new request while asleep, unless the engine queues them."""
        if self.asleep_tags and self.config.requests_while_sleeping == "reject":
            raise EngineSleepingError("the engine is sleeping (sleep mode, between RL rollouts): retry after "
                                      "wake_up")

    def can_step(self) -> bool:
        return not self.asleep_tags

    def take_held(self) -> list[EngineCoreOutput]:
        held, self.held = self.held, []
        return held
