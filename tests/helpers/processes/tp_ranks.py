"""Run a function on N gloo ranks, each its own spawned process, and insist that every rank finished."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from pagedserve.tests.helpers.processes.server import free_port

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


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, init_method: str) -> Iterator[None]:
    """Run the block as one rank of a gloo group. If it raises, the group is torn down and the exception
    propagates (the rank exits non-zero). If it completes, the ranks meet at a barrier and the process ends
    there, without gloo's teardown: a rank that tears its group down while its peer still uses the pair
    sockets can abort in gloo's destructor ("terminate called without an active exception"), which a barrier
    before the teardown did not prevent (seen in full suite runs on a loaded machine)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init_method, world_size=world, rank=rank)
    try:
        yield
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)
