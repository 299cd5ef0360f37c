"""core/tracing/model_times.py: a traced request gets the sums of the steps it was in, and only those; a
request finished any way (stopped, aborted) is forgotten; untraced requests cost nothing and get nothing."""
from __future__ import annotations

from pagedserve.core.tracing.model_times import ModelTimes
from pagedserve.ipc.messages import CachedRequestData, EngineCoreOutput, SchedulerOutput


def step(*req_ids: str) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens={r: 1 for r in req_ids}, total_num_scheduled_tokens=len(req_ids),
                           finished_req_ids=[])


def test_sums_over_the_steps_a_traced_request_was_in():
    times = ModelTimes()
    assert not times and not times.wanted(step("a"))
    times.track("a")
    times.track("b")
    assert times.wanted(step("a", "x")) and not times.wanted(step("x"))
    times.add_step(step("a", "b", "x"), execute_s=0.5, forward_s=0.25)
    times.add_step(step("a"), execute_s=1.0, forward_s=None)      # a rank that did not time its forward
    times.add_step(step("x"), execute_s=9.0, forward_s=9.0)       # a step without them
    outs = [EngineCoreOutput("a", [7], finish_reason="length"), EngineCoreOutput("b", [7]),
            EngineCoreOutput("x", [7], finish_reason="stop")]
    times.attach(outs)
    assert (outs[0].model_forward_time, outs[0].model_execute_time) == (0.25, 1.5)
    assert outs[1].model_execute_time is None and outs[2].model_execute_time is None    # unfinished; untraced
    assert times                                                   # b is still running
    aborted = [EngineCoreOutput("b", [], finish_reason="abort")]
    times.attach(aborted)
    assert aborted[0].model_execute_time == 0.5 and not times
