"""Beam search over AsyncEngineClient (the server's): each step's beams are engine requests streamed
together; cancelling the search (a client that left, an error) aborts the step's requests still running."""
from __future__ import annotations

import asyncio
import itertools

from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.beam_search.search import (BeamSearch, StepLogprobs, arun_beam_search, output_text_ids,
                                             step_logprobs, step_sampling_params)
from pagedserve.frontend.client.input_processor import PreparedRequest, ProcessedPrompt
from pagedserve.frontend.client.outputs import CompletionOutput, RequestOutput


async def beam_search_outputs(engine: AsyncEngineClient, request_id: str, prompts: list[ProcessedPrompt],
                              params: BeamSearchParams, priority: int = 0, lora_int_id: int = 0
                              ) -> list[RequestOutput]:
    """One finished RequestOutput per prompt, its outputs the beams best first (index 0 the best)."""
    info = engine.info
    searches = [BeamSearch(p.prompt_token_ids, params, info.eos_token_ids, info.max_model_len) for p in prompts]
    step_params = step_sampling_params(params, len(info.eos_token_ids))
    ids = itertools.count()

    async def step(batch: list[list[int]]) -> list[StepLogprobs]:
        jobs = [engine.prepare(ProcessedPrompt(None, tokens), step_params, f"{request_id}-beam{next(ids)}",
                               priority, lora_int_id) for tokens in batch]
        return await _run_together(engine, jobs)

    await arun_beam_search(searches, step)
    return [await _request_output(engine, request_id, prompt, search, params)
            for prompt, search in zip(prompts, searches)]


async def _run_together(engine: AsyncEngineClient, jobs: list[PreparedRequest]) -> list[StepLogprobs]:
    """Run one step's requests at once; any failing or this being cancelled cancels the others, whose
    streams abort their engine requests as they unwind."""
    async def final(job: PreparedRequest) -> StepLogprobs:
        stream = engine.stream(job)
        try:
            async for out in stream:
                if out.finished:
                    return step_logprobs(out)
            raise RuntimeError(f"beam search step {job.request_id} ended without a final output")
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(final(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _request_output(engine: AsyncEngineClient, request_id: str, prompt: ProcessedPrompt, search: BeamSearch,
                          params: BeamSearchParams) -> RequestOutput:
    outputs = []
    for i, seq in enumerate(search.result()):
        text = await engine.detokenize(output_text_ids(seq, params.include_stop_str_in_output))
        outputs.append(CompletionOutput(index=i, text=text, token_ids=seq.output_token_ids,
                                        cumulative_logprob=seq.cum_logprob, finish_reason=seq.finish_reason,
                                        stop_reason=seq.stop_reason))
    return RequestOutput(request_id=request_id, prompt=prompt.prompt, prompt_token_ids=prompt.prompt_token_ids,
                         outputs=outputs, finished=True)
