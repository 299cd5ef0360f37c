"""EngineCore: schedule -> execute -> update, one step at a time."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from pagedserve.core.block_hash import BlockHasher
from pagedserve.common.config.engine_args import EngineArgs, EngineConfig
from pagedserve.common.errors import RequestError
from pagedserve.common.model.model_files import tokenizer_folder
from pagedserve.common.request_checks import (check_request, check_request_id, check_waiting_room,
                                              generation_budget)
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.kv_connector.offloading import make_scheduler_connector
from pagedserve.core.lora.registry import LoRARegistry
from pagedserve.core.multimodal.checks import check_mm_features, multimodal_info
from pagedserve.core.pooling.requests import check_runner, pooling_info
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.rl.control import RLControl
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.core.structured_output.setup import check_structured_outputs, make_structured_output_manager
from pagedserve.core.tracing.model_times import ModelTimes
from pagedserve.ipc.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo,
                                     ModelRunnerOutput, SchedulerOutput)

logger = logging.getLogger(__name__)


class PendingOutput(Protocol):
    """A step started by execute_model_async (a concurrent.futures.Future does)."""

    def result(self, timeout: float | None = None) -> ModelRunnerOutput: ...


class ExecutorLike(Protocol):
    """What the core drives. The executor classes satisfy it; the core never imports them, whoever builds
    the core injects one (executor.procs.backends.get_executor_class)."""

    def determine_num_blocks(self) -> int: ...
    def initialize_cache(self, num_blocks: int) -> None: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    # Starts the step and returns at once; steps run in the order they were started.
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: Callable[[EngineConfig], ExecutorLike]) -> None:
        self.config = config
        start = time.perf_counter()
        self.executor = executor_class(config)
        try:
            self.num_blocks = self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        cache = config.cache
        self.kv_cache_manager = KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.structured_outputs = make_structured_output_manager(config)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.structured_outputs,
                                   config.speculative, config.multimodal,
                                   make_scheduler_connector(config.kv_transfer, cache.block_size,
                                                            config.model.device))
        self.block_hasher = BlockHasher(cache.block_size) if cache.enable_prefix_caching else None
        self.loras: LoRARegistry | None = None
        if config.lora is not None:
            self.loras = LoRARegistry(config.lora, config.model.hf_config, self.executor.collective_rpc)
            self.scheduler.on_lora_done = self.loras.release
        self.eos_token_ids = config.model.eos_token_ids
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None    # async scheduling's step N
        self._launched_at = 0.0                                                  # when it was launched
        # Pipeline parallelism: up to one batch per stage in flight, oldest first (vLLM's batch queue).
        self.batch_queue_size = config.scheduler.batch_queue_size
        self._batch_queue: deque[tuple[SchedulerOutput, PendingOutput, float]] = deque()    # ..., launched at
        self.model_times = ModelTimes()       # --collect-detailed-traces: the traced requests' step times
        self._info: EngineInfo | None = None
        # collective_rpc, weight reloads, sleep (core/rl/control.py)
        self.rl = RLControl(self.executor, config.rl, self._weights_changed, self.settle)
        logger.info("engine core ready in %.1f s: %d KV blocks", time.perf_counter() - start, self.num_blocks)

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         executor_class: Callable[[EngineConfig], ExecutorLike]) -> "EngineCore":
        """The core builds (and validates) its own configuration; callers hand it the user's knobs."""
        return cls(args.create_engine_config(), executor_class)

    def _init_kv_cache(self) -> int:
        num_blocks = self.executor.determine_num_blocks()
        block_size = self.config.cache.block_size
        needed = cdiv(self.config.model.max_model_len, block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens), fewer than one "
                f"request of max_model_len={self.config.model.max_model_len} needs ({needed} blocks): "
                "raise kv_cache_memory / gpu_memory_utilization or lower max_model_len")
        self.executor.initialize_cache(num_blocks)
        return num_blocks

    # ---------------------------------------------------------------- requests

    def add_request(self, req: EngineCoreRequest, checked: bool = False) -> None:
        """Validate and queue a request: RequestError (naming the field) if it can never run as asked,
        EngineOverloadedError if the waiting queue is full. The core's trust boundary: any client may send
        anything. checked: the frontend in this very process already ran check_request on it (InprocClient)."""
        model = self.config.model
        check_request_id(req.request_id, self.scheduler.requests)
        check_runner(req, self.config)
        self.rl.check_admission()
        params = req.sampling_params
        if req.pooling_params is not None:     # the prompt only: checked above, against the pooler's limits
            max_tokens = 0
        elif checked:
            max_tokens = generation_budget(params, len(req.prompt_token_ids), model.max_model_len)
        else:
            max_tokens = check_request(req.prompt_token_ids, params, req.priority, model.max_model_len,
                                       model.vocab_size)
        check_waiting_room(len(self.scheduler.waiting), self.config.scheduler.max_waiting_requests)
        structured = params.structured_outputs if req.pooling_params is None else None
        if structured is not None:
            check_structured_outputs(structured)
        mm_features = check_mm_features(req.mm_features, len(req.prompt_token_ids), self.config.multimodal)
        digest = self.rl.cache_salt(self._lora_digest(req.lora_int_id))
        request = Request(req.request_id, list(req.prompt_token_ids), params, self.eos_token_ids,
                          max_tokens, self.block_hasher, req.arrival_time, req.priority, req.client_index,
                          req.lora_int_id, digest, req.pooling_params,
                          whole_prompt=self.config.pooler is not None and self.config.pooler.whole_prompt,
                          mm_features=mm_features)
        request.persistent_kv = self.rl.weights_version == 0
        if structured is not None:
            request.structured = self.structured_outputs.submit(structured)
        self.scheduler.add_request(request)
        if req.trace_model_times:
            self.model_times.track(req.request_id)

    def _lora_digest(self, lora_int_id: int) -> bytes | None:
        """The adapter's digest, held for the request (released when it ends); None for the base model."""
        if not lora_int_id:
            return None
        if self.loras is None:
            raise RequestError.at("lora_request", "this engine serves no LoRA adapters (enable_lora is off)")
        return self.loras.acquire(lora_int_id)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = [EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason="abort") for r in done]
        if self.model_times:
            self.model_times.attach(outputs)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Outputs to give: a step's, or those of the requests sleep() ended (none is stepped while asleep)."""
        return bool(self.rl.held) or (self.rl.can_step() and self.has_work())

    def has_work(self) -> bool:
        # A step still in flight counts: its output must be taken even if all its requests were aborted.
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._batch_queue)

    def settle(self, abort: bool) -> list[EngineCoreOutput]:
        """Before sleep: no request left in the scheduler, each run to its end or aborted; their outputs."""
        outputs = self.abort_requests(list(self.scheduler.requests)) if abort else []
        while self.has_work():
            outputs += self.run_step().outputs
        return outputs

    # ---------------------------------------------------------------- the step

    def step(self) -> EngineCoreOutputs:
        if self.rl.held or not self.rl.can_step():
            return self._outputs(self.rl.take_held(), 0)
        return self.run_step()

    def run_step(self) -> EngineCoreOutputs:
        if self.batch_queue_size > 1:
            return self._step_batch_queue()
        if self.async_scheduling:
            return self._step_async()
        sched = self._schedule()
        outputs = self._take_grammar_errors()
        if _has_work(sched):
            start = time.perf_counter()
            result = self.executor.execute_model(sched)
            self._time_step(sched, start, result)
            outputs += self.scheduler.update_from_output(sched, result)
        elif not outputs:
            self.scheduler.grammar_waiters.wait()   # only compiles pending: do not spin
        return self._outputs(outputs, sched.total_num_scheduled_tokens)

    def _step_async(self) -> EngineCoreOutputs:
        """Start step N+1, then take step N's output: the scheduling overlaps step N's run, and the
        output processing overlaps step N+1's. Requests in both steps were given placeholders; a stop
        found in step N's output frees the request, and step N+1's token for it is dropped on arrival."""
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and self.scheduler.needs_each_output_before_scheduling():
            outputs += self._take_in_flight()
        sched = self._schedule()
        outputs += self._take_grammar_errors()
        self._launched_at = time.perf_counter()
        started = (sched, self.executor.execute_model_async(sched)) if _has_work(sched) else None
        if self._in_flight is not None:
            outputs += self._take_in_flight()
        self._in_flight = started
        if started is None and not outputs:
            self.scheduler.grammar_waiters.wait()   # only compiles pending: do not spin
        return self._outputs(outputs, sched.total_num_scheduled_tokens)

    def _step_batch_queue(self) -> EngineCoreOutputs:
        """Start a batch while the queue has room (the stages work on earlier ones meanwhile); take the oldest
        batch's output once the queue is full or nothing new could start. A request sits in at most one
        batch in flight (the scheduler skips the others), so each batch is scheduled from known tokens."""
        outputs: list[EngineCoreOutput] = []
        started = False
        num_tokens = 0
        if len(self._batch_queue) < self.batch_queue_size:
            sched = self._schedule()
            outputs += self._take_grammar_errors()
            num_tokens = sched.total_num_scheduled_tokens
            if _has_work(sched):
                self._batch_queue.append((sched, self.executor.execute_model_async(sched), time.perf_counter()))
                started = True
        if self._batch_queue and (not started or len(self._batch_queue) >= self.batch_queue_size):
            sched, future, launched_at = self._batch_queue.popleft()
            result = future.result()
            if self.model_times:
                self.model_times.add_step(sched, time.perf_counter() - launched_at, result.forward_time)
            outputs += self.scheduler.update_from_output(sched, result)
        elif not started and not outputs:
            self.scheduler.grammar_waiters.wait()   # only compiles pending: do not spin
        return self._outputs(outputs, num_tokens)

    def _take_grammar_errors(self) -> list[EngineCoreOutput]:
        """The requests whose grammar failed in the schedule() just run: their error goes out with this step,
        so a request id is in use exactly while the scheduler holds it (no output pends for a freed one)."""
        errors, self.scheduler.grammar_errors = self.scheduler.grammar_errors, []
        return errors

    def _take_in_flight(self) -> list[EngineCoreOutput]:
        sched, future = self._in_flight
        self._in_flight = None
        result = future.result()
        self._time_step(sched, self._launched_at, result)
        return self.scheduler.update_from_output(sched, result)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if self.model_times:
            sched.time_forward = self.model_times.wanted(sched)
        return sched

    def _time_step(self, sched: SchedulerOutput, start: float, result: ModelRunnerOutput) -> None:
        """Tell the speculative step cost model how long a step of this many tokens took (with drafts, async
        scheduling takes each step's output before it launches the next: the time from launch to output is
        the step's), and the traced requests of the step its times."""
        if self.scheduler.spec is not None and sched.total_num_scheduled_tokens:
            self.scheduler.spec.cost.observe(sched.total_num_scheduled_tokens, time.perf_counter() - start)
        if self.model_times:
            self.model_times.add_step(sched, time.perf_counter() - start, result.forward_time)

    def _outputs(self, outputs: list[EngineCoreOutput], num_step_tokens: int) -> EngineCoreOutputs:
        if self.model_times:
            self.model_times.attach(outputs)
        stats = self.scheduler.make_stats()
        if self.loras is not None:
            names = self.loras.running_adapters({r.lora_int_id for r in self.scheduler.running} - {0})
            stats.running_lora_adapters, stats.waiting_lora_adapters = names["running"], names["waiting"]
        stats.num_step_tokens = num_step_tokens
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def _weights_changed(self) -> bool:
        """New weights: the requests in flight keep their hashes, so none of their KV may reach a KV tier."""
        for request in self.scheduler.requests.values():
            request.persistent_kv = False
        return self.reset_prefix_cache()

    # ---------------------------------------------------------------- what clients may ask

    def info(self) -> EngineInfo:
        if self._info is None:
            cfg = self.config
            self._info = EngineInfo(
                served_model_name=cfg.model.served_model_name, model_path=cfg.model.source.path,
                tokenizer=tokenizer_folder(cfg.model.source, cfg.model.tokenizer),
                max_model_len=cfg.model.max_model_len, vocab_size=cfg.model.vocab_size,
                eos_token_ids=list(cfg.model.eos_token_ids),
                max_waiting_requests=cfg.scheduler.max_waiting_requests, block_size=cfg.cache.block_size,
                num_blocks=self.num_blocks, default_sampling=dict(cfg.model.default_sampling),
                reasoning_parser=cfg.structured_outputs.reasoning_parser,
                max_loras=cfg.lora.max_loras if cfg.lora is not None else 0, **pooling_info(cfg),
                **multimodal_info(cfg.multimodal))
        return self._info

    def call_utility(self, method: str, args: Sequence[Any] = ()) -> Any:
        """The one table of what a client may call by name (in-process or over the socket); results are
        plain data, ready for msgpack."""
        handlers: dict[str, Callable[..., Any]] = {
            "ping": lambda: "pong",
            "reset_prefix_cache": self.reset_prefix_cache,
            "get_stats": lambda: msgspec.to_builtins(self.scheduler.make_stats()),
            "get_engine_info": lambda: msgspec.to_builtins(self.info()),
            "get_structured_output_stats": self.structured_outputs.stats,
            "add_lora": self._lora_call("add"), "remove_lora": self._lora_call("remove"),
            "list_loras": self._lora_call("list"),
            **self.rl.handlers(),
        }
        handler = handlers.get(method)
        if handler is None:
            raise ValueError(f"unknown utility method {method!r} (allowed: {', '.join(handlers)})")
        return handler(*args)

    def _lora_call(self, name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if self.loras is None:
                raise ValueError("LoRA adapters need enable_lora")
            return getattr(self.loras, name)(*args)
        return call

    def shutdown(self) -> None:
        if self._in_flight is not None:    # let the worker finish it before the executor goes
            try:
                self._in_flight[1].result()
            except Exception:               # the engine is going down anyway; the step's error was its own
                logger.debug("the step in flight at shutdown failed", exc_info=True)
            self._in_flight = None
        self.structured_outputs.shutdown()
        self.executor.shutdown()


def _has_work(sched: SchedulerOutput) -> bool:
    """Tokens to run, finished requests the workers must drop, or KV for them to load."""
    return (sched.total_num_scheduled_tokens > 0 or bool(sched.finished_req_ids)
            or sched.kv_connector_metadata is not None)
