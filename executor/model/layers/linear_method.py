"""How a linear layer computes y = x W^T + b: one LinearMethod per layer, picked once, at load.

vLLM's LinearMethodBase shape, smaller. The layer holds the weight, in one of two attributes:
`layer.weight`, a dense Parameter [out, in], or `layer.packed`, the kernel form quantization/packing.py made
(Int4Weight, PermutedInput, IntNWeight, Int8Weight, RowSplitWeight, Fp8Weight). `layer.method.apply(layer, x,
bias)` runs it, with no test of the weight's type per call. The method is picked from the weight's final form:
a dense layer's when it is built (on the device it is built on), a quantized layer's when its pieces are
packed (LinearBase.finish_packed_load); a GGUF file mixes formats per layer (Q4_K beside Q6_K), so only then is the
form known. What one method chooses by the number of input rows (GEMV, integer GEMM, widen + dense GEMM) is
the kernels' own business (kernels/weights/weight_only.py: measured crossovers).
"""
from __future__ import annotations

import functools
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.quant.fp8 import Fp8Weight, fp8_linear
from pagedserve.executor.model.quant.packing import Packed, PermutedInput
from pagedserve.kernels.fixed_rows import fixed_rows_linear
from pagedserve.kernels.ops import triton_usable
from pagedserve.kernels.weights.weight_intn import IntNWeight, intn_linear
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight, int4_linear, int8_linear
from pagedserve.kernels.weights.weight_split import RowSplitWeight


class LinearWeights(Protocol):
    """What a method reads from its layer (LinearBase, ParallelLMHead, Router)."""
    weight: torch.Tensor
    packed: Packed | None


class LinearMethod:
    """x [..., in] -> [..., out] with the layer's weight; bias [out] or None."""
    name: ClassVar[str]

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class FixedRowsLinearMethod(LinearMethod):
    """A dense CPU weight under --batch-invariant (VLLM_BATCH_INVARIANT=1): every row's bits independent of the
    rows beside it (kernels/fixed_rows.py, docs/determinism.md)."""
    name = "fixed_rows"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fixed_rows_linear(x, layer.weight, bias)


class SkinnyGemmLinearMethod(LinearMethod):
    """A dense weight on CUDA: decode-sized batches (up to 16 rows) take the skinny Triton GEMM for the
    shapes where it measured faster than cuBLAS (kernels/triton/gemm.py), the rest F.linear."""
    name = "unquantized_triton"

    def __init__(self) -> None:
        from pagedserve.kernels.triton import gemm as triton_gemm  # imports triton: CUDA only
        self._chooser, self._skinny = triton_gemm.SkinnyGemmChooser(), triton_gemm.skinny_gemm

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight
        if x.dim() == 2 and x.shape[0] <= 16 and x.stride(-1) == 1 and w.is_contiguous() \
                and self._chooser.use_skinny(x, w, bias):
            return self._skinny(x, w, bias)
        return F.linear(x, w, bias)


class Int4LinearMethod(LinearMethod):
    """Group-affine int4 (GGUF Q4_*, AWQ, GPTQ 4-bit): kernels/weights/weight_only.py's int4 GEMV / GEMM / widening."""
    name = "int4"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(x, layer.packed, bias)


class ActOrderInt4LinearMethod(LinearMethod):
    """GPTQ act-order int4: x's columns gathered into the weight's group order first (packing.PermutedInput);
    a tensor-parallel slice's padding columns read a zero."""
    name = "int4_act_order"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.packed
        if packed.zero_input:
            x = F.pad(x, (0, 1))
        return int4_linear(x.index_select(-1, packed.perm), packed.inner, bias)


class IntNLinearMethod(LinearMethod):
    """GGUF's 5- and 6-bit formats at their own width on CPU (kernels/weights/weight_intn.py)."""
    name = "intn"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return intn_linear(x, layer.packed, bias)


class Int8LinearMethod(LinearMethod):
    """Symmetric int8 per output channel (--quantization int8, and GGUF's 5-8 bit formats requantized where
    IntNLinearMethod does not take them)."""
    name = "int8"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.packed, bias)


class RowSplitLinearMethod(LinearMethod):
    """A merged layer whose pieces keep different forms (kernels/weights/weight_split.py): each part by its own
    method, the outputs side by side."""
    name = "row_split"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([_BY_FORM[type(part)].apply(_Bare(part), x, None) for part in layer.packed.parts], -1)
        return y if bias is None else y + bias


class Fp8LinearMethod(LinearMethod):
    """e4m3 weights per output channel, activations scaled per token (CUDA, compute capability 8.9+)."""
    name = "fp8"

    def apply(self, layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.packed
        return fp8_linear(x, packed.w, packed.scale, bias)


_UNQUANTIZED = UnquantizedLinearMethod()
_FIXED_ROWS = FixedRowsLinearMethod()
_BY_FORM: dict[type, LinearMethod] = {Int4Weight: Int4LinearMethod(), PermutedInput: ActOrderInt4LinearMethod(),
                                      IntNWeight: IntNLinearMethod(), Int8Weight: Int8LinearMethod(),
                                      RowSplitWeight: RowSplitLinearMethod(), Fp8Weight: Fp8LinearMethod()}


@functools.cache
def _skinny_method() -> SkinnyGemmLinearMethod:
    # One per process, like Triton's own autotuning cache: its choice depends only on the shape and device.
    return SkinnyGemmLinearMethod()


def dense_linear_method(device: torch.device | str) -> LinearMethod:
    """The method of a dense weight on device."""
    if torch.device(device).type == "cuda" and triton_usable():
        return _skinny_method()
    return _UNQUANTIZED


def use_batch_invariant_methods(model: nn.Module) -> int:
    """Every dense CPU layer of `model` onto the fixed-row method (ModelConfig.batch_invariant, set by
    --batch-invariant): applied to the built model, after its weights took their final forms, so the layers'
    constructors need not know the setting. Returns how many layers it switched."""
    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(getattr(module, "method", None), UnquantizedLinearMethod) and \
                isinstance(weight, torch.Tensor) and weight.device.type == "cpu":
            module.method = _FIXED_ROWS
            switched += 1
    return switched


def linear_method_for(weight: Packed | torch.Tensor, device: torch.device | str) -> LinearMethod:
    """The method of a weight in its final form: a dense tensor or one of packing.py's kernel forms."""
    if isinstance(weight, torch.Tensor):
        return dense_linear_method(device)
    method = _BY_FORM.get(type(weight))
    if method is None:
        raise TypeError(f"no linear method takes a weight of type {type(weight).__name__}")
    return method


class _Bare:
    """One weight in the layer shape a method reads (for apply_linear)."""

    def __init__(self, weight: Packed | torch.Tensor) -> None:
        self.weight = self.packed = weight


def apply_linear(x: torch.Tensor, weight: Packed | torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x through a bare weight with the method a layer holding it would have: for tests and tools (it picks
    the method on every call; layers pick theirs once)."""
    device = weight.device if isinstance(weight, torch.Tensor) else x.device
    return linear_method_for(weight, device).apply(_Bare(weight), x, bias)
