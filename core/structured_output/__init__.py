"""StructuredOutputManager: compiles each request's grammar off the busy loop and fills the step's bitmask.

The core's side of constrained decoding (vLLM v1's shape): a request with `structured_outputs` waits in the
scheduler until its grammar has compiled (in a thread pool, with a timeout, cached by the spec), then each
step the rows that sample under a grammar get one row of an int32 bitmask (bit t of a row: token t is
allowed), which rides to the workers in the SchedulerOutput. Sampled tokens advance the matchers here.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from pagedserve.common.config.engine_args import StructuredOutputsConfig
from pagedserve.common.errors import RequestError
from pagedserve.common.reasoning import REASONING_PARSERS
from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.core.structured_output.backend_xgrammar import XgrammarBackend
from pagedserve.core.structured_output.request import StructuredOutputRequest, fill_draft_masks
from pagedserve.ipc.messages import GrammarBitmask

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse: clients that send a fresh schema per request must not grow the core.
MAX_CACHED_GRAMMARS = 256
# Compile threads. A compile past its timeout cannot be interrupted and keeps its thread until it ends, so
# there are spare threads for the requests behind it; and a request's timeout counts from the moment its
# compile starts, not while it queues behind such a compile (that failed good requests with a 400).
COMPILE_THREADS = 4
# How many compile timeouts a request may wait in the queue before it gets its 400.
QUEUE_TIMEOUT_FACTOR = 3
# The grammar backend (xgrammar's view of the tokenizer) loads once per process, in the first compile's
# thread: not a grammar's compile time (counted in it, a 1 s timeout failed the first requests of a loaded
# machine), but bounded too, so that a request never hangs on it.
BACKEND_LOAD_TIMEOUT_S = 120.0


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: Callable[[], str], vocab_size: int, stop_token_ids: list[int],
                 config: StructuredOutputsConfig, max_workers: int = COMPILE_THREADS) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.reasoning = REASONING_PARSERS[config.reasoning_parser] if config.reasoning_parser else None
        self.compile_timeout_s = config.compile_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._backend: Optional[XgrammarBackend] = None
        self._end_marker: list[int] = []
        self._cache: dict[str, Future[Any]] = {}
        self.num_compiles = 0          # grammars actually compiled (cache misses), for get_stats and tests

    # ---------------------------------------------------------------- compiling (pool threads)

    def _load_backend(self) -> XgrammarBackend:
        with self._lock:
            if self._backend is None:
                start = time.perf_counter()
                backend = XgrammarBackend(self.tokenizer_dir(), self.vocab_size, self.stop_token_ids)
                if self.reasoning is not None:
                    self._end_marker = backend.encode(self.reasoning.end)
                self._backend = backend
                logger.info("structured outputs: tokenizer loaded in %.1f s", time.perf_counter() - start)
            return self._backend

    def _compile(self, params: StructuredOutputsParams, started: list[float]) -> Any:
        started.append(time.monotonic())                   # off the queue
        backend = self._load_backend()
        started.append(time.monotonic())                   # the grammar's own compile begins
        start = time.perf_counter()
        with self._lock:
            self.num_compiles += 1
        compiled = backend.compile(params)
        logger.debug("compiled a %s grammar in %.3f s", params.kind, time.perf_counter() - start)
        return compiled

    def submit(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Start (or reuse) the compile of a request's grammar; returns at once."""
        key = params.cache_key()
        future = self._cache.pop(key, None)
        if future is None:
            started: list[float] = []          # the pool thread's times: off the queue, compile begins
            future = self._pool.submit(self._compile, params, started)
            future.started = started
            self._evict()
        self._cache[key] = future          # (re)inserted last: the dict's order is least recently used first
        return StructuredOutputRequest(params, future)

    def _evict(self) -> None:
        """Drop the least recently used compiled grammars beyond the bound (never one still compiling)."""
        excess = len(self._cache) + 1 - MAX_CACHED_GRAMMARS
        for key in [k for k, f in self._cache.items() if f.done()][:max(0, excess)]:
            del self._cache[key]

    # ---------------------------------------------------------------- the busy loop's side

    def poll(self, state: StructuredOutputRequest, prompt_token_ids: list[int]) -> tuple[bool, Optional[RequestError]]:
        """(ready, error) for a request waiting for its grammar; starts its matcher once ready."""
        future = state.compiled
        field = f"structured_outputs.{state.params.kind}"
        if not future.done():
            started, now = future.started, time.monotonic()
            if len(started) > 1 and now - max(started[1], state.submitted) > self.compile_timeout_s:
                return False, RequestError.at(field, "the grammar did not compile within "
                                              f"{self.compile_timeout_s:g} s (--structured-outputs-compile-timeout)")
            if len(started) == 1 and now - started[0] > BACKEND_LOAD_TIMEOUT_S:
                return False, RequestError.at(field, "the grammar backend did not load its view of the tokenizer "
                                              f"within {BACKEND_LOAD_TIMEOUT_S:g} s")
            # Still queued: every compile thread is held by slow grammars. Bounded so a request never hangs.
            if not started and now - state.submitted > QUEUE_TIMEOUT_FACTOR * self.compile_timeout_s:
                return False, RequestError.at(field, "every grammar compile thread stayed busy for "
                                              f"{QUEUE_TIMEOUT_FACTOR * self.compile_timeout_s:g} s; try again")
            return False, None
        exc = future.exception()
        if exc is not None:
            return False, exc if isinstance(exc, RequestError) else \
                RequestError(field, f"{field} does not compile: {type(exc).__name__}: {exc}")
        state.start(self._backend.matcher(future.result()), self._end_marker, prompt_token_ids)
        return True, None

    def wait_any(self, states: list[StructuredOutputRequest], timeout: float) -> None:
        """Sleep until one of these compiles ends or `timeout` passes (an idle loop must not spin)."""
        from concurrent.futures import FIRST_COMPLETED, wait
        wait([s.compiled for s in states], timeout=timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, rows: list[tuple[str, StructuredOutputRequest]],
                        drafts: Optional[dict[str, list[int]]] = None) -> Optional[GrammarBitmask]:
        """One bitmask row per request that samples under its grammar this step, and one more per draft token
        of a request that verifies drafts (its rows consecutive, in position order); None when none does."""
        rows = [(rid, s) for rid, s in rows if s.constrains_next]
        if not rows:
            return None
        drafts = drafts or {}
        words = (self.vocab_size + 31) // 32
        counts = [1 + len(drafts.get(rid, ())) for rid, _ in rows]
        mask = np.full((sum(counts), words), -1, dtype=np.int32)
        row = 0
        for (rid, state), count in zip(rows, counts):
            fill_draft_masks(state, drafts.get(rid, []), mask, row)
            row += count
        return GrammarBitmask(req_ids=[rid for (rid, _), count in zip(rows, counts) for _ in range(count)],
                              data=mask.tobytes(), num_words=words)

    def stats(self) -> dict[str, int]:
        return {"num_compiles": self.num_compiles, "num_cached_grammars": len(self._cache)}

    def shutdown(self) -> None:
        # A runaway compile cannot be interrupted; do not wait for it.
        self._pool.shutdown(wait=False, cancel_futures=True)
