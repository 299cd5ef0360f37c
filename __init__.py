"""pagedserve: an LLM serving engine with a paged KV cache and continuous batching."""
from pagedserve.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import pagedserve` does not pull torch into processes that only need messages.
    if name == "LLM":
        from pagedserve.frontend.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve.frontend import outputs
        return getattr(outputs, name)
    if name == "EngineArgs":
        from pagedserve.core.config import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
