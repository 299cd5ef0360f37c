"""Pooling requests at the engine core's door: the checks a pooling (or generate) request meets against the
runner the model has, and the Request the scheduler runs for it (its prompt only: max_tokens 0)."""
from __future__ import annotations

from typing import Any

from pagedserve.common.config.engine_config import EngineConfig
from pagedserve.common.params.pooling_params import check_generation_allowed, check_pooling_request, check_pooling_task
from pagedserve.ipc.messages import EngineCoreRequest


def max_whole_prompt(config: EngineConfig) -> int | None:
    """The longest prompt a pooler that needs the whole prompt in one step can take; None when chunked."""
    if config.pooler is None or not config.pooler.whole_prompt:
        return None
    return min(config.scheduler.max_num_batched_tokens, config.model.max_model_len)


def check_runner(req: EngineCoreRequest, config: EngineConfig) -> None:
    """A generate request on a pooling model, or a pooling request on a generating one, is refused (as vLLM)."""
    info = pooling_info(config)
    if req.pooling_params is None:
        check_generation_allowed(info.get("pooling_tasks", []))
        return
    check_pooling_task(req.pooling_params, info.get("pooling_tasks", []), info.get("is_matryoshka", False),
                       info.get("matryoshka_dimensions"))
    check_pooling_request(req.prompt_token_ids, req.pooling_params, config.model.max_model_len,
                          config.model.vocab_size, max_whole_prompt(config))


def pooling_info(config: EngineConfig) -> dict[str, Any]:
    """The EngineInfo fields a frontend checks pooling requests by."""
    pooler = config.pooler
    if pooler is None:
        return {}
    dims = pooler.matryoshka_dimensions
    return {"pooling_tasks": list(pooler.tasks), "is_matryoshka": pooler.is_matryoshka,
            "matryoshka_dimensions": list(dims) if dims is not None else None,
            "max_whole_prompt": max_whole_prompt(config)}
