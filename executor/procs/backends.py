"""The executor class for a distributed_executor_backend name.

Whoever builds an EngineCore asks here and injects the class: the core never imports the executor.
Each class module is imported only when chosen, and none of them imports torch at import time, so a
process that only launches an engine core (the API server) stays free of torch.
"""
from __future__ import annotations

from pagedserve.common.config.engine_args import EXECUTOR_BACKENDS
from pagedserve.executor.procs.executor import Executor


def get_executor_class(backend: str) -> type[Executor]:
    if backend == "uni":
        from pagedserve.executor.procs.uniproc_executor import UniProcExecutor
        return UniProcExecutor
    if backend == "mp":
        from pagedserve.executor.procs.multiproc_executor import MultiProcExecutor
        return MultiProcExecutor
    if backend == "torchrun":
        from pagedserve.executor.procs.torchrun_executor import TorchrunExecutor
        return TorchrunExecutor
    if backend == "ray":
        from pagedserve.executor.procs.ray_executor import RayDistributedExecutor
        return RayDistributedExecutor
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got {backend!r}")
