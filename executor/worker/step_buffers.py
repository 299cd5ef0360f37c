"""Persistent per-step input tensors.

On CUDA every step's inputs go numpy -> pinned host tensor -> fixed device tensor with non-blocking
copies; the device tensors keep their addresses for the whole run, which is what CUDA graphs replay
against. The pinned tensors come in two sets used in turn: with async scheduling the host fills step N+1's
while step N's copies may still be queued. On CPU the numpy arrays are wrapped as they are (no copy at all).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.kernels.attention.interface import AttentionMetadataBuilder
from pagedserve.kernels.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.executor.worker.step_output import PendingStep

_SPECS = {   # name -> (dtype, shape kind): "tok" = per token, "seq" = per sequence, "seq1" = num_seqs + 1
    "input_ids": (torch.int64, "tok"), "positions": (torch.int64, "tok"), "slot_mapping": (torch.int64, "tok"),
    "query_start_loc": (torch.int32, "seq1"), "seq_lens": (torch.int32, "seq"), "logits_indices": (torch.int64, "seq"),
}


@dataclass
class HostBatch:
    """One step's inputs as numpy arrays, built by input_prep; rows are sequences, decodes first."""
    req_ids: list[str]
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray          # [num_seqs, width]
    logits_indices: np.ndarray
    sample_rows: list[int]
    num_decodes: int
    # (token index, launched step, its row): input ids the previous step sampled, still on the device
    pending_inputs: list[tuple[int, "PendingStep", int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.req_ids)


@dataclass
class PreparedBatch:
    req_ids: list[str]                 # row order of the batch: decodes first
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor       # token index whose hidden state feeds each sampled row
    sample_rows: list[int]             # batch rows that sample this step (caught up with their tokens)


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 builder: AttentionMetadataBuilder) -> None:
        self.device = device
        self.builder = builder
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks_per_seq
        self.dev: dict[str, torch.Tensor] = {}
        self._hosts: list[dict[str, torch.Tensor]] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]   # each set's copies, once queued
        self._turn = 0
        if device.type == "cpu":
            return
        sizes = {"tok": max_tokens, "seq": max_seqs, "seq1": max_seqs + 1}
        for name, (dtype, kind) in _SPECS.items():
            self.dev[name] = torch.zeros(sizes[kind], dtype=dtype, device=device)
        self.dev["block_tables"] = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._hosts = [{name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=True) for name, t in self.dev.items()}
                       for _ in range(2)]

    def commit(self, batch: HostBatch, pad_to: int | None = None) -> PreparedBatch:
        """Device tensors for this step. pad_to (decode-only steps): pad to that many one-token rows,
        whose slot is -1 (never written) and whose context is empty, so a captured graph can run them."""
        if self.device.type == "cpu":
            arrays = {name: torch.from_numpy(np.ascontiguousarray(getattr(batch, name))).to(dtype)
                      for name, (dtype, _) in _SPECS.items()}
            arrays["block_tables"] = torch.from_numpy(batch.block_tables).to(torch.int32)
            return self._prepared(batch, arrays, batch.num_seqs, int(batch.query_start_loc[-1]))
        self._check_fits(batch, pad_to)
        n, tokens = batch.num_seqs, int(batch.query_start_loc[-1])
        seqs, total = (pad_to, pad_to) if pad_to else (n, tokens)
        pinned = self._hosts[self._turn]
        if (copied := self._copied[self._turn]) is not None:
            copied.synchronize()        # the device has read this set (two steps ago): it may be rewritten
        host = {name: t.numpy() for name, t in pinned.items()}
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices"):
            host[name][:len(getattr(batch, name))] = getattr(batch, name)
        host["query_start_loc"][:n + 1] = batch.query_start_loc
        host["block_tables"][:n, :batch.block_tables.shape[1]] = batch.block_tables
        if pad_to:
            host["input_ids"][tokens:total] = 0
            host["positions"][tokens:total] = 0
            host["slot_mapping"][tokens:total] = -1
            host["seq_lens"][n:seqs] = 0
            host["query_start_loc"][n + 1:seqs + 1] = np.arange(tokens + 1, total + 1)
        sizes = {"tok": total, "seq": seqs, "seq1": seqs + 1}
        arrays = {}
        for name, (_, kind) in _SPECS.items():
            count = len(batch.logits_indices) if name == "logits_indices" else sizes[kind]
            arrays[name] = self.dev[name][:count]
            arrays[name].copy_(pinned[name][:count], non_blocking=True)
        arrays["block_tables"] = self.dev["block_tables"][:seqs]
        arrays["block_tables"].copy_(pinned["block_tables"][:seqs], non_blocking=True)
        self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        self._turn ^= 1
        return self._prepared(batch, arrays, seqs, total)

    @staticmethod
    def apply_pending(input_ids: torch.Tensor, pending: list[tuple[int, "PendingStep", int]]) -> None:
        """Write the input ids that earlier steps sampled and the host does not have yet, device to device
        (queued after this step's input copy, before its forward)."""
        by_step: dict[int, tuple["PendingStep", list[int], list[int]]] = {}
        for dst, step, k in pending:
            entry = by_step.setdefault(id(step), (step, [], []))
            entry[1].append(dst)
            entry[2].append(k)
        for step, dsts, ks in by_step.values():
            source = step.device_ids()
            index = torch.tensor(dsts, dtype=torch.int64).to(input_ids.device, non_blocking=True)
            input_ids[index] = source[torch.tensor(ks, dtype=torch.int64).to(source.device, non_blocking=True)]

    def decode_view(self, num_seqs: int) -> PreparedBatch:
        """The fixed device tensors of a decode-only step of num_seqs rows (what a CUDA graph captures)."""
        arrays = {name: self.dev[name][:num_seqs + 1 if name == "query_start_loc" else num_seqs]
                  for name in list(_SPECS) + ["block_tables"]}
        meta = self.builder.build(
            slot_mapping=arrays["slot_mapping"], query_start_loc=arrays["query_start_loc"],
            seq_lens=arrays["seq_lens"], block_tables=arrays["block_tables"], num_decodes=num_seqs,
            max_query_len=1, max_seq_len=0, query_start_loc_cpu=[], seq_lens_cpu=[])
        return PreparedBatch(req_ids=[], input_ids=arrays["input_ids"], positions=arrays["positions"], meta=meta,
                             logits_indices=arrays["logits_indices"], sample_rows=[])

    def _prepared(self, batch: HostBatch, arrays: dict[str, torch.Tensor], seqs: int, tokens: int) -> PreparedBatch:
        counts = np.diff(batch.query_start_loc)
        meta = self.builder.build(
            slot_mapping=arrays["slot_mapping"], query_start_loc=arrays["query_start_loc"],
            seq_lens=arrays["seq_lens"], block_tables=arrays["block_tables"],
            num_decodes=batch.num_decodes + (seqs - batch.num_seqs),
            max_query_len=int(counts.max()) if len(counts) else 0, max_seq_len=int(batch.seq_lens.max()),
            query_start_loc_cpu=batch.query_start_loc.tolist(), seq_lens_cpu=batch.seq_lens.tolist())
        return PreparedBatch(req_ids=batch.req_ids, input_ids=arrays["input_ids"], positions=arrays["positions"],
                             meta=meta, logits_indices=arrays["logits_indices"], sample_rows=batch.sample_rows)

    def _check_fits(self, batch: HostBatch, pad_to: int | None) -> None:
        tokens, seqs = int(batch.query_start_loc[-1]), pad_to or batch.num_seqs
        if tokens > self.max_tokens or seqs > self.max_seqs or batch.block_tables.shape[1] > self.max_blocks:
            raise RuntimeError(f"step of {tokens} tokens / {seqs} sequences / {batch.block_tables.shape[1]} blocks "
                               f"exceeds the step buffers ({self.max_tokens} / {self.max_seqs} / {self.max_blocks})")
