"""CUDA graphs for decode-only steps: captured once at start-up for a ladder of batch sizes.

A step of n decodes replays the smallest captured size >= n; the extra rows are padding (slot -1,
empty context) that writes nothing. Mixed steps (any prefill chunk) run eagerly.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedserve.executor.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, then every 16: padding stays under ~20% past 64 rows."""
    ladder = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_num_seqs + 16, 16))
    sizes = sorted({min(s, max_num_seqs) for s in ladder})
    return sizes


class CudaGraphRunner:
    def __init__(self, model: nn.Module, buffers: StepBuffers, sizes: list[int]) -> None:
        self.model = model
        self.buffers = buffers
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):          # largest first: smaller graphs reuse its pool memory
            view = self.buffers.decode_view(size)
            # Warm up and capture on a harmless batch: one-token contexts, nothing written to the cache.
            view.meta.seq_lens.fill_(1)
            view.meta.slot_mapping.fill_(-1)
            torch.arange(size + 1, out=view.meta.query_start_loc)
            self.model(view.input_ids, view.positions, view.meta)     # compiles kernels outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(view.input_ids, view.positions, view.meta)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s, %.0f MiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
                    self.pool_bytes / (1 << 20))

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size that serves a decode-only step of num_seqs rows, or None (run eagerly)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.outputs[size]
