"""AsyncEngineClient: the asyncio API over an engine core process (its own, or a running daemon's).

Its face is narrow on purpose: the HTTP layer (and any Python caller) uses `info` (the engine's limits and
names, as the core told them), `tokenize`, `render_chat`, `detokenize`, `prepare` + `stream` (or
`generate`, which is both), `abort`, `is_dead`, `check_health`, `last_stats` and the hooks (`started_hooks`,
`finished_hooks`, ...).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from pagedserve.common.config.engine_args import CORE_HEARTBEAT_INTERVAL_S, EngineArgs
from pagedserve.common.errors import (ENGINE_DIED, OVERLOADED, SLEEPING, EngineOverloadedError, EngineSleepingError,
                                      RequestError)
from pagedserve.common.request_checks import check_request_id
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.client.core_client import AsyncMPClient, EngineDeadError
from pagedserve.frontend.client.core_process import CoreProcess, split_engine_address
from pagedserve.frontend.client.input_processor import PreparedRequest, ProcessedPrompt, PromptType
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.client.processors import Processors
from pagedserve.ipc.messages import EngineInfo, SchedulerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngineClient:
    def __init__(self, info: EngineInfo, client: AsyncMPClient, chat_template: str | None = None,
                 max_media_bytes: int | None = None) -> None:
        """info: what the engine core said about itself; chat_template: used instead of the tokenizer's;
        max_media_bytes: one image's or video's most bytes, however it comes (the server's --max-body-bytes)."""
        self.info = info
        self.client = client
        if info.mm_limits:
            client.use_mm_cache(info.mm_processor_cache_gb)
        self.processors = Processors.from_info(info, chat_template, max_media_bytes)
        # Tokenizing a multi-MiB prompt takes seconds; on the event loop it would stall every stream.
        # One thread: calls stay serialized, as they were on the loop.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # Images are fetched, decoded and processed on a pool of their own: a large image takes the tokenizer
        # thread from no text request (vLLM #49317). PIL and numpy drop the GIL for the heavy parts.
        self._media_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="media") if info.mm_limits else None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._children: dict[str, list[str]] = {}
        self._handler: asyncio.Task | None = None
        self._connected = False
        self._connect_lock: asyncio.Lock | None = None
        # Each engine core's latest SchedulerStats, by its index (data-parallel engines 0, 1, ...).
        self.engine_stats: dict[int, SchedulerStats] = {}
        # Each hook's last argument is the index of the engine core the observation came from.
        # Called with every finished RequestOutput and its total generated tokens (metrics).
        self.finished_hooks: list[Callable[[RequestOutput, int, int], None]] = []
        # Called with each request as it starts, and with the id of each that ends unfinished (tracing).
        self.started_hooks: list[Callable[[PreparedRequest], None]] = []
        self.unfinished_hooks: list[Callable[[str], None]] = []
        # Called with the intervals between consecutive output tokens seen in each batch of outputs (metrics).
        self.inter_token_hooks: list[Callable[[list[float], int], None]] = []
        # Called with the SchedulerStats of every engine step (metrics).
        self.step_hooks: list[Callable[[SchedulerStats, int], None]] = []
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_level: int = logging.INFO,
                         chat_template: str | None = None) -> "AsyncEngineClient":
        """Start an engine core process (and its workers) owned by this client."""
        if args.data_parallel_size != 1:
            raise ValueError("data_parallel_size: AsyncEngineClient.from_engine_args starts one engine core; "
                             "engine-serve --data-parallel-size N serves N behind one API")
        proc = CoreProcess(args, log_level)
        client = AsyncMPClient(proc.addresses, proc.token, proc, heartbeat_timeout_s=args.engine_heartbeat_timeout)
        return cls(proc.info, client, chat_template)

    @classmethod
    async def connect(cls, address: str, token: str, timeout_s: float = 30.0,
                      heartbeat_timeout_s: float = EngineArgs.engine_heartbeat_timeout) -> "AsyncEngineClient":
        """Attach to the engine core of a running `engine-serve` (its --engine-address and --engine-token).
        This client tokenizes and detokenizes for itself; the core serves every client. A core silent
        for heartbeat_timeout_s (stopped, killed, unreachable) fails every pending request with
        EngineDeadError."""
        from pagedserve.core.engine_core_proc import CoreAddresses
        if not heartbeat_timeout_s >= 2 * CORE_HEARTBEAT_INTERVAL_S:
            raise ValueError(f"heartbeat_timeout_s must be >= {2 * CORE_HEARTBEAT_INTERVAL_S:g} s (the core "
                             f"beats every {CORE_HEARTBEAT_INTERVAL_S:g} s), got {heartbeat_timeout_s!r}")
        inp, out = split_engine_address(address)
        client = AsyncMPClient(CoreAddresses(input=inp, output=out, handshake=""), token,
                               heartbeat_timeout_s=heartbeat_timeout_s)
        try:
            info = msgspec.convert(await client.call_utility("get_engine_info", timeout_s=timeout_s), EngineInfo)
        except BaseException:
            client.close()
            raise
        engine = cls(info, client)
        engine._connected = True
        return engine

    # ---------------------------------------------------------------- the narrow face

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The engines' latest stats, summed over data-parallel engines (KV usage: the fullest engine's)."""
        stats = list(self.engine_stats.values())
        if len(stats) <= 1:
            return stats[0] if stats else None
        return SchedulerStats(
            num_running=sum(s.num_running for s in stats), num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=max(s.kv_cache_usage for s in stats),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
            num_preemptions=sum(s.num_preemptions for s in stats))

    @property
    def num_engines(self) -> int:
        """Engine cores behind this client (data parallelism: more than one)."""
        return getattr(self.client, "num_engines", 1)

    def engine_states(self) -> list[dict[str, Any]]:
        states = getattr(self.client, "engine_states", None)
        return states() if states is not None else [
            {"engine": 0, "state": "ok" if self.client.dead is None else f"dead: {self.client.dead}"}]

    @property
    def is_dead(self) -> bool:
        return self.client.dead is not None

    def check_alive(self) -> None:
        """EngineDeadError, with the reason, once the engine core is dead or silent."""
        if self.client.dead is not None:
            raise EngineDeadError(self.client.dead)

    async def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> ProcessedPrompt:
        """A text, token-id or dict prompt as token ids (on the tokenizer thread)."""
        return await self.run_tokenizer(self.processors.input.parse_prompt, prompt, add_special_tokens)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None,
                          continue_final_message: bool = False,
                          tools: list[dict[str, Any]] | None = None) -> ProcessedPrompt:
        prompt = await self.run_tokenizer(self.processors.input.apply_chat_template, messages,
                                          add_generation_prompt, template_kwargs=template_kwargs,
                                          continue_final_message=continue_final_message, tools=tools)
        if prompt.pending_media:
            prompt = await asyncio.get_running_loop().run_in_executor(
                self._media_pool, self.processors.input.attach_media, prompt)
        return prompt

    @property
    def is_multimodal(self) -> bool:
        return bool(self.info.mm_limits)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.run_tokenizer(self.processors.tokenizer.decode, token_ids)

    def prepare(self, prompt: ProcessedPrompt, sampling_params: SamplingParams, request_id: str | None = None,
                priority: int = 0, lora_int_id: int = 0) -> PreparedRequest:
        """Validate against the engine's limits and fan out n > 1: a bad request fails here, before a
        stream has answered anything. (Its id is checked when it runs, in `stream`.)"""
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        return self.processors.prepare(rid, prompt, sampling_params, priority, lora_int_id)

    async def generate(self, prompt: PromptType | ProcessedPrompt, sampling_params: SamplingParams,
                       request_id: str | None = None, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Yield RequestOutputs as tokens arrive; leaving the generator early aborts the request."""
        parsed = prompt if isinstance(prompt, ProcessedPrompt) else await self.tokenize(prompt)
        async for out in self.stream(self.prepare(parsed, sampling_params, request_id, priority)):
            yield out

    async def stream(self, prepared: PreparedRequest) -> AsyncGenerator[RequestOutput, None]:
        """Run a prepared request; leaving the generator early aborts it."""
        await self._ensure_handler()
        rid = prepared.request_id
        check_request_id(rid, self._queues)      # this client's own table: a second one would take its queue
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        self._children[rid] = prepared.child_ids
        self.processors.track(prepared)
        self._run_hooks(self.started_hooks, prepared)
        finished = False
        try:
            for request in prepared.requests:
                await self.client.add_request(request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            children = self._children.pop(rid, [])
            if not finished:        # cancelled, disconnected or failed: the engine must drop it
                self._run_hooks(self.unfinished_hooks, rid)
                self.processors.output.abort_request(children)
                if not self.is_dead:
                    await self.client.abort_requests(children)

    async def abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            children = self._children.get(request_id, [])
            self.processors.output.abort_request(children)
            await self.client.abort_requests(children)
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def check_health(self) -> None:
        self.check_alive()
        await self.client.call_utility("ping", timeout_s=5.0)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        return await self.client.call_utility(method, *args, timeout_s=timeout_s)

    def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
        self._fail_all(EngineDeadError("the client was shut down"))
        self.client.close()
        self._tokenizer_pool.shutdown(wait=False)
        if self._media_pool is not None:
            self._media_pool.shutdown(wait=False)

    # ---------------------------------------------------------------- outputs

    async def _ensure_handler(self) -> None:
        if self._handler is not None and not self._handler.done():
            return
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if not self._connected:
                # Outputs for a peer the core's output socket has not seen yet would be lost.
                await self.client.call_utility("ping", timeout_s=30.0)
                self._connected = True
            if self._handler is None or self._handler.done():
                self._handler = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output()
                engine = outputs.engine_index
                # An engine scaled away may leave a last batch behind it: its stats are gone with it.
                if outputs.scheduler_stats is not None and engine < self.num_engines:
                    self.engine_stats[engine] = outputs.scheduler_stats
                    self._run_hooks(self.step_hooks, outputs.scheduler_stats, engine)
                # Chunks keep one huge batch from holding the event loop for long.
                for i in range(0, len(outputs.outputs), 256):
                    processed = self.processors.output.process_outputs(outputs.outputs[i:i + 256])
                    if processed.inter_token_latencies:
                        self._run_hooks(self.inter_token_hooks, processed.inter_token_latencies, engine)
                    for out in processed.request_outputs:
                        if out.finished:
                            self._run_hooks(self.finished_hooks, out,
                                            int(out.metrics.get("num_generation_tokens", 0)), engine)
                        queue = self._queues.get(out.request_id)
                        if queue is not None:
                            queue.put_nowait(out if not out.error else
                                             _request_error(out, outputs.engine_dead is not None))
                    if processed.reqs_to_abort:
                        await self.client.abort_requests(processed.reqs_to_abort)
                    await asyncio.sleep(0)
                if outputs.engine_dead:
                    raise EngineDeadError(outputs.engine_dead)
        except EngineDeadError as exc:
            self._fail_all(exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here must still end every waiting request
            logger.exception("output handler failed")
            self._fail_all(EngineDeadError(f"output handler failed: {exc}"))

    @staticmethod
    def _run_hooks(hooks: list[Callable[..., None]], *args: Any) -> None:
        for hook in hooks:
            try:
                hook(*args)
            except Exception:   # metrics must never break serving
                logger.exception("metrics hook failed")

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the tokenizer thread: for tokenizer-bound work (encoding, chat templates,
        decoding long id lists), so the event loop keeps streaming meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                functools.partial(fn, *args, **kwargs))


def _request_error(out: RequestOutput, engine_dead: bool) -> Exception:
    """The exception a caller sees for a request the engine core ended with an error: the engine died
    (EngineDeadError), its queue is full (EngineOverloadedError) or it refused the request (RequestError,
    with the field the core named)."""
    if engine_dead or out.error_kind == ENGINE_DIED:
        return EngineDeadError(out.error)
    if out.error_kind == OVERLOADED:
        return EngineOverloadedError(out.error)
    if out.error_kind == SLEEPING:
        return EngineSleepingError(out.error)
    return RequestError(out.error_field, out.error)
