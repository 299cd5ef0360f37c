"""Run a function on N gloo ranks, each its own spawned process, and insist that every rank finished."""
from __future__ import annotations

from collections.abc import Callable

from pagedserve.tests.helpers.server import free_port

TP_TIMEOUT_S = 180


def run_ranks(target: Callable[..., None], args: tuple, world: int = 2, timeout_s: float = TP_TIMEOUT_S) -> None:
    """target(rank, world, init_method, *args) on `world` processes; a rank that hangs is killed, and a rank
    that failed or hung fails the calling test."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(rank, world, init, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert [p.exitcode for p in procs] == [0] * world, "a TP worker failed or timed out"
