"""A draft model runs its proposal passes only where the core will use them (SchedulerOutput.
num_draft_tokens_to_propose): with step costs that make drafts never pay, the draft runs the steps' own tokens
(its cache must hold them) and no proposal pass at all; with costs that make them pay, it proposes and its drafts
are accepted. The greedy output is the output without drafts either way."""
from __future__ import annotations

from pagedserve import SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.uniproc_executor import UniProcExecutor
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.spec_costs import FixedStepCosts

PROMPTS = [[11, 12, 13, 14, 15] * 4, [40, 41, 42] * 5]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _core(model: str, spec: dict | None) -> EngineCore:
    return EngineCore.from_engine_args(EngineArgs(model=model, dtype="float32", max_model_len=128,
                                                  enable_prefix_caching=False, speculative_config=spec),
                                       UniProcExecutor)


def _generate(core: EngineCore) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, PARAMS, arrival_time=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


def _count_forwards(module, calls: list[int]) -> None:
    module.register_forward_hook(lambda mod, args, out: calls.append(len(args[0])))


def test_the_draft_model_proposes_only_where_the_core_will_verify(tiny_llama_dir):
    plain = _core(tiny_llama_dir, None)
    want = _generate(plain)
    plain.shutdown()
    core = _core(tiny_llama_dir, {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3})
    runner = core.executor.worker.runner
    assert runner.decode_step is None and runner.drafter.decode_step is None    # every pass is a forward call
    model_calls: list[int] = []
    draft_calls: list[int] = []
    _count_forwards(runner.model, model_calls)
    _count_forwards(runner.drafter.model, draft_calls)
    spec = core.scheduler.spec
    spec.cost = FixedStepCosts(per_row=1000.0)      # a verify row costs a whole step: no draft pays, nor a probe
    never = _generate(core)
    # the draft ran each step's tokens beside the model, and nothing else
    assert draft_calls == model_calls and len(model_calls) > 10 and spec.num_drafts == 0
    del model_calls[:], draft_calls[:]
    spec.cost = FixedStepCosts()                    # a verify row is free: drafts pay
    paying = _generate(core)
    core.shutdown()
    assert len(draft_calls) > len(model_calls) and 1 in draft_calls            # one-token proposal passes
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 20               # the model drafting for itself
    assert never == want and paying == want
