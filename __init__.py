"""pagedserve: an LLM serving engine with a paged KV cache and continuous batching."""
from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.common.lora import LoRARequest
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.common.params.structured_outputs import StructuredOutputsParams
from pagedserve.common.version import __version__

__all__ = ["LLM", "AsyncEngineClient", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "EngineArgs", "EngineDeadError", "LoRARequest", "BeamSearchParams"]


def __getattr__(name: str):
    # Lazy so that `import pagedserve` does not pull torch into processes that only need messages.
    if name == "LLM":
        from pagedserve.frontend.offline.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve.frontend.client import outputs
        return getattr(outputs, name)
    if name == "AsyncEngineClient":
        from pagedserve.frontend.client.async_client import AsyncEngineClient
        return AsyncEngineClient
    if name == "EngineDeadError":
        from pagedserve.frontend.client.core_client import EngineDeadError
        return EngineDeadError
    if name == "EngineArgs":
        from pagedserve.common.config.engine_args import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
