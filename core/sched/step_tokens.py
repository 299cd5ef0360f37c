"""A step's new tokens for one request: accepted drafts, then the sampled token, appended up to a stop."""
from __future__ import annotations

from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.spec_decode.state import SpecDecodeState
from pagedserve.ipc.messages import EngineCoreOutput, LogprobsEntry, ModelRunnerOutput, SchedulerOutput


def step_tokens(sched: SchedulerOutput, result: ModelRunnerOutput, i: int, request: Request, token: int,
                spec: SpecDecodeState | None) -> tuple[list[int], list[LogprobsEntry | None]]:
    """Row i's new tokens (accepted drafts, then the sampled one) and their logprobs entries. Rejected
    drafts' KV slots are given back: num_computed_tokens counted them, the next step overwrites them."""
    entry = result.logprobs[i] if result.logprobs is not None else None
    scheduled = sched.scheduled_spec_decode_tokens.get(request.request_id)
    if not scheduled:
        return [token], [entry]
    accepted = result.spec_token_ids[i] if result.spec_token_ids is not None else []
    request.num_computed_tokens -= len(scheduled) - len(accepted)
    spec.record(request, len(scheduled), len(accepted))
    spec_entries = result.spec_logprobs[i] if result.spec_logprobs is not None else None
    return [*accepted, token], [*(spec_entries or [None] * len(accepted)), entry]


def append_tokens(request: Request, tokens: list[int], entries: list[LogprobsEntry | None],
                  out: EngineCoreOutput, max_model_len: int) -> RequestStatus | None:
    """Append one step's tokens up to the first that ends the request (tokens past a stop are never
    emitted); fills the output's ids and logprobs. Returns the finished status, or None."""
    status = None
    for n, token in enumerate(tokens, 1):
        request.append_output_token(token)
        status = request.check_stop(max_model_len)
        if (request.structured is not None and request.structured.accept(token, request.output_token_ids)
                and status is None):
            status = RequestStatus.FINISHED_STOPPED      # the grammar is complete
        if status is not None:
            break
    out.new_token_ids = tokens[:n]
    kept = entries[:n]
    out.new_logprobs = kept if all(e is not None for e in kept) else None
    return status
