"""Offline inference: `LLM(...).generate(prompts, sampling_params)`, shaped like vLLM's."""
from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.errors import RequestError
from pagedserve.common.lora import LoRARequest, check_lora_request
from pagedserve.common.request_checks import has_waiting_room
from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.beam_search.search import (BeamSearch, BeamSearchOutput, StepLogprobs, run_beam_search,
                                             step_logprobs, step_sampling_params)
from pagedserve.frontend.client.input_processor import InputProcessor, PreparedRequest, ProcessedPrompt, PromptType
from pagedserve.frontend.rl.offline import RLClient
from pagedserve.frontend.client.output_processor import OutputProcessor
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.client.processors import Processors
from pagedserve.frontend.client.prompt_lists import as_prompt_list, per_prompt
from pagedserve.frontend.tracing.settings import check_tracing
from pagedserve.ipc.messages import EngineCoreRequest

if TYPE_CHECKING:
    from pagedserve.frontend.client.core_client import EngineCoreClient
    from pagedserve.frontend.tracing.request_spans import RequestSpans

logger = logging.getLogger(__name__)


class LLM:
    """Offline engine. `multiprocess_core=True` runs the engine core in its own process (as the
    server does); otherwise it runs here. tensor_parallel_size > 1 always uses worker processes."""

    def __init__(self, model: str | None = None, *, multiprocess_core: bool = False,
                 otlp_traces_endpoint: str | None = None, collect_detailed_traces: str | None = None,
                 **kwargs: Any) -> None:
        """otlp_traces_endpoint, collect_detailed_traces: vLLM's, as engine-serve's flags of those names
        (docs/tracing.md): one span per request to that OTLP endpoint."""
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"LLM got unknown argument(s): {', '.join(sorted(unknown))}")
        check_tracing(otlp_traces_endpoint, collect_detailed_traces, spell=str)
        self.engine_args = EngineArgs(model=model, **kwargs)
        if self.engine_args.data_parallel_size != 1:
            raise ValueError("data_parallel_size: LLM runs one engine core; engine-serve --data-parallel-size N "
                             "serves N behind one API")
        self.client: EngineCoreClient
        if multiprocess_core:
            from pagedserve.frontend.client.core_client import SyncMPClient
            from pagedserve.frontend.client.core_process import CoreProcess
            proc = CoreProcess(self.engine_args, logging.getLogger().getEffectiveLevel())
            self.client = SyncMPClient(proc.addresses, proc.token, proc,
                                       heartbeat_timeout_s=self.engine_args.engine_heartbeat_timeout)
            self.info = proc.info
            if self.info.mm_limits:
                self.client.use_mm_cache(self.info.mm_processor_cache_gb)
        else:
            from pagedserve.frontend.client.inproc_client import InprocClient
            self.client = InprocClient(self.engine_args)
            self.info = self.client.info
        self.processors = Processors.from_info(self.info)
        self.rl = RLClient(self.client, self.engine_args.requests_while_sleeping)
        self._ids = itertools.count()
        self._loras: dict[int, LoRARequest] = {}      # adapters this LLM registered with the core, by id
        self._spans: RequestSpans | None = None       # off: nothing imported, a None check per request
        if otlp_traces_endpoint:
            from pagedserve.frontend.tracing.request_spans import RequestSpans
            self._spans = RequestSpans(otlp_traces_endpoint, self.info.served_model_name, collect_detailed_traces)

    @property
    def tokenizer(self) -> Any:
        return self.processors.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.processors.input

    @property
    def output_processor(self) -> OutputProcessor:
        return self.processors.output

    @property
    def engine(self):
        """The in-process EngineCore (None when it runs in its own process)."""
        return getattr(self.client, "core", None)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling params: the model's generation-config
        defaults (temperature, top_p, top_k, min_p, repetition_penalty) over SamplingParams' own."""
        params = SamplingParams(**self.info.default_sampling)
        params.validate()       # the core checked these at startup; this normalizes them (greedy drops top_k)
        return params

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None: the base model) per prompt."""
        items = as_prompt_list(prompts)
        parsed = [self.input_processor.parse_prompt(p) for p in items]
        return self._run(parsed, sampling_params, use_tqdm, priority, lora_request)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             continue_final_message: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        parsed = [self.input_processor.attach_media(self.input_processor.apply_chat_template(
            c, add_generation_prompt, chat_template, chat_template_kwargs, continue_final_message))
            for c in conversations]
        return self._run(parsed, sampling_params, use_tqdm, None, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's params.beam_width best beams (frontend/beam_search/search.py), best
        first; each sequence's tokens and text include its prompt, as vLLM's do. concurrency_limit: prompts
        searched at once (unset: all); use_tqdm: accepted, no bar."""
        if concurrency_limit is not None and not (isinstance(concurrency_limit, int) and concurrency_limit >= 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1, got {concurrency_limit!r}")
        eos = self.info.eos_token_ids
        params.validate(len(eos))
        parsed = [self.input_processor.parse_prompt(p) for p in as_prompt_list(prompts)]
        searches = [BeamSearch(p.prompt_token_ids, params, eos, self.info.max_model_len) for p in parsed]
        step_params = step_sampling_params(params, len(eos))

        def step(batch: list[list[int]]) -> list[StepLogprobs]:
            return [step_logprobs(out) for out in self.generate(batch, step_params, use_tqdm=False,
                                                                lora_request=lora_request)]
        limit = concurrency_limit or max(1, len(searches))
        for start in range(0, len(searches), limit):
            run_beam_search(searches[start:start + limit], step)
        outputs = []
        for search in searches:
            sequences = search.result()
            for seq in sequences:
                seq.text = self.tokenizer.decode(seq.tokens)
            outputs.append(BeamSearchOutput(sequences))
        return outputs

    def _run(self, prompts: list[ProcessedPrompt], sampling_params: Any, use_tqdm: bool,
             priority: Sequence[int] | None, lora_request: Any = None) -> list[RequestOutput]:
        self.rl.refuse_waiting_asleep()
        params = per_prompt(sampling_params, len(prompts), "sampling_params", self.get_default_sampling_params())
        priorities = per_prompt(list(priority) if priority is not None else None, len(prompts), "priority", 0)
        loras = per_prompt(list(lora_request) if isinstance(lora_request, (list, tuple)) else lora_request,
                            len(prompts), "lora_request", None)
        lora_ids = [self._lora_id(lora) for lora in loras]
        batch = []
        for prompt, p, prio, lora_id in zip(prompts, params, priorities, lora_ids):
            # Offline callers want one result per prompt: only the final output is needed.
            p = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            batch.append(self.processors.prepare(str(next(self._ids)), prompt, p, prio, lora_id))
        return self._run_prepared(batch, use_tqdm)

    def _run_prepared(self, batch: list[PreparedRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Run requests prepared (and so validated) all before any is queued; their final outputs, in order."""
        for prepared in batch:   # validated all before queueing any
            self.processors.track(prepared)
            if self._spans is not None:
                self._spans.begin(prepared)
        backlog = deque(request for prepared in batch for request in prepared.requests)
        return self._run_engine([prepared.request_id for prepared in batch], backlog, use_tqdm)

    # Pooling models (--runner pooling, docs/pooling.md): thin calls into frontend/pooling/offline.py.
    def embed(self, prompts: Any, pooling_params: Any = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[Any]:
        """One EmbeddingRequestOutput per prompt (.outputs.embedding)."""
        from pagedserve.frontend.pooling import offline as llm_pooling
        return llm_pooling.embed(self._pooling_runner(), prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def encode(self, prompts: Any, pooling_params: Any = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[Any]:
        """One PoolingRequestOutput per prompt (.outputs.data: the pooler's raw vector)."""
        from pagedserve.frontend.pooling import offline as llm_pooling
        return llm_pooling.encode(self._pooling_runner(), prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def classify(self, prompts: Any, pooling_params: Any = None, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[Any]:
        """One ClassificationRequestOutput per prompt (.outputs.probs)."""
        from pagedserve.frontend.pooling import offline as llm_pooling
        return llm_pooling.classify(self._pooling_runner(), prompts, pooling_params, use_tqdm, truncate_prompt_tokens)

    def score(self, data_1: Any, data_2: Any, pooling_params: Any = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[Any]:
        """One ScoringRequestOutput per pair (.outputs.score): a cross-encoder's, or embeddings' cosine."""
        from pagedserve.frontend.pooling import offline as llm_pooling
        return llm_pooling.score(self._pooling_runner(), data_1, data_2, pooling_params, use_tqdm, truncate_prompt_tokens)

    def _pooling_runner(self) -> Any:
        from pagedserve.frontend.pooling.offline import PoolingRunner
        return PoolingRunner(self.input_processor, lambda: str(next(self._ids)), self._run_prepared,
                             self.info.pooling_tasks)

    def _lora_id(self, lora: LoRARequest | None) -> int:
        """The adapter's id, registered with the core the first time it is seen here (as vLLM's LLM does)."""
        if lora is None:
            return 0
        lora = check_lora_request(lora)
        if self._loras.get(lora.lora_int_id) != lora:
            self.client.call_utility("add_lora", lora.lora_name, lora.lora_int_id, lora.lora_path)
            self._loras[lora.lora_int_id] = lora
        return lora.lora_int_id

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter ahead of the requests that name it; ValueError with the reason it cannot be served."""
        self._lora_id(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        self._loras.pop(lora_int_id, None)
        return bool(self.client.call_utility("remove_lora", lora_int_id))

    def list_loras(self) -> list[dict[str, Any]]:
        return list(self.client.call_utility("list_loras"))

    def _submit(self, backlog: deque[EngineCoreRequest]) -> None:
        """Send the core what it will take from the backlog. It refuses a request when max_waiting_requests
        are already waiting; waiting ones are among the submitted-but-unfinished here, so holding those
        to the bound keeps every request out of that refusal, however many prompts the caller gave."""
        bound = self.info.max_waiting_requests
        # The output processor tracks every request of this call; those not yet sent are the backlog.
        in_flight = self.output_processor.num_unfinished() - len(backlog)
        while backlog and has_waiting_room(in_flight, bound):
            self.client.add_request(backlog.popleft())
            in_flight += 1

    def _run_engine(self, order: list[str], backlog: deque[EngineCoreRequest],
                    use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        out_tokens = 0
        try:
            while self.output_processor.num_unfinished():
                self._submit(backlog)
                step = self.client.get_output()
                if step is None:
                    continue
                processed = self.output_processor.process_outputs(step.outputs)
                if processed.reqs_to_abort:
                    self.client.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    if output.error:
                        raise RequestError(output.error_field, f"request {output.request_id} failed: {output.error}")
                    if output.finished:
                        results[output.request_id] = output
                        if self._spans is not None:
                            self._spans.finish(output, int(output.metrics.get("num_generation_tokens", 0)))
                        out_tokens += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{out_tokens / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s")
                stats = step.scheduler_stats
                if (stats is not None and stats.num_running == 0 and stats.num_waiting > 0 and not step.outputs
                        and not stats.num_loading and not stats.num_loads_done):
                    raise RuntimeError("the scheduler could not admit any waiting request: "
                                       "the KV cache is too small for the queued requests")
        except BaseException:
            # The core ignores ids it never got (the backlog's).
            pending = self.output_processor.unfinished_ids()
            self.output_processor.abort_request(pending)
            self.client.abort_requests(pending)
            if self._spans is not None:
                for rid in order:
                    self._spans.drop(rid)       # no span for a request that did not finish
            raise
        finally:
            bar.close()
        return [results[rid] for rid in order]

    # ------------------------------------------------ RL rollouts (vLLM's calls), answered by self.rl

    def collective_rpc(self, method: str, timeout: float | None = None, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.rl.collective_rpc(method, timeout, args, kwargs)

    def reload_weights(self, weights_path: str | None = None) -> None:
        self.rl.reload_weights(weights_path)

    def sleep(self, level: int = 1, abort_requests: bool = False) -> None:
        self.rl.sleep(level, abort_requests)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.rl.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.rl.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.rl.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine core and its workers; idempotent. Without it they stop at interpreter exit."""
        if not getattr(self, "_closed", False):
            self._closed = True
            self.client.close()
            if self._spans is not None:
                self._spans.shutdown()          # the spans still queued leave now

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

