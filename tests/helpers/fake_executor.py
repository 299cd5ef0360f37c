"""An executor with no model, for the engine core's bookkeeping: a worker-like state per request, a
deterministic "model" (the next id is a function of the last id and its position), and outputs that come
back one step late when the core starts steps with execute_model_async.

It checks what a real worker relies on: every scheduled input id is one it already has (sampled by itself
in an earlier step, maybe one the core has not seen yet), and every position's KV is written in order."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput

EOS = 2


def next_token(last: int, position: int) -> int:
    """The fake model: never EOS (2) by itself; ids 3..502 of the tiny Llama's 512."""
    return (last * 7 + position * 13 + 5) % 500 + 3


@dataclass
class FakeState:
    token_ids: list[int]
    num_prompt: int
    num_computed: int
    kv: list[int] = field(default_factory=list)    # the input id written at each position


@dataclass
class FakeResult:
    """A started step; the log records when the core asks for its output."""
    step: int
    output: ModelRunnerOutput
    log: list[tuple[str, int]]

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self.log.append(("result", self.step))
        return self.output


class FakeExecutor:
    def __init__(self, config: EngineConfig, eos_at: dict[str, int] | None = None) -> None:
        self.config = config
        self.eos_at = eos_at or {}       # request id -> the output index at which the fake model samples EOS
        self.states: dict[str, FakeState] = {}
        self.log: list[tuple[str, int]] = []
        self.num_steps = 0
        self.sampled: dict[str, list[int]] = {}      # every id sampled, kept after the request is dropped
        self.dropped: list[str] = []

    def determine_num_blocks(self) -> int:
        return self.config.cache.num_blocks_override or 64

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def execute_model_async(self, sched: SchedulerOutput) -> FakeResult:
        self.num_steps += 1
        self.log.append(("start", self.num_steps))
        return FakeResult(self.num_steps, self._run(sched), self.log)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(sched).result()

    def _run(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for rid in sched.finished_req_ids:
            self.states.pop(rid)
            self.dropped.append(rid)
        for data in sched.scheduled_new_reqs:
            self.states[data.req_id] = FakeState(list(data.prompt_token_ids) + list(data.output_token_ids),
                                                 len(data.prompt_token_ids), data.num_computed_tokens,
                                                 kv=[-1] * data.num_computed_tokens)   # prefix-cache hits
        cached = sched.scheduled_cached_reqs
        for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.states[rid].num_computed = num_computed
        req_ids, sampled = [], []
        for rid, n in sched.num_scheduled_tokens.items():
            req_ids.append(rid)
            sampled.append(self._run_request(rid, self.states[rid], n))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _run_request(self, rid: str, state: FakeState, n: int) -> int:
        start = state.num_computed
        if start != len(state.kv):
            raise AssertionError(f"{rid}: step starts at position {start}, KV written up to {len(state.kv)}")
        if start + n > len(state.token_ids):
            raise AssertionError(f"{rid}: scheduled up to position {start + n}, the worker knows "
                                 f"{len(state.token_ids)} ids")
        state.kv.extend(state.token_ids[start:start + n])
        state.num_computed = start + n
        if state.num_computed < len(state.token_ids):
            return -1                                 # a prefill chunk
        num_out = len(state.token_ids) - state.num_prompt
        token = EOS if self.eos_at.get(rid) == num_out else next_token(state.token_ids[-1], state.num_computed)
        state.token_ids.append(token)
        self.sampled.setdefault(rid, []).append(token)
        return token


def expected_tokens(prompt: list[int], max_tokens: int, eos_at: int | None = None) -> list[int]:
    """What the fake model generates for a prompt, computed directly."""
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        token = EOS if eos_at == len(out) else next_token(ids[-1], len(ids))
        ids.append(token)
        out.append(token)
        if token == EOS:
            break
    return out
