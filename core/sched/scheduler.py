"""V1-style scheduler: one token budget per step, running requests first, chunked prefill, preemption."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from pagedserve.common.config.engine_args import SchedulerConfig
from pagedserve.common.multimodal.config import MultiModalConfig
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_connector.base import KVConnectorScheduler
from pagedserve.core.kv_connector.waiting import WaitingForKV
from pagedserve.core.multimodal.encoder_scheduler import EncoderScheduler
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.request_queue import make_queue
from pagedserve.core.sched.stats import pick_victim, scheduler_stats
from pagedserve.core.sched.step_tokens import append_tokens, step_tokens
from pagedserve.core.spec_decode.state import SpecDecodeState
from pagedserve.core.structured_output import StructuredOutputManager
from pagedserve.core.structured_output.waiting import GrammarWaiters
from pagedserve.ipc.messages import (CachedRequestData, EngineCoreOutput, LogprobsEntry, ModelRunnerOutput,
                                     NewRequestData, SchedulerOutput, SchedulerStats, refused_output)

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns every unfinished request and the KV cache manager. Knows nothing of tensors.

    Each step every request simply gets tokens until its num_computed_tokens catches up with its
    tokens: a prompt is a run of tokens like any other, so prefill chunks and decodes share a batch.

    A step that samples for a request gives it an output placeholder until the sampled id comes back, and
    the next schedule() counts placeholders as tokens: with async scheduling that next step is scheduled
    (and runs) before the previous step's ids are known, and the worker feeds them in itself.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 structured: StructuredOutputManager | None = None,
                 speculative: SpeculativeConfig | None = None, multimodal: MultiModalConfig | None = None,
                 connector: KVConnectorScheduler | None = None) -> None:
        self.config = config
        self.connector = connector
        self.loads = WaitingForKV(connector, kv_cache_manager) if connector is not None else None
        self.mm = EncoderScheduler(multimodal) if multimodal is not None else None
        self.spec = SpecDecodeState(speculative, config) if speculative is not None else None
        self.lookahead = speculative.num_lookahead_tokens if speculative is not None else 0
        self.kv = kv_cache_manager
        self.structured = structured
        self.grammar_waiters = GrammarWaiters(structured) if structured is not None else None
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self._sent_to_workers: set[str] = set()
        self._finished_ids: list[str] = []       # to drop from the workers' batch next step
        self.num_preemptions = 0
        self.grammar_errors: list[EngineCoreOutput] = []   # requests whose grammar failed, for the next outputs
        # id(SchedulerOutput) -> the Request objects it scheduled: an output is applied only to those, never
        # to a later request that reused the id of one aborted while the step ran.
        self._scheduled: dict[int, dict[str, Request]] = {}
        # Request id -> batches in flight that hold it (batch queue, pipeline parallelism): none is scheduled
        # again, nor preempted, until its batch is back.
        self._in_flight: Counter[str] = Counter()
        self._num_structured = 0
        self.on_lora_done: Callable[[int], None] | None = None     # a request with an adapter ended (LoRARegistry)

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request the core has checked (EngineCore.add_request: its id is not in `requests`)."""
        self.requests[request.request_id] = request
        if request.structured is not None:
            self._num_structured += 1
        if request.structured is not None and self.grammar_waiters is not None:
            self.grammar_waiters.add(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, error). Unknown or finished ids are ignored."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            self._unqueue(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def needs_each_output_before_scheduling(self) -> bool:
        """True while a request has structured outputs: its grammar must accept step N's token before step
        N+1's bitmask can be built, so async scheduling waits for each step's output then. With speculative
        decoding always: drafts come from the tokens step N accepts."""
        return self._num_structured > 0 or self.spec is not None

    def _unqueue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self.grammar_waiters.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.loads.remove(request)
        else:                            # waiting, or preempted while a step for it was in flight
            self.waiting.remove(request)

    def _free(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        self.kv.free(request)
        if self.mm is not None:
            self.mm.release_all(request)
        if request.lora_int_id and self.on_lora_done is not None:
            self.on_lora_done(request.lora_int_id)
        del self.requests[request.request_id]
        if request.structured is not None:
            self._num_structured -= 1
        if request.request_id in self._sent_to_workers:
            self._sent_to_workers.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        drafts: dict[str, list[int]] = {}
        preempted_any = False
        if self.grammar_waiters is not None:
            self._admit_compiled()
        if self.spec is not None:        # each request's drafts for this step, from the step cost model
            self.spec.plan(self.running, budget)
        if self.mm is not None:
            self.mm.begin_step()

        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = 0 if request.request_id in self._in_flight else self._num_new_tokens(request, budget)
            if self.mm is not None and num_new > 0:
                num_new = self.mm.fit(request, request.num_computed_tokens, num_new,
                                      self.config.enable_chunked_prefill)
            if num_new <= 0:
                idx += 1
                continue
            if num_new == 1 and self.spec is not None:
                if draft := self.spec.drafts_for(request, budget, sum(map(len, drafts.values()))):
                    drafts[request.request_id] = draft
                    num_new += len(draft)
            while (new_blocks := self.kv.allocate_slots(request, num_new,
                                                        num_lookahead_tokens=self.lookahead)) is None:
                victim = pick_victim(self.running, self._in_flight, self.config.policy)
                if victim is None:
                    break
                if self.running.index(victim) < idx:
                    idx -= 1
                drafts.pop(victim.request_id, None)
                if victim.request_id in num_scheduled:   # priority policy may pick one already scheduled
                    budget += num_scheduled.pop(victim.request_id)
                    self._unemit(victim, new_reqs, cached)
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                drafts.pop(request.request_id, None)
                break
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if self.mm is not None:
                self.mm.commit(request, request.num_computed_tokens, num_new)
            self._emit(request, num_new, [b.block_id for b in new_blocks], new_reqs, cached)
            idx += 1

        # Admit waiting requests only when nothing was preempted: otherwise the victim would be
        # admitted again at once and the two would thrash.
        loras = {r.lora_int_id for r in self.running} - {0}
        while (not preempted_any and budget > 0 and len(self.waiting)
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            if request.num_output_placeholders or request.request_id in self._in_flight:
                break                    # preempted with a step in flight: its ids come back first
            if request.lora_int_id and request.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                break                    # its adapter finds no slot: it waits, and no later request passes it
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            if (scheduled := self._admit(request, budget)) is None:
                break
            self.waiting.pop()
            if not scheduled:            # its KV loads first (WaitingForKV): no tokens for it this step
                continue
            new_block_ids, num_new = scheduled
            request.status = RequestStatus.RUNNING
            request.mark_scheduled()
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._emit(request, num_new, new_block_ids, new_reqs, cached)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=self._finished_ids, scheduled_spec_decode_tokens=drafts)
        if self.mm is not None:
            out.encoder_inputs, out.free_encoder_mm_hashes = self.mm.step_inputs, self.mm.take_freed()
        self._finished_ids = []
        sampling = self._advance(num_scheduled)
        out.num_draft_tokens_to_propose = self.spec.to_propose(self.running, sampling, drafts) if self.spec else {}
        if num_scheduled:                # a step with no tokens gets no output to match
            self._scheduled[id(out)] = {rid: self.requests[rid] for rid in num_scheduled}
            if self.config.batch_queue_size > 1:
                self._in_flight.update(num_scheduled.keys())
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out, self.requests, self.kv.get_block_ids)
        if self.structured is not None:
            out.grammar_bitmask = self.structured.grammar_bitmask(
                [(r.request_id, r.structured) for r in sampling if r.structured is not None], drafts)
        return out

    def _advance(self, num_scheduled: dict[str, int]) -> list[Request]:
        """Count this step's tokens as computed and give each request it samples for a placeholder (returned)."""
        sampling = []
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if self.mm is not None:
                self.mm.release_done(request)
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
                sampling.append(request)
        return sampling

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the waiting queue; failed compiles end with an error."""
        ready, failed = self.grammar_waiters.take_ready()
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.add(request)
        for request, error in failed:
            request.status = RequestStatus.FINISHED_ERROR
            self._free(request)
            self.grammar_errors.append(refused_output(request.request_id, error))

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        pending = request.num_output_placeholders
        if pending and (request.num_output_tokens + pending >= request.max_tokens
                        or request.num_tokens + pending >= self.config.max_model_len):
            return 0                     # the ids in flight already end it: another step would be thrown away
        num_new = request.num_tokens + pending - request.num_computed_tokens
        return 0 if not self.config.enable_chunked_prefill and num_new > budget else min(num_new, budget)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        if self.mm is not None:
            self.mm.release_all(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0  # resumes from the prefix cache, and a KV tier's copy (swap), or recomputes
        if self.connector is not None:
            self.connector.request_preempted(request)
        request.spec_token_ids = []      # proposed from KV the preemption dropped
        request.note_preempted()
        self.num_preemptions += 1
        if request.request_id in self._sent_to_workers:
            self._sent_to_workers.discard(request.request_id)
            self._finished_ids.append(request.request_id)
        self.waiting.add_preempted(request)
        logger.debug("preempted %s (%d tokens)", request.request_id, request.num_tokens)

    def _admit(self, request: Request, budget: int) -> tuple[list[int], int] | tuple[()] | None:
        """(new block ids, tokens) to schedule; () when its KV loads from the connector first; None: not now."""
        if self.kv.holds_blocks(request.request_id):     # its load is done: it holds the blocks it filled
            hit_blocks, num_hit = [], request.num_computed_tokens
        else:
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            hit_blocks, num_hit = self.kv.cut_hit(hit_blocks, self.mm.cut_hit(request, num_hit) if self.mm else num_hit)
            if self.loads is not None and self.loads.start(request, hit_blocks, num_hit):
                return ()
        num_new = request.num_tokens - num_hit
        if (request.whole_prompt or not self.config.enable_chunked_prefill) and num_new > budget:
            return None
        num_new = min(num_new, budget)
        if self.mm is not None:
            num_new = self.mm.fit(request, num_hit, num_new, self.config.enable_chunked_prefill
                                  and not request.whole_prompt)
            if num_new <= 0:
                return None
        fresh_hit = num_hit - request.num_computed_tokens     # a finished load's tokens already count as computed
        new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks, fresh_hit, self.lookahead)
        if new_blocks is None:
            return None
        if self.mm is not None:
            self.mm.commit(request, num_hit, num_new)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        return [b.block_id for b in new_blocks], num_new

    def _emit(self, request: Request, num_new: int, new_block_ids: list[int], new_reqs: list[NewRequestData],
              cached: CachedRequestData) -> None:
        rid = request.request_id
        if rid in self._sent_to_workers:
            cached.req_ids.append(rid)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if self.config.batch_queue_size > 1:       # no placeholders: the request is in no batch in flight
                start = request.num_computed_tokens
                cached.new_token_ids.append(request.all_token_ids[start:start + num_new])
            return
        self._sent_to_workers.add(rid)
        new_reqs.append(NewRequestData(
            req_id=rid, prompt_token_ids=request.prompt_token_ids, output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params, block_ids=self.kv.get_block_ids(rid),
            num_computed_tokens=request.num_computed_tokens, lora_int_id=request.lora_int_id,
            pooling_params=request.pooling_params, mm_features=request.mm_placements))

    def _unemit(self, request: Request, new_reqs: list[NewRequestData], cached: CachedRequestData) -> None:
        rid = request.request_id
        if self.mm is not None:
            self.mm.take_back(request)
        for i, data in enumerate(new_reqs):
            if data.req_id == rid:       # the workers never saw it: nothing for them to drop
                del new_reqs[i]
                self._sent_to_workers.discard(rid)
                return
        i = cached.req_ids.index(rid)
        for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            del column[i]
        if cached.new_token_ids:
            del cached.new_token_ids[i]

    # ---------------------------------------------------------------- results of a step

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        prompt_logprobs = result.prompt_logprobs or {}
        scheduled = self._scheduled.pop(id(sched), {})
        if self.loads is not None:
            for request in self.loads.finish(result.kv_connector_output):
                self.waiting.add_preempted(request)     # it was admitted before everything still waiting
        if self.config.batch_queue_size > 1:
            self._in_flight.subtract(scheduled.keys())
            self._in_flight = +self._in_flight       # drop the zero counts
        for i, rid in enumerate(result.req_ids):
            token = result.sampled_token_ids[i]
            request = self.requests.get(rid)
            if request is None or scheduled.get(rid, request) is not request:
                continue                 # finished (aborted, or stopped by the step before) while it ran
            if result.pooler_output is not None and result.pooler_output[i] is not None:
                outputs.append(self._finish_pooled(request, result.pooler_output[i]))
                continue
            if token >= 0:
                request.num_output_placeholders -= 1
            scored = request.take_prompt_logprobs(prompt_logprobs.get(rid))
            if token < 0 and scored is None:
                continue                 # a prefill chunk
            out = EngineCoreOutput(request_id=rid, new_token_ids=[], new_prompt_logprobs=scored,
                                   num_cached_tokens=max(request.num_cached_tokens, 0))
            request.stamp_timing(out)      # the first output of any kind carries the queue time
            if token < 0:
                outputs.append(out)
                continue
            status = RequestStatus.FINISHED_LENGTH_CAPPED    # max_tokens=0: the prompt only, nothing sampled
            if result.draft_token_ids is not None:
                request.spec_token_ids = result.draft_token_ids[i]
            if request.max_tokens > 0:
                tokens, entries = step_tokens(sched, result, i, request, token, self.spec)
                status = append_tokens(request, tokens, entries, out, self.config.max_model_len)
            if status is not None:
                self._unqueue(request)
                request.status = status
                out.finish_reason = status.finish_reason
                out.stop_reason = request.stop_reason
                self._free(request)
            outputs.append(out)
        if self.spec is not None:
            self.spec.maybe_log()
        return outputs

    def _finish_pooled(self, request: Request, pooled: bytes) -> EngineCoreOutput:
        """A pooling request's prompt is computed and pooled: it ends here, its blocks freed."""
        self._unqueue(request)
        request.status = RequestStatus.FINISHED_STOPPED
        request.num_output_placeholders = 0
        out = EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason="stop",
                               num_cached_tokens=max(request.num_cached_tokens, 0), pooling_output=pooled)
        request.stamp_timing(out)
        self._free(request)
        return out

    def make_stats(self) -> SchedulerStats:
        return scheduler_stats(self)
