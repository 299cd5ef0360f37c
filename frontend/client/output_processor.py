"""Turn engine-core outputs (token ids) into RequestOutputs (text, logprobs, stop strings, n > 1)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.frontend.client.detokenizer import IncrementalDetokenizer
from pagedserve.frontend.client.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.ipc.messages import EngineCoreEvent, EngineCoreOutput, LogprobsEntry


@dataclass
class _Sequence:
    """One engine request: a whole user request, or one of its n samples."""
    parent: "_Parent"
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0          # for delta outputs
    sent_logprobs: int = 0
    sent_finish: bool = False     # delta outputs report a finish once, not in every later output of the parent
    last_token_time: float | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: list[_Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    queue_time: float | None = None           # measured by the engine core, sent with the first token
    events: list[EngineCoreEvent] = field(default_factory=list)     # its samples' scheduling moments
    # Traced model times (EngineCoreOutput.model_*_time), the most over its samples: they run in the same steps.
    model_times: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None
    error_field: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False      # delta outputs carry them once, when complete
    pooling_output: bytes | None = None     # a pooling request's pooled vector (float32 bytes)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]      # engine request ids that hit a stop string: the core must drop them
    # Seconds between consecutive output tokens of a sequence, one per token after its first (metrics).
    inter_token_latencies: list[float] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._seqs: dict[str, _Sequence] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_ids: list[str], params: list[SamplingParams]) -> None:
        parent = _Parent(request_id, prompt, prompt_token_ids, params[0].output_kind)
        if params[0].prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, (cid, p) in enumerate(zip(child_ids, params)):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, list(p.stop or ()),
                                           p.include_stop_str_in_output, p.skip_special_tokens)
            seq = _Sequence(parent, index, p, detok, logprobs=[] if p.logprobs is not None else None,
                            cumulative_logprob=0.0 if p.logprobs is not None else None)
            parent.children.append(seq)
            self._seqs[cid] = seq

    def num_unfinished(self) -> int:
        return len(self._seqs)

    def unfinished_ids(self) -> list[str]:
        return list(self._seqs)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[int, _Parent] = {}
        to_abort: list[str] = []
        intervals: list[float] = []
        now = time.time()
        for out in outputs:
            seq = self._seqs.get(out.request_id)
            if seq is None:
                continue                       # already finished here (e.g. stop string), core caught up
            parent = seq.parent
            if parent.first_token_time is None and out.new_token_ids:
                parent.first_token_time = now
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.queue_time is not None and parent.queue_time is None:
                parent.queue_time = out.queue_time
            if out.events:
                parent.events.extend(out.events)
            if out.model_execute_time is not None:
                for name, value in (("model_forward_time", out.model_forward_time),
                                    ("model_execute_time", out.model_execute_time)):
                    parent.model_times[name] = max(parent.model_times.get(name, 0.0), value or 0.0)
            if out.pooling_output is not None:
                parent.pooling_output = out.pooling_output
            if out.new_token_ids:
                _add_intervals(intervals, seq, len(out.new_token_ids), now)
            self._update_sequence(seq, out)
            if seq.detok.stop_hit is not None and out.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_hit
                to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                if out.error:
                    parent.error, parent.error_kind, parent.error_field = out.error, out.error_kind, out.error_field
            if seq.finish_reason is not None:
                del self._seqs[out.request_id]
            touched[id(parent)] = parent
        results = [r for p in touched.values() if (r := self._make_output(p, now)) is not None]
        return ProcessedOutputs(results, to_abort, intervals)

    def _update_sequence(self, seq: _Sequence, out: EngineCoreOutput) -> None:
        taken = seq.detok.add_tokens(out.new_token_ids)
        seq.token_ids.extend(out.new_token_ids[:taken])
        if seq.parent.prompt_logprobs is not None and out.new_prompt_logprobs:
            seq.parent.prompt_logprobs.extend(self._logprob_dict(seq.detok, e) for e in out.new_prompt_logprobs)
        if seq.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs[:taken]:
                seq.logprobs.append(self._logprob_dict(seq.detok, entry))
                seq.cumulative_logprob += entry.logprobs[0]

    @staticmethod
    def _logprob_dict(detok: IncrementalDetokenizer, entry: LogprobsEntry) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for rank, (tid, lp) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if tid not in result:
                result[tid] = Logprob(lp, entry.sampled_rank if rank == 0 else rank, detok.decode_token(tid))
        return result

    def _make_output(self, parent: _Parent, now: float) -> RequestOutput | None:
        finished = parent.finished
        # An error goes out at once, even before the other samples of an n > 1 request end:
        # the caller fails fast and its abort frees the siblings.
        if parent.kind == RequestOutputKind.FINAL_ONLY and not finished and parent.error is None:
            return None
        delta = parent.kind == RequestOutputKind.DELTA
        if delta:
            fresh = [c for c in parent.children if not c.sent_finish]
            completions = [self._completion(c, delta) for c in fresh]
            completions = [c for c in completions if c.text or c.token_ids or c.finish_reason]
            for seq in fresh:
                seq.sent_finish = seq.finish_reason is not None
        else:
            completions = [self._completion(c, delta) for c in parent.children]
        metrics = {"arrival_time": parent.arrival_time, "last_token_time": now,
                   "num_generation_tokens": float(sum(len(c.token_ids) for c in parent.children))}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        if parent.queue_time is not None:
            metrics["queue_time"] = parent.queue_time
        if finished:
            metrics.update(parent.model_times)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, finished,
                             parent.num_cached_tokens, metrics, parent.error, parent.error_kind,
                             self._prompt_logprobs(parent, delta), parent.error_field, parent.pooling_output,
                             parent.events if finished else [])

    @staticmethod
    def _prompt_logprobs(parent: _Parent, delta: bool) -> list[dict[int, Logprob] | None] | None:
        """All of them so far; in delta mode only once, in the first output after the prompt is scored."""
        scored = parent.prompt_logprobs
        if scored is None or (delta and (parent.sent_prompt_logprobs or len(scored) < len(parent.prompt_token_ids))):
            return None
        parent.sent_prompt_logprobs = True
        return list(scored)

    @staticmethod
    def _completion(seq: _Sequence, delta: bool) -> CompletionOutput:
        finished = seq.finish_reason is not None
        text = seq.detok.delta(finished)
        if not delta:
            text = seq.detok.text[:seq.detok.emitted]
        token_ids = seq.token_ids[seq.sent_tokens:] if delta else list(seq.token_ids)
        logprobs = seq.logprobs
        if delta and logprobs is not None:
            logprobs = logprobs[seq.sent_logprobs:]
            seq.sent_logprobs = len(seq.logprobs or [])
        if delta:
            seq.sent_tokens = len(seq.token_ids)
        return CompletionOutput(seq.index, text, token_ids, seq.cumulative_logprob,
                                list(logprobs) if logprobs is not None else None,
                                seq.finish_reason, seq.stop_reason)

    def abort_request(self, child_ids: list[str]) -> None:
        for cid in child_ids:
            self._seqs.pop(cid, None)


def _add_intervals(intervals: list[float], seq: _Sequence, num_new: int, now: float) -> None:
    """The gaps before each of a sequence's num_new tokens that arrived at `now`, but its very first: tokens
    that arrive together share the gap since the previous arrival."""
    if seq.last_token_time is None:
        intervals.extend([0.0] * (num_new - 1))
    else:
        gap = max(0.0, now - seq.last_token_time) / num_new
        intervals.extend([gap] * num_new)
    seq.last_token_time = now
