"""pagedserve: an LLM serving engine with a paged KV cache and continuous batching."""
from pagedserve.core.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngineClient", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs",
           "EngineDeadError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import pagedserve` does not pull torch into processes that only need messages.
    if name == "LLM":
        from pagedserve.frontend.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve.frontend import outputs
        return getattr(outputs, name)
    if name == "AsyncEngineClient":
        from pagedserve.frontend.async_client import AsyncEngineClient
        return AsyncEngineClient
    if name == "EngineDeadError":
        from pagedserve.frontend.core_client import EngineDeadError
        return EngineDeadError
    if name == "EngineArgs":
        from pagedserve.core.config import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
