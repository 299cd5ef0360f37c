"""A launched step and the output it will have: async scheduling on the device.

On a GPU a step's sampled ids stay on the device: the next step, launched before they reach the host, reads
them from there (step_buffers.apply_pending), and the host gets them through one non-blocking copy into
pinned memory, waited for only when the step's output is taken (`result`). The host's work for step N+1
(input prep, launches, metadata) then overlaps the device's run of step N, with no `.tolist()` between
them. On a CPU the same objects are used; the copy is the sampled tensor itself and there is nothing to
wait for.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.sample.sampling_metadata import SamplerOutput
from pagedserve.ipc.messages import KVConnectorOutput, LogprobsEntry, ModelRunnerOutput, PromptLogprobsChunk


class PinnedPool:
    """Reused page-locked buffers for the sampled ids (allocating pinned memory costs more than a step)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.pinned = device.type == "cuda"
        self._free: list[torch.Tensor] = []

    def take(self, n: int) -> torch.Tensor:
        if n > self.size or not self._free:
            return torch.empty(max(n, self.size), dtype=torch.int64, pin_memory=self.pinned)
        return self._free.pop()

    def give(self, buf: torch.Tensor) -> None:
        if len(buf) == self.size:
            self._free.append(buf)


@dataclass
class _Sampled:
    rows: list[int]                        # batch row of each sampled id
    states: list[CachedRequestState]
    indices: list[int]                     # the id's index in its state's token_ids
    device_ids: torch.Tensor               # [len(rows)] on the device: what the next step's inputs read
    host_ids: torch.Tensor                 # its host copy (pinned on CUDA; written when the event fires)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # host copies: ids, logprobs, ranks


class PendingStep:
    """result() is the step's ModelRunnerOutput; every request state's pending id from it is filled then.
    Safe to call from another thread than the one launching the next step: `lock` (the runner's) guards
    the request states."""

    def __init__(self, req_ids: list[str], lock: threading.RLock, pool: PinnedPool | None = None,
                 prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None) -> None:
        self.req_ids = req_ids
        self._lock = lock
        self._pool = pool
        self._prompt_logprobs = prompt_logprobs
        self._sampled: _Sampled | None = None
        self._event: torch.cuda.Event | None = None
        self._pinned: torch.Tensor | None = None      # the pool buffer host_ids is a view of
        self._output: ModelRunnerOutput | None = None
        self.kv_connector_output: KVConnectorOutput | None = None     # the KV connector's report, if any
        self.forward_time: float | None = None      # SchedulerOutput.time_forward: seconds of the forward

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> "PendingStep":
        step = cls(output.req_ids, threading.RLock())
        step._output = output
        return step

    def record(self, rows: list[int], states: list[CachedRequestState], out: SamplerOutput) -> None:
        """Start the copies of what the rows sampled and add each id to its request, pending (under the
        runner's lock, which the caller holds)."""
        ids = out.sampled_token_ids
        logprobs = None
        if out.logprobs is not None:
            logprobs = tuple(_to_host(t) for t in (out.logprob_token_ids, out.logprobs, out.sampled_ranks))
        if ids.device.type == "cuda":
            if self._pool is not None:
                self._pinned = self._pool.take(len(rows))
                host = self._pinned[:len(rows)]
                host.copy_(ids, non_blocking=True)
            else:
                host = _to_host(ids)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            host = ids
        indices = [len(state.token_ids) for state in states]
        self._sampled = _Sampled(rows, states, indices, ids, host, logprobs)
        for k, state in enumerate(states):
            state.append_pending(self, k)

    def device_ids(self) -> torch.Tensor:
        assert self._sampled is not None
        return self._sampled.device_ids

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()      # outside the lock: the next step's launch goes on meanwhile
            with self._lock:
                if self._output is None:
                    self._output = self._build()
        if self.kv_connector_output is not None:
            self._output.kv_connector_output = self.kv_connector_output
        if self.forward_time is not None:
            self._output.forward_time = self.forward_time
        return self._output

    def _build(self) -> ModelRunnerOutput:
        sampled_ids = [-1] * len(self.req_ids)
        logprobs = None
        s = self._sampled
        if s is not None:
            tokens = s.host_ids.tolist()
            for row, state, index, token in zip(s.rows, s.states, s.indices, tokens):
                sampled_ids[row] = token
                if state.pending.get(index, (None,))[0] is self:
                    state.fill(index, token)
            if s.logprobs is not None:
                logprobs = _logprobs_entries(s.logprobs, s.states, s.rows, len(self.req_ids))
            if self._pool is not None and self._pinned is not None:
                self._pool.give(self._pinned)
                self._pinned = None
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled_ids, logprobs=logprobs,
                                 prompt_logprobs=self._prompt_logprobs)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _logprobs_entries(tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], states: list[CachedRequestState],
                      rows: list[int], num_rows: int) -> list[LogprobsEntry | None]:
    entries: list[LogprobsEntry | None] = [None] * num_rows
    ids, lps, ranks = (t.tolist() for t in tensors)
    for k, (row, state) in enumerate(zip(rows, states)):
        wanted = state.sampling_params.logprobs
        if wanted is not None:
            entries[row] = LogprobsEntry(token_ids=ids[k][:wanted + 1], logprobs=lps[k][:wanted + 1],
                                         sampled_rank=ranks[k])
    return entries
