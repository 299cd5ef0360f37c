"""A process group of its own between a trainer and the engine's worker ranks, for pushing new weights.

torch's default process group already joins the worker ranks (tensor parallelism) and cannot take in a
trainer; this one is built from a TCPStore and a backend's process group directly (the shape of vLLM's
StatelessProcessGroup in its RLHF examples): the trainer is rank 0 and hosts the store, worker rank r joins as
rank_offset + r. gloo on CPU, NCCL on CUDA. The trainer builds the same object with
`WeightSyncGroup(host, port, 0, world_size, device)`.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_PREFIX = "pagedserve-weight-sync"


class WeightSyncGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device | str = "cpu",
                 timeout_s: float = 300.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"weight sync group: rank {rank} is outside world_size {world_size}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        store = dist.PrefixStore(_PREFIX, self.store)
        if self.device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """tensor from rank src into every rank's tensor of the same shape and dtype (in place)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, device=self.device))
