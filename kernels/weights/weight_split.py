"""A merged linear (q/k/v, gate/up) whose pieces keep different kernel forms, side by side in its output.

A GGUF file may store a merged layer's pieces in formats no one form holds at their size: the 360M ladder
model's Q4_K_M file has q and k in Q5_0 beside v in Q8_0, the 1.7B one q and k in Q4_K beside v in Q6_K. One
weight for all of them meant int8 for all (8 bits a weight where q and k hold 4.5-5.5): 6.2 MB of the 360M
model's token and 44 MB of the 1.7B one's. `RowSplitWeight` keeps each run of like pieces in its own form
(executor/model/quant/packing.py picks them); y is their outputs side by side. The C decode step runs each
part at its columns in the same phase (kernels/cpu/csrc/decode_step.c); elsewhere each part's method runs and
the outputs are concatenated.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kernels.weights.weight_intn import IntNWeight
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight

SplitPart = Int4Weight | IntNWeight | Int8Weight


@dataclass
class RowSplitWeight:
    parts: tuple[SplitPart, ...]     # in output order: part i gives columns widths[:i].sum() ...
    widths: tuple[int, ...]          # each part's output features

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


# Every weight-only form the CPU kernels and the C decode step run (a merged layer's split among them).
WeightOnly = Int4Weight | IntNWeight | Int8Weight | RowSplitWeight
