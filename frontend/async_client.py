"""AsyncEngineClient: the asyncio API over an engine core process (its own, or a running daemon's)."""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedserve.common.config import CORE_HEARTBEAT_INTERVAL_S, EngineArgs, EngineConfig
from pagedserve.common.errors import OVERLOADED, EngineOverloadedError
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.frontend.core_client import AsyncMPClient, CoreProcess, EngineDeadError
from pagedserve.frontend.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedserve.frontend.output_processor import OutputProcessor
from pagedserve.frontend.outputs import RequestOutput
from pagedserve.frontend.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, client: AsyncMPClient) -> None:
        self.config = config
        self.model_config = config.model
        self.client = client
        self.tokenizer = load_tokenizer(config.model.source, config.model.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer, config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Tokenizing a multi-MiB prompt takes seconds; on the event loop it would stall every stream.
        # One thread: calls stay serialized, as they were on the loop.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._children: dict[str, list[str]] = {}
        self._handler: asyncio.Task | None = None
        self._connected = False
        self._connect_lock: asyncio.Lock | None = None
        self._utility: dict[int, asyncio.Future] = {}
        self.last_stats = None
        # Called with every finished RequestOutput and its total generated tokens (metrics).
        self.finished_hooks: list[Callable[[RequestOutput, int], None]] = []
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_level: int = logging.INFO) -> "AsyncEngineClient":
        """Start an engine core process (and its workers) owned by this client."""
        config = args.create_engine_config()
        proc = CoreProcess(args, log_level)
        return cls(config, AsyncMPClient(proc.addresses, proc.token, proc,
                                         heartbeat_timeout_s=args.engine_heartbeat_timeout))

    @classmethod
    async def connect(cls, address: str, token: str, timeout_s: float = 30.0,
                      heartbeat_timeout_s: float = 30.0) -> "AsyncEngineClient":
        """Attach to the engine core of a running `engine-serve` (its --engine-address and --engine-token).
        This client tokenizes and detokenizes for itself; the core serves every client. A core silent
        for heartbeat_timeout_s (stopped, killed, unreachable) fails every pending request with
        EngineDeadError."""
        from pagedserve.core.engine_core_proc import CoreAddresses
        from pagedserve.frontend.core_client import split_engine_address
        if not heartbeat_timeout_s >= 2 * CORE_HEARTBEAT_INTERVAL_S:
            raise ValueError(f"heartbeat_timeout_s must be >= {2 * CORE_HEARTBEAT_INTERVAL_S:g} s (the core "
                             f"beats every {CORE_HEARTBEAT_INTERVAL_S:g} s), got {heartbeat_timeout_s!r}")
        inp, out = split_engine_address(address)
        client = AsyncMPClient(CoreAddresses(input=inp, output=out, handshake=""), token,
                               heartbeat_timeout_s=heartbeat_timeout_s)
        try:
            source_args = await _first_answer(client, "get_engine_args", timeout_s)
            source_args = dict(source_args)
        except BaseException:
            client.close()
            raise
        source_args["distributed_executor_backend"] = None
        source_args["tensor_parallel_size"] = 1     # only the model/tokenizer settings matter here
        config = EngineArgs(**source_args).create_engine_config()
        return cls(config, client)

    @property
    def is_dead(self) -> bool:
        return self.client.dead is not None

    async def _ensure_handler(self) -> None:
        if self._handler is not None and not self._handler.done():
            return
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if not self._connected:
                # Outputs for a peer the core's output socket has not seen yet would be lost.
                await _first_answer(self.client, "ping", 30.0)
                self._connected = True
            if self._handler is None or self._handler.done():
                self._handler = asyncio.get_running_loop().create_task(self._output_loop())

    # ---------------------------------------------------------------- requests

    async def generate(self, prompt: PromptType | ProcessedPrompt, sampling_params: SamplingParams,
                       request_id: str | None = None, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Yield RequestOutputs as tokens arrive; leaving the generator early aborts the request."""
        await self._ensure_handler()
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        parsed = prompt if isinstance(prompt, ProcessedPrompt) else \
            await self.run_tokenizer(self.input_processor.parse_prompt, prompt)
        child_ids, requests = self.input_processor.make_requests(rid, parsed, sampling_params, priority)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        self._children[rid] = child_ids
        self.output_processor.add_request(rid, parsed.prompt, parsed.prompt_token_ids, child_ids,
                                          [r.sampling_params for r in requests])
        finished = False
        try:
            for request in requests:
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
                self.output_processor.abort_request(children)
                if not self.is_dead:
                    await self.client.abort_requests(children)

    async def abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            children = self._children.get(request_id, [])
            self.output_processor.abort_request(children)
            await self.client.abort_requests(children)
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def _output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output()
                if outputs is None:
                    continue
                self._dispatch_utility(outputs.utility_results)
                if outputs.scheduler_stats is not None:
                    self.last_stats = outputs.scheduler_stats
                # Chunks keep one huge batch from holding the event loop for long.
                for i in range(0, len(outputs.outputs), 256):
                    processed = self.output_processor.process_outputs(outputs.outputs[i:i + 256])
                    for out in processed.request_outputs:
                        if out.finished:
                            self._run_hooks(out)
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

    def _run_hooks(self, out: RequestOutput) -> None:
        for hook in self.finished_hooks:
            try:
                hook(out, int(out.metrics.get("num_generation_tokens", 0)))
            except Exception:   # metrics must never break serving
                logger.exception("finished hook failed")

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        for fut in self._utility.values():
            if not fut.done():
                fut.set_exception(exc)

    def _dispatch_utility(self, results: list) -> None:
        for result in results:
            fut = self._utility.pop(result.call_id, None)
            if fut is not None and not fut.done():
                if result.error:
                    fut.set_exception(RuntimeError(result.error))
                else:
                    fut.set_result(result.result)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        await self._ensure_handler()
        call_id = await self.client.send_utility(method, *args)
        fut = asyncio.get_running_loop().create_future()
        self._utility[call_id] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._utility.pop(call_id, None)

    # ---------------------------------------------------------------- helpers

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the tokenizer thread: for tokenizer-bound work (encoding, chat templates,
        decoding long id lists), so the event loop keeps streaming meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run_tokenizer(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(self.client.dead)
        await self.call_utility("ping", timeout_s=5.0)

    def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
        self._fail_all(EngineDeadError("the client was shut down"))
        self.client.close()
        self._tokenizer_pool.shutdown(wait=False)


def _request_error(out: RequestOutput, engine_dead: bool) -> Exception:
    """The exception a caller sees for a request the engine core ended with an error: the engine died
    (EngineDeadError), its queue is full (EngineOverloadedError) or it refused the request (ValueError)."""
    if engine_dead:
        return EngineDeadError(out.error)
    if out.error_kind == OVERLOADED:
        return EngineOverloadedError(out.error)
    return ValueError(out.error)


async def _first_answer(client: AsyncMPClient, method: str, timeout_s: float) -> Any:
    """Call a utility before the output loop runs, resending until the core's output socket knows us."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        call_id = await client.send_utility(method)
        resend_at = loop.time() + 0.5
        while loop.time() < resend_at:
            out = await client.get_output(timeout_s=0.1)
            for result in (out.utility_results if out else ()):
                if result.call_id == call_id:
                    if result.error:
                        raise RuntimeError(result.error)
                    return result.result
    raise TimeoutError(f"no answer from the engine core within {timeout_s} s (wrong address or token?)")
